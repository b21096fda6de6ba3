"""S3Backend on loopback moto and JuiceFS: round trips, layout, verification, lifecycle, redaction."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import obstore
import pytest
import torch
from obstore.store import S3Store
from s3_helpers import NAMESPACE, open_backend, unique_prefix
from s3_servers import S3Server

from hicache.errors import CacheClosed, StorageAuthError, StorageError, StorageUnavailable
from storage_backends.page_format import HEADER_SIZE
from storage_backends.protocol import PageStatus, StorageBackend
from storage_backends.registry import open_backend as open_registered
from storage_backends.s3 import S3Backend, S3Statistics

PAGE = 4096
HIT, MISS = PageStatus.HIT, PageStatus.MISS


def keys_for(n: int, salt: str = "") -> list[str]:
    """`n` distinct lowercase-hex page keys."""
    return [f"{salt}{i:08x}".replace("-", "") for i in range(n)]


def host_pages(n: int, page_bytes: int = PAGE, *, fill: bool = True) -> tuple[torch.Tensor, list[memoryview]]:
    """A host tensor of `n` pages and one writable byte view per page."""
    tensor = torch.zeros(n, page_bytes, dtype=torch.uint8)
    if fill:
        tensor.copy_(torch.randint(0, 256, (n, page_bytes), dtype=torch.uint8))
    return tensor, [memoryview(tensor[i].numpy()) for i in range(n)]


def raw_store(server: S3Server) -> S3Store:
    """A plain obstore client on the server, for looking under the backend."""
    return S3Store(
        server.bucket,
        endpoint=server.endpoint,
        region=server.region,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        client_options={"allow_http": True},
    )


@pytest.fixture(params=["moto_server", "juicefs_server"])
def server(request: pytest.FixtureRequest) -> S3Server:
    """Each loopback server in turn."""
    result: S3Server = request.getfixturevalue(request.param)
    return result


@pytest.fixture
async def backend(server: S3Server) -> AsyncIterator[S3Backend]:
    """An open backend on a fresh prefix of `server`."""
    async with open_backend(server) as b:
        yield b


async def test_round_trip_of_float_pages_into_a_host_tensor(backend: S3Backend) -> None:
    """Pages written from one tensor's views come back bit-identical into another tensor's views."""
    src = torch.randn(8, 1024, dtype=torch.float32)
    dst = torch.zeros_like(src)
    keys = keys_for(8)
    assert await backend.put(keys, [memoryview(src[i].numpy()) for i in range(8)]) == [True] * 8
    assert await backend.exists(keys) == 8
    assert await backend.get(keys, [memoryview(dst[i].numpy()) for i in range(8)]) == [HIT] * 8
    assert torch.equal(src, dst)
    stats = backend.statistics()
    assert isinstance(stats, S3Statistics)
    assert (stats.pages_written, stats.pages_read) == (8, 8)
    assert stats.bytes_read == stats.bytes_written == 8 * 4096
    assert stats.retries == 0
    assert stats.errors == 0


async def test_objects_are_laid_out_one_per_page_with_header(backend: S3Backend, server: S3Server) -> None:
    """Each page is one object `<prefix>/<ab>/<key>` holding header + payload, readable by a plain client."""
    _, bufs = host_pages(1)
    key = keys_for(1, "ab")[0]
    await backend.put([key], bufs)
    path = backend.object_path(key)
    assert path.endswith(f"/{key[:2]}/{key}")
    body = bytes(await (await obstore.get_async(raw_store(server), path)).bytes_async())
    assert len(body) == HEADER_SIZE + PAGE
    assert body[:4] == b"HKVP"
    assert body[HEADER_SIZE:] == bytes(bufs[0])


async def test_exists_stops_at_the_first_missing_page_across_windows(server: S3Server) -> None:
    """The longest stored prefix is found when the gap sits beyond the first HEAD window."""
    async with open_backend(server, max_concurrency=4) as backend:
        keys = keys_for(11)
        _, bufs = host_pages(11)
        await backend.put(keys[:6] + keys[7:], bufs[:6] + bufs[7:])
        assert await backend.exists(keys) == 6
        assert await backend.exists(keys[:6]) == 6
        assert await backend.exists([]) == 0


async def test_get_reports_each_page_missing_or_loaded(backend: S3Backend) -> None:
    """A missing page in the middle is False for itself only, and counted as a miss."""
    keys = keys_for(3)
    _, bufs = host_pages(3)
    await backend.put([keys[0], keys[2]], [bufs[0], bufs[2]])
    _, out = host_pages(3, fill=False)
    assert await backend.get(keys, out) == [HIT, MISS, HIT]
    assert backend.statistics().misses == 1


async def test_page_of_another_namespace_is_a_miss(backend: S3Backend, server: S3Server) -> None:
    """A stored page never loads into a cache of another namespace: a foreign page, not an error."""
    key = keys_for(1)[0]
    _, bufs = host_pages(1)
    await backend.put([key], bufs)
    prefix = backend.object_path(key).split("/")[0]
    async with S3Backend.from_url(
        server.url(prefix), namespace_digest=b"x" * 16, **server.options()
    ) as other:
        _, out = host_pages(1, fill=False)
        assert await other.get([key], out) == [PageStatus.FOREIGN]
        assert other.statistics().foreign_pages == 1
        assert other.statistics().errors == 0


@pytest.mark.parametrize("damage", ["truncate", "extend", "garbage"])
async def test_truncated_overlong_or_garbage_object_is_a_counted_miss(
    backend: S3Backend, server: S3Server, damage: str
) -> None:
    """An object that is not a whole page of the buffer's size never loads; the buffer is untouched."""
    keys = keys_for(2)
    _, bufs = host_pages(2)
    await backend.put(keys, bufs)
    store = raw_store(server)
    path = backend.object_path(keys[0])
    body = bytes(await (await obstore.get_async(store, path)).bytes_async())
    damaged = {"truncate": body[:-100], "extend": body + b"\0" * 100, "garbage": b"not a page" * 500}[damage]
    await obstore.put_async(store, path, damaged)
    out_tensor, out = host_pages(2, fill=False)
    assert await backend.get(keys, out) == [PageStatus.CORRUPT, HIT]
    assert not out_tensor[0].any()
    assert backend.statistics().checksum_failures == 1


async def test_large_pages_verify_in_a_worker_thread(backend: S3Backend) -> None:
    """1 MiB pages (over the inline threshold) round trip and a flipped byte is caught."""
    keys = keys_for(2)
    src, bufs = host_pages(2, 1 << 20)
    assert await backend.put(keys, bufs) == [True, True]
    dst, out = host_pages(2, 1 << 20, fill=False)
    assert await backend.get(keys, out) == [HIT, HIT]
    assert torch.equal(src, dst)


async def test_delete_removes_pages_and_ignores_absent_ones(backend: S3Backend) -> None:
    """Deleted pages no longer exist; deleting unknown keys is not an error."""
    keys = keys_for(3)
    _, bufs = host_pages(3)
    await backend.put(keys, bufs)
    await backend.delete([keys[1], "deadbeef"])
    assert await backend.exists(keys) == 1
    _, out = host_pages(3, fill=False)
    assert await backend.get(keys, out) == [HIT, MISS, HIT]


async def test_bad_arguments_raise_naming_the_argument(backend: S3Backend) -> None:
    """Misuse is an exception: bad keys, mismatched or read-only buffers."""
    _, bufs = host_pages(2)
    with pytest.raises(ValueError, match="buffers"):
        await backend.get(keys_for(1), bufs)
    with pytest.raises(ValueError, match="keys"):
        await backend.put(["../etc/passwd"], bufs[:1])
    with pytest.raises(ValueError, match="writable"):
        await backend.get(keys_for(1), [memoryview(bytes(PAGE))])
    with pytest.raises(TypeError, match="keys"):
        await backend.exists("abcd")


async def test_closed_backend_raises_and_close_is_idempotent(server: S3Server) -> None:
    """After aclose every operation raises CacheClosed; aclose again is a no-op."""
    backend = open_backend(server)
    assert isinstance(backend, StorageBackend)
    await backend.aclose()
    await backend.aclose()
    assert backend.closed
    assert "closed=True" in repr(backend)
    _, bufs = host_pages(1)
    with pytest.raises(CacheClosed):
        await backend.exists(keys_for(1))
    with pytest.raises(CacheClosed):
        await backend.get(keys_for(1), bufs)
    with pytest.raises(CacheClosed):
        await backend.put(keys_for(1), bufs)
    with pytest.raises(CacheClosed):
        await backend.delete(keys_for(1))


def test_unclosed_backend_warns(moto_server: S3Server) -> None:
    """A backend dropped without aclose warns with ResourceWarning."""
    with pytest.warns(ResourceWarning, match="unclosed S3Backend"):
        open_backend(moto_server)  # dropped at once: nothing else holds a reference


async def test_registry_opens_s3_urls(moto_server: S3Server) -> None:
    """`s3://` URLs open an S3Backend through the lazy registry, options passed through."""
    backend = open_registered(
        moto_server.url(unique_prefix()), namespace_digest=NAMESPACE, **moto_server.options()
    )
    async with backend:  # type: ignore[attr-defined]
        assert isinstance(backend, S3Backend)
        _, bufs = host_pages(1)
        assert await backend.put(keys_for(1), bufs) == [True]


async def test_wrong_credentials_fail_pages_without_retrying(juicefs_server: S3Server) -> None:
    """A 403 is not transient: the call fails at once with `StorageAuthError` (an outage for this cache,
    never a miss), every page is counted as an error, and nothing is retried. Once a request of a batch
    was refused, its pages not yet started are not sent."""
    async with open_backend(juicefs_server, secret_access_key="not-the-secret") as backend:
        _, bufs = host_pages(2)
        with pytest.raises(StorageAuthError, match="refused"):
            await backend.put(keys_for(2), bufs)
        with pytest.raises(StorageAuthError, match="refused"):
            await backend.get(keys_for(2), bufs)
        with pytest.raises(StorageAuthError, match="refused"):
            await backend.exists(keys_for(2))
        stats = backend.statistics()
        assert stats.errors >= 5
        assert stats.misses == 0
        assert stats.retries == 0
        assert 3 <= stats.requests <= 6


# --------------------------------------------------------------------------- configuration and redaction

SECRET = "s3cr3t-Value-that-must-not-leak"
KEY_ID = "AKIA-must-not-leak-either"


async def test_from_url_reads_endpoint_region_and_options_from_the_query() -> None:
    """Query parameters configure the backend; keyword options win over them."""
    url = "s3://bucket/some/prefix/?endpoint=http://127.0.0.1:9&region=eu-west-1&max_concurrency=3"
    async with S3Backend.from_url(url, namespace_digest=NAMESPACE, max_concurrency=5) as backend:
        text = repr(backend)
    assert "bucket='bucket'" in text
    assert "prefix='some/prefix'" in text
    assert "endpoint='http://127.0.0.1:9'" in text
    assert "region='eu-west-1'" in text
    assert "max_concurrency=5" in text


async def test_configuration_falls_back_to_aws_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Endpoint, region and credentials come from the standard AWS variables when not given."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    async with S3Backend("bucket", namespace_digest=NAMESPACE) as backend:
        text = repr(backend)
    assert "http://127.0.0.1:9" in text
    assert "ap-south-1" in text
    assert "explicit-or-env" in text
    assert SECRET not in text
    assert KEY_ID not in text


def test_plain_http_is_refused_for_remote_endpoints_unless_allowed() -> None:
    """http:// is allowed by default only on loopback."""
    with pytest.raises(ValueError, match="allow_http"):
        S3Backend("bucket", namespace_digest=NAMESPACE, endpoint="http://s3.example.invalid:9000")
    with pytest.raises(ValueError, match="scheme"):
        S3Backend.from_url("gs://bucket/x", namespace_digest=NAMESPACE)
    with pytest.raises(ValueError, match="unknown query parameter"):
        S3Backend.from_url("s3://bucket/x?colour=blue", namespace_digest=NAMESPACE)


async def test_credentials_never_appear_in_repr_logs_or_errors(caplog: pytest.LogCaptureFixture) -> None:
    """Secrets from the URL query stay out of repr, log records (even DEBUG) and every error message."""
    from s3_servers import free_port

    caplog.set_level(logging.DEBUG)
    url = (
        f"s3://bucket/p?endpoint=http://127.0.0.1:{free_port()}&access_key_id={KEY_ID}"
        f"&secret_access_key={SECRET}&deadline_s=0.3&backoff_initial_s=0.01&backoff_max_s=0.05"
        "&attempt_timeout_s=0.2"
    )
    messages: list[str] = []
    backend = S3Backend.from_url(url, namespace_digest=NAMESPACE)
    messages.append(repr(backend))
    _, bufs = host_pages(1)
    with pytest.raises(StorageUnavailable) as down:
        await backend.get(keys_for(1), bufs)
    messages.append(str(down.value))
    with pytest.raises(StorageUnavailable) as unavailable:
        await backend.delete(keys_for(1))
    messages.append(str(unavailable.value))
    await backend.aclose()
    with pytest.raises(CacheClosed) as closed:
        await backend.exists(keys_for(1))
    messages.append(str(closed.value))
    with pytest.raises(ValueError, match="max_concurrency") as bad:
        S3Backend.from_url(url + "&max_concurrency=many", namespace_digest=NAMESPACE)
    messages.append(str(bad.value))
    messages.extend(record.getMessage() for record in caplog.records)
    assert any("retrying" in m for m in messages), "the retries were logged"
    for message in messages:
        assert SECRET not in message, message
        assert KEY_ID not in message, message


def test_storage_errors_are_oserrors() -> None:
    """Callers may catch the translated errors as builtins."""
    assert issubclass(StorageUnavailable, ConnectionError)
    assert issubclass(StorageError, OSError)
