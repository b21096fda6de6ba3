"""How a network store's backend runs one round trip: deadlines, bounded retries with backoff, translation.

Shared by the S3, Valkey and Mooncake backends. A round trip (one S3 request, a pipeline to one Valkey node,
one Mooncake batch call) first waits for one of the backend's `max_concurrency` connections, where it has
such a bound, then runs attempts of at most `attempt_timeout_s` each, with capped exponential backoff and
jitter between them, at most `max_retries` retries. The wait, the attempts and the backoff all count toward
the round trip's read or write deadline, and a connection is held only during an attempt (not while backing
off). `classify` tells the kind of a native failure; every message is redacted of the backend's secrets.

A round trip that gives up fails the pages it carried. The round trips of one call may share a `Batch`,
the fuse S3's per-page requests need: once one has given up on an unreachable server (or the server refused
our credentials) the round trips not yet started fail at once instead of each waiting out its own deadline.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, TypeVar

from storage_backends.cancellation import StopScope
from storage_backends.errors import PageNotFound, StorageAuthError, StorageError, StorageUnavailable
from storage_backends.protocol import PageStatus
from storage_backends.redact import redact_text

__all__ = ["Batch", "Failure", "RoundTrips"]

T = TypeVar("T")

Failure = Literal["transient", "auth", "fatal", "missing", "misuse"]
"""What a native failure means: retry it; the server refused our credentials; a bug or a refusal retrying
cannot change; the object does not exist (`PageNotFound`, never retried); the caller's misuse (a buffer of the
wrong size: raised as itself)."""

logger = logging.getLogger("storage_backends.net_calls")


class Batch:
    """Per-call state shared by the round trips of one call: the fuse that trips when the server is gone
    (`unavailable`) or refuses our credentials (`auth`), with the first such error."""

    __slots__ = ("auth", "error", "unavailable")

    def __init__(self) -> None:
        self.unavailable = False
        self.auth = False
        self.error: StorageError | None = None

    def fail(self, exc: StorageError) -> StorageError:
        """Remember the first outage error of the batch; returns `exc` for raising."""
        if self.error is None:
            self.error = exc
        return exc

    def raise_if_all_failed(self, flags: Sequence[PageStatus] | Sequence[bool]) -> None:
        """Raise the batch's outage error when not one page succeeded: an outage, not missing pages."""
        if self.error is not None and not any(flags):
            raise self.error


class RoundTrips:
    """Deadlines, retries, the connection bound, counters and error translation for one backend's round trips.

    Args:
        name: the backend's name in messages (`"valkey"`).
        read_deadline_s: the total time a read round trip may take, the wait for a connection, retries and
            backoff included.
        write_deadline_s: the same for writes and deletes.
        attempt_timeout_s: the most one attempt may take.
        max_retries: the most retries after transient failures (0: none).
        backoff_initial_s: the first backoff delay; doubles per retry.
        backoff_max_s: the cap of the backoff delay.
        secrets: values to redact from every message.
        classify: the kind of a native exception (`Failure`).
        max_concurrency: the most round trips in flight at once (connections), or None for no bound here
            (a backend whose round trips each take one of its worker threads, bounded there).

    Attributes:
        requests: attempts started, retries included.
        retries: attempts retried after a transient failure.
    """

    __slots__ = (
        "_attempt_timeout_s",
        "_backoff_initial_s",
        "_backoff_max_s",
        "_classify",
        "_limiter",
        "_max_concurrency",
        "_max_retries",
        "_name",
        "_read_deadline_s",
        "_secrets",
        "_waiting",
        "_write_deadline_s",
        "requests",
        "retries",
    )

    def __init__(
        self,
        *,
        name: str,
        read_deadline_s: float,
        write_deadline_s: float,
        attempt_timeout_s: float,
        max_retries: int,
        backoff_initial_s: float,
        backoff_max_s: float,
        secrets: tuple[str, ...],
        classify: Callable[[BaseException], Failure],
        max_concurrency: int | None = None,
    ) -> None:
        self._name = name
        self._read_deadline_s = read_deadline_s
        self._write_deadline_s = write_deadline_s
        self._attempt_timeout_s = attempt_timeout_s
        self._max_retries = max_retries
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._secrets = secrets
        self._classify = classify
        self._max_concurrency = max_concurrency
        self._limiter = None if max_concurrency is None else asyncio.Semaphore(max_concurrency)
        self._waiting = 0
        self.requests = 0
        self.retries = 0

    def deadline_s(self, *, write: bool) -> float:
        """The deadline of a write (or read) round trip."""
        return self._write_deadline_s if write else self._read_deadline_s

    @property
    def waiting(self) -> int:
        """Round trips waiting for a connection now."""
        return self._waiting

    async def call(
        self,
        op: Callable[[], Awaitable[T]],
        *,
        write: bool,
        what: str,
        retry: bool = True,
        batch: Batch | None = None,
    ) -> T:
        """Run `op()` with retries under the round trip's deadline.

        Args:
            op: one attempt of the round trip.
            write: whether it writes (the write deadline applies) or reads.
            what: what it does, for messages (`"GET 12 pages from 127.0.0.1:7000"`).
            retry: False when a timed-out attempt may still touch caller buffers (a worker thread that
                was abandoned): then the round trip gives up after the first failure.
            batch: the fuse this call's round trips share, if any (see the module).

        Raises:
            PageNotFound: the object does not exist (never retried).
            StorageAuthError: the server refused our credentials.
            StorageError: a failure `classify` calls fatal.
            StorageUnavailable: transient failures lasted past the deadline or the retries, no connection
                came free before the deadline, or the batch already gave up.
        """
        if batch is not None and batch.auth:
            raise StorageAuthError(
                f"{self._name} {what}: skipped, the server refused our credentials in this batch"
            )
        if batch is not None and batch.unavailable:
            raise StorageUnavailable(
                f"{self._name} {what}: skipped, the server was unreachable earlier in this batch"
            )
        limit_s = self.deadline_s(write=write)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        attempt = 0
        while True:
            attempt += 1
            await self._take_connection(deadline, limit_s, what)
            self.requests += 1
            remaining = deadline - loop.time()
            try:
                try:
                    # The attempt's timeout covers the attempt alone, never the wait for a connection.
                    async with asyncio.timeout(max(0.0, min(self._attempt_timeout_s, remaining))):
                        return await op()
                finally:
                    if self._limiter is not None:
                        self._limiter.release()  # before any backoff: a retry waits without a connection
            except StorageError:
                raise  # ours already
            except Exception as exc:
                kind: Failure = "transient" if isinstance(exc, TimeoutError) else self._classify(exc)
                if kind == "misuse":
                    raise
                reason = "attempt timed out" if isinstance(exc, TimeoutError) else self.redact(exc)
                if kind == "missing":
                    raise PageNotFound(f"{self._name} {what}: no such object") from None
                if kind == "auth":
                    refused = StorageAuthError(f"{self._name} {what} refused: {reason}")
                    if batch is not None:
                        batch.auth = True
                        batch.fail(refused)
                    raise refused from None
                if kind == "fatal":
                    raise StorageError(f"{self._name} {what} failed: {reason}") from None
                delay = min(self._backoff_max_s, self._backoff_initial_s * 2 ** (attempt - 1))
                delay *= 0.5 + random.random() / 2  # jitter: spread the retries of concurrent calls apart
                if (
                    not retry
                    or (batch is not None and batch.unavailable)
                    or attempt > self._max_retries
                    or loop.time() + delay >= deadline
                ):
                    error = StorageUnavailable(
                        f"{self._name} {what} failed after {attempt} attempt(s) within {limit_s}s: {reason}"
                    )
                    if batch is not None:
                        batch.unavailable = True
                        batch.fail(error)
                    raise error from None
                self.retries += 1
                logger.debug(
                    "%s %s attempt %d failed (%s); retrying in %.3fs",
                    self._name,
                    what,
                    attempt,
                    reason,
                    delay,
                )
                await asyncio.sleep(delay)

    async def _take_connection(self, deadline: float, limit_s: float, what: str) -> None:
        """Wait for one of the `max_concurrency` connections, up to the round trip's `deadline` (the wait
        counts toward the deadline, not toward an attempt's timeout: with many requests queued, a healthy
        server's requests used to time out before they were ever sent, and were retried).

        Raises:
            StorageUnavailable: no connection came free before the deadline (ours were all busy: a batch's
                fuse is left alone, the server may be fine).
        """
        if self._limiter is None:
            return
        self._waiting += 1
        try:
            async with StopScope(max(0.0, deadline - asyncio.get_running_loop().time())) as waited:
                await self._limiter.acquire()
        finally:
            self._waiting -= 1
        if waited.cut_short:
            raise StorageUnavailable(
                f"{self._name} {what}: no connection came free within {limit_s}s "
                f"(all {self._max_concurrency} busy)"
            )

    def redact(self, exc: BaseException) -> str:
        """The first line of a native error, with every secret replaced by `***`."""
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        return redact_text(f"{type(exc).__name__}: {first}", self._secrets)
