"""The cache's background task and its bounded shutdown.

One task of its own runs the workers (the release queue, the backup and write-through queues, prefetch
streams) until the cache closes, then shuts down however long stuck I/O takes: it releases what is left,
closes storage, waits for copies and stray reads, and closes the pools the cache made.

A worker that raises never ends the others' work in silence: `on_failure` fails the cache (every later
call raises `CacheFailed`), and the shutdown runs as after `aclose()`, each of its steps past a failing one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from hicache.controller.movement.copies import CopyTracker
from hicache.controller.movement.tier_mover import TierMover
from hicache.controller.pages.release import ReleaseQueue
from hicache.controller.prefetch.job import Prefetches
from hicache.errors import CacheClosed, HiCacheError
from hicache.memory import KVPool
from storage_backends.cancellation import StopScope, uncancellable
from storage_backends.protocol import StorageBackend
from storage_backends.threads import stray_threads

__all__ = ["Workers"]

logger = logging.getLogger("hicache.cache")

_QUARANTINE_POLL_S = 0.02
"""How often a closing cache checks whether the stray threads under its quarantined pages returned."""


class Workers:
    """Runs a cache's background work in a task of its own and shuts it down.

    The task is not the caller's: `close()` may then be called under any deadline (`asyncio.timeout`,
    `asyncio.wait_for`) and return within its bound while the rest of the
    shutdown finishes in that task.

    Args:
        name: names the task and the log lines.
        release_queue, mover, prefetches: whose workers run here (and whose leftovers shutdown releases).
        copies: the copies shutdown waits for before closing pools.
        owned_pools: the pools to close last (those the cache made).
        close_timeout_s: the most `close()` waits.
        on_failure: called with the job's name and its exception when a background job raises (not when
            it is cancelled); it must close the cache (`begin_close`).
    """

    def __init__(
        self,
        name: str,
        *,
        release_queue: ReleaseQueue,
        mover: TierMover,
        prefetches: Prefetches,
        copies: CopyTracker,
        owned_pools: Sequence[KVPool],
        close_timeout_s: float,
        on_failure: Callable[[str, Exception], None],
    ) -> None:
        self._name = name
        self._on_failure = on_failure
        self._task_group: asyncio.TaskGroup | None = None
        self._spawned: set[asyncio.Task[None]] = set()
        self._release_queue = release_queue
        self._mover = mover
        self._prefetches = prefetches
        self._copies = copies
        self._owned_pools = owned_pools
        self._close_timeout_s = close_timeout_s
        self._owned_storage: StorageBackend | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._shut_down = asyncio.Event()

    def __repr__(self) -> str:
        return f"<Workers {self._name}>"

    async def start(self, owned_storage: StorageBackend | None) -> None:
        """Start the task and wait until the workers run; `owned_storage` is closed at shutdown.

        Raises:
            HiCacheError: the task ended (raised, or was cancelled) before the workers ran; the task's
                exception is its `__cause__`. Nothing runs then: `abort` closes storage and the pools.
        """
        self._owned_storage = owned_storage
        ready = asyncio.Event()
        runner = asyncio.get_running_loop().create_task(self._run(ready), name=self._name)
        runner.add_done_callback(lambda _: ready.set())  # a task that dies first must not leave us waiting
        self._runner = runner
        await ready.wait()
        if runner.done():
            self._runner = None  # never ran (or already stopped): `abort` closes what is left itself
            cause = None if runner.cancelled() else runner.exception()
            what = "was cancelled" if cause is None else f"raised {cause!r}"
            raise HiCacheError(f"{self._name}: the workers task {what} before the workers ran") from cause

    def spawn(self, job: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run `job(*args)` in the workers' task group (a prefetch stream); if it raises, the cache fails.

        Raises:
            CacheClosed: the workers are not running (the cache closed meanwhile).
        """
        if self._task_group is None:
            raise CacheClosed(f"{self._name}: the workers are not running")
        task = self._task_group.create_task(self._guarded(job, args), name=getattr(job, "__qualname__", None))
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def _guarded(self, job: Callable[..., Awaitable[object]], args: tuple[object, ...]) -> None:
        try:
            await job(*args)
        except Exception as exc:  # cancellation passes: it is how the workers stop
            name = getattr(job, "__qualname__", repr(job))
            try:
                self._on_failure(name, exc)
            except Exception:
                logger.exception("%s: failing the cache after %s raised failed too", self._name, name)
            self._stopping.set()  # whatever on_failure did: the shutdown runs

    async def abort(self, owned_storage: StorageBackend | None) -> None:
        """A failed start: close `owned_storage` (bounded, shielded) and the pools, or have the task do it
        and wait for it (bounded, shielded): the caller's error propagates only then."""
        if self._runner is not None:
            self._stopping.set()  # the runner closes storage and pools on its way out
            await uncancellable(self._within_close_timeout(self._shut_down.wait()))
            return
        if owned_storage is not None:
            await uncancellable(self._within_close_timeout(owned_storage.aclose()))
        self.close_pools()

    async def _within_close_timeout(self, work: Awaitable[object]) -> None:
        async with StopScope(self._close_timeout_s):
            await work

    def begin_close(self) -> None:
        """Stop taking work and ask the task to shut down (or close the pools at once if it never ran).
        Prefetches must have been resolved first."""
        self._mover.backups.close()
        self._mover.storage_writes.close()
        self.release_what_can_be()
        if self._runner is None:  # never started: nothing runs, nothing reads
            self.close_pools()
            return
        self._stopping.set()

    async def wait_closed(self) -> None:
        """Wait (at most `close_timeout_s`) for the shutdown; log what is left to finish if it did not."""
        if self._runner is None:
            return
        await self._within_close_timeout(self._shut_down.wait())
        if not self._shut_down.is_set():
            stats = self._release_queue.statistics()
            logger.warning(
                "%s: aclose gave up waiting after %.3gs; left to finish in the background: "
                "%d quarantined host tokens, %d stray storage threads, %d copies in flight",
                self._name,
                self._close_timeout_s,
                stats.quarantined_tokens,
                stray_threads.count,
                self._copies.count,
            )

    def close_pools(self) -> None:
        """Close the pools the cache made."""
        for pool in self._owned_pools:
            pool.close()

    async def _run(self, ready: asyncio.Event) -> None:
        """The task: runs the workers until `begin_close()`, then shuts down."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._task_group = tg
                self._prefetches.spawn = self.spawn
                self.spawn(self._release_queue.run)
                self.spawn(self._mover.backups.run)
                self.spawn(self._mover.storage_writes.run)
                ready.set()
                await self._stopping.wait()
                self._task_group = None  # spawns nothing more
                for task in self._spawned:
                    task.cancel()
            self._task_group = None
            await self._shutdown()
        except BaseException:
            # Cancelled by the event loop's own shutdown: nothing left to run the rest. The pools are
            # closed all the same: a pool still in use by a stray thread is kept alive by that thread's
            # buffer references.
            logger.warning("%s: shutdown interrupted; closing the pools", self._name)
            self.close_pools()
            raise
        finally:
            self._task_group = None
            self._prefetches.spawn = None
            self._shut_down.set()

    def release_what_can_be(self) -> None:
        """Free every pending release now; one that raises (a page freed twice) is logged and the rest
        are freed all the same (each failing release is dropped from the queue)."""
        while True:
            try:
                self._release_queue.flush()
                return
            except Exception:
                logger.exception("%s: a release failed while closing; releasing the rest", self._name)

    async def _shutdown(self) -> None:
        """After the workers stopped: release what is left, close storage, wait for copies and stray reads
        (quarantined pages), then close the pools the cache made. A step that raises is logged and the
        next one runs: the pools are closed whatever failed before."""
        self._mover.backups.close()
        self._mover.storage_writes.close()
        try:
            self._prefetches.finish_all_detached()  # streams that never ran: nothing can write into them
        except Exception:
            logger.exception("%s: releasing the cancelled prefetches failed", self._name)
        self.release_what_can_be()
        if self._owned_storage is not None:
            try:
                await self._owned_storage.aclose()
            except Exception:
                logger.exception("%s: closing storage failed", self._name)
        await self._copies.wait_idle()
        while self._release_queue.statistics().quarantined_calls:
            await asyncio.sleep(_QUARANTINE_POLL_S)
            self.release_what_can_be()
        self.release_what_can_be()
        self.close_pools()
