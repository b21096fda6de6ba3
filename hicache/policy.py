"""The names of the cache's policies, shared by the tree, the controller and the configuration."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

__all__ = ["EvictionPolicy", "RefillPolicy", "StopPolicy", "WritePolicy", "parse_policy"]

E = TypeVar("E", bound=StrEnum)


class WritePolicy(StrEnum):
    """When device pages are backed up to host memory."""

    WRITE_THROUGH = "write_through"
    """Back up a node as soon as it is inserted (its first hit)."""
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    """Back up a node once it has been hit `write_through_threshold` times (default 2)."""
    WRITE_BACK = "write_back"
    """Back up a node only when it is evicted from the device."""


class RefillPolicy(StrEnum):
    """What a prefetch commit does with a storage refill whose attach point is not backed up (under
    write-through, where a host node must never hang below a device-only one)."""

    DROP = "drop"
    """Release the refill's pages (the request recomputes them)."""
    BACKUP_THEN_ATTACH = "backup_then_attach"
    """Back up the attach point's un-backed chain to host first (root first, as write-through would
    have), then attach the refill; if host room or the copy fails, drop as `DROP` does."""


class EvictionPolicy(StrEnum):
    """Which evictable leaf goes first."""

    LRU = "lru"
    LFU = "lfu"
    PRIORITY = "priority"


class StopPolicy(StrEnum):
    """When a storage prefetch stops streaming."""

    BEST_EFFORT = "best_effort"
    """Stream until the serving loop commits (or cancels) the prefetch."""
    WAIT_COMPLETE = "wait_complete"
    """Commit waits until every page has been read or has failed."""
    TIMEOUT = "timeout"
    """Commit waits until complete or min(max, base + per_1k_tokens * tokens / 1024) seconds have passed."""


def parse_policy(enum: type[E], value: object, name: str) -> E:
    """Turn `value` into a member of `enum`, raising `ValueError` that names the argument otherwise."""
    if isinstance(value, enum):
        return value
    if isinstance(value, str):
        try:
            return enum(value)
        except ValueError:
            pass
    choices = ", ".join(repr(m.value) for m in enum)
    raise ValueError(f"{name}: unknown policy {value!r}; expected one of {choices}")
