"""A Valkey (or Redis) backend, cluster or single node: one string value per page, `valkey://host:port,.../prefix`.

Layout: page `key` is the value of `<prefix>/<key>` (just `<key>` without a prefix); the value is the page
header followed by the payload (`storage_backends.page_format`), so a page the server evicted (`maxmemory`
with `allkeys-lru`), expired (`ttl_s`) or lost with a node is a miss, and a page another writer put under the
key is refused as `FOREIGN`. A single `SET` per page makes every page atomic.

Cluster batches are split per node, never per hash tag: every command names one key, and the client's
non-transactional pipeline sends each node the commands of the slots it owns in one round trip, so no call
can fail with `CROSSSLOT` and a chain's pages spread over every shard. A batch is cut into pipelines of at
most `batch_bytes` (`storage_backends.batching.group_slices`), at most `max_concurrency` in flight.

The client is redis-py's asyncio client (`redis.asyncio.RedisCluster` or `Redis`), chosen by measurement:
on loopback, 128 x 1 MiB pages, three nodes, its pipelined GETs matched valkey-glide's asyncio `MGET`
(0.34 against 0.35 GB/s on the 2-core CI machine) without a second runtime's threads; see BENCHMARKS.md.
It connects on the first call, and finds out there whether the first reachable node runs in cluster mode
(unless `cluster=` says).

Reads copy each value once, from the client's bytes into the caller's buffer, after its header and
checksum verify (for batches of 64 KiB or more in one of the backend's at most `max_concurrency` worker
threads, `storage_backends.threads.WorkerThreads`, waited for unless cancelled).
Every round trip runs under the same deadlines and bounded retries as the S3 backend's requests
(`storage_backends.net_calls`); a call in which no page could be read or written because the servers were
unreachable raises `StorageUnavailable` (the controller's circuit breaker counts it), one in which some pages
succeeded returns per-page results. A password, from the URL's user info or the `password` option, never
appears in `repr`, logs or messages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final
from urllib.parse import parse_qsl, unquote, urlsplit

from storage_backends.batching import (
    BackendStatistics,
    StatisticsRecorder,
    buffer_sizes,
    check_batch,
    check_keys,
    gather_bounded,
    group_slices,
)
from storage_backends.cancellation import uncancellable
from storage_backends.errors import ChecksumMismatch, StorageError, StorageUnavailable
from storage_backends.lifecycle import BackendLifecycle
from storage_backends.names import prefix_from_url_path, validate_prefix
from storage_backends.net_calls import Failure, RoundTrips
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
from storage_backends.redact import REDACTED, remember_secrets
from storage_backends.s3_options import check_limits
from storage_backends.threads import WorkerThreads

__all__ = ["ValkeyBackend", "ValkeyStatistics", "parse_valkey_url"]

logger = logging.getLogger(__name__)

_THREAD_THRESHOLD: Final = 64 * 1024
"""Pipelines carrying at least this many payload bytes verify and copy in a worker thread."""

_EXISTS_WINDOW: Final = 256
"""Keys per `EXISTS` pipeline while `exists` scans for the first missing page."""

_INT_OPTIONS: Final = frozenset({"max_concurrency", "max_retries", "batch_bytes", "db"})
_FLOAT_OPTIONS: Final = frozenset(
    {
        "deadline_s",
        "read_deadline_s",
        "write_deadline_s",
        "attempt_timeout_s",
        "connect_timeout_s",
        "backoff_initial_s",
        "backoff_max_s",
        "ttl_s",
    }
)
_BOOL_OPTIONS: Final = frozenset({"cluster"})
_STR_OPTIONS: Final = frozenset({"username", "password"})


@dataclass(frozen=True, slots=True)
class ValkeyStatistics(BackendStatistics):
    """A snapshot of a `ValkeyBackend`'s counters since it was opened.

    Adds to `BackendStatistics`:

    Attributes:
        requests: pipeline round trips attempted, retries included.
        retries: round trips retried after a transient failure.
    """

    requests: int = 0
    retries: int = 0


def parse_valkey_url(url: str) -> tuple[list[tuple[str, int]], str, dict[str, Any]]:
    """The nodes, prefix and options of `valkey://[user:password@]host:port[,host:port...]/prefix?...`.

    Raises:
        ValueError: for another scheme, no node, a node without a valid port, a bad prefix, or an unknown,
            repeated or unparsable query parameter (never echoing the password).
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != "valkey":
        raise ValueError("url: expected valkey://host:port[,host:port...]/prefix")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    options: dict[str, Any] = {}
    if userinfo:
        user, has_password, password = userinfo.partition(":")
        if user:
            options["username"] = unquote(user)
        if has_password:
            options["password"] = unquote(password)
            remember_secrets([options["password"]])
    nodes: list[tuple[str, int]] = []
    for i, item in enumerate(hosts.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"url: node {i} must be host:port, got {item!r}")
        nodes.append((host.strip("[]"), int(port)))
    prefix = prefix_from_url_path(parts.path)
    seen: set[str] = set()
    for name, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if name in seen:
            raise ValueError(f"url: query parameter {name!r} is repeated")
        seen.add(name)
        options[name] = _parse_option(name, value)
    return nodes, prefix, options


def _parse_option(name: str, value: str) -> Any:
    shown = REDACTED if name in _STR_OPTIONS else repr(value)
    try:
        if name in _INT_OPTIONS:
            return int(value)
        if name in _FLOAT_OPTIONS:
            return float(value)
        if name in _BOOL_OPTIONS:
            if value.lower() in {"1", "true", "yes"}:
                return True
            if value.lower() in {"0", "false", "no"}:
                return False
            raise ValueError(value)
    except ValueError:
        raise ValueError(f"{name}: cannot parse {shown} from the URL query") from None
    if name in _STR_OPTIONS:
        if name == "password":
            remember_secrets([value])
        return value
    known = sorted(_INT_OPTIONS | _FLOAT_OPTIONS | _BOOL_OPTIONS | _STR_OPTIONS)
    raise ValueError(f"url: unknown query parameter {name!r}; known: {known}")


def _classify(exc: BaseException) -> Failure:
    from redis.exceptions import AuthenticationError, AuthorizationError, ConnectionError, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeout

    if isinstance(exc, ValueError | TypeError):
        return "misuse"
    if isinstance(exc, AuthenticationError | AuthorizationError):
        return "auth"
    if isinstance(exc, ResponseError) and str(exc).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
        return "auth"
    if isinstance(exc, ConnectionError | RedisTimeout | OSError | ResponseError):
        # A ResponseError here is a cluster in transition (CLUSTERDOWN, TRYAGAIN, MOVED loops): retry.
        return "transient"
    return "transient" if type(exc).__module__.startswith("redis") else "fatal"


class ValkeyBackend(BackendLifecycle):
    """Pages as string values in Valkey or Redis; implements `storage_backends.protocol.StorageBackend`.

    Open it with `ValkeyBackend.from_url("valkey://h1:7000,h2:7001/prefix", namespace_digest=...)` or the
    constructor; use it as an async context manager or call `aclose()`.

    Args:
        nodes: `(host, port)` of one or more nodes (cluster seeds, or the one server).
        prefix: the key prefix ("" for none): `/`-separated segments as for S3; `{` and `}` are refused
            (a hash tag would put every page on one shard).
        namespace_digest: the 16-byte namespace digest written into and checked in every page header.
        username: the ACL user (default: the server's default user).
        password: the password (`AUTH`); never shown.
        cluster: True for a cluster, False for one server, None to ask the first reachable node.
        db: the database number (single node only).
        ttl_s: expire every page this many seconds after it is written (None: never).
        max_concurrency: the most pipelines in flight at once, across all calls, and the most worker
            threads verifying or encoding pages at once.
        batch_bytes: the most payload bytes one pipeline carries.
        deadline_s: the total time one round trip may take, the wait for a connection, retries and backoff
            included.
        read_deadline_s: `deadline_s` for reads; a `HiCache` passes its `storage_read_timeout_s`.
        write_deadline_s: `deadline_s` for writes and deletes; a `HiCache` passes `storage_write_timeout_s`.
        attempt_timeout_s: the most one attempt may take.
        connect_timeout_s: the most connecting to one node may take.
        max_retries: the most retries of one round trip after transient failures.
        backoff_initial_s: the first backoff delay; doubles per retry.
        backoff_max_s: the cap of the backoff delay.

    Raises:
        ValueError: naming the argument, for no nodes, a bad prefix or a non-positive setting.
        TypeError: naming the argument, for a prefix that is not a str.
    """

    def __init__(
        self,
        nodes: Sequence[tuple[str, int]],
        prefix: str = "",
        *,
        namespace_digest: bytes,
        username: str | None = None,
        password: str | None = None,
        cluster: bool | None = None,
        db: int = 0,
        ttl_s: float | None = None,
        max_concurrency: int = 8,
        batch_bytes: int = 16 << 20,
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
        if not nodes or not all(
            isinstance(h, str) and h and isinstance(p, int) and 0 < p < 65536 for h, p in nodes
        ):
            raise ValueError(f"nodes: expected one or more (host, port) pairs, got {list(nodes)!r}")
        prefix = validate_prefix(prefix)
        if "{" in prefix or "}" in prefix:
            raise ValueError(
                f"prefix: braces would make a hash tag (every page on one shard), got {prefix!r}"
            )
        if password is not None:
            remember_secrets([password])
        read_deadline_s = deadline_s if read_deadline_s is None else read_deadline_s
        write_deadline_s = deadline_s if write_deadline_s is None else write_deadline_s
        seconds = {
            "deadline_s": deadline_s,
            "read_deadline_s": read_deadline_s,
            "write_deadline_s": write_deadline_s,
            "attempt_timeout_s": attempt_timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "backoff_initial_s": backoff_initial_s,
            "backoff_max_s": backoff_max_s,
        }
        if ttl_s is not None:
            seconds["ttl_s"] = ttl_s
        check_limits(max_concurrency, max_retries, seconds)
        if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 1:
            raise ValueError(f"batch_bytes: expected an int >= 1, got {batch_bytes!r}")
        if isinstance(db, bool) or not isinstance(db, int) or db < 0:
            raise ValueError(f"db: expected an int >= 0, got {db!r}")
        self._namespace_digest = check_namespace_digest(namespace_digest)
        self._nodes = [(h, int(p)) for h, p in nodes]
        self._prefix = prefix
        self._username = username
        self._password = password
        self._cluster = cluster
        self._db = db
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._max_concurrency = max_concurrency
        self._batch_bytes = batch_bytes
        self._connect_timeout_s = float(connect_timeout_s)
        self._attempt_timeout_s = min(
            float(attempt_timeout_s), max(float(read_deadline_s), float(write_deadline_s))
        )
        self._calls = RoundTrips(
            name="valkey",
            read_deadline_s=float(read_deadline_s),
            write_deadline_s=float(write_deadline_s),
            attempt_timeout_s=self._attempt_timeout_s,
            max_retries=max_retries,
            backoff_initial_s=float(backoff_initial_s),
            backoff_max_s=float(backoff_max_s),
            secrets=(password,) if password else (),
            classify=_classify,
            max_concurrency=max_concurrency,
        )
        self._client: Any = None
        self._closing: Any = None
        """The client `_release` took from `_client`, for `aclose` to close."""
        self._connecting = asyncio.Lock()
        self._workers = WorkerThreads(max_concurrency, name="hicache-valkey")
        self._stats = StatisticsRecorder()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, namespace_digest: bytes, **options: Any) -> ValkeyBackend:
        """Open a backend for `valkey://[user:password@]host:port[,host:port...]/prefix?option=value...`.

        Query parameters and keyword `options` take the constructor's keyword names; keyword options win.

        Raises:
            ValueError: for a malformed URL (see `parse_valkey_url`) or what the constructor refuses.
        """
        nodes, prefix, merged = parse_valkey_url(url)
        merged.update(options)
        return cls(nodes, prefix, namespace_digest=namespace_digest, **merged)

    # ------------------------------------------------------------------ lifecycle and observability

    def _release(self) -> None:
        """Hand the client to `aclose`, which closes its connections (once no call is in flight); close the
        worker threads."""
        self._closing, self._client = self._client, None
        self._workers.close()

    async def aclose(self) -> None:
        """Refuse new calls, wait for calls in flight, close the client's connections; idempotent."""
        await super().aclose()
        client, self._closing = self._closing, None
        if client is not None:
            await uncancellable(client.aclose())

    def __repr__(self) -> str:
        hosts = ",".join(f"{h}:{p}" for h, p in self._nodes)
        auth = f"{self._username or ''}:{REDACTED}@" if self._password else ""
        return (
            f"ValkeyBackend(url='valkey://{auth}{hosts}/{self._prefix}', cluster={self._cluster}, "
            f"max_concurrency={self._max_concurrency}, closed={self._closed})"
        )

    def statistics(self) -> ValkeyStatistics:
        """A frozen snapshot of the counters since the backend was opened."""
        return ValkeyStatistics(
            **self._stats.counters(), requests=self._calls.requests, retries=self._calls.retries
        )

    def server_key(self, key: str) -> bytes:
        """The Valkey key page `key` is stored under (`<prefix>/<key>`)."""
        return f"{self._prefix}/{key}".encode() if self._prefix else key.encode()

    # ------------------------------------------------------------------ the protocol

    async def exists(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` whose pages are all stored.

        Raises:
            StorageUnavailable, StorageAuthError: the servers are unreachable or refused us (never a miss).
        """
        self._check_open()
        check_keys(keys)
        validate_keys(keys)
        client = await self._connected()
        found = 0
        for start in range(0, len(keys), _EXISTS_WINDOW):
            window = keys[start : start + _EXISTS_WINDOW]
            replies = await self._round_trip(client, [("EXISTS", k) for k in window], write=False)
            for reply in replies:
                if isinstance(reply, BaseException):
                    self._stats.errors += 1
                    raise StorageUnavailable(f"valkey EXISTS failed: {self._calls.redact(reply)}")
                if not reply:
                    return found
                found += 1
        return found

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Read pages into caller buffers; one `PageStatus` per page, `HIT` only for a verified page.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: for mismatched lengths, a bad key, a read-only or non-contiguous buffer, or a
                buffer whose size differs from the stored page's (named `buffers[i]`).
            StorageUnavailable, StorageAuthError: no page was read because the servers were unreachable or
                refused us.
        """
        self._check_open()
        check_batch(keys, buffers)
        validate_keys(keys)
        for i, buf in enumerate(buffers):
            if buf.readonly:
                raise ValueError(f"buffers[{i}]: expected a writable memoryview")
        client = await self._connected()
        failures: list[StorageError] = []
        groups = self._groups(buffers)
        outcomes = await gather_bounded(
            [partial(self._get_group, client, keys[g], buffers[g], failures) for g in groups],
            self._max_concurrency,
        )
        statuses = [s for group in outcomes for s in group]
        if failures and not any(statuses):
            raise failures[0]
        return self._stats.record_reads(statuses, buffers)

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Store pages from caller buffers, one atomic `SET` each; one flag per page.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: for mismatched lengths, a bad key or a non-contiguous buffer.
            StorageUnavailable, StorageAuthError: no page was written because the servers were
                unreachable or refused us.
        """
        self._check_open()
        check_batch(keys, buffers)
        validate_keys(keys)
        client = await self._connected()
        failures: list[StorageError] = []
        groups = self._groups(buffers)
        outcomes = await gather_bounded(
            [partial(self._put_group, client, keys[g], buffers[g], failures) for g in groups],
            self._max_concurrency,
        )
        statuses = [s for group in outcomes for s in group]
        if failures and not any(statuses):
            raise failures[0]
        return self._stats.record_writes(statuses, buffers)

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove pages; absent keys are ignored.

        Raises:
            CacheClosed: after `aclose()`.
            StorageUnavailable: some deletes failed after retries.
        """
        self._check_open()
        check_keys(keys)
        validate_keys(keys)
        client = await self._connected()
        for start in range(0, len(keys), _EXISTS_WINDOW):
            window = keys[start : start + _EXISTS_WINDOW]
            replies = await self._round_trip(client, [("UNLINK", k) for k in window], write=True)
            failed = [r for r in replies if isinstance(r, BaseException)]
            if failed:
                self._stats.errors += len(failed)
                raise StorageUnavailable(
                    f"valkey: {len(failed)} deletes failed; first: {self._calls.redact(failed[0])}"
                )

    # ------------------------------------------------------------------ per-pipeline primitives

    def _groups(self, buffers: Sequence[memoryview]) -> list[slice]:
        return group_slices(buffer_sizes(buffers), limit=self._max_concurrency, group_bytes=self._batch_bytes)

    async def _get_group(
        self,
        client: Any,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        failures: list[StorageError],
    ) -> list[PageStatus]:
        try:
            values = await self._round_trip(client, [("GET", k) for k in keys], write=False)
        except StorageError as exc:
            failures.append(exc)
            return [PageStatus.ERROR] * len(keys)
        verify = partial(self._verify_into, keys, buffers, values)
        if sum(buffer_sizes(buffers)) >= _THREAD_THRESHOLD:
            # A cancelled caller does not wait; the thread stays registered with its buffers until it returns.
            return await self._workers.call(verify, touches=buffers)
        return verify()

    def _verify_into(
        self, keys: Sequence[str], buffers: Sequence[memoryview], values: Sequence[Any]
    ) -> list[PageStatus]:
        out: list[PageStatus] = []
        for key, buf, value in zip(keys, buffers, values, strict=True):
            if value is None:
                out.append(PageStatus.MISS)
                continue
            if isinstance(value, BaseException):
                logger.warning("valkey GET of page %s failed: %s", key, self._calls.redact(value))
                out.append(PageStatus.ERROR)
                continue
            view = memoryview(value)
            try:
                if view.nbytes != HEADER_SIZE + buf.nbytes:
                    check_stored_size(
                        view[:HEADER_SIZE], view.nbytes, buf.nbytes, self._namespace_digest, key
                    )
                verify_page(view[:HEADER_SIZE], view[HEADER_SIZE:], self._namespace_digest, key)
            except ChecksumMismatch as exc:
                logger.warning("valkey page %s failed verification (%s): treated as a miss", key, exc)
                out.append(failure_status(exc))
                continue
            dst = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
            dst[:] = view[HEADER_SIZE:]
            out.append(PageStatus.HIT)
        return out

    async def _put_group(
        self, client: Any, keys: Sequence[str], buffers: Sequence[memoryview], failures: list[StorageError]
    ) -> list[PageStatus]:
        encode = partial(_encode_values, buffers, self._namespace_digest, keys)
        if sum(buffer_sizes(buffers)) >= _THREAD_THRESHOLD:
            values = await self._workers.call(encode, touches=buffers)
        else:
            values = encode()
        px = () if self._ttl_ms is None else ("PX", str(self._ttl_ms))
        try:
            replies = await self._round_trip(
                client, [("SET", k, v, *px) for k, v in zip(keys, values, strict=True)], write=True
            )
        except StorageError as exc:
            failures.append(exc)
            return [PageStatus.ERROR] * len(keys)
        return [
            PageStatus.ERROR if isinstance(r, BaseException) or not r else PageStatus.HIT for r in replies
        ]

    async def _round_trip(self, client: Any, commands: list[tuple[Any, ...]], *, write: bool) -> list[Any]:
        """One non-transactional pipeline (split per node by the cluster client), under the deadline."""

        async def attempt() -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name, key, *args in commands:
                pipe.execute_command(name, self.server_key(key), *args)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
            transient = [r for r in replies if isinstance(r, BaseException) and _classify(r) != "fatal"]
            if transient and len(transient) == len(replies):
                raise transient[0]  # the whole round trip failed: retry it
            return replies

        what = f"{'write' if write else 'read'} of {len(commands)} keys"
        return await self._calls.call(attempt, write=write, what=what)

    async def _connected(self) -> Any:
        if self._client is not None:
            return self._client
        async with self._connecting:
            if self._client is None:
                self._client = await self._calls.call(self._connect, write=False, what="connect")
            return self._client

    async def _connect(self) -> Any:
        from redis.asyncio import Redis
        from redis.asyncio.cluster import ClusterNode, RedisCluster
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        common: dict[str, Any] = {
            "username": self._username,
            "password": self._password,
            "socket_timeout": self._attempt_timeout_s,
            "socket_connect_timeout": self._connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),  # retries happen in `RoundTrips`, counted and under one deadline
        }
        cluster = self._cluster
        if cluster is None:
            cluster = await self._probe_cluster_mode(Redis, common)
        if cluster:
            client: Any = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self._nodes],
                max_connections=max(4, 2 * self._max_concurrency),
                **common,
            )
            try:
                await client.initialize()
            except BaseException:
                await uncancellable(client.aclose())
                raise
        else:
            host, port = self._nodes[0]
            client = Redis(host=host, port=port, db=self._db, **common)
            try:
                await client.ping()
            except BaseException:
                await uncancellable(client.aclose())
                raise
        self._cluster = bool(cluster)
        return client

    async def _probe_cluster_mode(self, redis_cls: Any, common: dict[str, Any]) -> bool:
        last: BaseException | None = None
        for host, port in self._nodes:
            probe = redis_cls(host=host, port=port, **common)
            try:
                info = await probe.info("cluster")
                return bool(info.get("cluster_enabled"))
            except Exception as exc:
                if _classify(exc) == "auth":
                    raise
                last = exc
            finally:
                await uncancellable(probe.aclose())
        assert last is not None
        raise last


def _encode_values(
    buffers: Sequence[memoryview], namespace_digest: bytes, keys: Sequence[str]
) -> list[bytes]:
    values = []
    for key, buf in zip(keys, buffers, strict=True):
        payload = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
        values.append(b"".join((encode_header(payload, namespace_digest, key), payload)))
    return values
