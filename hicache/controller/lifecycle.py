"""The lifecycle of a `HiCache`: `start`, `aclose`, `async with`, and the warning for an unclosed cache.

A mixin of `HiCache` (its state and collaborators are the cache's own, built in `HiCache.__init__`): start
opens the storage tier and the background workers, close cancels prefetches and stops the workers within
`config.close_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from types import TracebackType
from typing import Self

import anyio

from hicache.config import HiCacheConfig
from hicache.controller.parts import CacheParts
from hicache.controller.storage.guarded import GuardedStorage
from hicache.controller.storage.writer import StorageWriter
from hicache.errors import UnsupportedEventLoop
from hicache.parallel import RankFailed, check_same_pools
from storage_backends.protocol import StorageBackend
from storage_backends.registry import open_backend

__all__ = ["CacheLifecycle"]

logger = logging.getLogger("hicache.cache")


class CacheLifecycle(CacheParts):
    """Start and close of a `HiCache` (the cache's parts: `CacheParts`)."""

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            # A storage URL or option refused by the backend: free the pools now, not in `__del__`.
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the storage backend (if configured) and start the background workers.

        If starting fails (the backend cannot be opened, or the caller is cancelled), everything made so
        far (storage, pools) is closed before the error propagates, and the cache is closed.

        Raises:
            UnsupportedEventLoop: no asyncio loop runs, or the cache was started on another event loop.
            CacheClosed: the cache was closed (`CacheFailed` after a background failure).
        """
        self._state.check_loop("start")
        if self._state.closed:
            raise self._state.closed_error("start")
        if self._state.started:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # anyio on trio: the read threads' eventfd and the pacer need asyncio's loop
            raise UnsupportedEventLoop(
                "start: HiCache runs on asyncio (anyio's asyncio backend); no asyncio event loop is running"
            ) from None
        try:
            if self.storage is None and self.config.storage_url is not None:
                self.storage = open_configured_storage(self.config)
            if self.storage is not None:
                self._open_storage_tier(self.storage)
            if self._device_pool.device.type == "cuda":
                # One thread enqueues every large CUDA copy plan: concurrent load-backs each launching
                # thousands of page copies from their own threads fight over the GIL (on an H200, 16
                # concurrent load-backs of 128 KiB pages ran at a quarter of one load-back's rate).
                self._copies.limiter = anyio.CapacityLimiter(1)
            if self.agreement is not None:
                await anyio.to_thread.run_sync(check_same_pools, self.config)
            await self._workers.start(self.storage if self._owns_storage else None)
        except BaseException:
            # A failed start: close what it opened and the pools; the cache stays closed.
            self._state.close()
            await self._workers.abort(self.storage if self._owns_storage else None)
            raise
        self._state.open(loop)

    def _open_storage_tier(self, storage: StorageBackend) -> None:
        """Put `storage` behind the breaker and hand it to the prefetcher and the write-through."""
        guarded = GuardedStorage(storage, self.storage_breaker, self.metrics.storage_errors)
        writer = StorageWriter(
            guarded,
            tree=self._tree,
            host_pool=self._host_pool,
            component_pools=self._component_pools,
            release_queue=self._release_queue,
            metrics=self.metrics,
            read_timeout_s=self.config.storage_read_timeout_s,
            write_timeout_s=self.config.storage_write_timeout_s,
        )
        self._mover.writer = writer
        self._prefetcher.storage = guarded
        self._prefetcher.known = writer.known
        warn_if_shared(self.config)

    async def aclose(self) -> None:
        """Cancel prefetches, stop the workers, release everything, close storage and the pools made here.

        Idempotent, and bounded: returns within `config.close_timeout_s` (or the caller's own deadline,
        whichever is first). What is left then (a stuck storage thread, pages it may still write into) is
        logged and finishes in the background: buffers are released, and the pools the cache made are
        closed, only once no read or copy can write into them. Pools passed to the constructor stay open.
        After a background failure (`CacheFailed`) it finishes the shutdown that failure began.

        On another event loop than `start()`'s (whose workers cannot run here) it closes the cache, asks
        `start()`'s loop to shut the workers down when it next runs, closes the pools the cache made now
        if that loop is not running, and returns.
        """
        home = self._state.loop
        if home is not None and self._state.on_another_loop():
            if not self._state.closed:
                self._state.close()
                if not home.is_closed():
                    home.call_soon_threadsafe(self._begin_close)
            logger.warning("%r: aclose on another event loop than start's: the workers run there", self)
            if not home.is_running():
                self._workers.close_pools()
            return
        if not self._state.closed:
            self._state.close()
            self._begin_close()
        await self._workers.wait_closed()

    def _begin_close(self) -> None:
        """The cache closes (its state says closed already): cancel the prefetches, fail the agreement and
        stop the workers."""
        self._prefetcher.cancel_all()
        if self.agreement is not None:
            reason = "failed" if self._state.failure is not None else "was closed"
            self.agreement.fail(RankFailed(f"rank {self.agreement.tp_rank}: the cache {reason}"))
        self._workers.begin_close()

    def _background_failed(self, job: str, error: Exception) -> None:
        """A background job raised `error` (`Workers`' `on_failure`): log it once, fail the cache (every
        later call raises `CacheFailed`) and close it as `aclose()` would; `aclose()` then finishes."""
        if not self._state.fail(error):
            logger.warning("%r: background job %s raised after the cache closed: %r", self, job, error)
            return
        logger.error(
            "%r: background job %s failed; the cache is closed and every call now raises CacheFailed",
            self,
            job,
            exc_info=error,
        )
        self._begin_close()

    def __del__(self) -> None:
        # getattr: a constructor that raised never set the state, and must not fail again here.
        state = getattr(self, "_state", None)
        if state is not None and state.started and not state.closed:
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=1)


def open_configured_storage(config: HiCacheConfig) -> StorageBackend:
    """Open the backend of `config.storage_url` (which must be set) with `config.storage_options`, plus
    the cache's timeouts for a client that has its own (S3, Valkey, Mooncake: per-round-trip read and write deadlines),
    unless the options set them."""
    url = config.storage_url
    assert url is not None
    options = dict(config.storage_options)
    if url.startswith(("s3://", "valkey://", "mooncake://")):
        options.setdefault("read_deadline_s", config.storage_read_timeout_s)
        options.setdefault("write_deadline_s", config.storage_write_timeout_s)
    return open_backend(url, namespace_digest=config.namespace.digest, **options)


def warn_if_shared(config: HiCacheConfig) -> None:
    """Warn when a storage tier is used without a model id: every cache with the same KV layout and an
    empty model id would share pages with this one."""
    if not config.namespace.model_id:
        logger.warning(
            "HiCache has a storage tier but namespace.model_id is empty: every cache with the "
            "same KV layout and an empty model_id shares pages with this one; pass "
            "Namespace(model_id=<model name and revision, or a config hash>)"
        )
