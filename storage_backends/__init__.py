"""Storage backends for hicache: one small protocol, a page format, a lazy registry, and the backends.

`import storage_backends` imports nothing but this file: every name below is re-exported lazily (module
`__getattr__`), so a leaf such as `storage_backends.errors` loads no async library and no client
library, and `open_backend(url)` imports only the backend it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from storage_backends.batching import BackendStatistics, gather_bounded
    from storage_backends.file import FileBackend
    from storage_backends.memory import MemoryBackend
    from storage_backends.page_format import HEADER_SIZE, encode_header, page_key, verify_page
    from storage_backends.protocol import StorageBackend
    from storage_backends.registry import open_backend, register_backend

__all__ = [
    "HEADER_SIZE",
    "BackendStatistics",
    "FileBackend",
    "MemoryBackend",
    "StorageBackend",
    "encode_header",
    "gather_bounded",
    "open_backend",
    "page_key",
    "register_backend",
    "verify_page",
]

_LAZY = {
    "HEADER_SIZE": "storage_backends.page_format",
    "BackendStatistics": "storage_backends.batching",
    "FileBackend": "storage_backends.file",
    "MemoryBackend": "storage_backends.memory",
    "StorageBackend": "storage_backends.protocol",
    "encode_header": "storage_backends.page_format",
    "gather_bounded": "storage_backends.batching",
    "open_backend": "storage_backends.registry",
    "page_key": "storage_backends.page_format",
    "register_backend": "storage_backends.registry",
    "verify_page": "storage_backends.page_format",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'storage_backends' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
