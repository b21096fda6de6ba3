"""Fault injection under prefetch: errors, truncated and flipped page files, missing pages, timeouts.

Pages live in a real `FileBackend` on `tmp_path`; faults are either done to the files themselves (truncate,
flip a byte, delete) or injected by a wrapper (`kv_oracle.FaultyBackend`: a raising batch, a page reported
unread, a read that never returns). Whatever happens, a prefetch becomes shorter or empty, never crashes,
never loads a wrong page (the loaded bytes are compared with the oracle KV), and each failure is counted
in the metrics. After each scenario the cache is sane and every page of both pools is accounted for.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch
from cache_internals import host_pool_of, tree_of
from controller_helpers import HOUR_S, LoopClock
from kv_oracle import FaultyBackend, chain_payload, check_pools_exact, layout_for, store_chain
from page_damage import damage_page

from hicache import HiCache, HiCacheConfig, PrefetchOutcome
from hicache.keys import TOKEN_BYTES, Namespace, as_key_bytes
from hicache.metrics import render
from storage_backends.file import FileBackend

PAGE = 4
N_PAGES = 12
BATCH = 3
LAYOUT = layout_for(PAGE)
NAMESPACE = HiCacheConfig(
    layout=LAYOUT, device_pages=1, host_pages=1, namespace=Namespace(model_id="faults")
).namespace
"""The effective namespace of every cache here (its config adds the layout to the model id)."""
SEQ = [1000 + 7 * i for i in range(N_PAGES * PAGE)]
KEY = as_key_bytes(SEQ)

FILE_FAULTS = ("truncate", "flip_payload", "flip_header", "missing")
WRAPPER_FAULTS = ("error", "false", "hang")


@pytest.fixture(autouse=True)
def _quiet_expected_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """The backends and the stream log every discarded page at warning level; that is expected here."""
    caplog.set_level(logging.ERROR, logger="storage_backends")
    caplog.set_level(logging.ERROR, logger="hicache")


@pytest.fixture
async def stored(tmp_path: Path) -> AsyncIterator[FileBackend]:
    """A file backend holding the 12 pages of SEQ, written as another instance would."""
    backend = FileBackend(tmp_path / "pages", namespace_digest=NAMESPACE.digest)
    try:
        await store_chain(backend, KEY, LAYOUT, NAMESPACE)
        yield backend
    finally:
        await backend.aclose()


def config(**overrides: object) -> HiCacheConfig:
    options: dict[str, object] = {
        "layout": LAYOUT,
        "device_pages": 32,
        "host_pages": 32,
        "namespace": NAMESPACE,
        "prefetch_threshold": PAGE,
        "prefetch_stop_policy": "wait_complete",
        "storage_batch_pages": BATCH,
        "backup_to_storage": False,
    }
    options.update(overrides)
    return HiCacheConfig(**options)  # type: ignore[arg-type]


def damage_file(backend: FileBackend, page: int, how: str, rng: random.Random) -> None:
    """Really damage page `page` on disk, and no other page of its group file: truncate it, flip a byte,
    or delete it (`page_damage.damage_page`)."""
    damage_page(backend, page_key_list()[page], how, rng)


def page_key_list() -> list[str]:
    from kv_oracle import page_keys

    return page_keys(KEY, LAYOUT, NAMESPACE)


def failures(cache: HiCache) -> dict[str, float]:
    """`storage_page_failures_total` by reason, parsed from the Prometheus text."""
    text = render(cache.registry)
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^hicache_storage_page_failures_total\{reason="([a-z_]+)"\} (\S+)$', text, re.M)
    }


def loaded_host_kv(cache: HiCache) -> tuple[int, torch.Tensor]:
    """Tokens of SEQ backed up on host from the root (to the match's last host node), and their KV."""
    info = tree_of(cache).node_info(cache.match(SEQ).last_host_node)
    values: list[torch.Tensor] = []
    while info.parent is not None:
        assert info.host_value is not None
        values.append(info.host_value)
        info = tree_of(cache).node_info(info.parent)
    if not values:
        return 0, torch.empty(0)
    indices = torch.cat(values[::-1])
    return int(indices.numel()), host_pool_of(cache).read_tokens(indices)


async def assert_settled(cache: HiCache) -> None:
    """Sane, nothing in flight, every page owned exactly once; prefetched bytes equal the oracle's."""
    await cache.wait_idle()
    cache.sanity_check()
    assert cache.statistics().prefetches_in_flight == 0
    check_pools_exact(cache)
    n, kv = loaded_host_kv(cache)
    if n:
        assert torch.equal(kv, chain_payload(KEY[: n * TOKEN_BYTES], LAYOUT, NAMESPACE)), (
            "a wrong page was loaded"
        )


def expected_pages(faults: dict[int, str]) -> tuple[int, bool]:
    """Pages a prefetch of SEQ completes with these faults, and whether a failure is expected.

    A missing file shortens the storage hit itself (exists stops there: a miss, not a failure); a raising
    or hanging batch loses the whole batch it is in (a page counts once its batch returned); every other
    fault ends the prefetch at its page.
    """
    missing = min((p for p, how in faults.items() if how == "missing"), default=N_PAGES)
    stop = missing
    for page, how in faults.items():
        if how == "missing" or page >= missing:
            continue
        stop = min(stop, page // BATCH * BATCH if how in ("error", "hang") else page)
    return stop, stop < missing


async def run_scenario(
    stored: FileBackend, faults: dict[int, str], seed: int, loop_clock: LoopClock | None = None
) -> None:
    """Prefetch SEQ and commit it with `faults` in place, then check what loaded and what was counted.

    A hanging read needs `loop_clock`: the commit's deadline passes on it once every page before the
    hang has landed (with a 50 ms real deadline those reads raced it under load).
    """
    rng = random.Random(seed)
    for page, how in faults.items():
        if how in FILE_FAULTS:
            damage_file(stored, page, how, rng)
    wrapper = FaultyBackend(stored)
    keys = page_key_list()
    for page, how in faults.items():
        if how in WRAPPER_FAULTS:
            wrapper.faults[keys[page]] = how
    hang = "hang" in faults.values()
    overrides: dict[str, object] = {}
    if hang:
        overrides = {
            "prefetch_stop_policy": "timeout",
            "prefetch_timeout_base": 60.0,
            "prefetch_timeout_per_1k_tokens": 0.0,
        }
    want_pages, want_failure = expected_pages(faults)
    cache = HiCache(config(**overrides), storage=wrapper)  # type: ignore[arg-type]
    async with cache:
        prefetch = await cache.prefetch("r", SEQ)
        if want_pages == 0 and not want_failure:
            assert prefetch is None  # page 0 is missing: nothing to prefetch
            assert failures(cache) == {}
            await assert_settled(cache)
            return
        assert prefetch is not None
        if hang:
            assert loop_clock is not None, "a hanging read needs the loop clock"
            while prefetch.completed_pages < want_pages and not prefetch.done:
                await prefetch.wait_progress()
            outcomes: list[PrefetchOutcome] = []
            async with anyio.create_task_group() as tg:

                async def commit() -> None:
                    outcomes.append(await cache.commit_prefetch("r"))

                tg.start_soon(commit)
                await anyio.wait_all_tasks_blocked()
                loop_clock.advance(HOUR_S)  # the timeout policy's deadline passes while the commit waits
            (outcome,) = outcomes
        else:
            outcome = await cache.commit_prefetch("r")
        assert outcome.status == "committed"
        assert outcome.completed_tokens == want_pages * PAGE
        assert outcome.loaded_tokens == want_pages * PAGE
        assert wrapper.reads_started == wrapper.reads_done
        n, _ = loaded_host_kv(cache)
        assert n == want_pages * PAGE
        counted = failures(cache)
        if want_failure:
            assert sum(counted.values()) >= 1, counted
            assert outcome.failed_pages + counted.get("timeout", 0) >= 1
        else:
            assert counted == {}
        await assert_settled(cache)
        # A second request for the same prompt gets the loaded prefix from host, bitwise, and no more.
        lease = await cache.acquire("again", SEQ)
        assert lease.cached_len >= want_pages * PAGE
        kv = cache.device_pool.read_tokens(lease.device_indices)
        assert torch.equal(kv, chain_payload(KEY[: lease.cached_len * TOKEN_BYTES], LAYOUT, NAMESPACE))
        cache.release(lease)
        await assert_settled(cache)


@pytest.mark.parametrize("how", FILE_FAULTS + WRAPPER_FAULTS)
@pytest.mark.parametrize("page", [0, 4, N_PAGES - 1])
async def test_one_fault_shortens_the_prefetch(
    stored: FileBackend, how: str, page: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single fault at the first, a middle or the last page: the prefetch stops there, counted."""
    await run_scenario(stored, {page: how}, seed=page, loop_clock=LoopClock(monkeypatch))


@pytest.mark.parametrize("seed", range(16))
async def test_random_faults_at_random_pages(stored: FileBackend, seed: int) -> None:
    """One to three faults of random kinds at random pages: the earliest one decides, nothing wrong loads."""
    rng = random.Random(seed)
    kinds = (*FILE_FAULTS, "error", "false")
    pages = rng.sample(range(N_PAGES), rng.randint(1, 3))
    faults = {p: rng.choice(kinds) for p in pages}
    await run_scenario(stored, faults, seed)


async def test_exists_error_means_no_prefetch_not_a_crash(stored: FileBackend) -> None:
    """Storage failing its lookup: acquire serves from nothing (cached_len 0), and the failure is counted."""
    wrapper = FaultyBackend(stored)
    wrapper.exists_error = True
    async with HiCache(config(), storage=wrapper) as cache:  # type: ignore[arg-type]
        assert await cache.prefetch("p", SEQ) is None
        lease = await cache.acquire("r", SEQ)
        assert lease.cached_len == 0
        assert lease.prefetch is None
        cache.release(lease)
        assert failures(cache) == {"exists": 2}
        await assert_settled(cache)


async def test_corrupt_pages_are_never_loaded_by_acquire(stored: FileBackend) -> None:
    """acquire() over flipped pages: the lease covers exactly the verified prefix, bitwise."""
    rng = random.Random(7)
    damage_file(stored, 5, "flip_payload", rng)
    async with HiCache(config(), storage=stored) as cache:
        lease = await cache.acquire("r", SEQ)
        assert lease.cached_len == 5 * PAGE
        assert lease.hit_tokens_by_tier == {"device": 0, "host": 0, "storage": 5 * PAGE}
        kv = cache.device_pool.read_tokens(lease.device_indices)
        assert torch.equal(kv, chain_payload(KEY[: 5 * PAGE * TOKEN_BYTES], LAYOUT, NAMESPACE))
        cache.release(lease)
        assert failures(cache) == {"corrupt": 1}
        assert stored.statistics().checksum_failures == 1
        await assert_settled(cache)


async def test_write_through_failures_are_counted_and_harmless(tmp_path: Path) -> None:
    """A backend whose writes raise: backups still commit on host, the failure is counted, nothing leaks."""

    class FailingWrites(FaultyBackend):
        async def put(self, keys: list[str], buffers: list[memoryview]) -> list[bool]:  # type: ignore[override]
            self.errors_raised += 1
            raise OSError("injected: disk full")

    async with FileBackend(tmp_path / "w", namespace_digest=NAMESPACE.digest) as inner:
        wrapper = FailingWrites(inner)
        async with HiCache(config(backup_to_storage=True), storage=wrapper) as cache:  # type: ignore[arg-type]
            lease = await cache.acquire("r", SEQ)
            new = await cache.alloc_device(len(SEQ))
            assert new is not None
            cache.device_pool.write_tokens(new, chain_payload(KEY, LAYOUT, NAMESPACE))
            await cache.insert(lease, SEQ, new)
            await cache.wait_idle()
            assert wrapper.errors_raised == 1
            assert failures(cache) == {"write": N_PAGES}
            match = cache.match(SEQ)
            assert match.last_host_node is match.last_device_node  # backed up on host all the same
            cache.sanity_check()
            check_pools_exact(cache)
