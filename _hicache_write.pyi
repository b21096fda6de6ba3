"""Type stub of the C extension `_hicache_write` (native/hicache_write.c): the file backend's write path."""

from typing_extensions import Buffer

HEADER_SIZE: int

def write_pages(
    dirs: list[str],
    keys: list[str],
    buffers: list[Buffer],
    namespace_digest: bytes,
    suffix: str,
    tmp_tag: str,
    durable: bool,
    /,
) -> list[int]: ...
