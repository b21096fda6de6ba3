"""How the S3 backend runs one request: retries with backoff under a deadline, and error translation.

`Requests` runs each request under capped exponential backoff with jitter, at most `max_retries` retries
inside a per-request deadline (obstore's own retries are disabled so the counts are exact), and translates
every native failure into a `storage_backends.errors` class with credentials redacted. `Batch` is the fuse the
requests of one call share: once one has given up on an unreachable server (or the server refused our
credentials) the requests not yet started fail at once instead of each waiting out its own deadline.
"""

from __future__ import annotations

import atexit
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, TypeVar

import anyio
from obstore.exceptions import (
    InvalidPathError,
    NotSupportedError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnknownConfigurationKeyError,
)

from storage_backends.errors import PageNotFound, StorageAuthError, StorageError, StorageUnavailable
from storage_backends.protocol import PageStatus
from storage_backends.redact import redact_text

__all__ = ["Batch", "Requests", "http_status"]

logger = logging.getLogger("storage_backends.s3")

T = TypeVar("T")

_NON_RETRYABLE: Final = (InvalidPathError, NotSupportedError, UnknownConfigurationKeyError, ValueError)
_AUTH_ERRORS: Final = (PermissionDeniedError, UnauthenticatedError)
_STATUS_RE: Final = re.compile(r"status code: (\d{3})")

_EXIT_GRACE_S: Final = 0.02
"""How long the interpreter releases the GIL at exit so obstore's threads can leave Python first."""


class Batch:
    """Per-call state shared by the requests of one batch: the fuse that trips when the server is gone
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


class Requests:
    """Retries, deadlines, the connection bound and error translation for one backend's requests.

    A request first waits for one of `max_concurrency` connections, then runs attempts of at most
    `attempt_timeout_s` each; the wait, the attempts and the backoff between them all count toward the
    request's deadline, and a connection is held only during an attempt (not while backing off).

    Args:
        max_concurrency: the most requests in flight at once.
        read_deadline_s: the total time a GET or HEAD may take, retries and backoff included.
        write_deadline_s: the same for PUT and DELETE.
        attempt_timeout_s: the most one attempt may take.
        max_retries: the most retries of one request after transient failures.
        backoff_initial_s: the first backoff delay; doubles per retry.
        backoff_max_s: the cap of the backoff delay.
        secrets: credential values to redact from every message.

    Attributes:
        requests: HTTP requests attempted, retries included.
        retries: attempts retried after a transient failure.
    """

    __slots__ = (
        "_attempt_timeout_s",
        "_backoff_initial_s",
        "_backoff_max_s",
        "_limiter",
        "_max_retries",
        "_read_deadline_s",
        "_secrets",
        "_write_deadline_s",
        "requests",
        "retries",
    )

    def __init__(
        self,
        *,
        max_concurrency: int,
        read_deadline_s: float,
        write_deadline_s: float,
        attempt_timeout_s: float,
        max_retries: int,
        backoff_initial_s: float,
        backoff_max_s: float,
        secrets: tuple[str, ...],
    ) -> None:
        self._limiter = anyio.CapacityLimiter(max_concurrency)
        self._read_deadline_s = read_deadline_s
        self._write_deadline_s = write_deadline_s
        self._attempt_timeout_s = attempt_timeout_s
        self._max_retries = max_retries
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._secrets = secrets
        self.requests = 0
        self.retries = 0

    async def call(self, op: Callable[[], Awaitable[T]], batch: Batch, method: str, path: str) -> T:
        """Run one request with retries; translate every failure into a `storage_backends.errors` class.

        Raises:
            PageNotFound: the object does not exist (never retried).
            StorageError: a non-retryable failure (permissions, bad configuration).
            StorageUnavailable: transient failures lasted past the deadline, or the batch already gave up.
        """
        if batch.auth:
            raise StorageAuthError(
                f"{method} {path}: skipped, the server refused our credentials in this batch"
            )
        if batch.unavailable:
            raise StorageUnavailable(
                f"{method} {path}: skipped, the server was unreachable earlier in this batch"
            )
        limit_s = self._read_deadline_s if method in ("GET", "HEAD") else self._write_deadline_s
        deadline = anyio.current_time() + limit_s
        attempt = 0
        while True:
            attempt += 1
            await self._take_connection(deadline, limit_s, method, path)
            self.requests += 1
            remaining = deadline - anyio.current_time()
            try:
                try:
                    # The attempt's timeout covers the request alone, never the wait for a connection.
                    with anyio.fail_after(max(0.0, min(self._attempt_timeout_s, remaining))):
                        return await op()
                finally:
                    self._limiter.release()  # before any backoff: a retry waits without a connection
            except FileNotFoundError:
                raise PageNotFound(f"{method} {path}: no such object") from None
            except _AUTH_ERRORS as exc:
                batch.auth = True
                raise batch.fail(StorageAuthError(f"{method} {path} refused: {self.redact(exc)}")) from None
            except _NON_RETRYABLE as exc:
                raise StorageError(f"{method} {path} failed: {self.redact(exc)}") from None
            except Exception as exc:
                status = http_status(exc)
                if status in {401, 403}:
                    batch.auth = True
                    raise batch.fail(
                        StorageAuthError(f"{method} {path} refused: {self.redact(exc)}")
                    ) from None
                if status is not None and 400 <= status < 500 and status not in {408, 429}:
                    raise StorageError(f"{method} {path} failed: {self.redact(exc)}") from None
                # Three cases left: 5xx and throttling, connection errors, and our attempt timeout.
                reason = "attempt timed out" if isinstance(exc, TimeoutError) else self.redact(exc)
                delay = min(self._backoff_max_s, self._backoff_initial_s * 2 ** (attempt - 1))
                delay *= 0.5 + random.random() / 2  # jitter: spread retries of a batch apart
                if (
                    batch.unavailable
                    or attempt > self._max_retries
                    or anyio.current_time() + delay >= deadline
                ):
                    batch.unavailable = True
                    raise batch.fail(
                        StorageUnavailable(
                            f"{method} {path} failed after {attempt} attempt(s) within {limit_s}s: {reason}"
                        )
                    ) from None
                self.retries += 1
                logger.debug(
                    "s3 %s %s attempt %d failed (%s); retrying in %.3fs", method, path, attempt, reason, delay
                )
                await anyio.sleep(delay)

    async def _take_connection(self, deadline: float, limit_s: float, method: str, path: str) -> None:
        """Wait for one of the `max_concurrency` connections, up to the request's `deadline` (the wait
        counts toward the request's deadline, not toward an attempt's timeout: with many requests queued,
        a healthy server's requests used to time out before they were ever sent, and were retried).

        Raises:
            StorageUnavailable: no connection came free before the deadline (ours were all busy: the
                batch's fuse is left alone, the server may be fine).
        """
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())) as waited:
            await self._limiter.acquire()
        if waited.cancelled_caught:
            raise StorageUnavailable(
                f"{method} {path}: no connection came free within {limit_s}s "
                f"(all {int(self._limiter.total_tokens)} busy)"
            )

    @property
    def waiting(self) -> int:
        """Requests waiting for a connection now."""
        return int(self._limiter.statistics().tasks_waiting)

    def redact(self, exc: BaseException) -> str:
        """The first line of a native error, with every credential replaced by `***`."""
        text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return redact_text(text, self._secrets)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status a native error reports, if any (object_store has no typed field for it)."""
    match = _STATUS_RE.search(str(exc))
    return int(match.group(1)) if match else None


def _let_client_threads_leave_python() -> None:
    """Release the GIL for a moment at exit, before the interpreter starts finalizing.

    obstore completes each request on a tokio thread that calls back into Python
    (`loop.call_soon_threadsafe`) and releases the GIL inside that call while it wakes the event loop. If
    the program returns and finalization starts in that window, Python < 3.14 answers the thread's GIL
    re-acquire with `pthread_exit`, and unwinding through Rust frames aborts the process (SIGABRT after a
    successful run: about 3 in 100 short runs here). A thread waiting for the GIL gets it during this sleep
    and finishes its callback; atexit handlers run before finalization.
    """
    time.sleep(_EXIT_GRACE_S)


atexit.register(_let_client_threads_leave_python)
