"""A storage backend seen through its tier's circuit breaker: refused at no cost while storage is down;
and the breaker, a pure, synchronous state machine with an injectable clock.

`GuardedStorage` implements the storage protocol around a real backend. Before each call it asks the
breaker for a ticket (none: `StorageCircuitOpen`, raised without I/O); afterwards it tells the breaker how
the call went and counts errors in `storage_errors{op,kind}`. Misses and damaged pages are answers, not
outages: a `PageNotFound` or `ChecksumMismatch` settles the ticket as a success.

The breaker (`CircuitBreaker`) has three states. **Closed**: every call goes to storage; `threshold`
consecutive errors (connection refused, timeouts, 5xx after retries, refused credentials) open the
breaker. **Open**: calls are refused without any I/O until the backoff has passed; then the next call is
let through as the one probe. **Half-open**: that probe is in flight and every other call is still
refused. The probe's success closes the breaker; its failure (or cancellation: it proved nothing) opens
it again with the backoff doubled, up to `backoff_max_s`.

Callers take a `Ticket` with `begin()` before a call and settle it with `success`, `failure` or `abandon`.
Tickets remember the state they were issued in, so a late answer from a call started before the breaker
opened neither closes it nor counts again. Every state change is logged once and handed to the
listeners (the cache sets its `storage_breaker_state` gauge from one).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hicache.config import HiCacheConfig
from hicache.errors import ChecksumMismatch, PageNotFound, StorageCircuitOpen
from hicache.metrics import Counter
from storage_backends.protocol import PageStatus, StorageBackend

__all__ = ["BreakerState", "BreakerStatistics", "CircuitBreaker", "GuardedStorage", "Ticket", "error_kind"]

logger = logging.getLogger("hicache.breaker")


class BreakerState(enum.IntEnum):
    """Where a breaker is; the int value is what the state gauge exports."""

    CLOSED = 0
    """Calls go to storage."""
    OPEN = 1
    """Calls are refused without I/O until the next probe is due."""
    HALF_OPEN = 2
    """One probe call is in flight; the others are refused."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """Permission for one storage call, from `CircuitBreaker.begin`.

    Attributes:
        probe: the call is the one probe of a half-open breaker.
        epoch: the breaker's epoch when issued (each opening starts a new one).
    """

    probe: bool
    epoch: int


@dataclass(frozen=True, slots=True)
class BreakerStatistics:
    """A snapshot of a breaker.

    Attributes:
        tier: the storage tier it guards.
        state: its state now.
        consecutive_failures: errors in a row while closed.
        backoff_s: the wait before the next probe (while open).
        next_probe_in_s: seconds until a probe is due (0 when due, or when closed).
        opened: times it opened (from closed).
        probes: probes let through.
        refused: calls refused without I/O.
    """

    tier: str
    state: BreakerState
    consecutive_failures: int
    backoff_s: float
    next_probe_in_s: float
    opened: int
    probes: int
    refused: int


Listener = Callable[[BreakerState, BreakerState], None]
"""Called as `listener(old, new)` on every state change."""


class CircuitBreaker:
    """Remembers that a storage tier is down so that calls stop paying for it.

    Args:
        tier: the tier's name, for logs and metrics labels.
        threshold: consecutive errors that open the breaker (>= 1).
        backoff_initial_s: the wait after opening before the first probe (> 0).
        backoff_max_s: the cap of the doubling backoff (>= `backoff_initial_s`).
        clock: monotonic seconds (default `time.monotonic`); tests pass a fake one.

    Raises:
        ValueError: naming the argument, for a threshold below 1 or a bad backoff.
    """

    def __init__(
        self,
        tier: str = "storage",
        *,
        threshold: int = 5,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"threshold: expected an int >= 1, got {threshold!r}")
        if not isinstance(backoff_initial_s, int | float) or not backoff_initial_s > 0:
            raise ValueError(f"backoff_initial_s: expected a positive number, got {backoff_initial_s!r}")
        if not isinstance(backoff_max_s, int | float) or not backoff_max_s >= backoff_initial_s:
            raise ValueError(
                f"backoff_max_s: expected a number >= backoff_initial_s ({backoff_initial_s}), "
                f"got {backoff_max_s!r}"
            )
        self.tier = tier
        self.threshold = threshold
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._backoff = self.backoff_initial_s
        self._probe_at = 0.0
        self._epoch = 0
        self._opened = 0
        self._probes = 0
        self._refused = 0
        self.listeners: list[Listener] = []
        """Called as `listener(old, new)` on every state change, after it is logged."""

    @classmethod
    def for_storage(cls, config: HiCacheConfig) -> CircuitBreaker:
        """The storage tier's breaker as `config`'s `storage_breaker_*` fields describe it."""
        return cls(
            "storage",
            threshold=config.storage_breaker_threshold,
            backoff_initial_s=config.storage_breaker_backoff_s,
            backoff_max_s=config.storage_breaker_backoff_max_s,
        )

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker whose probe is due still reads `OPEN` until a call probes)."""
        return self._state

    def allows(self) -> bool:
        """Whether a call started now would be let through (`begin` would return a ticket); no change."""
        if self._state is BreakerState.CLOSED:
            return True
        return self._state is BreakerState.OPEN and self._clock() >= self._probe_at

    def begin(self) -> Ticket | None:
        """A ticket for one call, or None when the call must not touch storage (counted as refused).

        While open and the backoff has passed, the ticket is the probe and the breaker goes half-open.
        """
        if self._state is BreakerState.CLOSED:
            return Ticket(probe=False, epoch=self._epoch)
        if self._state is BreakerState.OPEN and self._clock() >= self._probe_at:
            self._probes += 1
            self._set(BreakerState.HALF_OPEN)
            return Ticket(probe=True, epoch=self._epoch)
        self._refused += 1
        return None

    def success(self, ticket: Ticket) -> None:
        """The call answered (a hit or a miss alike: storage is reachable)."""
        if ticket.probe and self._state is BreakerState.HALF_OPEN and ticket.epoch == self._epoch:
            self._failures = 0
            self._backoff = self.backoff_initial_s
            self._set(BreakerState.CLOSED)
        elif self._state is BreakerState.CLOSED and ticket.epoch == self._epoch:
            self._failures = 0

    def failure(self, ticket: Ticket | None = None) -> None:
        """The call failed with an outage-like error (or timed out). `None`: a failure seen outside a call
        with a ticket, counted like a call issued now."""
        if ticket is None:
            ticket = Ticket(probe=False, epoch=self._epoch)
        if ticket.epoch != self._epoch:
            return  # a call from before the last opening: already accounted for
        if ticket.probe and self._state is BreakerState.HALF_OPEN:
            self._backoff = min(self.backoff_max_s, self._backoff * 2)
            self._reopen()
        elif self._state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures >= self.threshold:
                self._opened += 1
                self._backoff = self.backoff_initial_s
                self._reopen()

    def abandon(self, ticket: Ticket) -> None:
        """The call was cancelled before it answered. A cancelled probe proved nothing: it counts as a
        failed probe, so a storage that hangs is not probed again before the next backoff."""
        if ticket.probe:
            self.failure(ticket)

    def statistics(self) -> BreakerStatistics:
        """A frozen snapshot."""
        due = max(0.0, self._probe_at - self._clock()) if self._state is BreakerState.OPEN else 0.0
        return BreakerStatistics(
            tier=self.tier,
            state=self._state,
            consecutive_failures=self._failures,
            backoff_s=self._backoff,
            next_probe_in_s=due,
            opened=self._opened,
            probes=self._probes,
            refused=self._refused,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<CircuitBreaker {s.tier} {s.state.name.lower()} failures={s.consecutive_failures}/"
            f"{self.threshold} backoff={s.backoff_s:g}s opened={s.opened} refused={s.refused}>"
        )

    def _reopen(self) -> None:
        self._epoch += 1
        self._failures = 0
        self._probe_at = self._clock() + self._backoff
        self._set(BreakerState.OPEN)

    def _set(self, new: BreakerState) -> None:
        old = self._state
        if old is new:
            return
        self._state = new
        if new is BreakerState.OPEN and old is BreakerState.CLOSED:
            logger.warning(
                "storage tier %s unavailable: breaker open after %d consecutive errors; next probe in %gs",
                self.tier,
                self.threshold,
                self._backoff,
            )
        elif new is BreakerState.CLOSED:
            logger.warning("storage tier %s recovered: breaker closed", self.tier)
        else:
            logger.info("storage tier %s breaker %s -> %s", self.tier, old.name.lower(), new.name.lower())
        for listener in self.listeners:
            listener(old, new)


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
