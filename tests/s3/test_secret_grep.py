"""Secret grep: a fake credential given through the URL query, keyword options or the environment never
shows up in anything hicache prints.

Guards against issue 9 finding 4: `repr`/`str` of `HiCacheConfig` printed `storage_options` and the URL
query, and `hicache demo --backend 's3://...&secret_access_key=...'` printed the secret in its table and
JSON. Each test runs the real thing (the controller over moto on loopback, the file backend, the demo CLI
as a subprocess) and greps every text it can produce: reprs and strs of the config, cache and backend,
every log record at every level (DEBUG included, tracebacks included), every exception message of a
misuse, the Prometheus text and the metrics snapshot, the demo's table, JSON and snapshot, and
`hicache inspect`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from page_damage import flip_page_byte, pages_at
from s3_helpers import FAST_RETRIES, unique_prefix
from s3_instance import PAGE, PROMPTS, aligned, instance_config, kv_payload
from s3_servers import S3Server, free_port

import storage_backends.registry as registry_module
from hicache import HiCache, HiCacheConfig, Lease
from hicache.metrics import render as render_metrics
from hicache.metrics import snapshot as metrics_snapshot
from storage_backends.file import FileBackend
from storage_backends.registry import open_backend
from storage_backends.s3 import S3Backend

ROOT = Path(__file__).resolve().parents[2]

KEY_ID = "AKIAFAKEKEYID7Q2XW"
SECRET = "fake/Secret+Key=7d1e2c9b40aa"
TOKEN = "FakeSessionToken-4b9a0f-ZZ"
CREDENTIALS = {"access_key_id": KEY_ID, "secret_access_key": SECRET, "session_token": TOKEN}
ENV_SECRET = "fakeEnvOnlySecret-c05e11f3"
"""Set in the environment of every test here, under a name no option reads: it must never show either."""
ALL_SECRETS = (KEY_ID, SECRET, TOKEN, ENV_SECRET)
HANG_GUARD_S = 60
"""Not a timing assertion: only turns a hang into a failure well before the pytest timeout."""

_AWS_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def quoted(value: str) -> str:
    """`value` percent-encoded for a URL query (the secret holds `/`, `+` and `=`)."""
    from urllib.parse import quote

    return quote(value, safe="")


def query_credentials() -> str:
    return "&".join(f"{name}={quoted(value)}" for name, value in CREDENTIALS.items())


def assert_clean(texts: list[str]) -> None:
    """No secret (nor its URL-encoded form) in any of `texts`; `texts` must not be empty."""
    assert texts
    for text in texts:
        for secret in ALL_SECRETS:
            assert secret not in text, text
            assert quoted(secret) not in text, text


def exception_text(exc: BaseException) -> str:
    """What a user sees of an uncaught exception: the formatted traceback with its chain."""
    return "".join(traceback.format_exception(exc))


async def misuse(action: Callable[[], Awaitable[Any] | Any]) -> str:
    """Run `action`, which must raise; return its exception as printed."""
    try:
        result = action()
        if isinstance(result, Awaitable):
            await result
    except Exception as exc:
        return exception_text(exc)
    raise AssertionError(f"{action} did not raise")


@pytest.fixture(autouse=True)
def env_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret-named variable no option reads, and no AWS credentials unless a test sets them."""
    for name in _AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HICACHE_TEST_API_TOKEN", ENV_SECRET)


async def open_cache(config: HiCacheConfig) -> None:
    """Open (and close) a cache on `config`: the backend is opened here, so its errors surface here."""
    async with HiCache(config):
        pass


async def serve(cache: HiCache, request_id: str, prompt: list[int]) -> Lease:
    """Acquire `prompt`, compute what was not cached, insert it; return the lease."""
    lease = await cache.acquire(request_id, prompt)
    n = len(prompt)
    new = await cache.alloc_device(-(-n // PAGE) * PAGE - lease.cached_len)
    assert new is not None
    cache.device_pool.write_tokens(new[: n - lease.cached_len], kv_payload(prompt)[:, :, lease.cached_len :])
    await cache.insert(lease, prompt, torch.cat([lease.device_indices, new]))
    return lease


def texts_of(config: HiCacheConfig, cache: HiCache) -> list[str]:
    """Every repr, str and metrics text of a running cache and its configuration."""
    return [
        repr(config),
        str(config),
        f"{config}",
        repr(cache),
        str(cache),
        repr(cache.storage),
        str(cache.statistics()),
        repr(cache.storage.statistics()) if cache.storage is not None else "",
        render_metrics(cache.registry),
        json.dumps(metrics_snapshot(cache.registry), default=str),
    ]


def log_texts(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every record's message and the formatted log (tracebacks included); at least one record."""
    assert caplog.records, "the run logged nothing: the log check would prove nothing"
    return [caplog.text, *(record.getMessage() for record in caplog.records)]


# --------------------------------------------------------------------------- the S3 backend on moto


@pytest.mark.s3
@pytest.mark.parametrize("source", ["query", "options", "environment"])
async def test_s3_run_never_shows_credentials(
    moto_server: S3Server,
    source: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A writer and a fresh reader share pages through moto; nothing they print holds a credential."""
    caplog.set_level(logging.DEBUG)
    url = moto_server.url(unique_prefix())
    options: dict[str, Any] = {"deadline_s": 10.0}
    if source == "query":
        url = f"{url}&{query_credentials()}"
    elif source == "options":
        options.update(CREDENTIALS)
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    config = instance_config(url, storage_options=options)
    prompt = PROMPTS[0]
    texts: list[str] = []

    with anyio.fail_after(HANG_GUARD_S):
        async with HiCache(config) as writer:
            lease = await serve(writer, "writer", prompt)
            await writer.wait_idle()
            assert lease.cached_len == 0
            storage = writer.storage
            assert isinstance(storage, S3Backend)
            assert storage.statistics().pages_written == aligned(len(prompt)) // PAGE
            texts += texts_of(config, writer)
        async with HiCache(config) as reader:
            again = await reader.acquire("reader", prompt)
            assert again.hit_tokens_by_tier["storage"] == aligned(len(prompt))  # a real read through S3
            reader.release(again)
            await reader.wait_idle()
            texts += texts_of(config, reader)
            texts.append(await misuse(lambda: reader.acquire("", prompt)))
            texts.append(await misuse(lambda: reader.acquire("bad-tokens", [1 << 63])))
        texts.append(await misuse(lambda: reader.acquire("closed", prompt)))
    texts += log_texts(caplog)
    assert_clean(texts)


@pytest.mark.s3
async def test_unreachable_s3_server_errors_and_retries_never_show_credentials(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Failing HEADs, GETs, PUTs and DELETEs against a dead port log retries and warnings, all clean."""
    caplog.set_level(logging.DEBUG)
    url = f"s3://bucket/p?endpoint=http://127.0.0.1:{free_port()}&{query_credentials()}"
    options = {**FAST_RETRIES, "max_concurrency": 2}
    config = instance_config(url, storage_options=options)
    texts: list[str] = []
    with anyio.fail_after(HANG_GUARD_S):
        async with HiCache(config) as cache:
            await serve(cache, "r", PROMPTS[1])
            await cache.wait_idle()
            storage = cache.storage
            assert isinstance(storage, S3Backend)
            assert storage.statistics().errors > 0  # the writes really failed
            texts += texts_of(config, cache)
            key = "ab" * 16
            texts.append(await misuse(lambda: storage.delete([key])))
    texts += log_texts(caplog)
    assert any("retrying" in text for text in texts), "the retries were logged at DEBUG"
    assert_clean(texts)


@pytest.mark.s3
async def test_misuse_errors_never_show_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each configuration or call mistake made with credentials in reach raises a clean message."""
    base = f"s3://bucket/p?endpoint=http://127.0.0.1:{free_port()}"
    with_query = f"{base}&{query_credentials()}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)

    def config(url: str = with_query, **overrides: Any) -> HiCacheConfig:
        return instance_config(url, **overrides)

    def leaky_factory(url: str, **options: Any) -> Any:
        raise RuntimeError(f"plugin could not open {url} with {options}")

    texts = [
        await misuse(lambda: config(with_query.replace("s3://bucket", "s3://Bad_Bucket"))),
        await misuse(lambda: config(with_query.replace("/p?", "/%2e%2e/p?"))),
        await misuse(lambda: config(prefetch_timeout_max=math.nan)),
        await misuse(lambda: config(storage_options=[("secret_access_key", SECRET)])),
        await misuse(lambda: open_cache(config(f"{with_query}&colour=blue"))),
        await misuse(lambda: open_cache(config(f"{with_query}&max_concurrency=many"))),
        await misuse(lambda: open_cache(config(f"{with_query}&secret_access_key={quoted(SECRET)}"))),
        await misuse(lambda: open_cache(config(base, storage_options={"secret_acces_key": SECRET}))),
        await misuse(
            lambda: open_cache(
                config(
                    f"s3://bucket/p?endpoint=http://u:{quoted(SECRET)}@127.0.0.1:9",
                    storage_options=CREDENTIALS,
                )
            )
        ),
        await misuse(
            lambda: open_cache(
                config(f"s3://bucket/p?endpoint=http://s3.example.invalid:9&{query_credentials()}")
            )
        ),
        await misuse(
            lambda: open_backend(f"nope://u:{SECRET}@host/?token={TOKEN}", namespace_digest=bytes(16))
        ),
        await misuse(lambda: open_backend(f"file:///tmp/x?token={TOKEN}", namespace_digest=bytes(16))),
        await misuse(lambda: open_backend(f"memory://n?password={SECRET}", namespace_digest=bytes(16))),
        await misuse(
            lambda: HiCacheConfig(layout=config().layout, device_pages=1, host_pages=1, storage_url=SECRET)
        ),
    ]
    monkeypatch.setattr(registry_module, "resolve_factory", lambda scheme: leaky_factory)
    texts.append(
        await misuse(lambda: open_backend(with_query, namespace_digest=bytes(16), session_token=TOKEN))
    )
    assert "RuntimeError: plugin could not open s3://bucket/p?" in texts[-1]  # the type and place are kept
    assert_clean(texts)


# --------------------------------------------------------------------------- the file backend


async def test_file_backend_run_never_shows_environment_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With credentials only in the environment, a file-backed run (writes, reads, a corrupt page that
    is logged) and its misuse errors print none of them."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    url = (tmp_path / "pages").as_uri()
    config = instance_config(url)
    prompt = PROMPTS[2]
    texts: list[str] = []
    with anyio.fail_after(HANG_GUARD_S):
        async with HiCache(config) as writer:
            await serve(writer, "w", prompt)
            await writer.wait_idle()
            texts += texts_of(config, writer)
        pages = sorted((tmp_path / "pages").rglob("*.kvp"))
        assert pages
        # a damaged page (its payload's last byte, in its group file): logged as a miss
        stored = pages_at(tmp_path / "pages", config.namespace.digest)
        key = pages[-1].name.removesuffix(".kvp")
        flip_page_byte(stored, key, stored.page_extent(key)[2] - 1)
        async with HiCache(config) as reader:
            lease = await reader.acquire("r", prompt)
            assert 0 < lease.hit_tokens_by_tier["storage"] < aligned(len(prompt))
            reader.release(lease)
            await reader.wait_idle()
            texts += texts_of(config, reader)
    texts.append(
        await misuse(lambda: open_cache(instance_config(url, storage_options={"api_token": SECRET})))
    )
    texts.append(
        await misuse(lambda: FileBackend.from_url(f"{url}?token={TOKEN}", namespace_digest=bytes(16)))
    )
    texts.append(await misuse(lambda: HiCacheConfig(layout=config.layout, device_pages=1, host_pages=1,
                                                    storage_url=f"file:///x/%2e%2e?secret={SECRET}")))  # fmt: skip
    texts += log_texts(caplog)
    assert_clean(texts)


async def test_inspect_redacts_a_snapshot_written_before_redaction(tmp_path: Path) -> None:
    """An older snapshot may hold a raw URL: `hicache inspect` shows it redacted, as a table and as JSON."""
    url = f"s3://bucket/p?endpoint=http://127.0.0.1:9&{query_credentials()}"
    pool = {"device": "cpu", "capacity_pages": 4, "used_pages": 1, "page_size": 16, "page_nbytes": 64}
    snapshot = tmp_path / "old.json"
    snapshot.write_text(
        json.dumps(
            {
                "summary": {"requests": 1, "identical": 1, "backend": url},
                "pools": {"device": pool, "host": pool, "storage": {"url": url, "bytes_written": 1}},
                "tree": {
                    "nodes": 1,
                    "device_tokens": 16,
                    "host_tokens": 0,
                    "evictable_device_tokens": 16,
                    "evictable_host_tokens": 0,
                },
                "top_prefixes": [],
            }
        )
    )
    table = run_cli("inspect", str(snapshot))
    as_json = run_cli("inspect", str(snapshot), "--json")
    assert table.returncode == 0, table.stderr
    assert as_json.returncode == 0, as_json.stderr
    assert "s3://bucket/p?endpoint=http://127.0.0.1:9" in as_json.stdout
    assert json.loads(as_json.stdout)["pools"]["storage"]["url"].endswith("session_token=***")
    assert_clean([table.stdout, table.stderr, as_json.stdout, as_json.stderr])


# --------------------------------------------------------------------------- the demo CLI


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m hicache.cli ARGS` from the repository root, the checkout first on the path."""
    base = {k: v for k, v in os.environ.items() if k not in _AWS_VARIABLES}
    return subprocess.run(
        [sys.executable, "-m", "hicache.cli", *args],
        cwd=ROOT,
        env={**base, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.s3
@pytest.mark.slow
def test_demo_on_s3_never_shows_credentials(moto_server: S3Server, tmp_path: Path) -> None:
    """`hicache demo --backend 's3://...&secret_access_key=...'` (with a session token in the
    environment): its table, its JSON, its snapshot, `hicache inspect` and the logs on stderr are clean."""
    url = f"{moto_server.url(unique_prefix())}&{query_credentials()}"
    env = {"AWS_SESSION_TOKEN": TOKEN, "AWS_SECRET_ACCESS_KEY": ENV_SECRET}
    small = [
        "--users",
        "1",
        "--turns",
        "2",
        "--system-prompts",
        "1",
        "--device-pages",
        "40",
        "--host-pages",
        "72",
    ]
    snapshot = tmp_path / "snap.json"

    as_json = run_cli("demo", "--backend", url, "--json", *small, env=env)
    assert as_json.returncode == 0, as_json.stderr[-4000:]
    summary = json.loads(as_json.stdout)
    assert summary["identical"] == summary["requests"] == 2
    assert summary["backend"].startswith(f"s3://{moto_server.bucket}/")
    assert "secret_access_key=***" in summary["backend"]

    table = run_cli("demo", "--backend", url, "--snapshot", str(snapshot), *small, env=env)
    assert table.returncode == 0, table.stderr[-4000:]
    assert "secret_access_key=***" in table.stdout

    shown = run_cli("inspect", str(snapshot))
    shown_json = run_cli("inspect", str(snapshot), "--json")
    assert shown.returncode == 0, shown.stderr
    assert shown_json.returncode == 0, shown_json.stderr
    assert_clean(
        [
            as_json.stdout,
            as_json.stderr,
            table.stdout,
            table.stderr,
            snapshot.read_text(),
            shown.stdout,
            shown.stderr,
            shown_json.stdout,
            shown_json.stderr,
        ]
    )
