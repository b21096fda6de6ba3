"""Storage backends for hicache: one small protocol, a page format, a lazy registry, and the backends.

`import storage_backends` imports no client library; `open_backend(url)` imports the one it needs. The
file and memory backends are re-exported lazily too (module `__getattr__`), so naming them costs nothing
until used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from storage_backends.batching import BackendStatistics, gather_bounded
from storage_backends.page_format import HEADER_SIZE, encode_header, page_key, verify_page
from storage_backends.protocol import StorageBackend
from storage_backends.registry import open_backend, register_backend

if TYPE_CHECKING:
    from storage_backends.file import FileBackend
    from storage_backends.memory import MemoryBackend

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

_LAZY = {"FileBackend": "storage_backends.file", "MemoryBackend": "storage_backends.memory"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'storage_backends' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
