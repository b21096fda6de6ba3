"""Type stub of the C extension `_hicache_tree` (native/hicache_tree.c): the radix tree's walk."""

from typing import Any

BUILD: int

def bind(node_class: type, np_empty: Any, np_int64: Any, from_numpy: Any, /) -> None: ...
def walk(
    node: Any,
    key: bytes,
    pos: int,
    step: int,
    tick: int,
    last_host: Any,
    values: list[Any] | None,
    backups: list[Any] | None,
    backup_hits: int,
    /,
) -> tuple[int, Any, Any, Any, int]: ...
def maker(cls: type, fields: tuple[str, ...], defaults: dict[str, object], /) -> Any: ...
def bind_tree(
    tree_class: type, leaf_set_class: type, ref_class: type, leaf_maker: Any, heappush: Any, /
) -> None: ...
def add_leaf(
    tree: Any,
    parent: Any,
    key: bytes,
    pos: int,
    value: Any,
    tick: int,
    backups: list[Any],
    backup_hits: int | None,
    /,
) -> Any: ...
def all_hashes(hashes: list[Any], /) -> bool: ...
def copy_out(src_address: int, n: int, /) -> Any: ...
def join(parts: Any, /) -> Any: ...
def page_runs(tokens: Any, out: Any, page_size: int, num_pages: int, /) -> int: ...
