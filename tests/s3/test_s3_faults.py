"""S3Backend under faults: a dead endpoint, a server that never answers, a server that ignores Range, and a
server killed in the middle of a batch and brought back on the same port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import anyio
import anyio.to_thread
import obstore
import pytest
import torch
from obstore.store import S3Store
from s3_helpers import FAST_RETRIES, NAMESPACE, open_backend
from s3_servers import S3Server, free_port

import storage_backends.s3 as s3_module
from hicache.errors import StorageUnavailable
from storage_backends.protocol import PageStatus
from storage_backends.s3 import S3Backend

HIT, ERROR = PageStatus.HIT, PageStatus.ERROR

PAGE = 4096
HANG_GUARD_S = 30
"""Not a timing assertion: only turns a hang into a failure well before the pytest timeout."""


def keys_for(n: int) -> list[str]:
    return [f"{i:08x}" for i in range(n)]


def host_pages(n: int, *, fill: bool = True) -> tuple[torch.Tensor, list[memoryview]]:
    tensor = torch.zeros(n, PAGE, dtype=torch.uint8)
    if fill:
        tensor.copy_(torch.randint(0, 256, (n, PAGE), dtype=torch.uint8))
    return tensor, [memoryview(tensor[i].numpy()) for i in range(n)]


def dead_backend(**options: object) -> S3Backend:
    """A backend whose endpoint is a closed loopback port."""
    url = f"s3://bucket/p?endpoint=http://127.0.0.1:{free_port()}"
    return S3Backend.from_url(
        url,
        namespace_digest=NAMESPACE,
        access_key_id="k",
        secret_access_key="s",
        **{**FAST_RETRIES, **options},
    )


# --------------------------------------------------------------------------- tiny loopback TCP servers


class _LoopbackServer:
    """An asyncio TCP server on 127.0.0.1 that tracks its connection handlers so it can close them all."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _tracked(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        try:
            await self._handle(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            with suppress(ConnectionError, asyncio.CancelledError):
                await writer.wait_closed()
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def __aenter__(self) -> _LoopbackServer:
        self._server = await asyncio.start_server(self._tracked, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Blackhole(_LoopbackServer):
    """Accepts connections and reads requests but never answers."""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass


class RangeIgnoringProxy(_LoopbackServer):
    """Forwards each HTTP request to an upstream S3 server with its `Range` header removed.

    The upstream then answers a ranged GET with 200 and the whole object, as rclone's `serve s3` does.
    One request per connection (`Connection: close` both ways) keeps the forwarding trivial.
    """

    def __init__(self, upstream_port: int) -> None:
        super().__init__()
        self.upstream_port = upstream_port
        self.requests = 0
        self.ranges_dropped = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head[:-4].split(b"\r\n")
        kept: list[bytes] = []
        length = 0
        for line in header_lines:
            name, _, value = line.partition(b":")
            lowered = name.strip().lower()
            if lowered == b"range":
                self.ranges_dropped += 1
                continue
            if lowered == b"connection":
                continue
            if lowered == b"content-length":
                length = int(value)
            kept.append(line)
        body = await reader.readexactly(length) if length else b""
        self.requests += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            up_writer.write(b"\r\n".join([request_line, *kept, b"Connection: close", b"", b""]) + body)
            await up_writer.drain()
            writer.write(await up_reader.read())
            await writer.drain()
        finally:
            up_writer.close()
            await up_writer.wait_closed()


def raw_store(server: S3Server, endpoint: str) -> S3Store:
    """A plain obstore client for `server`'s bucket at `endpoint` (the server itself or a proxy)."""
    return S3Store(
        server.bucket,
        endpoint=endpoint,
        region=server.region,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        client_options={"allow_http": True},
        retry_config={"max_retries": 0},
    )


async def ranged_read(store: S3Store, path: str) -> str:
    """What a plain client makes of a 10-byte ranged GET: "10 bytes", "N bytes" or the error class."""
    try:
        result = await obstore.get_async(store, path, options={"range": (0, 10)})
        return f"{len(await result.bytes_async())} bytes"
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc).splitlines()[0]


@asynccontextmanager
async def _proxied(server: S3Server) -> AsyncIterator[RangeIgnoringProxy]:
    async with RangeIgnoringProxy(server.port) as proxy:
        yield proxy


# --------------------------------------------------------------------------- scenarios


async def test_dead_endpoint_fails_every_page_within_the_deadline() -> None:
    """Against a closed port every call fails after bounded retries with `StorageUnavailable`: an outage
    is an error, never a page reported missing (`exists` used to answer 0, which read as an empty cache)."""
    with anyio.fail_after(HANG_GUARD_S):
        async with dead_backend() as backend:
            _, bufs = host_pages(6)
            with pytest.raises(StorageUnavailable, match="attempt"):
                await backend.get(keys_for(6), bufs)
            with pytest.raises(StorageUnavailable):
                await backend.put(keys_for(6), bufs)
            with pytest.raises(StorageUnavailable):
                await backend.exists(keys_for(6))
            with pytest.raises(StorageUnavailable, match="deletes failed"):
                await backend.delete(keys_for(2))
            stats = backend.statistics()
    assert stats.retries >= 1, "connection errors are retried"
    assert stats.errors >= 13
    assert stats.misses == 0, "an unreachable server is not a miss"
    assert stats.pages_read == stats.pages_written == 0


async def test_retries_of_a_dead_endpoint_are_bounded_by_max_retries() -> None:
    """However long the deadline, a refused connection is retried `max_retries` times, then given up:
    the controller's breaker must learn of a dead endpoint quickly, not after a 30 s deadline."""
    with anyio.fail_after(HANG_GUARD_S):
        async with dead_backend(max_concurrency=1, max_retries=2, deadline_s=600.0) as backend:
            with pytest.raises(StorageUnavailable, match="after 3 attempt"):
                await backend.exists(keys_for(1))
            stats = backend.statistics()
    assert stats.requests == 3
    assert stats.retries == 2


async def test_a_batch_gives_up_once_the_server_is_known_unreachable() -> None:
    """After one page exhausted its deadline, the pages of that batch not yet started fail without requests.

    Guards against a batch of N pages on a dead server taking N deadlines (serially under the limit).
    """
    with anyio.fail_after(HANG_GUARD_S):
        async with dead_backend(max_concurrency=1) as backend:
            _, bufs = host_pages(20)
            with pytest.raises(StorageUnavailable):
                await backend.get(keys_for(20), bufs)
            stats = backend.statistics()
    assert stats.errors == 20
    assert stats.requests == stats.retries + 1, "only the first page made requests: its attempts"


async def test_a_server_that_never_answers_times_out_each_attempt() -> None:
    """A silent server (accepts, never responds) costs attempt timeouts, then `StorageUnavailable`."""
    with anyio.fail_after(HANG_GUARD_S):
        async with Blackhole() as hole:
            backend = S3Backend(
                "bucket", namespace_digest=NAMESPACE, endpoint=hole.endpoint, access_key_id="k",
                secret_access_key="s", **FAST_RETRIES,
            )  # fmt: skip
            async with backend:
                _, bufs = host_pages(3)
                with pytest.raises(StorageUnavailable, match="timed out"):
                    await backend.get(keys_for(3), bufs)
                with pytest.raises(StorageUnavailable, match="timed out"):
                    await backend.exists(keys_for(3))
                stats = backend.statistics()
    assert stats.errors >= 3
    assert stats.retries >= 1


async def test_server_that_ignores_range_still_reads_exact_pages(moto_server: S3Server) -> None:
    """Regression for servers that answer a ranged GET with 200 and the whole object (rclone `serve s3`).

    The proxy is first checked to really behave that way (a plain ranged read through it is refused by
    object_store), then pages written, probed and read through it must be exact (the backend reads whole
    objects and checks their length), and a truncated object behind it must still be a counted miss.
    """
    async with _proxied(moto_server) as proxy, open_backend(moto_server, endpoint=proxy.endpoint) as backend:
        keys = keys_for(4)
        src, bufs = host_pages(4)
        assert await backend.put(keys, bufs) == [True] * 4
        path = backend.object_path(keys[0])

        direct = await ranged_read(raw_store(moto_server, moto_server.endpoint), path)
        quirky = await ranged_read(raw_store(moto_server, proxy.endpoint), path)
        assert direct == "10 bytes"
        # object_store refuses such an answer ("Received non-partial response when range requested"),
        # so a backend built on ranged GETs would fail every read from these servers.
        assert quirky != "10 bytes", quirky
        assert proxy.ranges_dropped >= 1

        assert await backend.exists(keys) == 4
        dst, out = host_pages(4, fill=False)
        assert await backend.get(keys, out) == [HIT] * 4
        assert torch.equal(src, dst)

        store = raw_store(moto_server, proxy.endpoint)
        body = bytes(await (await obstore.get_async(store, path)).bytes_async())
        await obstore.put_async(store, path, body[: len(body) // 2])
        dst.zero_()
        assert await backend.get(keys, out) == [PageStatus.CORRUPT, HIT, HIT, HIT]
        assert not dst[0].any()
        assert backend.statistics().checksum_failures == 1
        assert proxy.requests >= 12


async def test_server_killed_mid_batch_fails_pages_then_recovers(
    private_moto: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kill the server while a batch is held at a gate: the batch ends with some False and no exception;
    after the server restarts on the same port the same backend works again."""
    server = private_moto
    limit = 2
    async with open_backend(server, max_concurrency=limit, **FAST_RETRIES) as backend:
        keys = keys_for(12)
        src, bufs = host_pages(12)
        assert await backend.put(keys, bufs) == [True] * 12

        held = set(keys[4:])
        waiting = 0
        all_workers_held = anyio.Event()
        gate = anyio.Event()
        real_fetch = s3_module._fetch

        async def gated_fetch(store: S3Store, path: str) -> obstore.Bytes:
            nonlocal waiting
            if path.rsplit("/", 1)[1] in held:
                waiting += 1
                if waiting == limit:
                    all_workers_held.set()  # both workers are here, so pages 0-3 are done
                await gate.wait()
            return await real_fetch(store, path)

        monkeypatch.setattr(s3_module, "_fetch", gated_fetch)
        dst, out = host_pages(12, fill=False)
        results: list[PageStatus] = []

        async def prefetch() -> None:
            results.extend(await backend.get(keys, out))

        with anyio.fail_after(HANG_GUARD_S):
            async with anyio.create_task_group() as tg:
                tg.start_soon(prefetch)
                await all_workers_held.wait()
                await anyio.to_thread.run_sync(server.kill)
                held.clear()
                gate.set()

        assert results == [HIT] * 4 + [ERROR] * 8
        assert torch.equal(dst[:4], src[:4])
        stats = backend.statistics()
        assert stats.errors == 8
        assert stats.retries >= 1

        await anyio.to_thread.run_sync(server.restart)
        with anyio.fail_after(HANG_GUARD_S):
            assert await backend.put(keys[:3], bufs[:3]) == [True] * 3
            dst.zero_()
            assert await backend.get(keys[:3], out[:3]) == [HIT] * 3
            assert await backend.exists(keys) == 3
        assert torch.equal(dst[:3], src[:3])


# --------------------------------------------------------------------------- waiting for a connection


@asynccontextmanager
async def every_connection_busy(backend: S3Backend) -> AsyncIterator[None]:
    """Every connection of the backend taken, as by requests that run long (a request held inside its
    attempt would time out and give its connection up)."""
    limiter, connections = backend._requests._limiter, backend._requests._max_concurrency
    assert limiter is not None
    assert connections is not None
    async with anyio.create_task_group() as tg:
        held = anyio.Event()
        done = anyio.Event()

        async def hold(n: int) -> None:
            async with limiter:
                if n == connections - 1:
                    held.set()
                await done.wait()

        for n in range(connections):
            tg.start_soon(hold, n)
        await held.wait()
        try:
            yield
        finally:
            done.set()


async def test_waiting_for_a_connection_is_not_an_attempt_timeout(moto_server: S3Server) -> None:
    """A request queued behind busy connections waited inside its attempt's timeout: on a healthy server
    it timed out before it was ever sent, was retried, and failed once the retries ran out. The wait now
    counts toward the request's deadline only: the queued GET is sent once a connection frees, first
    time, and loads."""
    attempt_s = FAST_RETRIES["attempt_timeout_s"]
    options = {**FAST_RETRIES, "deadline_s": 60.0}
    async with open_backend(moto_server, max_concurrency=1, **options) as backend:
        keys = keys_for(1)
        src, bufs = host_pages(1)
        assert await backend.put(keys, bufs) == [True]
        before = backend.statistics()
        dst, out = host_pages(1, fill=False)
        with anyio.fail_after(HANG_GUARD_S):
            async with anyio.create_task_group() as tg, every_connection_busy(backend):

                async def queued() -> None:
                    assert await backend.get(keys, out) == [HIT]

                tg.start_soon(queued)
                while not backend._requests.waiting:  # noqa: ASYNC110 - polled: no event to wait on
                    await anyio.sleep(0.01)
                # Time must pass here: the old code's attempt timeout fired during this wait.
                await anyio.sleep(3 * attempt_s)
                assert backend._requests.waiting == 1, "the queued GET stopped waiting"
                assert backend.statistics().requests == before.requests, "a GET went without a connection"
        assert torch.equal(dst, src)
        after = backend.statistics()
        assert after.retries == before.retries, "the wait for a connection was retried"
        assert after.requests == before.requests + 1


async def test_the_wait_for_a_connection_is_bounded_by_the_deadline(moto_server: S3Server) -> None:
    """With every connection busy past a request's deadline, the queued request fails (ERROR, no request
    sent, the server not taken for down) at its deadline instead of waiting on."""
    async with open_backend(moto_server, max_concurrency=1, **FAST_RETRIES) as backend:
        keys = keys_for(1)
        _, bufs = host_pages(1)
        assert await backend.put(keys, bufs) == [True]
        before = backend.statistics()
        _, out = host_pages(1, fill=False)
        with anyio.fail_after(HANG_GUARD_S):
            async with every_connection_busy(backend):
                assert await backend.get(keys, out) == [ERROR]
        stats = backend.statistics()
        assert stats.requests == before.requests
        assert stats.errors == before.errors + 1
        assert await backend.get(keys, out) == [HIT]  # the connections came back
