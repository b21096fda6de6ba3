"""Whether the cache is open: the one piece of the facade's state its collaborators need to see."""

from __future__ import annotations

import asyncio
import enum

from hicache.errors import CacheClosed, CacheFailed, UnsupportedEventLoop

__all__ = ["OpenState", "Phase"]


class Phase(enum.Enum):
    """Where a cache is in its life: made, started, closed by its owner, or failed (and closed)."""

    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"
    FAILED = "failed"


class OpenState:
    """A cache's `Phase` (and the background failure that ended it), and the check every public
    operation makes first."""

    def __init__(self) -> None:
        self.phase = Phase.NEW
        self.failure: BaseException | None = None
        """The background job's exception that failed the cache (`Phase.FAILED`), else None."""
        self.loop: asyncio.AbstractEventLoop | None = None
        """The event loop `start()` ran on: the workers run there, and every call must be made there."""

    @property
    def started(self) -> bool:
        """Whether the cache is open: `start()` succeeded and nothing closed it since."""
        return self.phase is Phase.OPEN

    @property
    def closed(self) -> bool:
        """Whether the cache is closed or closing (by `aclose`, a failed start, or a failure)."""
        return self.phase in (Phase.CLOSED, Phase.FAILED)

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """`start()` succeeded on `loop`."""
        if self.phase is Phase.NEW:
            self.phase, self.loop = Phase.OPEN, loop

    def on_another_loop(self) -> bool:
        """Whether an event loop other than the one `start()` ran on is running in this thread."""
        if self.loop is None:
            return False
        try:
            return asyncio.get_running_loop() is not self.loop
        except RuntimeError:  # no loop in this thread (the model's thread): not a second loop
            return False

    def check_loop(self, what: str) -> None:
        """Refuse, naming `what`, a call made on another event loop than the one `start()` ran on: the
        cache's workers run there, so backups, writes and closing would never run for this one."""
        if self.on_another_loop():
            raise UnsupportedEventLoop(
                f"{what}: this HiCache was started on another event loop, where its background workers "
                f"run; use it only on the loop that started it (one cache per loop)"
            )

    def close(self) -> None:
        """`aclose()` or a failed `start()`: a failure already recorded stays the reason."""
        if not self.closed:
            self.phase = Phase.CLOSED

    def fail(self, error: BaseException) -> bool:
        """A background job raised `error`: the cache fails (and closes). Returns whether this is the
        first failure (False: already failed, or closed by its owner)."""
        if self.closed:
            return False
        self.phase, self.failure = Phase.FAILED, error
        return True

    def closed_error(self, what: str, detail: str = "this HiCache was closed") -> CacheClosed:
        """The error for `what` on a closed cache: `CacheFailed` (caused by the failure) after a
        background failure, `CacheClosed` saying `detail` otherwise. Raised in an `except` block, it
        shows no other context."""
        error: CacheClosed
        if self.failure is not None:
            error = CacheFailed(
                f"{what}: this HiCache failed and closed: a background job raised {self.failure!r}"
            )
            error.__cause__ = self.failure
        else:
            error = CacheClosed(f"{what}: {detail}")
        error.__suppress_context__ = True
        return error

    def check_open(self, what: str) -> None:
        """Raise `CacheClosed` (`CacheFailed` after a background failure) naming `what` unless the cache
        is started and not closed; `UnsupportedEventLoop` on another event loop than `start()`'s."""
        self.check_loop(what)
        if self.closed:
            raise self.closed_error(what)
        if self.phase is Phase.NEW:
            raise CacheClosed(f"{what}: this HiCache was not started (use `async with HiCache(...)`)")
