"""The project's C extension, `_hicache_native` (native/hicache_native.c), imported with a clear error.

It holds the storage data path that must not hold the GIL: `read_pages`, the file backend's batched read
and verify (one memory pass per page, the whole batch without the GIL), `ReadQueue`, worker threads that
run such batches (`ReadJob`s) one after another without ever taking the GIL between them, and Python calls
(`ReadQueue.call`) with it (`storage_backends.threads.WorkerThreads`), `chain_hashes`, the chained page
hashes of a key (`hicache.keys.chained_page_hashes`), and `xxh3_64`, the page payload checksum
(byte-compatible with python-xxhash's `xxh3_64_intdigest`). `write_group`, the file backend's
write path (one group file of pages with their headers, a hard link per page, without the GIL), lives in a second
module, `_hicache_write` (native/hicache_write.c). `pip install -e .` or `make venv` builds both; see the
README's "Dependencies and why".
"""

from __future__ import annotations

try:
    import _hicache_native
except ImportError as exc:  # pragma: no cover - only on an install that skipped the build
    raise ImportError(
        "hicache's C extension _hicache_native is not built (it holds the storage read path). Build it "
        "with `make venv`, `pip install -e .` or `python setup.py build_ext --inplace` in the repository "
        "root; it needs a C compiler (gcc) and Python's development headers (Python.h)."
    ) from exc

BUILD = 9
"""The interface version this Python side expects (`NATIVE_BUILD` in native/hicache_native.c)."""

_REBUILD = (
    "Rebuild it with `make native` or `python setup.py build_ext --inplace` in the repository root (after a "
    "merge that changed native/hicache_native.c, each worktree needs its own rebuild)."
)

if getattr(_hicache_native, "BUILD", 1) != BUILD:  # pragma: no cover - only on a stale build
    raise ImportError(
        f"hicache's C extension _hicache_native ({_hicache_native.__file__}) is stale: built from an older "
        f"native/hicache_native.c (build {getattr(_hicache_native, 'BUILD', 1)}, this code needs {BUILD}). "
        + _REBUILD
    )

from _hicache_native import (  # noqa: E402  (after the check: a stale build lacks some of these names)
    CHUNK_BYTES,
    ERROR,
    HEADER_SIZE,
    HIT,
    MISS,
    READAHEAD,
    RETRY,
    ReadJob,
    ReadQueue,
    chain_hashes,
    read_pages,
    xxh3_64,
)

__all__ = [
    "BUILD",
    "CHUNK_BYTES",
    "ERROR",
    "HEADER_SIZE",
    "HIT",
    "MISS",
    "READAHEAD",
    "RETRY",
    "ReadJob",
    "ReadQueue",
    "chain_hashes",
    "read_pages",
    "xxh3_64",
]

del _hicache_native

WRITE_BUILD = 2
"""The interface version of `_hicache_write` this Python side expects (`WRITE_BUILD` in native/hicache_write.c)."""

try:
    import _hicache_write
except ImportError as exc:  # pragma: no cover - only on an install that skipped the build
    raise ImportError(
        "hicache's C extension _hicache_write (native/hicache_write.c: the file backend's write path) is not "
        "built. " + _REBUILD
    ) from exc

if getattr(_hicache_write, "BUILD", 1) != WRITE_BUILD:  # pragma: no cover - only on a stale build
    raise ImportError(
        f"hicache's C extension _hicache_write ({_hicache_write.__file__}) is stale: built from an older "
        f"native/hicache_write.c (build {getattr(_hicache_write, 'BUILD', 1)}, this code needs {WRITE_BUILD}). "
        + _REBUILD
    )

from _hicache_write import write_group  # noqa: E402  (after the check)

__all__ += ["WRITE_BUILD", "write_group"]
del _hicache_write
