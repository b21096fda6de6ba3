"""The contract every storage backend passes: one abstract test class, subclassed once per backend.

A subclass provides the fixture `backend` (yield an open backend for `namespace_digest`, close it after)
and may override two hooks:

* `reopen`: an async callable `reopen(namespace_digest) -> StorageBackend` opening a second backend over
  the same store (the caller closes it). Without it the cross-namespace and cross-instance tests skip.
* `corrupt_page`: a callable `corrupt_page(key)` (sync or async) that damages the stored page `key` (flip a
  payload byte, truncate the object). Without it the corruption test skips.
* `hold_reads`: a `ReadGate` whose wrapper the subclass installed around the step of `backend` that fills
  the caller's buffers (`ReadGate.in_thread` for a worker-thread function, `ReadGate.awaited` for a
  coroutine function); it holds reads there until opened. Without it the closing-while-reading test skips.

Example::

    class TestMyBackend(BackendContract):
        @pytest.fixture
        async def backend(self, namespace_digest, tmp_path):
            async with MyBackend(tmp_path, namespace_digest=namespace_digest) as b:
                yield b

Every test runs for page payloads of 4 KiB and 64 KiB (`page_bytes`), using only protocol methods.
"""

from __future__ import annotations

import inspect
import random
import threading
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import anyio
import anyio.to_thread
import pytest

from hicache.errors import CacheClosed
from storage_backends import StorageBackend, page_key
from storage_backends.protocol import PageStatus
from storage_backends.threads import stray_threads

__all__ = ["BackendContract", "Corrupt", "ReadGate", "Reopen", "empty_pages", "make_keys", "make_pages"]

Reopen = Callable[[bytes], Awaitable[StorageBackend]]
Corrupt = Callable[[str], Any]

P = ParamSpec("P")
T = TypeVar("T")

HIT, MISS, CORRUPT, FOREIGN = PageStatus.HIT, PageStatus.MISS, PageStatus.CORRUPT, PageStatus.FOREIGN

_GATE_TIMEOUT_S = 60.0
"""A held read gives up waiting after this long, so a failing test cannot leave a thread behind forever."""


def make_keys(n: int, *, salt: int = 0) -> list[str]:
    """`n` distinct page keys shaped like real ones (32 hex characters)."""
    return [page_key(((salt << 64) | (i * 0x9E3779B97F4A7C15 + 1)).to_bytes(16, "little")) for i in range(n)]


def make_pages(n: int, page_bytes: int, *, seed: int = 0) -> list[memoryview]:
    """`n` pages of random bytes as writable memoryviews."""
    rng = random.Random(seed)
    return [memoryview(bytearray(rng.randbytes(page_bytes))) for _ in range(n)]


def empty_pages(n: int, page_bytes: int, fill: int = 0) -> list[memoryview]:
    """`n` writable page buffers filled with `fill`."""
    return [memoryview(bytearray([fill]) * page_bytes) for _ in range(n)]


class ReadGate:
    """Holds a backend's page reads at the step that fills the caller's buffers until `open()`.

    The subclass's `hold_reads` fixture installs `in_thread(func)` around a function that runs in a worker
    thread (the thread itself waits, as a slow disk would) or `awaited(func)` around a coroutine function
    (it waits without blocking the event loop), and opens the gate at teardown.
    """

    def __init__(self) -> None:
        self._held = threading.Event()
        self._open = threading.Event()

    def in_thread(self, func: Callable[P, T]) -> Callable[P, T]:
        """`func`, waiting at the gate first; for functions that run in worker threads."""

        def held(*args: P.args, **kwargs: P.kwargs) -> T:
            self._held.set()
            self._open.wait(_GATE_TIMEOUT_S)
            return func(*args, **kwargs)

        return held

    def awaited(self, func: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        """`func`, waiting at the gate first; for coroutine functions."""

        async def held(*args: P.args, **kwargs: P.kwargs) -> T:
            self._held.set()
            # The waiting thread touches no buffer: a cancelled caller may leave it behind.
            await anyio.to_thread.run_sync(self._open.wait, _GATE_TIMEOUT_S, abandon_on_cancel=True)
            return await func(*args, **kwargs)

        return held

    async def wait_held(self) -> None:
        """Return once a read reached the gate."""
        await anyio.to_thread.run_sync(self._held.wait, _GATE_TIMEOUT_S)
        assert self._held.is_set(), "no read reached the gate"

    def open(self) -> None:
        """Let the held reads, and every later one, go on."""
        self._open.set()


class BackendContract:
    """Abstract contract tests; subclasses provide `backend` and optionally `reopen`/`corrupt_page`."""

    @pytest.fixture(params=[4096, 65536], ids=["4KiB", "64KiB"])
    def page_bytes(self, request: pytest.FixtureRequest) -> int:
        """Payload bytes per page."""
        return int(request.param)

    @pytest.fixture
    def namespace_digest(self) -> bytes:
        """The namespace digest the `backend` fixture is opened with."""
        return bytes(range(16))

    @pytest.fixture
    def reopen(self) -> Reopen | None:
        """Hook: open another backend over the same store; None when the backend cannot."""
        return None

    @pytest.fixture
    def corrupt_page(self) -> Corrupt | None:
        """Hook: damage one stored page; None when the backend cannot."""
        return None

    @pytest.fixture
    def hold_reads(self) -> ReadGate | None:
        """Hook: a gate installed in `backend`'s read path; None when the backend provides none."""
        return None

    # -- round trips ----------------------------------------------------------------------------------

    async def test_put_then_get_round_trips_bitwise(self, backend: StorageBackend, page_bytes: int) -> None:
        """Every stored byte comes back, in the right buffer."""
        keys, pages = make_keys(9), make_pages(9, page_bytes)
        assert await backend.put(keys, pages) == [True] * 9
        out = empty_pages(9, page_bytes)
        assert await backend.get(keys, out) == [HIT] * 9
        assert [bytes(o) for o in out] == [bytes(p) for p in pages]

    async def test_overwrite_replaces_the_whole_page(self, backend: StorageBackend, page_bytes: int) -> None:
        """A second put of a key replaces the first version entirely."""
        [key] = make_keys(1)
        await backend.put([key], make_pages(1, page_bytes, seed=1))
        newer = make_pages(1, page_bytes, seed=2)
        assert await backend.put([key], newer) == [True]
        out = empty_pages(1, page_bytes)
        assert await backend.get([key], out) == [HIT]
        assert bytes(out[0]) == bytes(newer[0])

    async def test_get_reports_missing_pages_false(self, backend: StorageBackend, page_bytes: int) -> None:
        """A missing page is False while its neighbours in the batch still load."""
        keys, pages = make_keys(4), make_pages(4, page_bytes)
        await backend.put([keys[0], keys[2]], [pages[0], pages[2]])
        out = empty_pages(4, page_bytes)
        assert await backend.get(keys, out) == [HIT, MISS, HIT, MISS]
        assert bytes(out[0]) == bytes(pages[0])
        assert bytes(out[2]) == bytes(pages[2])

    async def test_empty_batches(self, backend: StorageBackend) -> None:
        """Empty batches are valid and do nothing."""
        assert await backend.get([], []) == []
        assert await backend.put([], []) == []
        assert await backend.exists([]) == 0
        await backend.delete([])

    # -- misuse ---------------------------------------------------------------------------------------

    async def test_keys_and_buffers_of_different_lengths_raise(
        self, backend: StorageBackend, page_bytes: int
    ) -> None:
        """One buffer per key, or ValueError naming `buffers` before any I/O."""
        keys = make_keys(3)
        with pytest.raises(ValueError, match="buffers"):
            await backend.put(keys, make_pages(2, page_bytes))
        with pytest.raises(ValueError, match="buffers"):
            await backend.get(keys, empty_pages(4, page_bytes))
        assert await backend.exists(keys) == 0

    # -- exists and delete ----------------------------------------------------------------------------

    async def test_exists_counts_the_longest_stored_prefix(
        self, backend: StorageBackend, page_bytes: int
    ) -> None:
        """A hole in the middle ends the prefix even though later pages are stored."""
        keys, pages = make_keys(10), make_pages(10, page_bytes)
        assert await backend.exists(keys) == 0
        await backend.put(keys[:3] + keys[4:], pages[:3] + pages[4:])
        assert await backend.exists(keys) == 3
        assert await backend.exists(keys[4:]) == 6
        assert await backend.exists(keys[3:]) == 0
        await backend.put([keys[3]], [pages[3]])
        assert await backend.exists(keys) == 10

    async def test_exists_on_a_long_batch(self, backend: StorageBackend) -> None:
        """Long batches (several internal chunks) still stop exactly at the first miss."""
        keys, pages = make_keys(300), make_pages(300, 64)
        await backend.put(keys[:217] + keys[218:], pages[:217] + pages[218:])
        assert await backend.exists(keys) == 217
        assert await backend.exists(keys[:217]) == 217

    async def test_delete_removes_pages_and_ignores_absent_ones(
        self, backend: StorageBackend, page_bytes: int
    ) -> None:
        """Deleted pages read as misses; deleting what is not there is fine."""
        keys, pages = make_keys(4), make_pages(4, page_bytes)
        await backend.put(keys, pages)
        await backend.delete([keys[1], *make_keys(2, salt=9)])
        await backend.delete([keys[1]])
        assert await backend.exists(keys) == 1
        assert await backend.get(keys, empty_pages(4, page_bytes)) == [HIT, MISS, HIT, HIT]

    # -- closing --------------------------------------------------------------------------------------

    async def test_aclose_is_idempotent_and_later_calls_raise(
        self, backend: StorageBackend, page_bytes: int
    ) -> None:
        """After aclose every operation raises CacheClosed; a second aclose is a no-op."""
        await backend.aclose()
        await backend.aclose()
        keys, pages = make_keys(1), make_pages(1, page_bytes)
        with pytest.raises(CacheClosed):
            await backend.put(keys, pages)
        with pytest.raises(CacheClosed):
            await backend.get(keys, pages)
        with pytest.raises(CacheClosed):
            await backend.exists(keys)
        with pytest.raises(CacheClosed):
            await backend.delete(keys)

    async def test_aclose_waits_for_calls_in_flight(
        self, backend: StorageBackend, hold_reads: ReadGate | None, page_bytes: int
    ) -> None:
        """aclose refuses new calls at once, but returns only after the read in flight returned.

        Guards against a close that lets its caller free buffers a worker thread is still filling. Two
        concurrent acloses both wait; the held read completes normally.
        """
        if hold_reads is None:
            pytest.skip("this backend provides no `hold_reads` hook")
        n = 4
        keys, pages = make_keys(n), make_pages(n, page_bytes)
        assert await backend.put(keys, pages) == [True] * n
        out = empty_pages(n, page_bytes)
        steps: list[str] = []
        results: list[list[PageStatus]] = []

        async def read() -> None:
            results.append(await backend.get(keys, out))
            steps.append("read returned")

        async def close(which: str) -> None:
            await backend.aclose()
            steps.append(f"{which} aclose returned")

        later_calls: list[Callable[[], Awaitable[object]]] = [
            lambda: backend.exists(keys),
            lambda: backend.get(keys, empty_pages(n, page_bytes)),
            lambda: backend.put(keys, pages),
            lambda: backend.delete(keys),
        ]
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await hold_reads.wait_held()
            tg.start_soon(close, "first")
            tg.start_soon(close, "second")
            try:
                await anyio.wait_all_tasks_blocked()
                assert steps == [], "aclose returned while a read was in flight"
                for call in later_calls:
                    with pytest.raises(CacheClosed):
                        await call()
                assert steps == []
                steps.append("gate opened")
            finally:
                hold_reads.open()
        assert steps[:2] == ["gate opened", "read returned"]
        assert sorted(steps[2:]) == ["first aclose returned", "second aclose returned"]
        assert results == [[HIT] * n]
        assert [bytes(o) for o in out] == [bytes(p) for p in pages]
        await backend.aclose()  # and a later one returns at once

    # -- namespaces and sharing -----------------------------------------------------------------------

    async def test_pages_are_visible_to_another_instance(
        self, backend: StorageBackend, reopen: Reopen | None, namespace_digest: bytes, page_bytes: int
    ) -> None:
        """A second backend over the same store (same namespace) reads what the first wrote."""
        if reopen is None:
            pytest.skip("this backend provides no `reopen` hook")
        keys, pages = make_keys(3), make_pages(3, page_bytes)
        await backend.put(keys, pages)
        other = await reopen(namespace_digest)
        try:
            out = empty_pages(3, page_bytes)
            assert await other.get(keys, out) == [HIT] * 3
            assert [bytes(o) for o in out] == [bytes(p) for p in pages]
        finally:
            await other.aclose()

    async def test_page_of_another_namespace_is_a_miss(
        self, backend: StorageBackend, reopen: Reopen | None, namespace_digest: bytes, page_bytes: int
    ) -> None:
        """A page written by a differently configured cache never loads, whatever its key."""
        if reopen is None:
            pytest.skip("this backend provides no `reopen` hook")
        keys, pages = make_keys(2), make_pages(2, page_bytes)
        foreign_digest = bytes(reversed(namespace_digest))
        foreign = await reopen(foreign_digest)
        try:
            assert await foreign.put(keys, pages) == [True, True]
        finally:
            await foreign.aclose()
        assert await backend.get(keys, empty_pages(2, page_bytes)) == [FOREIGN, FOREIGN]

    # -- corruption -----------------------------------------------------------------------------------

    async def test_corrupted_page_is_a_miss(
        self, backend: StorageBackend, corrupt_page: Corrupt | None, page_bytes: int
    ) -> None:
        """A damaged page reads as False and never as loaded; its neighbours are unaffected."""
        if corrupt_page is None:
            pytest.skip("this backend provides no `corrupt_page` hook")
        keys, pages = make_keys(3), make_pages(3, page_bytes)
        await backend.put(keys, pages)
        result = corrupt_page(keys[1])
        if inspect.isawaitable(result):
            await result
        out = empty_pages(3, page_bytes)
        assert await backend.get(keys, out) == [HIT, CORRUPT, HIT]
        assert bytes(out[0]) == bytes(pages[0])
        assert bytes(out[2]) == bytes(pages[2])

    # -- concurrency ----------------------------------------------------------------------------------

    async def test_concurrent_put_and_get_never_see_a_torn_page(
        self, backend: StorageBackend, page_bytes: int
    ) -> None:
        """Readers racing writers of one key see one whole version, never a mix of two."""
        [key] = make_keys(1)
        versions = [memoryview(bytearray([v]) * page_bytes) for v in (0xAA, 0xBB)]
        await backend.put([key], [versions[0]])
        seen: set[bytes] = set()

        async def writer(version: memoryview) -> None:
            for _ in range(12):
                assert await backend.put([key], [version]) == [True]

        async def reader() -> None:
            for _ in range(12):
                out = empty_pages(1, page_bytes)
                if (await backend.get([key], out))[0]:
                    seen.add(bytes(set(bytes(out[0]))))

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer, versions[0])
            tg.start_soon(writer, versions[1])
            for _ in range(3):
                tg.start_soon(reader)
        assert seen, "no read succeeded"
        assert seen <= {b"\xaa", b"\xbb"}, f"torn page: byte values {seen}"

    async def test_cancelled_get_leaves_no_writer_behind_its_quiet_buffers(
        self, backend: StorageBackend, page_bytes: int
    ) -> None:
        """After a cancelled get returns, nothing writes into its buffers except those `stray_threads`
        reports busy, and those only until their threads return.

        Guards against executor-style reads (aiofiles, bare run_in_executor) that abandon a thread which
        then keeps filling a buffer the caller has already given to someone else, unannounced.
        """
        n = 64
        keys, pages = make_keys(n), make_pages(n, page_bytes)
        await backend.put(keys, pages)
        out = empty_pages(n, page_bytes)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(backend.get, keys, out)
                await anyio.wait_all_tasks_blocked()
                scope.cancel()
        busy = stray_threads.busy_flags(out)
        quiet = [buf for buf, flag in zip(out, busy, strict=True) if not flag]
        for buf in quiet:
            buf[:] = b"\x5a" * page_bytes
        with anyio.fail_after(30):
            await stray_threads.wait_quiet(out)
        # A full round of further work drains any thread a careless backend would have left running.
        assert await backend.get(keys, empty_pages(n, page_bytes)) == [HIT] * n
        assert await backend.put(keys, pages) == [True] * n
        assert all(bytes(buf) == b"\x5a" * page_bytes for buf in quiet)

    async def test_cancelled_get_returns_while_its_read_is_stuck(
        self, backend: StorageBackend, hold_reads: ReadGate | None, page_bytes: int
    ) -> None:
        """A get whose read hangs (held at the gate) returns promptly when cancelled; a buffer a stuck
        thread may still fill is reported busy until the read is let go, then quiet and whole.

        Guards against a caller hung by a dead mount: the shielded wait for the thread that used to be
        the contract.
        """
        if hold_reads is None:
            pytest.skip("this backend provides no `hold_reads` hook")
        n = 4
        keys, pages = make_keys(n), make_pages(n, page_bytes)
        assert await backend.put(keys, pages) == [True] * n
        out = empty_pages(n, page_bytes)
        try:
            with anyio.fail_after(10):  # generous: returning takes a few event-loop turns
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(backend.get, keys, out)
                        await hold_reads.wait_held()
                        scope.cancel()
            assert scope.cancelled_caught
            busy = stray_threads.busy_flags(out)
            for buf, flag in zip(out, busy, strict=True):
                if not flag:
                    assert bytes(buf) == b"\0" * page_bytes, "a quiet buffer was written after cancel"
        finally:
            hold_reads.open()
        with anyio.fail_after(30):
            await stray_threads.wait_quiet(out)
        assert await backend.get(keys, out) == [HIT] * n
        assert [bytes(o) for o in out] == [bytes(p) for p in pages]
