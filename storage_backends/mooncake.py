"""A Mooncake Store backend: pages in a Mooncake cluster's pooled memory, `mooncake://master:port/prefix?metadata=...`.

Mooncake Store is a master (object metadata, leases, eviction at a watermark) plus clients that each
contribute memory segments; objects live in those segments and move by its transfer engine (TCP here, RDMA
where the hardware has it). This backend is one such client: it mounts `segment_bytes` of its own memory
into the pool and reads and writes pages with the zero-copy batch calls.

Layout: page `key` is the object `<prefix>/<key>` (just `<key>` without a prefix), the page header followed
by the payload (`storage_backends.page_format`). Both parts move without a copy: `get` scatters each object
into a small header slab and straight into the caller's buffer (`batch_get_into_multi_buffers`), `put`
gathers them from there (`batch_put_from_multi_buffers`); the checksum is then verified in place. With
`protocol=rdma` every buffer's whole exporting object (the host pool's one flat buffer) is registered with
the transfer engine once, on first use, so RDMA can reach it (TCP reads and writes any address). An object the master evicted, or lost with the client whose
segment held it, is a miss; a page of another writer is refused as `FOREIGN`.

A put replaces the object stored under its key: Mooncake's own put keeps the first writer's, so the old
object is removed first, in the same worker-thread call (a reader in between sees a miss).

The client library's calls block, so they run in the backend's worker threads (at most `max_concurrency`
at once, `storage_backends.threads.WorkerThreads`) under the same read and write deadlines as the other
network backends (`storage_backends.net_calls`). A timed-out read or write is not retried: its thread may
still write into (or read from) the caller's buffers, so it is abandoned and registered in
`storage_backends.threads.stray_threads` with them, which keeps those buffers out of use until it returns. A call in which no page could be read or written because the store was unreachable
raises `StorageUnavailable`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final
from urllib.parse import parse_qsl, urlsplit

import numpy as np

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
from storage_backends.redact import redact_url
from storage_backends.s3_options import check_limits
from storage_backends.threads import WorkerThreads

__all__ = ["MooncakeBackend", "MooncakeStatistics", "parse_mooncake_url"]

logger = logging.getLogger(__name__)

OBJECT_NOT_FOUND: Final = -704
"""Mooncake's error code for a key with no object."""
NO_SPACE: Final = -200
"""Mooncake's code for a put the pool has no room for (until it evicts): a failed page, not an outage."""
LEASE_EXPIRED: Final = -707
"""Mooncake's code for a read that outlived the object's lease: the master may have evicted it meanwhile."""
_ABSENT: Final = frozenset({OBJECT_NOT_FOUND, -703, LEASE_EXPIRED})
"""Codes of a read that found no readable object: none, one still being written (REPLICA_IS_NOT_READY), or
one whose lease ran out during the read (its bytes may be another object's: a miss, never an outage)."""
_SIZE_MISMATCH: Final = frozenset({-600, -800})
"""Codes a read gets for an object larger (BUFFER_OVERFLOW) or smaller (TRANSFER_FAIL) than its buffers."""

_INT_OPTIONS: Final = frozenset(
    {"max_concurrency", "max_retries", "batch_bytes", "segment_bytes", "buffer_bytes"}
)
_FLOAT_OPTIONS: Final = frozenset(
    {
        "deadline_s",
        "read_deadline_s",
        "write_deadline_s",
        "attempt_timeout_s",
        "backoff_initial_s",
        "backoff_max_s",
    }
)
_STR_OPTIONS: Final = frozenset({"metadata", "protocol", "local_hostname", "device"})


class _Unreachable(Exception):
    """Every page of a round trip failed with a transport or master error code (retry or give up)."""


@dataclass(frozen=True, slots=True)
class MooncakeStatistics(BackendStatistics):
    """A snapshot of a `MooncakeBackend`'s counters since it was opened.

    Adds to `BackendStatistics`:

    Attributes:
        requests: batch calls attempted, retries included.
        retries: batch calls retried after a transient failure.
        registered_bytes: bytes of caller memory registered with the transfer engine.
    """

    requests: int = 0
    retries: int = 0
    registered_bytes: int = 0


def parse_mooncake_url(url: str) -> tuple[str, str, dict[str, Any]]:
    """The master address, prefix and options of `mooncake://host:port/prefix?metadata=...&...`.

    Raises:
        ValueError: for another scheme, a master without a port, a bad prefix, or an unknown, repeated or
            unparsable query parameter.
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != "mooncake":
        raise ValueError("url: expected mooncake://master-host:port/prefix?metadata=...")
    host, _, port = parts.netloc.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"url: the master must be host:port, got {parts.netloc!r}")
    options: dict[str, Any] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in options:
            raise ValueError(f"url: query parameter {name!r} is repeated")
        try:
            if name in _INT_OPTIONS:
                options[name] = int(value)
            elif name in _FLOAT_OPTIONS:
                options[name] = float(value)
            elif name in _STR_OPTIONS:
                options[name] = value
            else:
                known = sorted(_INT_OPTIONS | _FLOAT_OPTIONS | _STR_OPTIONS)
                raise ValueError(f"url: unknown query parameter {name!r}; known: {known}")
        except ValueError as exc:
            if "unknown query" in str(exc):
                raise
            raise ValueError(f"{name}: cannot parse {value!r} from the URL query") from None
    return f"{host}:{port}", prefix_from_url_path(parts.path), options


def _classify(exc: BaseException) -> Failure:
    if isinstance(exc, ValueError | TypeError):
        return "misuse"
    return "transient" if isinstance(exc, _Unreachable | RuntimeError | OSError) else "fatal"


def _address(buf: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


class MooncakeBackend(BackendLifecycle):
    """Pages as objects in Mooncake Store; implements `storage_backends.protocol.StorageBackend`.

    Open it with `MooncakeBackend.from_url("mooncake://master:50051/prefix?metadata=http://m:8080/metadata",
    namespace_digest=...)` or the constructor; use it as an async context manager or call `aclose()`.

    Args:
        master: the master's `host:port` (its RPC port).
        prefix: the object name prefix ("" for none), validated as for S3.
        namespace_digest: the 16-byte namespace digest written into and checked in every page header.
        metadata: the transfer engine's metadata server (`http://host:port/metadata` for the master's
            own HTTP metadata server, `etcd://...`, or `P2PHANDSHAKE`).
        protocol: the transfer protocol, `tcp` or `rdma`.
        local_hostname: this client's address as the other clients reach it.
        device: RDMA device names (`""` for TCP).
        segment_bytes: memory this client contributes to the pool (mounted on connect; 0: none, a pure
            client of memory that other clients, e.g. dedicated `mooncake_client` processes, contribute).
            Objects live in the segments of the clients that contribute them: a client's segment leaves
            the pool when it closes, and the pages in it become misses.
        buffer_bytes: the client's local transfer buffer.
        max_concurrency: the most batch calls in flight at once (worker threads).
        batch_bytes: the most payload bytes one batch call carries.
        deadline_s: the total time one batch call may take.
        read_deadline_s: `deadline_s` for reads; a `HiCache` passes its `storage_read_timeout_s`.
        write_deadline_s: `deadline_s` for writes; a `HiCache` passes its `storage_write_timeout_s`.
        attempt_timeout_s: the most one attempt may take.
        max_retries: the most retries of an `exists` or `delete` call (reads and writes are not retried
            after a timeout, see the module docstring).
        backoff_initial_s: the first backoff delay; doubles per retry.
        backoff_max_s: the cap of the backoff delay.

    Raises:
        ValueError: naming the argument, for no metadata server, a bad prefix, protocol or setting.
    """

    def __init__(
        self,
        master: str,
        prefix: str = "",
        *,
        namespace_digest: bytes,
        metadata: str | None = None,
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
        device: str = "",
        segment_bytes: int = 512 << 20,
        buffer_bytes: int = 64 << 20,
        max_concurrency: int = 4,
        batch_bytes: int = 32 << 20,
        deadline_s: float = 30.0,
        read_deadline_s: float | None = None,
        write_deadline_s: float | None = None,
        attempt_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
    ) -> None:
        self._closed = True  # until fully constructed: a failed __init__ must not warn in __del__
        if not isinstance(master, str) or ":" not in master:
            raise ValueError(f"master: expected host:port, got {master!r}")
        if not isinstance(metadata, str) or not metadata:
            raise ValueError(
                "metadata: expected the metadata server, e.g. ?metadata=http://master:8080/metadata"
            )
        if protocol not in {"tcp", "rdma"}:
            raise ValueError(f"protocol: expected 'tcp' or 'rdma', got {protocol!r}")
        for name, value, least in (
            ("segment_bytes", segment_bytes, 0),
            ("buffer_bytes", buffer_bytes, 1),
            ("batch_bytes", batch_bytes, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
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
                "backoff_initial_s": backoff_initial_s,
                "backoff_max_s": backoff_max_s,
            },
        )
        self._namespace_digest = check_namespace_digest(namespace_digest)
        self._master = master
        self._prefix = prefix
        self._metadata = metadata
        self._protocol = protocol
        self._local_hostname = local_hostname
        self._device = device
        self._segment_bytes = segment_bytes
        self._buffer_bytes = buffer_bytes
        self._max_concurrency = max_concurrency
        self._batch_bytes = batch_bytes
        self._calls = RoundTrips(
            name="mooncake",
            read_deadline_s=float(read_deadline_s),
            write_deadline_s=float(write_deadline_s),
            attempt_timeout_s=min(
                float(attempt_timeout_s), max(float(read_deadline_s), float(write_deadline_s))
            ),
            max_retries=max_retries,
            backoff_initial_s=float(backoff_initial_s),
            backoff_max_s=float(backoff_max_s),
            secrets=(),
            classify=_classify,
        )
        self._workers = WorkerThreads(max_concurrency, name="hicache-mooncake")
        self._store: Any = None
        self._holding = False
        """Whether `_release` left a reference to the shared client for `aclose` to drop."""
        self._shared: _SharedClient | None = None
        self._connecting = asyncio.Lock()
        self._registered: dict[int, int] = {}
        """Registered regions, start address -> bytes; touched under `_register_lock` in worker threads."""
        self._register_lock = threading.Lock()
        self._stats = StatisticsRecorder()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, namespace_digest: bytes, **options: Any) -> MooncakeBackend:
        """Open a backend for `mooncake://master-host:port/prefix?metadata=...&option=value...`.

        Query parameters and keyword `options` take the constructor's keyword names; keyword options win.

        Raises:
            ValueError: for a malformed URL (see `parse_mooncake_url`) or what the constructor refuses.
        """
        master, prefix, merged = parse_mooncake_url(url)
        merged.update(options)
        return cls(master, prefix, namespace_digest=namespace_digest, **merged)

    # ------------------------------------------------------------------ lifecycle and observability

    def _release(self) -> None:
        """Leave the shared client to `aclose` to hand back (once no call is in flight), in a worker thread:
        the threads close after that, or now if no client is held."""
        self._holding, self._store = self._store is not None, None
        if not self._holding:
            self._workers.close()

    async def aclose(self) -> None:
        """Refuse new calls, wait for calls in flight, hand the shared client back; idempotent.

        The process's client for this store closes (its segment leaves the pool) when its last backend
        closes; that takes the library about a second, spent in a worker thread.
        """
        await super().aclose()
        holding, self._holding = self._holding, False
        if holding:
            try:
                await uncancellable(self._workers.call(self.drop_client))
            finally:
                self._workers.close()

    def __repr__(self) -> str:
        return (
            f"MooncakeBackend(master={self._master!r}, prefix={self._prefix!r}, "
            f"metadata={redact_url(self._metadata)!r}, protocol={self._protocol!r}, closed={self._closed})"
        )

    def statistics(self) -> MooncakeStatistics:
        """A frozen snapshot of the counters since the backend was opened."""
        with self._register_lock:
            registered = sum(self._registered.values())
        return MooncakeStatistics(
            **self._stats.counters(),
            requests=self._calls.requests,
            retries=self._calls.retries,
            registered_bytes=registered,
        )

    def object_name(self, key: str) -> str:
        """The Mooncake object name page `key` is stored under (`<prefix>/<key>`)."""
        return f"{self._prefix}/{key}" if self._prefix else key

    # ------------------------------------------------------------------ the protocol

    async def exists(self, keys: Sequence[str]) -> int:
        """Length of the longest prefix of `keys` whose pages are all stored.

        Raises:
            StorageUnavailable: the master could not answer (never taken for a miss).
        """
        self._check_open()
        check_keys(keys)
        validate_keys(keys)
        if not keys:
            return 0
        store = await self._connected()
        names = [self.object_name(k) for k in keys]
        codes = await self._calls.call(
            partial(self._in_thread, _exists, store, names, touches=()),
            write=False,
            what=f"exists of {len(keys)} keys",
        )
        found = 0
        for code in codes:
            if code < 0:
                self._stats.errors += 1
                raise StorageUnavailable(f"mooncake: exists failed with code {code}")
            if code == 0:
                break
            found += 1
        return found

    async def get(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Read pages straight into caller buffers; one `PageStatus` per page, `HIT` only when verified.

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: for mismatched lengths, a bad key, a read-only or non-contiguous buffer, or a
                buffer whose size differs from the stored page's (named `buffers[i]`).
            StorageUnavailable: no page was read because the store was unreachable or timed out.
        """
        self._check_open()
        check_batch(keys, buffers)
        validate_keys(keys)
        for i, buf in enumerate(buffers):
            if buf.readonly:
                raise ValueError(f"buffers[{i}]: expected a writable memoryview")
        if not keys:
            return []
        store = await self._connected()
        failures: list[StorageError] = []
        outcomes = await gather_bounded(
            [
                partial(self._get_group, store, g.start, keys[g], buffers[g], failures)
                for g in self._groups(buffers)
            ],
            self._max_concurrency,
        )
        statuses = [s for group in outcomes for s in group]
        if failures and not any(statuses):
            raise failures[0]
        return self._stats.record_reads(statuses, buffers)

    async def put(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[bool]:
        """Store pages straight from caller buffers; one flag per page (True also when already stored).

        Raises:
            CacheClosed: after `aclose()`.
            ValueError: for mismatched lengths, a bad key or a non-contiguous buffer.
            StorageUnavailable: no page was written because the store was unreachable or timed out.
        """
        self._check_open()
        check_batch(keys, buffers)
        validate_keys(keys)
        if not keys:
            return []
        store = await self._connected()
        failures: list[StorageError] = []
        outcomes = await gather_bounded(
            [partial(self._put_group, store, keys[g], buffers[g], failures) for g in self._groups(buffers)],
            self._max_concurrency,
        )
        statuses = [s for group in outcomes for s in group]
        if failures and not any(statuses):
            raise failures[0]
        return self._stats.record_writes(statuses, buffers)

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove pages (even while leased to a reader); absent keys are ignored.

        Raises:
            CacheClosed: after `aclose()`.
            StorageUnavailable: some deletes failed.
        """
        self._check_open()
        check_keys(keys)
        validate_keys(keys)
        if not keys:
            return
        store = await self._connected()
        names = [self.object_name(k) for k in keys]
        codes = await self._calls.call(
            partial(self._in_thread, _remove, store, names, touches=()),
            write=True,
            what=f"delete of {len(keys)} keys",
        )
        failed = [c for c in codes if c < 0 and c != OBJECT_NOT_FOUND]
        if failed:
            self._stats.errors += len(failed)
            raise StorageUnavailable(
                f"mooncake: {len(failed)} of {len(keys)} deletes failed; first code {failed[0]}"
            )

    # ------------------------------------------------------------------ batch primitives

    def _groups(self, buffers: Sequence[memoryview]) -> list[slice]:
        return group_slices(buffer_sizes(buffers), limit=self._max_concurrency, group_bytes=self._batch_bytes)

    async def _in_thread(self, func: Any, *args: Any, touches: Sequence[memoryview]) -> Any:
        return await self._workers.call(self._holding_client, func, *args, touches=touches)

    def _holding_client(self, func: Any, *args: Any) -> Any:
        """`func(*args)` in a worker thread, counted in the shared client meanwhile, so that a thread
        abandoned inside the library (a stuck master) is never left using a closed client."""
        shared = self._shared
        if shared is None or not shared.enter():
            raise _Unreachable("the Mooncake client was closed")
        try:
            return func(*args)
        finally:
            shared.leave()

    async def _get_group(
        self,
        store: Any,
        first: int,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        failures: list[StorageError],
    ) -> list[PageStatus]:
        read = partial(self._read_into, store, first, keys, buffers)
        try:
            return await self._calls.call(
                partial(self._in_thread, read, touches=buffers),
                write=False,
                what=f"read of {len(keys)} pages",
                retry=False,
            )
        except StorageError as exc:
            failures.append(exc)
            return [PageStatus.ERROR] * len(keys)

    async def _put_group(
        self, store: Any, keys: Sequence[str], buffers: Sequence[memoryview], failures: list[StorageError]
    ) -> list[PageStatus]:
        write = partial(self._write_from, store, keys, buffers)
        try:
            return await self._calls.call(
                partial(self._in_thread, write, touches=buffers),
                write=True,
                what=f"write of {len(keys)} pages",
                retry=False,
            )
        except StorageError as exc:
            failures.append(exc)
            return [PageStatus.ERROR] * len(keys)

    # ------------------------------------------------------------------ worker-thread bodies

    def _read_into(
        self, store: Any, first: int, keys: Sequence[str], buffers: Sequence[memoryview]
    ) -> list[PageStatus]:
        """Scatter each object into its header slot and its caller buffer, then verify in place."""
        n = len(keys)
        slab = bytearray(n * HEADER_SIZE)
        headers = memoryview(slab)
        base = _address(headers)
        self._register(store, buffers)
        names = [self.object_name(k) for k in keys]
        ptrs = [[base + i * HEADER_SIZE, _address(buf)] for i, buf in enumerate(buffers)]
        sizes = [[HEADER_SIZE, buf.nbytes] for buf in buffers]
        codes = store.batch_get_into_multi_buffers(names, ptrs, sizes)
        out: list[PageStatus] = []
        for i, (key, name, buf, code) in enumerate(zip(keys, names, buffers, codes, strict=True)):
            header = headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE]
            payload = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
            try:
                if code in _ABSENT:
                    out.append(PageStatus.MISS)
                    continue
                if (code >= 0 and code != HEADER_SIZE + buf.nbytes) or code in _SIZE_MISMATCH:
                    status = self._classify_odd_size(store, name, key, buf.nbytes, code)
                    out.append(status)
                    continue
                if code < 0:
                    logger.warning("mooncake read of %s failed with code %d", name, code)
                    out.append(PageStatus.ERROR)
                    continue
                verify_page(header, payload, self._namespace_digest, key)
            except ChecksumMismatch as exc:
                logger.warning("mooncake page %s failed verification (%s): treated as a miss", name, exc)
                out.append(failure_status(exc))
                continue
            out.append(PageStatus.HIT)
        if all(status is PageStatus.ERROR for status in out):
            raise _Unreachable(f"every read failed, first code {codes[0]}")
        return out

    def _classify_odd_size(self, store: Any, name: str, key: str, nbytes: int, code: int) -> PageStatus:
        """A read that did not fill header and payload exactly: fetch the object whole to say why.

        Raises:
            ChecksumMismatch: the object is truncated, overlong, foreign, of an old format, or a whole page
                of another length (a page of this namespace and key is never the caller's fault).
        """
        size = store.get_size(name)
        if size in _ABSENT:
            return PageStatus.MISS  # evicted or removed between the two calls
        if size < 0 or size == HEADER_SIZE + nbytes:
            logger.warning("mooncake read of %s failed with code %d", name, code)
            return PageStatus.ERROR  # a transfer failure, not the page's size
        body = store.get(name)
        if len(body) != size:
            return PageStatus.ERROR
        view = memoryview(body)
        check_stored_size(view[:HEADER_SIZE], view.nbytes, nbytes, self._namespace_digest, key)
        raise AssertionError("check_stored_size raises for a stored size that differs from the buffer's")

    def _write_from(self, store: Any, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[PageStatus]:
        """Hash each payload into its header slot, then gather header and payload into one object each."""
        slab = bytearray(len(keys) * HEADER_SIZE)
        headers = memoryview(slab)
        base = _address(headers)
        self._register(store, buffers)
        for i, (key, buf) in enumerate(zip(keys, buffers, strict=True)):
            payload = buf if buf.format == "B" and buf.ndim == 1 else buf.cast("B")
            headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] = encode_header(
                payload, self._namespace_digest, key
            )
        names = [self.object_name(k) for k in keys]
        ptrs = [[base + i * HEADER_SIZE, _address(buf)] for i, buf in enumerate(buffers)]
        sizes = [[HEADER_SIZE, buf.nbytes] for buf in buffers]
        # Mooncake's put keeps an object already stored under the name (first writer wins); the protocol's
        # put replaces it, so the old one goes first (a reader in between sees a miss, never a mix).
        store.batch_remove(names, force=True)
        codes = store.batch_put_from_multi_buffers(names, ptrs, sizes)
        if all(c < 0 and c != NO_SPACE for c in codes):
            raise _Unreachable(f"every write failed, first code {codes[0]}")
        return [PageStatus.HIT if c == 0 else PageStatus.ERROR for c in codes]

    def _register(self, store: Any, buffers: Sequence[memoryview]) -> None:
        """Register the whole exporting object of each buffer with the transfer engine, once."""
        if self._protocol == "tcp":
            return  # the TCP transport reads and writes any address; registration buys nothing
        for buf in buffers:
            owner = buf.obj
            try:
                whole = memoryview(owner)
            except TypeError:
                whole = buf
            start = _address(whole)
            with self._register_lock:
                if self._registered.get(start, 0) >= whole.nbytes:
                    continue
                if store.register_buffer(start, whole.nbytes) != 0:
                    raise _Unreachable(f"registering {whole.nbytes} bytes at {start:#x} failed")
                self._registered[start] = whole.nbytes

    async def _connected(self) -> Any:
        if self._store is not None:
            return self._store
        async with self._connecting:
            if self._store is None:
                self._store = await self._calls.call(
                    partial(self._workers.call, self.acquire_client),
                    write=False,
                    what="connect",
                    retry=False,
                )
            return self._store

    def _client_key(self) -> tuple[object, ...]:
        return (
            self._master,
            self._metadata,
            self._protocol,
            self._local_hostname,
            self._device,
            self._segment_bytes,
            self._buffer_bytes,
        )

    def acquire_client(self) -> Any:
        """The process's Mooncake client for this store, set up on first use (blocking: a worker thread).

        Backends of one process with the same master and settings share one client (Mooncake's model:
        one client, one segment per process); each `acquire_client` is matched by one `drop_client`.

        Raises:
            RuntimeError: the client could not be set up against the master.
        """
        key = self._client_key()
        with _clients_lock:
            shared = _clients.get(key)
            if shared is None:
                from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]

                store = MooncakeDistributedStore()
                code = store.setup(
                    self._local_hostname,
                    self._metadata,
                    self._segment_bytes,
                    self._buffer_bytes,
                    self._protocol,
                    self._device,
                    self._master,
                )
                if code != 0:
                    raise _Unreachable(f"setup against master {self._master} failed with code {code}")
                shared = _clients[key] = _SharedClient(key, store)
            shared.backends += 1
        self._shared = shared
        return shared.store

    def drop_client(self) -> None:
        """Hand back one `acquire_client` (blocking: a worker thread).

        Once no backend holds the client, a new `acquire_client` sets up a fresh one (after a restarted
        master, say); the old one closes (its segment leaves the pool) when its last worker thread, if
        one is stuck inside the library, returns.
        """
        if self._shared is not None:
            self._shared.release()


class _SharedClient:
    """One Mooncake client of this process: the backends holding it and the worker threads inside it."""

    __slots__ = ("backends", "closed", "key", "store", "threads")

    def __init__(self, key: tuple[object, ...], store: Any) -> None:
        self.key = key
        self.store = store
        self.backends = 0
        self.threads = 0
        self.closed = False

    def enter(self) -> bool:
        """Count a worker thread in; False once the client is closed."""
        with _clients_lock:
            if self.closed:
                return False
            self.threads += 1
            return True

    def leave(self) -> None:
        """Count a worker thread out (closing the client if it was the last user)."""
        with _clients_lock:
            self.threads -= 1
        self._close_if_unused()

    def release(self) -> None:
        """Count a backend out: a later `acquire_client` gets a new client; this one closes once unused."""
        with _clients_lock:
            self.backends -= 1
            if self.backends == 0 and _clients.get(self.key) is self:
                del _clients[self.key]
        self._close_if_unused()

    def _close_if_unused(self) -> None:
        with _clients_lock:
            if self.closed or self.backends or self.threads:
                return
            self.closed = True
        self.store.close()


_clients: dict[tuple[object, ...], _SharedClient] = {}
"""The process's shared Mooncake clients by settings, while some backend holds them."""
_clients_lock = threading.Lock()


def _exists(store: Any, names: list[str]) -> list[int]:
    codes: list[int] = store.batch_is_exist(names)
    if codes and all(c < 0 for c in codes):
        raise _Unreachable(f"exists failed, first code {codes[0]}")
    return codes


def _remove(store: Any, names: list[str]) -> list[int]:
    codes: list[int] = store.batch_remove(names, force=True)
    if codes and all(c < 0 and c != OBJECT_NOT_FOUND for c in codes):
        raise _Unreachable(f"remove failed, first code {codes[0]}")
    return codes
