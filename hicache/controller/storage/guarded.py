"""A storage backend seen through its tier's circuit breaker: refused at no cost while storage is down.

`GuardedStorage` implements the storage protocol around a real backend. Before each call it asks the
breaker for a ticket (none: `StorageCircuitOpen`, raised without I/O); afterwards it tells the breaker how
the call went and counts errors in `storage_errors{op,kind}`. Misses and damaged pages are answers, not
outages: a `PageNotFound` or `ChecksumMismatch` settles the ticket as a success.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from hicache.controller.storage.breaker import CircuitBreaker
from hicache.errors import ChecksumMismatch, PageNotFound, StorageCircuitOpen
from hicache.metrics import Counter
from storage_backends.protocol import PageStatus, StorageBackend

__all__ = ["GuardedStorage", "error_kind"]

T = TypeVar("T")


def error_kind(exc: BaseException) -> str:
    """The `kind` label of a storage error: `auth`, `timeout`, `unavailable` or `other`."""
    if isinstance(exc, PermissionError):
        return "auth"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionError):
        return "unavailable"
    return "other"


class GuardedStorage:
    """`backend` behind `breaker`; implements `storage_backends.protocol.StorageBackend`.

    Args:
        backend: the real backend (the guard does not own it: `aclose` leaves it open).
        breaker: the tier's circuit breaker.
        errors: the `storage_errors` counter (labels `op`, `kind`).
    """

    def __init__(self, backend: StorageBackend, breaker: CircuitBreaker, errors: Counter) -> None:
        self.backend = backend
        self.breaker = breaker
        self._errors = errors

    def __repr__(self) -> str:
        return f"<GuardedStorage {self.backend!r} {self.breaker!r}>"

    async def exists(self, keys: Sequence[str]) -> int:
        """`backend.exists`, guarded."""
        return await self._call("exists", lambda: self.backend.exists(keys))

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """`backend.get`, guarded (a foreign or old-format page is an answer, not an outage)."""
        return await self._call("get", lambda: self.backend.get(keys, buffers))

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """`backend.put`, guarded."""
        return await self._call("put", lambda: self.backend.put(keys, buffers))

    async def delete(self, keys: Sequence[str]) -> None:
        """`backend.delete`, guarded."""
        await self._call("delete", lambda: self.backend.delete(keys))

    async def aclose(self) -> None:
        """Nothing to release: the backend stays its owner's to close."""

    def record_timeout(self, op: str) -> None:
        """A call cut short by the caller's own deadline: an error of kind `timeout` for the breaker."""
        self._errors.inc(op=op, kind="timeout")
        self.breaker.failure()

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T:
        ticket = self.breaker.begin()
        if ticket is None:
            raise StorageCircuitOpen(
                f"{op}: storage tier {self.breaker.tier!r} is unavailable (breaker open)"
            )
        try:
            result = await call()
        except (PageNotFound, ChecksumMismatch):
            self.breaker.success(ticket)  # storage answered
            raise
        except OSError as exc:  # StorageError and whatever a backend let through untranslated
            self._errors.inc(op=op, kind=error_kind(exc))
            self.breaker.failure(ticket)
            raise
        except BaseException:  # cancelled, or the caller's mistake (ValueError, CacheClosed)
            self.breaker.abandon(ticket)
            raise
        self.breaker.success(ticket)
        return result
