"""Storage backends for hicache: one small protocol, a page format, a lazy registry, and the backends.

`import storage_backends` imports no client library; `open_backend(url)` imports the one it needs.
"""

from __future__ import annotations

from storage_backends.protocol import StorageBackend

__all__ = ["StorageBackend"]
