"""Types of the C extension built from native/hicache_native.c (imported through storage_backends.native)."""

from collections.abc import Sequence

from typing_extensions import Buffer

HIT: int
"""Outcome byte of `read_pages`: the page was read and verified."""
MISS: int
"""Outcome byte of `read_pages`: the page file does not exist."""
RETRY: int
"""Outcome byte of `read_pages`: something unusual (short, foreign, old or corrupt): re-read it checked."""
ERROR: int
"""Outcome byte of `read_pages`: opening or reading failed; its errno is in the errors list."""
HEADER_SIZE: int
"""Bytes of page header the C reader expects (page format v2: 56)."""
CHUNK_BYTES: int
"""Bytes read, then hashed, at a time: small enough to still be in the CPU cache when hashed."""

def read_pages(
    root: str,
    suffix: str,
    keys: Sequence[str],
    buffers: Sequence[Buffer],
    namespace_digest: bytes,
    nowait_flags: int,
    /,
) -> tuple[bytes, int, list[tuple[int, int]]]:
    """Read and verify `root/ab/cd/<key><suffix>` into each buffer, the whole batch without the GIL.

    Returns one outcome byte per page, the probe flags to pass next time (0 once the filesystem refused
    `RWF_NOWAIT`), and `(index, errno)` for every `ERROR` page. A file longer or shorter than header plus
    buffer is `RETRY`, never `HIT`.

    Raises:
        ValueError: naming the argument, for a key that is not 4-128 lowercase hex characters, a NUL in
            `root` or `suffix`, a digest that is not 16 bytes, or a buffer count or buffer that does not fit.
        TypeError: naming `keys[i]`, for a key that is not a str.
    """

def xxh3_64(data: Buffer, /) -> int:
    """xxh3-64 (seed 0) of a C-contiguous buffer, as `xxhash.xxh3_64_intdigest`; releases the GIL."""
