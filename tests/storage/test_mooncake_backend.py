"""MooncakeBackend on a real `mooncake_master` (with its HTTP metadata server) on loopback, over TCP.

The shared contract and hostile-storage suites, then what only Mooncake does: URLs, pages read straight
into the caller's buffers, watermark eviction, a restarted master, a killed client that held segments.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
from contract import empty_pages, make_keys, make_pages
from net_contract import NetworkStoreContract, assert_pages_shared_across_processes
from net_instance import run_demo
from net_servers import MooncakeMaster, start_mooncake

from hicache.errors import StorageUnavailable
from storage_backends.mooncake import MooncakeBackend, parse_mooncake_url
from storage_backends.protocol import PageStatus
from storage_backends.threads import stray_threads

HIT, MISS, ERROR = PageStatus.HIT, PageStatus.MISS, PageStatus.ERROR
DIGEST = bytes(range(16))
_SMALL = {"segment_bytes": 0, "buffer_bytes": 16 << 20}
"""Test backends contribute no memory: the session's `raw_client` holds the pool's one segment, as a
dedicated storage client would, so pages outlive the backend that wrote them."""


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One mooncake_master with its HTTP metadata server, shared by the session."""
    master = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="session")
def raw_client(mooncake_master: MooncakeMaster) -> Iterator[Any]:
    """A plain Mooncake client (it contributes a segment too), to read and write objects directly."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        "127.0.0.1",
        mooncake_master.metadata,
        256 << 20,
        16 << 20,
        "tcp",
        "",
        f"127.0.0.1:{mooncake_master.rpc_port}",
    )
    assert code == 0
    yield store
    store.close()


@pytest.fixture(scope="session")
def kept_client(mooncake_master: MooncakeMaster, raw_client: Any) -> Iterator[None]:
    """Hold the process's shared client for the test backends' settings for the whole session, so a
    test's backends do not each set one up and close it (a second each)."""
    keeper = MooncakeBackend.from_url(mooncake_master.url("keeper"), namespace_digest=DIGEST, **_SMALL)
    keeper.acquire_client()
    yield
    keeper.drop_client()
    keeper._closed = True


class TestMooncakeContract(NetworkStoreContract):
    backend_class = MooncakeBackend
    options = _SMALL
    held_read = "_read_into"
    held_in_thread = True

    @pytest.fixture
    def url(self, mooncake_master: MooncakeMaster, kept_client: None) -> str:
        return mooncake_master.url(f"contract-{uuid.uuid4().hex[:12]}")

    @pytest.fixture
    def raw(self, raw_client: Any) -> Any:
        return raw_client

    def raw_get(self, raw: Any, backend: MooncakeBackend, key: str) -> bytes:
        return bytes(raw.get(backend.object_name(key)))

    def raw_set(self, raw: Any, backend: MooncakeBackend, key: str, data: bytes) -> None:
        assert raw.upsert(backend.object_name(key), data) == 0


# ---------------------------------------------------------------------------------------------- URLs


def test_url_names_master_prefix_and_metadata() -> None:
    master, prefix, options = parse_mooncake_url(
        "mooncake://10.0.0.1:50051/a/b?metadata=http://10.0.0.1:8080/metadata&protocol=rdma&segment_bytes=1024"
    )
    assert (master, prefix) == ("10.0.0.1:50051", "a/b")
    assert options == {"metadata": "http://10.0.0.1:8080/metadata", "protocol": "rdma", "segment_bytes": 1024}


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("mooncake://m/p?metadata=x", "master"),
        ("mooncake://m:1/p", "metadata"),
        ("mooncake://m:1/p?metadata=x&protocol=udp", "protocol"),
        ("mooncake://m:1/p?metadata=x&bogus=1", "bogus"),
        ("mooncake://m:1/p?metadata=x&segment_bytes=lots", "segment_bytes"),
        ("mooncake://m:1/a/../b?metadata=x", "prefix"),
    ],
)
def test_bad_urls_are_refused_naming_the_part(url: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        MooncakeBackend.from_url(url, namespace_digest=DIGEST)


# ---------------------------------------------------------------------------------------- zero copy


async def test_pages_land_in_one_pool_buffer_without_a_second_copy(mooncake_master: MooncakeMaster) -> None:
    """Pages read into views of one flat buffer (as the host pool hands them out) come back bitwise."""
    import torch

    pool = torch.zeros(16, 65536, dtype=torch.uint8)
    flat = pool.view(-1).numpy().data
    views = [flat[i * 65536 : (i + 1) * 65536] for i in range(16)]
    keys, pages = make_keys(16, salt=7), make_pages(16, 65536, seed=7)
    async with MooncakeBackend.from_url(
        mooncake_master.url("zc"), namespace_digest=DIGEST, **_SMALL
    ) as backend:
        assert await backend.put(keys, pages) == [True] * 16
        assert await backend.get(keys, views) == [HIT] * 16
    assert [bytes(v) for v in views] == [bytes(p) for p in pages]


# -------------------------------------------------------------------------------- eviction, failures


async def test_watermark_eviction_while_reading_gives_misses_never_wrong_bytes(tmp_path: Path) -> None:
    """A pool of one 16 MiB segment written with 32 MiB: the master evicts at its watermark; every page
    read back is a verified hit, a miss or an error (a page evicted during its read), never wrong bytes."""
    master = start_mooncake(
        tmp_path, extra=("--eviction_high_watermark_ratio=0.8", "--default_kv_lease_ttl=1")
    )
    try:
        keys, pages = make_keys(128), make_pages(128, 256 << 10)
        async with MooncakeBackend.from_url(
            master.url("evict"), namespace_digest=DIGEST, segment_bytes=16 << 20, buffer_bytes=16 << 20
        ) as backend:
            written = []
            for start in range(0, 128, 8):
                written += await backend.put(keys[start : start + 8], pages[start : start + 8])
            assert any(written)
            out = empty_pages(128, 256 << 10, fill=0x5A)
            statuses = await backend.get(keys, out)
            assert set(statuses) <= {HIT, MISS, ERROR}
            assert MISS in statuses  # the pool held a half of what was written
            for status, got, want in zip(statuses, out, pages, strict=True):
                if status is HIT:
                    assert bytes(got) == bytes(want)
    finally:
        master.stop()


async def test_a_restarted_master_is_an_outage_then_misses(tmp_path: Path) -> None:
    """While the master is down every read fails as an outage (the breaker's signal, never a miss); a
    new master knows no objects, so a fresh client then sees misses, never stale or wrong bytes."""
    master = start_mooncake(tmp_path)
    options = {"attempt_timeout_s": 2.0, "deadline_s": 4.0, "segment_bytes": 32 << 20}
    try:
        keys, pages = make_keys(8), make_pages(8, 4096)
        async with MooncakeBackend.from_url(
            master.url("restart"), namespace_digest=DIGEST, **options
        ) as backend:
            assert await backend.put(keys, pages) == [True] * 8
            master.stop()
            with anyio.fail_after(30), pytest.raises(StorageUnavailable):
                await backend.exists(keys)
        master.start()
        async with MooncakeBackend.from_url(
            master.url("restart"), namespace_digest=DIGEST, **options
        ) as backend:
            assert await backend.get(keys, empty_pages(8, 4096)) == [MISS] * 8
            assert await backend.put(keys, pages) == [True] * 8
            out = empty_pages(8, 4096)
            assert await backend.get(keys, out) == [HIT] * 8
    finally:
        master.stop()


_HOLDER = textwrap.dedent(
    """
    import sys, anyio
    from storage_backends.mooncake import MooncakeBackend
    async def main():
        backend = MooncakeBackend.from_url(sys.argv[1], namespace_digest=bytes(range(16)),
                                           segment_bytes=64 << 20, buffer_bytes=16 << 20)
        keys = [f"{i:032x}" for i in range(1, 9)]
        pages = [memoryview(bytearray([i]) * 4096) for i in range(1, 9)]
        assert await backend.put(keys, pages) == [True] * 8
        print("stored", flush=True)
        sys.stdin.readline()  # hold the segment until killed
    anyio.run(main)
    """
)


async def test_a_killed_client_that_held_the_segments_leaves_misses_or_errors(tmp_path: Path) -> None:
    """Another process that contributes a segment stores pages and is SIGKILLed: our reads of its pages
    are misses or errors, never wrong bytes, and what we store meanwhile loads.

    A master of its own: the dead client's segment stays listed until the master's client TTL expires,
    and pages placed there meanwhile are lost, which must not reach other tests."""
    mooncake_master = start_mooncake(tmp_path)
    url = mooncake_master.url(f"killed-{uuid.uuid4().hex[:8]}")
    start = partial(
        subprocess.Popen,
        [sys.executable, "-c", _HOLDER, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=Path.cwd(),
    )
    holder = await anyio.to_thread.run_sync(start)
    try:
        assert holder.stdout is not None
        line = await anyio.to_thread.run_sync(holder.stdout.readline)
        assert line.strip() == b"stored", line
        keys = [f"{i:032x}" for i in range(1, 9)]
        options = {"attempt_timeout_s": 2.0, "deadline_s": 4.0, "segment_bytes": 32 << 20}
        async with MooncakeBackend.from_url(url, namespace_digest=DIGEST, **options) as backend:
            seen = empty_pages(8, 4096)
            assert await backend.get(keys, seen) == [HIT] * 8  # the other process's pages, shared
            holder.kill()
            holder.wait()
            out = empty_pages(8, 4096, fill=0x5A)
            try:
                statuses = await backend.get(keys, out)
            except StorageUnavailable:
                statuses = [ERROR] * 8
            assert set(statuses) <= {HIT, MISS, ERROR}
            for i, (status, got) in enumerate(zip(statuses, out, strict=True)):
                if status is HIT:
                    assert bytes(got) == bytes([i + 1]) * 4096
            # Until the master expires the dead client, a put placed in its segment fails (per page);
            # what was stored loads.
            mine, pages = make_keys(4, salt=9), make_pages(4, 4096, seed=9)
            try:
                stored = await backend.put(mine, pages)
            except StorageUnavailable:
                stored = [False] * 4  # every page was placed in the dead client's segment
            back = empty_pages(4, 4096)
            statuses = await backend.get(mine, back)
            for flag, status, got, want in zip(stored, statuses, back, pages, strict=True):
                if flag:
                    assert status is HIT
                    assert bytes(got) == bytes(want)
    finally:
        holder.kill()
        holder.wait()
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()
        mooncake_master.stop()


# --------------------------------------------------------------------------- two processes, one pool


def test_two_processes_share_pages_through_the_pool_and_namespaces_stay_apart(
    mooncake_master: MooncakeMaster, raw_client: Any, tmp_path: Path
) -> None:
    """Instance A (its own process, the real controller, no memory of its own in the pool) writes its pages
    into the segment this process holds; B, a fresh process, prefetches them byte-identical; C, another
    model's namespace, finds none of them."""
    url = mooncake_master.url(f"share-{uuid.uuid4().hex[:8]}", "segment_bytes=0&buffer_bytes=16777216")
    assert_pages_shared_across_processes(url, tmp_path)


def test_the_demo_runs_on_the_pool(mooncake_master: MooncakeMaster) -> None:
    """`hicache demo --backend mooncake://...` serves its workload with the pool as its storage tier."""
    done = run_demo(mooncake_master.url(f"demo-{uuid.uuid4().hex[:8]}", "segment_bytes=67108864"))
    assert "outputs identical to recompute" in done


async def test_a_paused_master_cannot_hold_a_read_past_its_deadline_and_its_buffers_stay_quarantined(
    tmp_path: Path,
) -> None:
    """A SIGSTOPped master answers nothing: the read returns an outage within its deadline, and the
    worker thread still inside the client library keeps the read's buffers out of use (`stray_threads`)
    until the master is back and the thread returns."""
    master = start_mooncake(tmp_path)
    try:
        keys, pages = make_keys(4), make_pages(4, 4096)
        options = {"attempt_timeout_s": 0.5, "read_deadline_s": 1.0, "segment_bytes": 32 << 20}
        async with MooncakeBackend.from_url(
            master.url("pause"), namespace_digest=DIGEST, **options
        ) as backend:
            assert await backend.put(keys, pages) == [True] * 4
            out = empty_pages(4, 4096)
            master.pause()
            try:
                with anyio.fail_after(10), pytest.raises(StorageUnavailable, match="timed out"):
                    await backend.get(keys, out)
                assert stray_threads.busy(out)
            finally:
                master.resume()
            with anyio.fail_after(60):
                # The stuck thread returns once the master answers; the registry offers no event to wait on.
                while stray_threads.busy(out):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            back = empty_pages(4, 4096)
            assert await backend.get(keys, back) == [HIT] * 4
            assert [bytes(b) for b in back] == [bytes(p) for p in pages]
    finally:
        master.stop()
