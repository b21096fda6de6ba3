"""Opening the storage tier a configuration names."""

from __future__ import annotations

import logging

from hicache.config import HiCacheConfig
from storage_backends.protocol import StorageBackend
from storage_backends.registry import open_backend

__all__ = ["open_configured_storage", "warn_if_shared"]

logger = logging.getLogger("hicache.cache")


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
