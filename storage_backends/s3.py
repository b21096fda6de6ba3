"""An S3 storage backend on obstore (Rust `object_store`): one object per page, `s3://bucket/prefix`.

Layout: page `key` lives at `<prefix>/<key[:2]>/<key>`; the object body is the page header followed by the
payload, the same format as the file backend (`storage_backends.page_format`). A single PUT per page makes
every page atomic (S3 never shows a partial object); multipart upload is never used.

Reads are whole-object GETs, never ranged: the body's length is checked against the caller's buffer before
anything else, so a server that ignores `Range` (rclone's `serve s3` answers 200 with the whole object) or an
object that is truncated or overlong cannot be mistaken for a page. A page is copied once, from the client's
buffer into the caller's, after its header and xxh3 checksum verify; pages of 64 KiB or more verify and copy
in one of the backend's at most `max_concurrency` worker threads (`storage_backends.threads.WorkerThreads`),
waited for unless the caller is cancelled (then the thread is registered with the buffer in `stray_threads`).

Every request runs under capped exponential backoff with jitter, at most `max_retries` retries inside a
per-request deadline, the wait for one of `max_concurrency` connections included (`storage_backends.net_calls`,
shared with the other network backends); obstore's own retries are disabled so the counts in
`statistics()` are exact. The
bounds are small by default (3 retries, a 2 s connect timeout) so a dead endpoint fails in well under a
second and the controller's circuit breaker sees it quickly. A request that still fails fails only its
own page (`get` → False for it), and once one request of a batch has given up on an unreachable server
(or the server refused our credentials) the pages of that batch not yet started fail at once instead of
each waiting out its own deadline.

Outages are errors, never misses: `exists` raises when a HEAD fails (it cannot answer how many pages are
stored), and `get` and `put` raise `StorageUnavailable` (or `StorageAuthError` for HTTP 401/403) when not
one page of the call succeeded because the server was unreachable or refused us. A call in which some
pages succeeded returns its per-page flags.

Credentials come from keyword options, the URL query, or the standard AWS environment variables, in that
order; they never appear in `repr`, log records or error messages (`storage_backends.s3_options` resolves the
settings).
"""

from __future__ import annotations

import atexit
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Final

import obstore
from obstore.exceptions import (
    InvalidPathError,
    NotSupportedError,
    PermissionDeniedError,
    UnauthenticatedError,
    UnknownConfigurationKeyError,
)
from obstore.store import S3Store

from storage_backends.batching import (
    BackendStatistics,
    StatisticsRecorder,
    check_batch,
    check_keys,
    gather_bounded,
)
from storage_backends.errors import ChecksumMismatch, PageNotFound, StorageError, StorageUnavailable
from storage_backends.lifecycle import BackendLifecycle
from storage_backends.names import validate_bucket, validate_prefix
from storage_backends.net_calls import Batch, Failure, RoundTrips
from storage_backends.page_format import (
    HEADER_SIZE,
    check_namespace_digest,
    check_stored_size,
    encode_header,
    failure_status,
    validate_keys,
    verify_page,
)
from storage_backends.protocol import PageStatus
from storage_backends.redact import redact_url
from storage_backends.s3_options import check_limits, parse_url, store_settings
from storage_backends.threads import WorkerThreads

__all__ = ["S3Backend", "S3Statistics"]

logger = logging.getLogger(__name__)

_THREAD_THRESHOLD: Final = 64 * 1024
"""Pages at least this large are hashed and copied in a worker thread; smaller ones inline."""


@dataclass(frozen=True, slots=True)
class S3Statistics(BackendStatistics):
    """A snapshot of an `S3Backend`'s counters since it was opened.

    Adds to `BackendStatistics` (pages and bytes read and written, misses, checksum failures, errors):

    Attributes:
        requests: HTTP requests attempted (GET, HEAD, PUT, DELETE), retries included.
        retries: attempts that were retried after a transient failure.
    """

    requests: int = 0
    retries: int = 0


class S3Backend(BackendLifecycle):
    """Pages as objects in an S3 bucket; implements `storage_backends.protocol.StorageBackend`.

    Open it with `S3Backend.from_url("s3://bucket/prefix?endpoint=...&region=...", namespace_digest=...)` or
    the constructor, use it as an async context manager or call `aclose()`.

    Args:
        bucket: the bucket name, valid by the S3 naming rules (`storage_backends.names.validate_bucket`:
            3-63 lowercase letters, digits, dots and hyphens, no `..`, not an IP address, ...).
        prefix: the key prefix inside the bucket ("" for the bucket root), taken literally: leading and
            trailing `/` are dropped; empty, `.` and `..` segments, backslashes, control characters and
            `%` are refused.
        namespace_digest: the 16-byte namespace digest written into and checked in every page header.
        endpoint: the S3 endpoint URL; default `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, else AWS.
        region: the signing region; default `AWS_REGION` / `AWS_DEFAULT_REGION`, else "us-east-1".
        access_key_id: default `AWS_ACCESS_KEY_ID`.
        secret_access_key: default `AWS_SECRET_ACCESS_KEY`.
        session_token: default `AWS_SESSION_TOKEN`.
        allow_http: allow a plain-http endpoint; default True only for loopback endpoints.
        max_concurrency: the most requests in flight at once, across all calls (the connection bound), and
            the most worker threads verifying or encoding pages at once.
        deadline_s: the total time one page's request may take, the wait for a connection, retries and
            backoff included.
        read_deadline_s: `deadline_s` for reads (GET, HEAD); default `deadline_s`. A `HiCache` opening
            this backend from its URL passes its `storage_read_timeout_s` here.
        write_deadline_s: `deadline_s` for writes (PUT, DELETE); default `deadline_s`. A `HiCache` passes
            its `storage_write_timeout_s`.
        attempt_timeout_s: the most one attempt may take (never more than the request's deadline).
        connect_timeout_s: the most connecting may take (at most `attempt_timeout_s`).
        max_retries: the most retries of one request after transient failures (0: none).
        backoff_initial_s: the first backoff delay; doubles per retry.
        backoff_max_s: the cap of the backoff delay.

    Raises:
        ValueError: naming the argument, for a bad bucket, prefix, endpoint or a non-positive setting.
        TypeError: naming the argument, for a bucket or prefix that is not a str.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        namespace_digest: bytes,
        endpoint: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        allow_http: bool | None = None,
        max_concurrency: int = 32,
        deadline_s: float = 30.0,
        read_deadline_s: float | None = None,
        write_deadline_s: float | None = None,
        attempt_timeout_s: float = 10.0,
        connect_timeout_s: float = 2.0,
        max_retries: int = 3,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
    ) -> None:
        self._closed = True  # until fully constructed: a failed __init__ must not warn in __del__
        validate_bucket(bucket)
        prefix = validate_prefix(prefix)
        read_deadline_s = deadline_s if read_deadline_s is None else read_deadline_s
        write_deadline_s = deadline_s if write_deadline_s is None else write_deadline_s
        check_limits(
            max_concurrency,
            max_retries,
            {
                "deadline_s": deadline_s,
                "read_deadline_s": read_deadline_s,
                "write_deadline_s": write_deadline_s,
                "attempt_timeout_s": attempt_timeout_s,
                "connect_timeout_s": connect_timeout_s,
                "backoff_initial_s": backoff_initial_s,
                "backoff_max_s": backoff_max_s,
            },
        )
        self._namespace_digest = check_namespace_digest(namespace_digest)
        settings = store_settings(
            endpoint=endpoint,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            allow_http=allow_http,
        )
        self._bucket = bucket
        self._prefix = prefix
        self._endpoint = settings.endpoint
        self._region = settings.region
        self._credentials = "explicit-or-env" if settings.explicit_credentials else "provider-chain"
        self._max_concurrency = max_concurrency
        attempt_s = min(float(attempt_timeout_s), max(float(read_deadline_s), float(write_deadline_s)))
        self._requests = RoundTrips(
            name="s3",
            max_concurrency=max_concurrency,
            read_deadline_s=float(read_deadline_s),
            write_deadline_s=float(write_deadline_s),
            attempt_timeout_s=attempt_s,
            max_retries=max_retries,
            backoff_initial_s=float(backoff_initial_s),
            backoff_max_s=float(backoff_max_s),
            secrets=settings.secrets,
            classify=_classify,
        )
        try:
            self._store: S3Store | None = S3Store(
                bucket,
                config=settings.config,  # type: ignore[arg-type]
                client_options={
                    "allow_http": settings.allow_http,
                    "connect_timeout": timedelta(seconds=min(attempt_s, float(connect_timeout_s))),
                    "timeout": timedelta(seconds=attempt_s),
                },
                # Retries happen in `RoundTrips`, in Python, so they are counted and share one deadline
                # with backoff.
                retry_config={"max_retries": 0},
            )
        except Exception as exc:
            raise ValueError(f"invalid S3 configuration: {self._requests.redact(exc)}") from None
        self._workers = WorkerThreads(max_concurrency, name="hicache-s3")
        self._stats = StatisticsRecorder()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, namespace_digest: bytes, **options: Any) -> S3Backend:
        """Open a backend for `s3://bucket/prefix?endpoint=...&region=...`.

        Query parameters and keyword `options` take the constructor's keyword names (`endpoint`, `region`,
        `access_key_id`, `secret_access_key`, `session_token`, `allow_http`, `max_concurrency`, `deadline_s`,
        `read_deadline_s`, `write_deadline_s`, `attempt_timeout_s`, `connect_timeout_s`, `max_retries`,
        `backoff_initial_s`, `backoff_max_s`); keyword options win over the query. The URL's path is
        percent-decoded once into the prefix; an encoded `/` (`%2F`) or a `%` left after decoding is
        refused, and so is everything the constructor refuses.

        Raises:
            ValueError: for another scheme, a bucket the S3 naming rules refuse (naming `bucket`), a bad
                prefix (naming `prefix`), an unknown or repeated query parameter, or a value that does not
                parse (the message never echoes credential values).
        """
        bucket, prefix, merged = parse_url(url)
        merged.update(options)
        return cls(bucket, prefix, namespace_digest=namespace_digest, **merged)

    # ------------------------------------------------------------------ lifecycle and observability

    def _release(self) -> None:
        """Drop the client and its connection pool, and close the worker threads (once no call is in
        flight)."""
        self._store = None
        self._workers.close()

    def __repr__(self) -> str:
        endpoint = None if self._endpoint is None else redact_url(self._endpoint)
        return (
            f"S3Backend(bucket={self._bucket!r}, prefix={self._prefix!r}, endpoint={endpoint!r}, "
            f"region={self._region!r}, credentials={self._credentials!r}, "
            f"max_concurrency={self._max_concurrency}, closed={self._closed})"
        )

    def statistics(self) -> S3Statistics:
        """A frozen snapshot of the counters since the backend was opened."""
        return S3Statistics(
            **self._stats.counters(), requests=self._requests.requests, retries=self._requests.retries
        )

    def object_path(self, key: str) -> str:
        """The object name of page `key` inside the bucket (`<prefix>/<key[:2]>/<key>`)."""
        name = f"{key[:2]}/{key}"
        return f"{self._prefix}/{name}" if self._prefix else name

    # ------------------------------------------------------------------ the protocol

    async def exists(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` whose pages are all stored.

        HEADs run concurrently in windows of `max_concurrency` keys; the scan stops at the first window with a
        missing page.

        Raises:
            StorageUnavailable: a HEAD failed after retries (the server is unreachable or failing).
            StorageAuthError: the server refused our credentials.
            StorageError: another failure; a failed HEAD is never taken for a missing page.
        """
        store = self._open_store()
        check_keys(keys)
        validate_keys(keys)
        batch = Batch()
        found = 0
        for start in range(0, len(keys), self._max_concurrency):
            window = keys[start : start + self._max_concurrency]
            flags = await gather_bounded(
                [partial(self._head_one, store, key, batch) for key in window], self._max_concurrency
            )
            for flag in flags:
                if not flag:
                    return found
                found += 1
        return found

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Read pages into caller buffers; one `PageStatus` per page, `HIT` only for a verified page.

        A page of another namespace or key (`FOREIGN`), of an older format (`OLD_FORMAT`), truncated,
        overlong, of another length or failing its checksum (`CORRUPT`) is logged at warning level, counted in `statistics()` and never
        copied into its buffer.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: for mismatched lengths, a bad key, or a read-only or non-contiguous buffer.
            StorageUnavailable, StorageAuthError: no page was read because the server was unreachable or
                refused our credentials.
        """
        store = self._open_store()
        check_batch(keys, buffers)
        validate_keys(keys)
        for i, buf in enumerate(buffers):
            if buf.readonly:
                raise ValueError(f"buffers[{i}]: expected a writable memoryview")
        batch = Batch()
        flags = await gather_bounded(
            [partial(self._get_one, store, key, buf, batch) for key, buf in zip(keys, buffers, strict=True)],
            self._max_concurrency,
        )
        batch.raise_if_all_failed(flags)
        return flags

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Store pages from caller buffers, one atomic PUT each; one flag per page.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: for mismatched lengths, a bad key or a non-contiguous buffer.
            StorageUnavailable, StorageAuthError: no page was written because the server was unreachable
                or refused our credentials.
        """
        store = self._open_store()
        check_batch(keys, buffers)
        validate_keys(keys)
        batch = Batch()
        flags = await gather_bounded(
            [partial(self._put_one, store, key, buf, batch) for key, buf in zip(keys, buffers, strict=True)],
            self._max_concurrency,
        )
        batch.raise_if_all_failed(flags)
        return flags

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove pages; absent keys are ignored.

        Raises:
            CacheClosed: after `aclose()`.
            StorageUnavailable: if some deletes still failed after retries (the count is in the message).
        """
        store = self._open_store()
        check_keys(keys)
        validate_keys(keys)
        batch = Batch()
        failures = await gather_bounded(
            [partial(self._delete_one, store, key, batch) for key in keys], self._max_concurrency
        )
        failed = [f for f in failures if f is not None]
        if failed:
            raise StorageUnavailable(f"{len(failed)} of {len(keys)} deletes failed; first: {failed[0]}")

    # ------------------------------------------------------------------ per-page primitives

    async def _head_one(self, store: S3Store, key: str, batch: Batch) -> bool:
        path = self.object_path(key)
        try:
            await self._requests.call(
                partial(obstore.head_async, store, path), write=False, what=f"HEAD {path}", batch=batch
            )
        except PageNotFound:
            return False
        except StorageError:
            self._stats.errors += 1
            raise  # not a miss: `exists` cannot say how many pages are stored
        return True

    async def _get_one(self, store: S3Store, key: str, buf: memoryview, batch: Batch) -> PageStatus:
        path = self.object_path(key)
        try:
            body = await self._requests.call(
                partial(_fetch, store, path), write=False, what=f"GET {path}", batch=batch
            )
        except PageNotFound:
            self._stats.misses += 1
            return PageStatus.MISS
        except StorageError:
            self._stats.errors += 1
            return PageStatus.ERROR
        verify = partial(_verify_and_copy, body, buf, self._namespace_digest, key)
        try:
            if len(body) != HEADER_SIZE + buf.nbytes:
                # A whole page of another length, a truncated or overlong object, or a page of another
                # namespace, key or format: each a counted miss (`failure_status`), never an exception.
                view = memoryview(body)[:HEADER_SIZE]
                check_stored_size(view, len(body), buf.nbytes, self._namespace_digest, key)
            elif buf.nbytes >= _THREAD_THRESHOLD:
                # A cancelled caller does not wait; the thread is registered as a stray with `buf` until
                # it returns (`storage_backends.threads`), so the caller keeps `buf` out of use meanwhile.
                await self._workers.call(verify, touches=(buf,))
            else:
                verify()
        except ChecksumMismatch as exc:
            status = failure_status(exc)
            self._stats.record_failures([status])
            logger.warning("s3 page %s failed verification (%s): treated as a miss", path, exc)
            return status
        self._stats.pages_read += 1
        self._stats.bytes_read += buf.nbytes
        return PageStatus.HIT

    async def _put_one(self, store: S3Store, key: str, buf: memoryview, batch: Batch) -> bool:
        path = self.object_path(key)
        encode = partial(_encode_body, buf, self._namespace_digest, key)
        if buf.nbytes >= _THREAD_THRESHOLD:
            body = await self._workers.call(encode, touches=(buf,))
        else:
            body = encode()
        try:
            await self._requests.call(
                partial(obstore.put_async, store, path, body, use_multipart=False),
                write=True,
                what=f"PUT {path}",
                batch=batch,
            )
        except StorageError:
            self._stats.errors += 1
            return False
        self._stats.pages_written += 1
        self._stats.bytes_written += buf.nbytes
        return True

    async def _delete_one(self, store: S3Store, key: str, batch: Batch) -> StorageError | None:
        path = self.object_path(key)
        try:
            await self._requests.call(
                partial(obstore.delete_async, store, path), write=True, what=f"DELETE {path}", batch=batch
            )
        except PageNotFound:
            return None
        except StorageError as exc:
            self._stats.errors += 1
            return exc
        return None

    def _open_store(self) -> S3Store:
        self._check_open()
        assert self._store is not None, "an open S3Backend holds its store"
        return self._store


async def _fetch(store: S3Store, path: str) -> obstore.Bytes:
    result = await obstore.get_async(store, path)
    return await result.bytes_async()


def _verify_and_copy(body: obstore.Bytes, buf: memoryview, namespace_digest: bytes, key: str) -> None:
    view = memoryview(body)
    payload = view[HEADER_SIZE:]
    verify_page(view[:HEADER_SIZE], payload, namespace_digest, key)
    dst = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
    dst[:] = payload


def _encode_body(buf: memoryview, namespace_digest: bytes, key: str) -> bytes:
    payload = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
    return b"".join((encode_header(payload, namespace_digest, key), payload))


_NON_RETRYABLE: Final = (InvalidPathError, NotSupportedError, UnknownConfigurationKeyError, ValueError)
_AUTH_ERRORS: Final = (PermissionDeniedError, UnauthenticatedError)
_STATUS_RE: Final = re.compile(r"status code: (\d{3})")


def _classify(exc: BaseException) -> Failure:
    """What an obstore failure means (`storage_backends.net_calls.Failure`): by type, else by HTTP status
    (5xx, 408, 429, connection errors: transient)."""
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, _AUTH_ERRORS):
        return "auth"
    if isinstance(exc, _NON_RETRYABLE):
        return "fatal"
    status = http_status(exc)
    if status in {401, 403}:
        return "auth"
    if status is not None and 400 <= status < 500 and status not in {408, 429}:
        return "fatal"
    return "transient"


def http_status(exc: BaseException) -> int | None:
    """The HTTP status a native error reports, if any (object_store has no typed field for it)."""
    match = _STATUS_RE.search(str(exc))
    return int(match.group(1)) if match else None


_EXIT_GRACE_S: Final = 0.02
"""How long the interpreter releases the GIL at exit so obstore's threads can leave Python first."""


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
