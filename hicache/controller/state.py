"""Whether the cache is open: the one piece of the facade's state its collaborators need to see."""

from __future__ import annotations

from hicache.errors import CacheClosed

__all__ = ["OpenState"]


class OpenState:
    """Started and closed flags of a cache, and the check every public operation makes first."""

    def __init__(self) -> None:
        self.started = False
        self.closed = False

    def check_open(self, what: str) -> None:
        """Raise `CacheClosed` naming `what` unless the cache is started and not closed."""
        if self.closed:
            raise CacheClosed(f"{what}: this HiCache was closed")
        if not self.started:
            raise CacheClosed(f"{what}: this HiCache was not started (use `async with HiCache(...)`)")
