"""How a network store's backend runs one round trip: deadlines, bounded retries with backoff, translation.

Shared by the Valkey and Mooncake backends (the S3 backend's `s3_requests` does the same for HTTP). One
round trip carries a whole batch (a pipeline to one Valkey node, one Mooncake batch call), so the per-page
fuse of S3 is not needed here: a round trip that gives up fails the pages it carried, and a backend raises
`StorageUnavailable` when every round trip of a call failed.

A round trip runs attempts of at most `attempt_timeout_s` each, with capped exponential backoff and jitter
between them, at most `max_retries` retries, all inside the call's deadline. `classify` tells the kind of a
native failure; every message is redacted of the backend's secrets.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import anyio

from storage_backends.errors import StorageAuthError, StorageError, StorageUnavailable
from storage_backends.redact import redact_text

__all__ = ["Failure", "RoundTrips"]

T = TypeVar("T")

Failure = Literal["transient", "auth", "fatal"]
"""What a native failure means: retry it, the server refused our credentials, or a bug or misuse."""

logger = logging.getLogger("storage_backends.net_calls")


class RoundTrips:
    """Deadlines, retries, counters and error translation for one backend's round trips.

    Args:
        name: the backend's name in messages (`"valkey"`).
        read_deadline_s: the total time a read round trip may take, retries and backoff included.
        write_deadline_s: the same for writes and deletes.
        attempt_timeout_s: the most one attempt may take.
        max_retries: the most retries after transient failures (0: none).
        backoff_initial_s: the first backoff delay; doubles per retry.
        backoff_max_s: the cap of the backoff delay.
        secrets: values to redact from every message.
        classify: the kind of a native exception (`Failure`).

    Attributes:
        requests: attempts started, retries included.
        retries: attempts retried after a transient failure.
    """

    __slots__ = (
        "_attempt_timeout_s",
        "_backoff_initial_s",
        "_backoff_max_s",
        "_classify",
        "_max_retries",
        "_name",
        "_read_deadline_s",
        "_secrets",
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
        self.requests = 0
        self.retries = 0

    def deadline_s(self, *, write: bool) -> float:
        """The deadline of a write (or read) round trip."""
        return self._write_deadline_s if write else self._read_deadline_s

    async def call(self, op: Callable[[], Awaitable[T]], *, write: bool, what: str, retry: bool = True) -> T:
        """Run `op()` with retries under the round trip's deadline.

        Args:
            op: one attempt of the round trip.
            write: whether it writes (the write deadline applies) or reads.
            what: what it does, for messages (`"GET 12 pages from 127.0.0.1:7000"`).
            retry: False when a timed-out attempt may still touch caller buffers (a worker thread that
                was abandoned): then the round trip gives up after the first failure.

        Raises:
            StorageAuthError: the server refused our credentials.
            StorageError: a failure `classify` calls fatal.
            StorageUnavailable: transient failures lasted past the deadline or the retries.
        """
        limit_s = self.deadline_s(write=write)
        deadline = anyio.current_time() + limit_s
        attempt = 0
        while True:
            attempt += 1
            self.requests += 1
            remaining = deadline - anyio.current_time()
            try:
                with anyio.fail_after(max(0.0, min(self._attempt_timeout_s, remaining))):
                    return await op()
            except (StorageError, ValueError, TypeError):
                raise  # ours already, or the caller's misuse (a buffer of the wrong size): never retried
            except Exception as exc:
                kind: Failure = "transient" if isinstance(exc, TimeoutError) else self._classify(exc)
                reason = "attempt timed out" if isinstance(exc, TimeoutError) else self.redact(exc)
                if kind == "auth":
                    raise StorageAuthError(f"{self._name} {what} refused: {reason}") from None
                if kind == "fatal":
                    raise StorageError(f"{self._name} {what} failed: {reason}") from None
                delay = min(self._backoff_max_s, self._backoff_initial_s * 2 ** (attempt - 1))
                delay *= 0.5 + random.random() / 2  # jitter: spread the retries of concurrent calls apart
                if not retry or attempt > self._max_retries or anyio.current_time() + delay >= deadline:
                    raise StorageUnavailable(
                        f"{self._name} {what} failed after {attempt} attempt(s) within {limit_s}s: {reason}"
                    ) from None
                self.retries += 1
                logger.debug(
                    "%s %s attempt %d failed (%s); retrying in %.3fs",
                    self._name,
                    what,
                    attempt,
                    reason,
                    delay,
                )
                await anyio.sleep(delay)

    def redact(self, exc: BaseException) -> str:
        """The first line of a native error, with every secret replaced by `***`."""
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        return redact_text(f"{type(exc).__name__}: {first}", self._secrets)
