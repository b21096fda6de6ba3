"""What the tree's operations return: small plain records of what the controller must carry out.

Results are data: they hold values and node handles, never the tree, and reading them changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hicache.tree.node import join_indices, maker

if TYPE_CHECKING:
    from hicache.tree.handles import NodeRef

__all__ = [
    "EMPTY_INDICES",
    "BranchStatistics",
    "ComponentEvictResult",
    "ComponentFree",
    "ComponentStatistics",
    "EvictResult",
    "FreeResult",
    "HostEvictResult",
    "InsertResult",
    "LoadResult",
    "MatchResult",
    "PrefixPeek",
    "TreeStatistics",
    "make_insert",
    "make_match",
]

EMPTY_INDICES = torch.empty(0, dtype=torch.int64)
"""A shared empty int64 tensor returned wherever no indices apply (never write into it)."""


class ComponentFree:
    """Indices of one component the tree let go of; the controller returns them to the tier's pool.

    Attributes:
        component: the component's name.
        tier: `"device"` or `"host"`.
        indices: int64 indices into that component's pool on that tier.
    """

    __slots__ = ("component", "indices", "tier")

    def __init__(self, component: str, tier: str, indices: torch.Tensor) -> None:
        self.component = component
        self.tier = tier
        self.indices = indices

    def __repr__(self) -> str:
        return f"ComponentFree({self.component!r}, {self.tier!r}, {int(self.indices.numel())} indices)"


class MatchResult:
    """The longest cached prefix of a key (a read-only record: callers never assign its attributes).

    A slotted class made by the tree through `make_match` (in C, without a Python `__init__`: it is built
    once per match on the hot path, where even a plain `__init__` cost a quarter of a match).

    Attributes:
        key: the page-aligned key in bytes form.
        device_values: the device values of the nodes on the matched device prefix, root-first.
        device_len: tokens matched on the device.
        host_len: tokens matched beyond the device prefix in host-only nodes.
        last_device_node: the deepest node of the device prefix (the root if none).
        last_host_node: the deepest matched node that is backed up (the root if none).
        host_nodes: the host-only nodes after the device prefix, root-first (to be loaded back).
        host_values: the host values of `host_nodes` (what a load-back copies), root-first.
    """

    __slots__ = (
        "_indices",
        "device_len",
        "device_values",
        "host_len",
        "host_nodes",
        "host_values",
        "key",
        "last_device_node",
        "last_host_node",
    )

    key: bytes
    device_values: tuple[torch.Tensor, ...]
    device_len: int
    host_len: int
    last_device_node: NodeRef
    last_host_node: NodeRef
    host_nodes: tuple[NodeRef, ...]
    host_values: tuple[torch.Tensor, ...]
    # The joined device indices, when known (the last device node's cached root path, or a join done by an
    # earlier read of `device_indices`).
    _indices: torch.Tensor | None

    @property
    def device_indices(self) -> torch.Tensor:
        """Device pool indices of the matched device prefix, one per token (empty if none).

        Joined on first access and then kept in this result (nothing else changes); not a copy when a
        single node matched or when the last device node held its joined root path at match time (callers
        must not modify the tensor).
        """
        out = self._indices
        if out is not None:
            return out
        vals = self.device_values
        if not vals:
            out = EMPTY_INDICES
        elif len(vals) == 1:
            out = vals[0]
        else:
            out = join_indices(vals)
        self._indices = out
        return out

    @property
    def host_indices(self) -> torch.Tensor:
        """Host pool indices of `host_nodes`, joined root-first (empty if none)."""
        vals = self.host_values
        if not vals:
            return EMPTY_INDICES
        return vals[0] if len(vals) == 1 else join_indices(vals)

    def __repr__(self) -> str:
        return (
            f"MatchResult(tokens={len(self.key) // 8}, device_len={self.device_len}, "
            f"host_len={self.host_len}, last_device_node={self.last_device_node.id}, "
            f"last_host_node={self.last_host_node.id}, host_nodes={[n.id for n in self.host_nodes]})"
        )


@dataclass(frozen=True, slots=True)
class PrefixPeek:
    """What a match of a key would find, from `RadixTree.peek` (which changes nothing).

    Attributes:
        device_len: tokens `match_prefix` would find on the device.
        host_len: tokens it would find beyond them in host-only nodes.
        anchor_len: tokens up to the end of the deepest matched node with a host copy (0: the root),
            where a storage prefetch would continue from.
    """

    device_len: int
    host_len: int
    anchor_len: int

    @property
    def matched_len(self) -> int:
        """Tokens found on the device or the host."""
        return self.device_len + self.host_len


class InsertResult:
    """What an `insert` or `insert_host` did (a read-only record, made by the tree through `make_insert`).

    Attributes:
        prefix_len: tokens of the key that were already cached; the caller frees `indices[:prefix_len]`.
        total_len: page-aligned tokens of the key now covered by the tree (0 when a refill was dropped).
        node: the last node covering the key (the anchor when a refill was dropped).
        backups: nodes to back up to the host; the controller asks `backup_chain` for each when it
            executes them (later entries' chains shrink once earlier ones are pending).
        host_insert_dropped: `insert_host` attached nothing because the attach point was not backed up;
            the caller frees every host index it passed.
        component_frees: component indices the caller returns to their pools (duplicates, and values
            no node took).
        backup_first: for a dropped refill, the plan that would rescue it: the un-backed chain (root
            first) whose backup makes the attach point backed up, after which `insert_host` attaches.
    """

    __slots__ = (
        "backup_first",
        "backups",
        "component_frees",
        "host_insert_dropped",
        "node",
        "prefix_len",
        "total_len",
    )

    prefix_len: int
    total_len: int
    node: NodeRef
    backups: tuple[NodeRef, ...]
    host_insert_dropped: bool
    component_frees: tuple[ComponentFree, ...]
    backup_first: tuple[NodeRef, ...]

    def __repr__(self) -> str:
        return (
            f"InsertResult(prefix_len={self.prefix_len}, total_len={self.total_len}, node={self.node.id}, "
            f"backups={[n.id for n in self.backups]}, host_insert_dropped={self.host_insert_dropped})"
        )


make_match: Callable[..., MatchResult] = maker(
    MatchResult,
    (
        "key",
        "device_values",
        "device_len",
        "host_len",
        "last_device_node",
        "last_host_node",
        "host_nodes",
        "_indices",
        "host_values",
    ),
    {},
)
"""`make_match(key, device_values, device_len, host_len, last_device_node, last_host_node, host_nodes,
indices, host_values)`: a `MatchResult` (`indices`: the joined device indices when known, else `None`)."""

make_insert: Callable[..., InsertResult] = maker(
    InsertResult,
    ("prefix_len", "total_len", "node", "backups", "host_insert_dropped", "component_frees", "backup_first"),
    {},
)
"""`make_insert(prefix_len, total_len, node, backups, host_insert_dropped, component_frees, backup_first)`:
an `InsertResult`."""


@dataclass(frozen=True, slots=True)
class EvictResult:
    """What `evict_device` freed, and the backups it counts on (the plan the controller carries out).

    Attributes:
        freed_device: device indices the caller returns to the device pool (demoted nodes, and nodes
            dropped without a backup).
        freed_host: host indices of dropped subtrees the caller returns to the host pool.
        evicted_tokens: device tokens freed plus the tokens of the leaves in `backups`.
        backups: under write-back, the chains to back up before their leaves can be demoted: each
            chain root-first (its first node's parent is the root, backed up, pending, or in an earlier
            chain), ending with an un-backed device leaf; disjoint, in the order to run them.
        backup_tokens: host tokens the chains in `backups` need together (at most the `host_free_tokens`
            the plan was given).
        dropped_tokens: device tokens freed without a backup (un-backed nodes deleted).
        component_frees: component indices of the freed nodes the caller returns to their pools.
    """

    freed_device: torch.Tensor
    freed_host: torch.Tensor
    evicted_tokens: int
    backups: tuple[tuple[NodeRef, ...], ...] = ()
    backup_tokens: int = 0
    dropped_tokens: int = 0
    component_frees: tuple[ComponentFree, ...] = ()

    @property
    def backup_first(self) -> tuple[NodeRef, ...]:
        """The leaf that ends each chain of `backups` (what `backup_chain` expands to the chain)."""
        return tuple(chain[-1] for chain in self.backups)


@dataclass(frozen=True, slots=True)
class HostEvictResult:
    """What `evict_host` freed: host indices the caller returns to the host pool.

    Attributes:
        freed_host: host indices of the removed nodes.
        evicted_tokens: their tokens.
        component_frees: component indices of the removed nodes.
    """

    freed_host: torch.Tensor
    evicted_tokens: int
    component_frees: tuple[ComponentFree, ...] = ()


@dataclass(frozen=True, slots=True)
class FreeResult:
    """Indices an operation let go of (`demote`, `commit_backup`, `abort_backup`); the caller frees them.

    Attributes:
        freed_device: device indices for the device pool.
        freed_host: host indices for the host pool.
        component_frees: component indices for the components' pools.
    """

    freed_device: torch.Tensor = EMPTY_INDICES
    freed_host: torch.Tensor = EMPTY_INDICES
    component_frees: tuple[ComponentFree, ...] = ()


@dataclass(frozen=True, slots=True)
class ComponentEvictResult:
    """What `evict_component` freed.

    Attributes:
        evicted_slots: slots of the component asked for that were freed (fewer when nothing more is
            evictable).
        component_frees: every component index let go of (the cascade to higher-ranked components
            included); the caller returns them to their pools.
    """

    evicted_slots: int
    component_frees: tuple[ComponentFree, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadResult:
    """What `attach_loaded` did with pages loaded back from the host.

    Attributes:
        match: the key's match after the attach (what the load-back's caller uses now).
        freed_device: loaded device pages no node took (nodes on the device again meanwhile, or beyond
            where the match now ends); the caller frees them.
        component_frees: component copies no node took, and component indices let go of.
    """

    match: MatchResult
    freed_device: torch.Tensor
    component_frees: tuple[ComponentFree, ...] = ()


@dataclass(frozen=True, slots=True)
class BranchStatistics:
    """One top-level branch of the tree (`RadixTree.branches`): a child of the root and everything below it,
    e.g. the requests sharing one system prompt.

    Attributes:
        node: the branch's top node (a child of the root).
        key: the top node's tokens as little-endian int64 bytes (whole pages).
        hits: the top node's hit count (inserts that touched it).
        nodes: nodes in the branch, the top node included.
        device_tokens: tokens of the branch held on the device.
        host_tokens: tokens of the branch held on the host.
    """

    node: NodeRef
    key: bytes
    hits: int
    nodes: int
    device_tokens: int
    host_tokens: int


@dataclass(frozen=True, slots=True)
class TreeStatistics:
    """A snapshot of the tree's sizes, in tokens.

    Attributes:
        num_nodes: nodes in the tree, the root excluded.
        device_tokens: tokens held on the device.
        host_tokens: tokens held on the host (committed backups and refills).
        pending_backup_tokens: tokens whose device-to-host backup is in flight.
        evictable_device_tokens: device tokens in nodes without a device lock.
        protected_device_tokens: device tokens in device-locked nodes.
        evictable_host_tokens: host tokens in nodes without a host lock.
        reclaimable_host_tokens: host tokens that `evict_host` can free now: those of host-only nodes
            without a host or device lock (a device node's host copy, and a locked node's, stay).
    """

    num_nodes: int
    device_tokens: int
    host_tokens: int
    pending_backup_tokens: int
    evictable_device_tokens: int
    protected_device_tokens: int
    evictable_host_tokens: int
    reclaimable_host_tokens: int

    def __repr__(self) -> str:
        return (
            f"TreeStatistics(nodes={self.num_nodes}, device={self.device_tokens} "
            f"[evictable {self.evictable_device_tokens}, protected {self.protected_device_tokens}], "
            f"host={self.host_tokens} [evictable {self.evictable_host_tokens}, "
            f"reclaimable {self.reclaimable_host_tokens}], "
            f"pending_backup={self.pending_backup_tokens})"
        )


@dataclass(frozen=True, slots=True)
class ComponentStatistics:
    """A snapshot of one hybrid component's sizes in the tree, in pool slots (tokens for a sliding window).

    Attributes:
        name: the component.
        device_slots: slots held on the device.
        host_slots: slots held on the host (committed).
        pending_backup_slots: host slots of backups in flight.
        evictable_device_nodes: nodes whose device value can be evicted now.
        evictable_host_nodes: nodes whose host value can be evicted now.
    """

    name: str
    device_slots: int
    host_slots: int
    pending_backup_slots: int
    evictable_device_nodes: int
    evictable_host_nodes: int
