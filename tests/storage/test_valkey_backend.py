"""ValkeyBackend on real valkey-server processes on loopback: a 3-node cluster and a single node.

The shared contract and hostile-storage suites run on both; then what only a network store does: URLs and
redaction, pages spread over every shard, pages the server evicts, a node killed or paused mid-read.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis
import torch
from contract import empty_pages, make_keys, make_pages
from net_contract import NetworkStoreContract, assert_pages_shared_across_processes
from net_instance import run_demo
from net_servers import ValkeyCluster, start_valkey
from s3_instance import PAGE, PROMPTS, instance_config, kv_payload

from hicache import HiCache, Lease
from hicache.errors import StorageAuthError, StorageUnavailable
from storage_backends.protocol import PageStatus
from storage_backends.registry import open_backend
from storage_backends.valkey import ValkeyBackend, parse_valkey_url

HIT, MISS, ERROR = PageStatus.HIT, PageStatus.MISS, PageStatus.ERROR
DIGEST = bytes(range(16))
HANG_GUARD_S = 60
"""Not a timing assertion: only turns a hang into a failure well before the pytest timeout."""


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """Three valkey-server nodes in cluster mode, shared by the session."""
    cluster = start_valkey(tmp_path_factory.mktemp("valkey-cluster"), nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def valkey_single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """One valkey-server, not clustered, with a password, shared by the session."""
    server = start_valkey(
        tmp_path_factory.mktemp("valkey-single"), nodes=1, cluster=False, password="s3cr3t-pw"
    )
    try:
        yield server
    finally:
        server.stop()


def raw_client(server: ValkeyCluster) -> Any:
    """A plain synchronous client on `server`, to read and write values behind the backend's back."""
    if server.clustered:
        return redis.RedisCluster(host="127.0.0.1", port=server.nodes[0].port, password=server.password)
    return redis.Redis(host="127.0.0.1", port=server.nodes[0].port, password=server.password)


class _ValkeyContract(NetworkStoreContract):
    backend_class = ValkeyBackend
    held_read = "_get_group"
    held_in_thread = False
    server_fixture = ""

    @pytest.fixture
    def server(self, request: pytest.FixtureRequest) -> ValkeyCluster:
        result: ValkeyCluster = request.getfixturevalue(self.server_fixture)
        return result

    @pytest.fixture
    def url(self, server: ValkeyCluster) -> str:
        return server.url(f"contract-{uuid.uuid4().hex[:12]}")

    @pytest.fixture
    def raw(self, server: ValkeyCluster) -> Iterator[Any]:
        client = raw_client(server)
        yield client
        client.close()

    def raw_get(self, raw: Any, backend: ValkeyBackend, key: str) -> bytes:
        return bytes(raw.get(backend.server_key(key)))

    def raw_set(self, raw: Any, backend: ValkeyBackend, key: str, data: bytes) -> None:
        raw.set(backend.server_key(key), data)


class TestValkeyCluster(_ValkeyContract):
    server_fixture = "valkey_cluster"


class TestValkeySingleNode(_ValkeyContract):
    server_fixture = "valkey_single"


# ---------------------------------------------------------------------------------------------- URLs


def test_url_names_every_node_the_prefix_and_options() -> None:
    nodes, prefix, options = parse_valkey_url("valkey://u:p%40ss@h1:7000,h2:7001/a/b?ttl_s=60&cluster=yes")
    assert nodes == [("h1", 7000), ("h2", 7001)]
    assert prefix == "a/b"
    assert options == {"username": "u", "password": "p@ss", "ttl_s": 60.0, "cluster": True}


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("valkey://h1/p", "node 0"),
        ("valkey://h1:0/p", "node 0"),
        ("valkey://h1:7000/p?bogus=1", "bogus"),
        ("valkey://h1:7000/p?ttl_s=x", "ttl_s"),
        ("valkey://h1:7000/p?ttl_s=0", "ttl_s"),
        ("valkey://h1:7000/a/../b", "prefix"),
        ("valkey://h1:7000/%7Btag%7D", "prefix"),
    ],
)
def test_bad_urls_are_refused_naming_the_part(url: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ValkeyBackend.from_url(url, namespace_digest=DIGEST)


def test_a_password_in_the_url_is_never_shown() -> None:
    backend = ValkeyBackend.from_url("valkey://:hunter2-secret@127.0.0.1:1/p", namespace_digest=DIGEST)
    try:
        assert "hunter2-secret" not in repr(backend)
        assert "***" in repr(backend)
    finally:
        backend._closed = True
    with pytest.raises(ValueError, match="ttl_s") as info:
        open_backend("valkey://:hunter2-secret@127.0.0.1:1/p?ttl_s=bad", namespace_digest=DIGEST)
    assert "hunter2-secret" not in str(info.value)


async def test_a_wrong_password_is_an_outage_naming_no_secret(valkey_single: ValkeyCluster) -> None:
    url = valkey_single.url("p").replace("s3cr3t-pw", "wrong-pw-123")
    async with ValkeyBackend.from_url(url, namespace_digest=DIGEST, max_retries=0) as backend:
        with pytest.raises(StorageAuthError) as info:
            await backend.put(make_keys(1), make_pages(1, 4096))
    assert "wrong-pw-123" not in str(info.value)
    assert "s3cr3t-pw" not in str(info.value)


# ------------------------------------------------------------------------------------ cluster layout


async def test_a_chain_spreads_over_every_shard_without_crossslot(valkey_cluster: ValkeyCluster) -> None:
    """A batch of one chain's pages is split per node: no CROSSSLOT error, and no hash tag piles the
    chain onto one shard."""
    keys, pages = make_keys(96), make_pages(96, 4096)
    async with ValkeyBackend.from_url(valkey_cluster.url("spread"), namespace_digest=DIGEST) as backend:
        assert await backend.put(keys, pages) == [True] * 96
        out = empty_pages(96, 4096)
        assert await backend.get(keys, out) == [HIT] * 96
        assert [bytes(o) for o in out] == [bytes(p) for p in pages]
        assert await backend.exists(keys) == 96
    counts = [int(node.command("DBSIZE")) for node in valkey_cluster.nodes]
    assert all(count > 0 for count in counts), counts


# ------------------------------------------------------------------------------------------ eviction


async def test_pages_evicted_under_memory_pressure_are_misses_never_wrong_bytes(tmp_path: Path) -> None:
    """`maxmemory` with `allkeys-lru`: the server drops pages while we write and read; every page read is
    a verified hit or a miss."""
    server = start_valkey(
        tmp_path, nodes=1, cluster=False, extra=("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    )
    try:
        keys, pages = make_keys(64), make_pages(64, 65536)
        async with ValkeyBackend.from_url(server.url("lru"), namespace_digest=DIGEST) as backend:
            for start in range(0, 64, 8):
                await backend.put(keys[start : start + 8], pages[start : start + 8])
            out = empty_pages(64, 65536)
            statuses = await backend.get(keys, out)
            assert set(statuses) == {HIT, MISS}
            for status, got, want in zip(statuses, out, pages, strict=True):
                if status is HIT:
                    assert bytes(got) == bytes(want)
            assert backend.statistics().misses == statuses.count(MISS)
    finally:
        server.stop()


# ------------------------------------------------------------------------------------- node failures


async def test_a_killed_node_fails_its_pages_and_a_dead_cluster_raises(tmp_path: Path) -> None:
    """Killing one node of three: its pages become errors (or the call raises when every page was on
    dead nodes), never wrong bytes; the other nodes' pages still load."""
    cluster = start_valkey(tmp_path, nodes=3)
    try:
        keys, pages = make_keys(48), make_pages(48, 4096)
        options = {"attempt_timeout_s": 1.0, "deadline_s": 3.0, "max_retries": 1, "connect_timeout_s": 0.5}
        async with ValkeyBackend.from_url(cluster.url("kill"), namespace_digest=DIGEST, **options) as backend:
            assert await backend.put(keys, pages) == [True] * 48
            cluster.nodes[2].kill()
            out = empty_pages(48, 4096, fill=0x5A)
            statuses = await backend.get(keys, out)
            assert set(statuses) == {HIT, ERROR}
            for status, got, want in zip(statuses, out, pages, strict=True):
                if status is HIT:
                    assert bytes(got) == bytes(want)
            for node in cluster.nodes[:2]:
                node.kill()
            with pytest.raises(StorageUnavailable):
                await backend.get(keys, out)
    finally:
        cluster.stop()


async def test_a_paused_node_cannot_hold_a_read_past_its_deadline(tmp_path: Path) -> None:
    """A SIGSTOPped server accepts nothing and answers nothing: the read returns within its deadline
    (the attempts' timeouts, retries and backoff all inside it) with an outage, and resumes afterwards."""
    server = start_valkey(tmp_path, nodes=1, cluster=False)
    try:
        keys, pages = make_keys(4), make_pages(4, 4096)
        options = {"attempt_timeout_s": 0.3, "read_deadline_s": 1.0, "max_retries": 2}
        async with ValkeyBackend.from_url(server.url("pause"), namespace_digest=DIGEST, **options) as backend:
            assert await backend.put(keys, pages) == [True] * 4
            server.nodes[0].pause()
            try:
                with anyio.fail_after(10):  # a hang fails the test; the bound itself is the backend's
                    with pytest.raises(StorageUnavailable, match=r"within 1\.0s"):
                        await backend.get(keys, empty_pages(4, 4096))
            finally:
                server.nodes[0].resume()
            out = empty_pages(4, 4096)
            assert await backend.get(keys, out) == [HIT] * 4
            assert backend.statistics().retries >= 1
    finally:
        server.stop()


async def test_waiting_for_a_connection_is_not_an_attempt_timeout(valkey_single: ValkeyCluster) -> None:
    """A pipeline queued behind busy connections waited inside its attempt's timeout (the S3 backend's old
    bug, still Valkey's while it had its own round-trip code): on a healthy server it timed out before it
    was ever sent, was retried, and failed. The wait now counts toward the round trip's deadline only (one
    `RoundTrips` for every network store): the queued GET is sent once a connection frees, and loads."""
    attempt_s = 0.2
    options = {"attempt_timeout_s": attempt_s, "deadline_s": 60.0, "max_retries": 1, "max_concurrency": 1}
    url = valkey_single.url(f"wait-{uuid.uuid4().hex[:8]}")
    async with ValkeyBackend.from_url(url, namespace_digest=DIGEST, **options) as backend:
        keys, pages = make_keys(1), make_pages(1, 4096)
        assert await backend.put(keys, pages) == [True]
        before = backend.statistics()
        out = empty_pages(1, 4096)
        connections = backend._calls._limiter
        assert connections is not None
        with anyio.fail_after(HANG_GUARD_S):
            async with anyio.create_task_group() as tg:
                await connections.acquire()  # the only connection, busy

                async def queued() -> None:
                    assert await backend.get(keys, out) == [HIT]

                try:
                    tg.start_soon(queued)
                    while not backend._calls.waiting:  # noqa: ASYNC110 - polled: no event to wait on
                        await anyio.sleep(0.01)
                    # Time must pass here: the old code's attempt timeout fired during this wait.
                    await anyio.sleep(3 * attempt_s)
                    assert backend._calls.waiting == 1, "the queued GET stopped waiting"
                    assert backend.statistics().requests == before.requests, "a GET went without a connection"
                finally:
                    connections.release()
        assert bytes(out[0]) == bytes(pages[0])
        after = backend.statistics()
        assert after.retries == before.retries, "the wait for a connection was retried"
        assert after.requests == before.requests + 1


# ------------------------------------------------------------------------- two processes, one cluster


def test_two_processes_share_pages_through_the_cluster_and_namespaces_stay_apart(
    valkey_cluster: ValkeyCluster, tmp_path: Path
) -> None:
    """Instance A (its own process, the real controller) writes its pages through to the cluster; B, a
    fresh process, prefetches them byte-identical; C, another model's namespace, finds none of them."""
    assert_pages_shared_across_processes(valkey_cluster.url(f"share-{uuid.uuid4().hex[:8]}"), tmp_path)


def test_the_demo_runs_on_the_cluster(valkey_cluster: ValkeyCluster) -> None:
    """`hicache demo --backend valkey://...` serves its workload with the cluster as its storage tier."""
    done = run_demo(valkey_cluster.url(f"demo-{uuid.uuid4().hex[:8]}"))
    assert "outputs identical to recompute" in done


# ------------------------------------------------------------------ the controller on a failing cluster


async def serve(cache: HiCache, request: str, prompt: list[int]) -> Lease:
    """Acquire `prompt`, compute (the deterministic) KV for what was not cached, insert it."""
    lease = await cache.acquire(request, prompt)
    n = len(prompt)
    new = await cache.alloc_device(-(-n // PAGE) * PAGE - lease.cached_len)
    assert new is not None
    cache.device_pool.write_tokens(new[: n - lease.cached_len], kv_payload(prompt)[:, :, lease.cached_len :])
    await cache.insert(lease, prompt, torch.cat([lease.device_indices, new]))
    return lease


def assert_exact_kv_and_no_leaks(cache: HiCache, lease: Lease, prompt: list[int]) -> None:
    """What the lease holds is the prompt's KV bit for bit, and every pool page is owned by the tree."""
    got = cache.device_pool.read_tokens(lease.device_indices[: lease.cached_len])
    assert torch.equal(got, kv_payload(prompt)[:, :, : lease.cached_len])
    cache.release(lease)
    cache.sanity_check()
    stats = cache.statistics()
    assert stats.prefetches_in_flight == 0
    assert stats.host_pool.used_pages * PAGE == stats.tree.host_tokens


async def test_nodes_killed_under_the_controller_fail_pages_open_the_breaker_and_it_recovers(
    tmp_path: Path,
) -> None:
    """One node of three killed: a fresh cache's prefetch loads what the live nodes hold, never a wrong
    byte. Every node killed: storage calls fail, the breaker opens, requests are served without storage.
    The nodes back (empty): the breaker's probe succeeds, pages are written again and prefetched again."""
    cluster = start_valkey(tmp_path, nodes=3)
    try:
        url = cluster.url("faults", "attempt_timeout_s=0.5&deadline_s=2&max_retries=1&connect_timeout_s=0.5")
        config = instance_config(url, storage_breaker_threshold=1, storage_breaker_backoff_s=0.05)
        prompt = PROMPTS[1]  # 173 tokens: 10 whole pages
        async with HiCache(config) as producer:
            producer.release(await serve(producer, "fill", prompt))
            await producer.wait_idle()
        cluster.nodes[2].kill()
        async with HiCache(config) as cache:
            with anyio.fail_after(HANG_GUARD_S):
                lease = await cache.acquire("one-dead", prompt)
            assert lease.cached_len < 160  # some of the 10 pages lived on the dead node
            assert_exact_kv_and_no_leaks(cache, lease, prompt)
            for node in cluster.nodes[:2]:
                node.kill()
            with anyio.fail_after(HANG_GUARD_S):
                lease = await cache.acquire("all-dead", prompt)
            assert lease.cached_len == 0
            assert_exact_kv_and_no_leaks(cache, lease, prompt)
            assert cache.storage_breaker.statistics().opened >= 1

            await anyio.to_thread.run_sync(cluster.restart)
            async with HiCache(config) as refill:
                with anyio.fail_after(HANG_GUARD_S):
                    refill.release(await serve(refill, "refill", prompt))
                    await refill.wait_idle()
            with anyio.fail_after(HANG_GUARD_S):
                while True:  # until the breaker's next probe (its backoff is 50 ms) finds the cluster back
                    lease = await cache.acquire(f"back-{uuid.uuid4().hex[:6]}", prompt)
                    if lease.hit_tokens_by_tier["storage"]:
                        break
                    cache.release(lease)
                    await anyio.sleep(0.05)
            assert lease.hit_tokens_by_tier["storage"] == 160
            assert_exact_kv_and_no_leaks(cache, lease, prompt)
    finally:
        cluster.stop()


async def test_ttl_s_gives_every_page_an_expiry(valkey_single: ValkeyCluster) -> None:
    """`ttl_s` writes each page with `PX`: the server expires it (a miss later); without it pages persist."""
    keys, pages = make_keys(2), make_pages(2, 4096)
    raw = raw_client(valkey_single)
    try:
        for ttl, query in ((None, ""), (60.0, "ttl_s=60")):
            url = valkey_single.url(f"ttl-{uuid.uuid4().hex[:8]}", query)
            async with ValkeyBackend.from_url(url, namespace_digest=DIGEST) as backend:
                assert await backend.put(keys, pages) == [True, True]
                ttls = [raw.pttl(backend.server_key(k)) for k in keys]
            if ttl is None:
                assert ttls == [-1, -1]  # no expiry
            else:
                assert all(0 < t <= 60_000 for t in ttls), ttls
    finally:
        raw.close()
