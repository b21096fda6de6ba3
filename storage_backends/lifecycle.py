"""The lifecycle every storage backend shares: calls in flight, closing, the context manager, the warning.

A backend is an async context manager with an idempotent `aclose()`. Closing refuses new calls at once
(`CacheClosed`), waits until every call already in flight has returned, and only then releases what the
backend holds. A call that returned normally left no worker thread touching the caller's buffers. A
backend garbage-collected while still open warns with `ResourceWarning`.

Worker threads are never waited for once their call is cancelled: a read stuck on a hung NFS or FUSE
mount must not hang its caller. A call that is cancelled while its worker thread runs abandons the thread
and registers it in `storage_backends.threads.stray_threads`, together with the buffers it may still read or
write, until the thread returns (`storage_backends.threads.WorkerThreads`). A caller must not reuse such a
buffer (free it, hand it out, overwrite it) while `stray_threads.busy(...)` reports it; every other buffer is
quiet as soon as the call returns. `aclose()` therefore waits for calls, never for stray threads: a backend
collected while its threads run lets them leave once their jobs return.
"""

from __future__ import annotations

import asyncio
import functools
import warnings
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Final, Self

from storage_backends.errors import CacheClosed

__all__ = ["BackendLifecycle"]

TRACKED_METHODS: Final = ("exists", "get", "put", "delete")
"""The protocol calls counted as in flight: every subclass's own definitions of them are wrapped."""


def _tracked(
    method: Callable[..., Awaitable[Any]],
) -> Callable[..., Coroutine[Any, Any, Any]]:
    """Wrap a protocol method: refuse it once closing began, count it in flight until it returns."""

    @functools.wraps(method)
    async def call(self: BackendLifecycle, /, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise CacheClosed(f"{self!r} is closed")
        self._in_flight += 1
        try:
            return await method(self, *args, **kwargs)
        finally:
            self._in_flight -= 1
            if not self._in_flight and self._released is not None and not self._released.is_set():
                self._release_now()

    return call


class BackendLifecycle:
    """Mixin for storage backends: calls in flight, `closed`, `aclose()`, `async with`, the warning.

    A subclass sets `self._closed = True` first in `__init__` (so a constructor that fails does not warn
    in `__del__`) and `False` once fully constructed, and overrides `_release()` to drop what it holds (a
    client, its connections, and its `WorkerThreads` as `_workers`, whose queue `__del__` closes too). Its own `exists`, `get`, `put` and `delete` are wrapped when the class is
    created: each call raises `CacheClosed` once `aclose()` began and otherwise counts as in flight until it
    returns. The cost is one counter update each way; no lock is taken.
    """

    _closed: bool = True
    _in_flight: int = 0
    _released: asyncio.Event | None = None
    """Created by the first `aclose()`; set once `_release()` ran."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in TRACKED_METHODS:
            method = cls.__dict__.get(name)
            if method is not None:
                setattr(cls, name, _tracked(method))

    @property
    def closed(self) -> bool:
        """Whether `aclose()` was called (new calls raise `CacheClosed`; some may still be finishing)."""
        return self._closed

    async def aclose(self) -> None:
        """Refuse new calls, wait for the calls in flight to return, then release resources; idempotent.

        Every `aclose()`, a concurrent second one included, returns only once the backend is released. If
        the wait is cancelled the backend stays closed, and the last call in flight releases it on return.
        """
        if self._released is None:
            self._closed = True
            self._released = asyncio.Event()
            if not self._in_flight:
                self._release_now()
        await self._released.wait()

    def _release(self) -> None:
        """Hook: drop what the backend holds. Runs once, after the last call in flight returned."""

    def _release_now(self) -> None:
        assert self._released is not None
        try:
            self._release()
        finally:
            self._released.set()

    async def __aenter__(self) -> Self:
        self._check_open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # `warnings.warn` is bound as a default so the check still works while the interpreter shuts down.
    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        if not getattr(self, "_closed", True):
            _warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2, source=self)
        workers = getattr(self, "_workers", None)
        if workers is not None:
            workers.close_queue()  # collected (unclosed, or its aclose cancelled): let its threads go

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosed(f"{self!r} is closed")
