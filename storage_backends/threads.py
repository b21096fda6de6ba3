"""Worker threads that cancelled storage calls abandoned, and the buffers each may still touch.

Storage I/O runs in worker threads, and a thread cannot be interrupted: a read stuck on a hung NFS or FUSE
mount returns when the mount does. A cancelled call therefore does not wait for its thread (its caller has
a deadline); the thread is abandoned and registered here, with the buffers it may still read or write,
until it returns. Callers keep those buffers out of use meanwhile (STYLE rule 5: never free a buffer a
thread may write into). This module imports nothing of hicache's, so every layer can use it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import anyio

__all__ = ["StrayThreads", "ThreadCall", "stray_threads"]


class _CallState(enum.Enum):
    PENDING = "pending"
    """Handed to a worker thread that has not started it yet."""
    RUNNING = "running"
    ABANDONED_PENDING = "abandoned before it started"
    """Its caller was cancelled first: the thread skips it."""
    ABANDONED_RUNNING = "abandoned while running"
    """Its caller was cancelled while it ran: registered as a stray thread until it returns."""
    DONE = "done"


class ThreadCall:
    """One worker-thread call that its caller may abandon: `run` in the thread, `abandon` on the loop.

    Created by `StrayThreads.call`. Every state change happens under the registry's lock, so a thread that
    returns while its caller is being cancelled is either done (nothing registered) or registered, never
    both and never neither.
    """

    __slots__ = ("_buffers", "_registry", "_state")

    def __init__(self, registry: StrayThreads, buffers: Sequence[object]) -> None:
        self._registry = registry
        self._buffers = tuple(buffers)
        self._state = _CallState.PENDING

    def run(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run `func(*args)` in the worker thread, unless the caller abandoned the call before it started."""
        registry = self._registry
        with registry._lock:
            if self._state is _CallState.ABANDONED_PENDING:
                return None  # nobody waits for the result: never start I/O for a cancelled caller
            self._state = _CallState.RUNNING
        try:
            return func(*args)
        finally:
            with registry._lock:
                if self._state is _CallState.ABANDONED_RUNNING:
                    registry._unregister(self._buffers)
                self._state = _CallState.DONE

    def abandon(self) -> None:
        """The caller stops waiting (it was cancelled): register the thread if it still runs."""
        registry = self._registry
        with registry._lock:
            if self._state is _CallState.PENDING:
                self._state = _CallState.ABANDONED_PENDING
            elif self._state is _CallState.RUNNING:
                self._state = _CallState.ABANDONED_RUNNING
                registry._register(self._buffers)


class StrayThreads:
    """Worker threads that cancelled storage calls left running, and the buffers each may still touch.

    Backends start every worker-thread call through `call()` (`storage_backends.batching.run_in_thread`
    does); callers ask `busy()` before reusing a buffer they passed to a cancelled call. Buffers are keyed
    by identity: the very objects passed to the call (a stray thread holds them, so no other object can
    take their id meanwhile). Updated from worker threads under a lock; read anywhere.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[int, int] = {}
        self._threads = 0
        self._abandoned_total = 0

    @property
    def count(self) -> int:
        """Stray threads still running."""
        return self._threads

    @property
    def abandoned_total(self) -> int:
        """Threads abandoned while running since the process started (returned or not)."""
        return self._abandoned_total

    def call(self, buffers: Sequence[object] = ()) -> ThreadCall:
        """A new abandonable call that touches `buffers` (reads from or writes into them)."""
        return ThreadCall(self, buffers)

    def busy(self, buffers: Iterable[object]) -> bool:
        """Whether a stray thread may still touch any of `buffers`."""
        if not self._busy:
            return False
        busy = self._busy
        return any(id(buf) in busy for buf in buffers)

    def busy_flags(self, buffers: Iterable[object]) -> list[bool]:
        """One flag per buffer: may a stray thread still touch it."""
        busy = self._busy
        return [id(buf) in busy for buf in buffers]

    def start(self, buffers: Sequence[object]) -> None:
        """Register a stray worker that may still touch `buffers` (for workers not started through
        `call()`: `storage_backends.read_queue`'s); `finish` with the same buffers once it returned."""
        with self._lock:
            self._register(buffers)

    def finish(self, buffers: Sequence[object]) -> None:
        """The stray worker registered by `start(buffers)` returned."""
        with self._lock:
            self._unregister(buffers)

    async def wait_quiet(self, buffers: Sequence[object], *, poll_s: float = 0.01) -> None:
        """Wait until no stray thread touches any of `buffers` (polled: threads cannot wake the loop
        safely once it may have stopped)."""
        while self.busy(buffers):  # noqa: ASYNC110 - a thread cannot set an anyio.Event safely
            await anyio.sleep(poll_s)

    def _register(self, buffers: Sequence[object]) -> None:
        self._threads += 1
        self._abandoned_total += 1
        for buf in buffers:
            self._busy[id(buf)] = self._busy.get(id(buf), 0) + 1

    def _unregister(self, buffers: Sequence[object]) -> None:
        self._threads -= 1
        for buf in buffers:
            left = self._busy[id(buf)] - 1
            if left:
                self._busy[id(buf)] = left
            else:
                del self._busy[id(buf)]

    def __repr__(self) -> str:
        return f"<StrayThreads running={self._threads} busy_buffers={len(self._busy)}>"


stray_threads: Final = StrayThreads()
"""The process-wide registry: worker threads are a process-wide resource, and so is the memory they touch."""
