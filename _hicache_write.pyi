"""Type stub of the C extension `_hicache_write` (native/hicache_write.c): the file backend's write path."""

from typing_extensions import Buffer

HEADER_SIZE: int
BUILD: int
"""The module's interface version (`storage_backends.native` refuses a build of another)."""

def write_group(
    root: str,
    keys: list[str],
    buffers: list[Buffer],
    namespace_digest: bytes,
    suffix: str,
    tmp_tag: str,
    durable: bool,
    /,
) -> list[int]:
    """Write the pages as one group file (`root/.group<tmp_tag>`: pages, table, footer), link each page's
    name `root/<key[:2]>/<key><suffix>` to it (replacing a name already there), unlink the temporary name;
    with `durable`, fsync the group before the first link and each page directory after. Without the GIL.
    Returns one errno per page (0: written)."""
