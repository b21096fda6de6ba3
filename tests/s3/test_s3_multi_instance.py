"""Serving instances sharing KV through S3, through the real controller (`HiCache`) on loopback servers.

- Two separate processes (`s3_instance.py`): A serves requests and writes its pages through to S3; B, a
  fresh process with an empty tree, prefetches the same prompts from S3 and gets byte-identical KV; an
  instance with another model fingerprint gets no hits from the same bucket. On moto and JuiceFS.
- The S3 server killed in the middle of a prefetch: the prefetch ends short, commit or cancel releases
  every page, the pools balance, and the cache serves again once the server is back on the same port.
- `examples/two_instances_s3.py` runs and exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import obstore
import pytest
import torch
from obstore.store import S3Store
from s3_helpers import FAST_RETRIES, unique_prefix
from s3_instance import PAGE, PROMPTS, aligned, instance_config, kv_payload
from s3_servers import S3Server

import storage_backends.s3 as s3_module
from hicache import HiCache, Lease, PrefetchOutcome
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from storage_backends.s3 import S3Backend

pytestmark = pytest.mark.s3

ROOT = Path(__file__).resolve().parents[2]
INSTANCE = Path(__file__).with_name("s3_instance.py")
EXAMPLE = ROOT / "examples" / "two_instances_s3.py"
SUBPROCESS_TIMEOUT_S = 120
HANG_GUARD_S = 30
"""Not a timing assertion: only turns a hang into a failure well before the pytest timeout."""

_AWS_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
)


def python_env(**variables: str) -> dict[str, str]:
    """This environment without any AWS settings, the checkout first on the path, plus `variables`."""
    env = {name: value for name, value in os.environ.items() if name not in _AWS_VARIABLES}
    env["PYTHONPATH"] = str(ROOT)
    env.update(variables)
    return env


def run_instance(server: S3Server, role: str, url: str, workdir: Path, *, model: str | None = None) -> Any:
    """Run one instance process (credentials in its environment only) and return its JSON report."""
    report = workdir / f"{role}-{model or 'same'}.json"
    argv = [sys.executable, "-W", "error", str(INSTANCE), role, "--url", url]
    argv += ["--report", str(report), "--kv-dir", str(workdir)]
    if model is not None:
        argv += ["--model", model]
    env = python_env(AWS_ACCESS_KEY_ID=server.access_key_id, AWS_SECRET_ACCESS_KEY=server.secret_access_key)
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{role} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"
    assert server.secret_access_key not in done.stdout + done.stderr
    return json.loads(report.read_text())


# --------------------------------------------------------------------------- two processes, one bucket


@dataclass(frozen=True)
class Shared:
    """A bucket prefix that instance A has filled, and A's report."""

    server: S3Server
    url: str
    workdir: Path
    producer: Any


@pytest.fixture(scope="module", params=["moto_server", "juicefs_server"])
def shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Shared:
    """Instance A, run once per server: serves `PROMPTS`, writes through to S3, saves its KV, exits."""
    server: S3Server = request.getfixturevalue(request.param)
    workdir = tmp_path_factory.mktemp(f"shared-{server.kind}")
    url = server.url(unique_prefix())
    return Shared(server, url, workdir, run_instance(server, "produce", url, workdir))


def test_instance_a_writes_every_whole_page_through_to_s3(shared: Shared) -> None:
    """A's 12 distinct whole pages (6 shared, then 2 and 4 of two requests' own) all reach S3, once each."""
    a = shared.producer
    assert [r["cached_len"] for r in a["requests"]] == [0, 96, 96]
    assert a["s3"]["pages_written"] == 12
    assert a["s3"]["errors"] == 0
    assert "host=12/64 pages" in a["repr"]


def test_fresh_instance_prefetches_byte_identical_kv(shared: Shared) -> None:
    """B, a new process with an empty tree, gets each prompt's stored pages from S3, bit for bit.

    Guards against anything that would make a second machine's KV differ from the first's: keys that are
    not stable across processes, pages written or read at the wrong offset, a wrong layout.
    """
    b = run_instance(shared.server, "consume", shared.url, shared.workdir)
    first, second, third = b["requests"]
    assert first["hits"] == {"device": 0, "host": 0, "storage": aligned(len(PROMPTS[0]))}
    assert first["prefetch"] == {
        "status": "committed",
        "completed_tokens": 128,
        "loaded_tokens": 128,
        "failed_pages": 0,
    }
    # The shared system prompt is on device now; only this request's own 4 pages come from S3.
    assert second["hits"] == {"device": 96, "host": 0, "storage": 64}
    assert second["prefetch"]["loaded_tokens"] == 64
    assert third["hits"] == {"device": 96, "host": 0, "storage": 0}
    assert third["prefetch"] is None
    for request in b["requests"]:
        assert request["matches_payload"], request
        assert request["matches_producer"], request
    assert b["s3"] == {**b["s3"], "pages_read": 12, "pages_written": 0, "misses": 0, "errors": 0}
    assert b["s3"]["checksum_failures"] == 0


def test_other_model_gets_no_hits_from_the_same_bucket(shared: Shared) -> None:
    """An instance whose namespace names another model looks in S3 (HEADs) and finds none of A's pages."""
    c = run_instance(shared.server, "consume", shared.url, shared.workdir, model="other")
    for request in c["requests"]:
        assert request["cached_len"] == 0
        assert request["prefetch"] is None
    assert c["s3"]["requests"] >= len(PROMPTS)
    assert c["s3"]["pages_read"] == 0
    assert c["s3"]["errors"] == 0


# --------------------------------------------------------------------------- the server dies mid-prefetch


async def complete(cache: HiCache, lease: Lease, prompt: list[int]) -> None:
    """Finish a request: compute (the deterministic) KV for what was not cached, insert it."""
    n = len(prompt)
    new = await cache.alloc_device(-(-n // PAGE) * PAGE - lease.cached_len)
    assert new is not None
    cache.device_pool.write_tokens(new[: n - lease.cached_len], kv_payload(prompt)[:, :, lease.cached_len :])
    await cache.insert(lease, prompt, torch.cat([lease.device_indices, new]))


def s3_backend(cache: HiCache) -> S3Backend:
    """The cache's storage, which these tests open as an S3Backend."""
    assert isinstance(cache.storage, S3Backend)
    return cache.storage


def assert_no_page_leaks(cache: HiCache) -> None:
    """Exact accounting: every host and device page is owned by the tree, nothing is in flight or pending."""
    cache.sanity_check()
    stats = cache.statistics()
    assert stats.prefetches_in_flight == 0
    assert stats.prefetch_tokens_in_flight == 0
    assert stats.release_queue.pending_tokens == 0
    assert stats.host_pool.used_pages * PAGE == stats.tree.host_tokens
    assert stats.device_pool.used_pages * PAGE == stats.tree.device_tokens


@pytest.mark.parametrize("resolve", ["commit", "cancel"])
async def test_server_killed_mid_prefetch_ends_it_short_then_the_cache_serves_again(
    private_moto: S3Server, monkeypatch: pytest.MonkeyPatch, resolve: str
) -> None:
    """Kill the S3 server while a prefetch of 10 pages is held after its 6th page, then let it go on.

    The prefetch must end short (6 pages verified, the rest failed) without an exception; committing it
    attaches the 6 pages and releases the other 4, cancelling it releases all 10; either way the pools
    balance exactly. Once the server is back on the same port (empty, as moto restarts), the same cache
    serves the request again and writes it through, and a fresh cache prefetches all of it.
    """
    server = private_moto
    url = server.url(unique_prefix())
    options = {**server.options(), **FAST_RETRIES, "max_concurrency": 2}
    prompt = PROMPTS[1]  # 173 tokens: 10 whole pages, read in batches of 4 by 2 workers
    # One batch in flight at a time, so "both workers hold pages 6 and 7" means pages 0-5 are verified.
    config = instance_config(url, storage_options=options, storage_concurrency=1)

    async with HiCache(config) as producer:
        await complete(producer, await producer.acquire("fill", prompt), prompt)
        await producer.wait_idle()
        assert s3_backend(producer).statistics().pages_written == 10

    hashes = chained_page_hashes(as_key_bytes(prompt)[: 160 * 8], PAGE, config.namespace, ROOT_HASH)
    held = {h.hex() for h in hashes[6:]}
    waiting = 0
    workers_held = anyio.Event()
    gate = anyio.Event()
    real_fetch = s3_module._fetch

    async def gated_fetch(store: S3Store, path: str) -> obstore.Bytes:
        nonlocal waiting
        if path.rsplit("/", 1)[1] in held:
            waiting += 1
            if waiting == 2:
                workers_held.set()  # both workers hold pages 6 and 7, so pages 0-5 are verified
            await gate.wait()
        return await real_fetch(store, path)

    monkeypatch.setattr(s3_module, "_fetch", gated_fetch)

    async with HiCache(config) as cache:
        lease: Lease | None = None
        outcome: PrefetchOutcome | None = None

        async def acquire() -> None:
            nonlocal lease
            lease = await cache.acquire("r", prompt)

        with anyio.fail_after(HANG_GUARD_S):
            async with anyio.create_task_group() as tg:
                if resolve == "commit":
                    tg.start_soon(acquire)
                else:
                    assert await cache.prefetch("r", prompt) is not None
                await workers_held.wait()
                assert cache.statistics().host_pool.used_pages == 10  # all of it belongs to the prefetch
                await anyio.to_thread.run_sync(server.kill)
                held.clear()
                gate.set()
                if resolve == "cancel":
                    prefetch = cache.get_prefetch("r")
                    await prefetch.wait_stopped()
                    assert prefetch.completed_pages == 6
                    outcome = await cache.cancel_prefetch("r")

        if resolve == "commit":
            assert lease is not None
            outcome = lease.prefetch
            assert lease.cached_len == 96
            assert lease.hit_tokens_by_tier == {"device": 0, "host": 0, "storage": 96}
            assert torch.equal(
                cache.device_pool.read_tokens(lease.device_indices), kv_payload(prompt)[:, :, :96]
            )
        assert outcome is not None
        assert outcome.matched_tokens == 160
        assert outcome.completed_tokens == 96
        assert outcome.failed_pages == 1
        if resolve == "commit":
            assert (outcome.status, outcome.loaded_tokens, outcome.released_tokens) == ("committed", 96, 64)
        else:
            assert (outcome.status, outcome.loaded_tokens, outcome.released_tokens) == ("cancelled", 0, 160)
        assert s3_backend(cache).statistics().errors == 2  # pages 6 and 7; 8 and 9 were never asked for
        await cache.wait_idle()
        assert_no_page_leaks(cache)
        assert cache.statistics().host_pool.used_pages == (6 if resolve == "commit" else 0)

        # The server comes back on the same port, empty: the cache serves the request and refills S3.
        await anyio.to_thread.run_sync(server.restart)
        with anyio.fail_after(HANG_GUARD_S):
            if lease is None:
                lease = await cache.acquire("r-again", prompt)
                assert lease.cached_len == 0
            await complete(cache, lease, prompt)
            await cache.wait_idle()
        assert s3_backend(cache).statistics().pages_written == 10
        assert_no_page_leaks(cache)

    async with HiCache(config) as fresh:
        with anyio.fail_after(HANG_GUARD_S):
            again = await fresh.acquire("r-fresh", prompt)
        assert again.hit_tokens_by_tier == {"device": 0, "host": 0, "storage": 160}
        assert again.prefetch is not None
        assert again.prefetch.status == "committed"
        assert torch.equal(
            fresh.device_pool.read_tokens(again.device_indices), kv_payload(prompt)[:, :, :160]
        )
        fresh.release(again)
        await fresh.wait_idle()
        assert_no_page_leaks(fresh)


# --------------------------------------------------------------------------- the example


def test_two_instances_example_runs_on_its_own_moto_server() -> None:
    """The example starts moto, runs a producer and a consumer process, and reports identical KV."""
    done = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE)],
        cwd=ROOT,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("started moto on http://127.0.0.1:")
    assert "producer: wrote 9 pages (73728 bytes) to S3" in lines
    assert "consumer: alice reused 96 tokens {'device': 0, 'host': 0, 'storage': 96}" in lines
    assert lines[-1] == "consumer: KV identical to the producer's for every request"
