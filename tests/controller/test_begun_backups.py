"""Backups begun at the engine call (`insert`): the nodes are pending from then until the copy lands and
the decision resolves, and the cache must behave as if the backup were already done or not yet asked for.

Two defects of the one backup path (issue 23): a pending node split by a later request (its upper part
pending with it) made the commit see an un-backed parent and abort the whole chain, and every chain
below; and `alloc_device` refused room that only begun backups held (pending nodes are device-locked).
"""

from __future__ import annotations

import anyio
import pytest
from cache_internals import tree_of
from controller_helpers import insert_device_chain, make_config, tokens

from hicache import HiCache
from hicache.controller.movement import copies as copies_module
from storage_backends.cancellation import uncancellable


def hold_copies(monkeypatch: pytest.MonkeyPatch) -> tuple[anyio.Event, anyio.Event]:
    """Hold every device<->host copy at a gate: (started, gate). A held copy is never abandoned."""
    real_copy = copies_module.copy_pages_async
    started = anyio.Event()
    gate = anyio.Event()

    async def held_copy(*args: object, **kwargs: object) -> None:
        started.set()

        async def copy() -> None:
            await gate.wait()
            await real_copy(*args, **kwargs)  # type: ignore[arg-type]

        await uncancellable(copy())

    monkeypatch.setattr(copies_module, "copy_pages_async", held_copy)
    return started, gate


async def test_a_pending_backup_split_by_a_later_request_commits_and_so_does_the_chain_below_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first request's 24-token node is pending when the second, sharing its first 16 tokens,
    splits it: the split-off upper part is pending with it, and the second request's leaf is begun
    below that upper part. Once the copies land, all three nodes are backed up (nothing aborted)."""
    started, gate = hold_copies(monkeypatch)
    first = tokens(0, 16) + tokens(100, 8)
    second = tokens(0, 16) + tokens(200, 8)
    async with HiCache(make_config()) as cache:
        await insert_device_chain(cache, first)
        await started.wait()  # the first backup's copy is in flight, held
        await insert_device_chain(cache, second)  # splits the pending node at 16 tokens
        stats = tree_of(cache).statistics()
        assert stats.pending_backup_tokens == 32  # the first node (both parts) and the second leaf
        gate.set()
        await cache.wait_idle()
        for seq in (first, second, tokens(0, 16)):
            match = cache.match(seq)
            assert match.device_len == len(seq)
            assert match.last_host_node is match.last_device_node, seq  # backed up to host
        assert tree_of(cache).statistics().pending_backup_tokens == 0
        assert cache.metrics.backup_tokens.value() == 32
        assert cache.metrics.backup_skipped.value() == 0
        cache.sanity_check()


async def test_alloc_device_waits_for_begun_backups_instead_of_refusing_the_room_they_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every device page asked for while the only node's backup is begun and its copy held: the node is
    pending (device-locked) and nothing else can be evicted, yet room will exist once the copy lands.
    `alloc_device` lets the backup resolve and evicts the node (demoted: its host copy stays)."""
    started, gate = hold_copies(monkeypatch)
    async with HiCache(make_config()) as cache:
        await insert_device_chain(cache, tokens(0, 16))
        await started.wait()
        assert tree_of(cache).statistics().pending_backup_tokens == 16
        got = []

        async def alloc_all() -> None:
            got.append(await cache.alloc_device(32 * 4))

        async with anyio.create_task_group() as tg:
            tg.start_soon(alloc_all)
            await anyio.wait_all_tasks_blocked()
            assert not got  # waiting for the held copy, not refused
            gate.set()
        taken = got[0]
        assert taken is not None
        assert taken.numel() == 32 * 4
        match = cache.match(tokens(0, 16))
        assert match.device_len == 0
        assert match.host_len == 16
        cache.sanity_check(held_device_tokens=32 * 4)
        cache.device_pool.free(taken)
        cache.sanity_check()
