"""The radix tree of KV pages: pure, synchronous bookkeeping over the device and host tiers.

The tree decides and the controller executes: operations return records (`MatchResult`, `InsertResult`,
`EvictResult`, ...) saying which indices to free and which nodes to back up; the tree never awaits and
never touches a pool or a storage backend.
"""

from __future__ import annotations

import itertools
import logging
import sys
from array import array
from collections.abc import Mapping, Sequence

import torch

from hicache.components.base import TIERS, Component, ComponentData, ComponentFree
from hicache.keys import TOKEN_BYTES, KeyLike, Namespace, as_key_bytes
from hicache.policy import EvictionPolicy, WritePolicy, parse_policy
from hicache.tree.eviction import LeafSet
from hicache.tree.node import TreeNode
from hicache.tree.results import (
    EMPTY_INDICES,
    ComponentStatistics,
    EvictResult,
    HostEvictResult,
    InsertResult,
    MatchResult,
    TreeStatistics,
)

__all__ = ["RadixTree"]

logger = logging.getLogger("hicache.tree")

_WB = WritePolicy.WRITE_BACK
_INT64 = torch.int64
_LITTLE = sys.byteorder == "little"


def _check_indices(value: object, name: str, expected: int) -> torch.Tensor:
    """Validate a 1-D int64 CPU tensor of `expected` entries; raise naming `name` otherwise."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D int64 tensor, got {type(value).__name__}")
    if value.dtype != torch.int64:
        raise TypeError(f"{name}: expected dtype torch.int64, got {value.dtype}")
    if value.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(value.shape)}")
    if value.shape[0] != expected:
        raise ValueError(f"{name}: expected {expected} entries (one per token), got {value.shape[0]}")
    return value


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return EMPTY_INDICES
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts)


class _Reader:
    """Reads one component's values for `valid_end`, remembering them; tier `None`: the device value on
    device nodes and the host value on the others (the state after loading the host-only nodes back)."""

    __slots__ = ("name", "parts", "tier", "tree")

    def __init__(self, tree: RadixTree, name: str, tier: str | None) -> None:
        self.tree = tree
        self.name = name
        self.tier = tier
        self.parts: list[torch.Tensor] = []

    def __call__(self, node: TreeNode) -> torch.Tensor | None:
        tier = self.tier
        if tier is None:
            tier = "device" if node.device_value is not None else "host"
        value = self.tree.component_value(node, self.name, tier)
        if value is not None:
            self.parts.append(value)
        return value


class RadixTree:
    """A paged radix tree of token keys whose nodes hold device and host pool indices.

    Args:
        page_size: tokens per page (>= 1); matching and insertion ignore a trailing partial page.
        write_policy: when device pages are backed up to the host (`WritePolicy` or its name).
        eviction_policy: which evictable leaf goes first (`EvictionPolicy` or its name).
        write_through_threshold: hits before a node is backed up under `write_through_selective` (>= 1).
        namespace: the cache's namespace, mixed into every page hash.
        components: hybrid-model components (sliding-window KV, Mamba state) kept per node beside the
            full-attention KV; `None` or empty for a full-attention-only tree (every operation then runs
            exactly as without components).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a page size below 1, a threshold below 1, an unknown policy name, or two components
            with one name.
    """

    def __init__(
        self,
        page_size: int,
        write_policy: WritePolicy | str = "write_through",
        eviction_policy: EvictionPolicy | str = "lru",
        write_through_threshold: int = 2,
        namespace: Namespace | None = None,
        components: Sequence[Component] | None = None,
    ) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int):
            raise TypeError(f"page_size: expected an int, got {type(page_size).__name__}")
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        if isinstance(write_through_threshold, bool) or not isinstance(write_through_threshold, int):
            raise TypeError(
                f"write_through_threshold: expected an int, got {type(write_through_threshold).__name__}"
            )
        if write_through_threshold < 1:
            raise ValueError(f"write_through_threshold: must be >= 1, got {write_through_threshold}")
        if namespace is None:
            namespace = Namespace()
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace: expected a Namespace, got {type(namespace).__name__}")
        self.page_size = page_size
        self.write_policy = parse_policy(WritePolicy, write_policy, "write_policy")
        self.eviction_policy = parse_policy(EvictionPolicy, eviction_policy, "eviction_policy")
        self.write_through_threshold = write_through_threshold
        self.namespace = namespace
        self._step = page_size * TOKEN_BYTES
        self._ctx = (page_size, namespace)
        self._ids = itertools.count(1)
        self._clock = 0
        # The hit count at which an inserted node is backed up (None: never at insert).
        self._backup_hits: int | None = {
            WritePolicy.WRITE_THROUGH: 1,
            WritePolicy.WRITE_THROUGH_SELECTIVE: write_through_threshold,
            WritePolicy.WRITE_BACK: None,
        }[self.write_policy]
        self.root = TreeNode(0, None, b"", self._ctx)
        self.root.hashes = []
        self._device_leaves = LeafSet(self.eviction_policy)
        self._host_leaves = LeafSet(self.eviction_policy)
        self._num_nodes = 0
        self._device_tokens = 0
        self._host_tokens = 0
        self._pending_tokens = 0
        self._evictable_size = 0
        self._protected_size = 0
        self._evictable_host = 0
        self._reclaimable_host = 0  # host tokens of host-only nodes without a lock: what evict_host frees
        self._path_cache_tokens = 0  # tokens held by the nodes' cached joined root paths
        self._components: tuple[Component, ...] | None = None
        self._component_index: dict[str, Component] = {}
        # Per component: slots held on the device, on the host, in backups in flight.
        self._comp_slots: dict[str, list[int]] = {}
        self._comp_sets: dict[tuple[str, str], LeafSet] = {}
        self._garbage: list[ComponentFree] = []
        if components:
            self._init_components(components)

    # ------------------------------------------------------------------ value bookkeeping
    # Every change of a node's values goes through these helpers, which keep the counters, the
    # parent's count of device children and the leaf sets up to date. Hybrid components (a later issue)
    # extend `_set_device`, `_set_host` and `_split_values` rather than the operations.

    def _set_device(self, node: TreeNode, value: torch.Tensor | None) -> None:
        old = node.device_value
        if value is None and old is not None and node.components is not None:
            self._drop_components(node, "device")
        n = len(node.key) >> 3
        delta = (value is not None) - (old is not None)
        node.device_value = value
        cached = node._path_indices
        if cached is not None:
            node._path_indices = None
            self._path_cache_tokens -= cached.numel()
        if delta:
            self._device_tokens += delta * n
            if node.host_value is not None and not node.host_lock and not node.device_lock:
                self._reclaimable_host -= delta * n
            if node.device_lock:
                self._protected_size += delta * n
            else:
                self._evictable_size += delta * n
            parent = node.parent
            if parent is not None:
                parent._dev_children += delta
                self._refresh(parent)
        self._refresh(node)

    def _set_host(self, node: TreeNode, value: torch.Tensor | None) -> None:
        old = node.host_value
        if value is None and old is not None and node.components is not None:
            self._drop_components(node, "host")
        n = len(node.key) >> 3
        delta = (value is not None) - (old is not None)
        node.host_value = value
        if delta:
            self._host_tokens += delta * n
            if not node.host_lock:
                self._evictable_host += delta * n
                if node.device_value is None and not node.device_lock:
                    self._reclaimable_host += delta * n
        self._refresh(node)

    def _remember_path(self, node: TreeNode, vals: tuple[torch.Tensor, ...], joined: torch.Tensor) -> None:
        """Cache `joined` on `node` as its joined root path if the path still holds exactly `vals`.

        Called by `MatchResult.device_indices` after a join. The cache stays exact: `_set_device` drops a
        node's cache whenever its device value changes, an ancestor's value cannot change while a
        descendant is on the device (device prefix continuity), and a split keeps the lower part's root
        path. The caches hold at most twice the device tokens (deep chains would otherwise cost O(depth^2)).
        """
        cur: TreeNode | None = node
        for v in reversed(vals):
            if cur is None or cur.device_value is not v:
                return
            cur = cur.parent
        n = joined.numel()
        if cur is not self.root or node._path_indices is not None:
            return
        if self._path_cache_tokens + n > 2 * self._device_tokens:
            return
        node._path_indices = joined
        self._path_cache_tokens += n

    def _split_values(self, node: TreeNode, upper: TreeNode, tokens: int) -> None:
        """Move the first `tokens` tokens' values of `node` to its new parent `upper` (token counts only
        change hands between the two, so the counters stay)."""
        dv = node.device_value
        if dv is not None:
            upper.device_value = dv[:tokens]
            node.device_value = dv[tokens:]
            upper._dev_children = 1
        hv = node.host_value
        if hv is not None:
            upper.host_value = hv[:tokens]
            node.host_value = hv[tokens:]
        pv = node.backup_pending
        if pv is not None:
            upper.backup_pending = pv[:tokens]
            node.backup_pending = pv[tokens:]
            upper._backup_owner = node._backup_owner or node
        hashes = node._hashes
        if hashes is not None:
            pages = tokens // self.page_size
            upper._hashes = hashes[:pages]
            node._hashes = hashes[pages:]
        if node.components is not None:
            self._split_components(node, upper, tokens)

    def _refresh(self, node: TreeNode) -> None:
        """Recompute whether `node` is an evictable device leaf or host leaf."""
        if node.parent is None:
            return
        if node.device_value is not None:
            self._host_leaves.discard(node)
            if not node._dev_children and not node.device_lock and node.backup_pending is None:
                self._device_leaves.add(node)
            else:
                self._device_leaves.discard(node)
        else:
            self._device_leaves.discard(node)
            if (
                node.host_value is not None
                and not node.children
                and not node.host_lock
                and not node.device_lock
            ):
                self._host_leaves.add(node)
            else:
                self._host_leaves.discard(node)

    def _split(self, node: TreeNode, nbytes: int) -> TreeNode:
        """Split `node` after `nbytes` key bytes; the new upper part is returned, `node` keeps the rest."""
        parent = node.parent
        assert parent is not None
        upper = TreeNode(next(self._ids), parent, node.key[:nbytes], self._ctx)
        upper.device_lock = node.device_lock
        upper.host_lock = node.host_lock
        upper.hit_count = node.hit_count
        upper.last_access = node.last_access
        upper.priority = node.priority
        self._split_values(node, upper, nbytes >> 3)
        rest = node.key[nbytes:]
        node.key = rest
        node.parent = upper
        upper.children[rest[: self._step]] = node
        parent.children[upper.key[: self._step]] = upper
        self._num_nodes += 1
        return upper

    def _new_node(self, parent: TreeNode, key: bytes) -> TreeNode:
        node = TreeNode(next(self._ids), parent, key, self._ctx)
        parent.children[key[: self._step]] = node
        self._num_nodes += 1
        return node

    def _detach(self, node: TreeNode) -> None:
        """Remove a childless node from the tree (its values must already have been taken)."""
        parent = node.parent
        assert parent is not None
        assert not node.children
        self._set_device(node, None)
        self._set_host(node, None)
        del parent.children[node.key[: self._step]]
        self._device_leaves.discard(node)
        self._host_leaves.discard(node)
        node.parent = None
        self._num_nodes -= 1
        self._refresh(parent)

    def _matched_bytes(self, kb: bytes, pos: int, ck: bytes) -> int:
        """Key bytes of `ck` matched by `kb[pos:]`, in whole pages (the first page is known to match)."""
        if kb.startswith(ck, pos):
            return len(ck)
        step = self._step
        end = min(len(ck), len(kb) - pos)
        i = step
        while i < end and kb[pos + i : pos + i + step] == ck[i : i + step]:
            i += step
        return i

    def _aligned_key(self, key: KeyLike, name: str = "key") -> tuple[bytes, int]:
        kb = as_key_bytes(key, name=name)
        n = len(kb)
        aligned = n - n % self._step
        return (kb if aligned == n else kb[:aligned]), n >> 3

    def _require_live(self, node: object, name: str = "node") -> TreeNode:
        if not isinstance(node, TreeNode):
            raise TypeError(f"{name}: expected a TreeNode, got {type(node).__name__}")
        cur = node
        step = self._step
        while cur is not self.root:
            parent = cur.parent
            if parent is None or parent.children.get(cur.key[:step]) is not cur:
                raise ValueError(f"{name}: node {node.id} is not a live node of this tree")
            cur = parent
        return node

    def _require_non_root(self, node: object, name: str = "node") -> TreeNode:
        live = self._require_live(node, name)
        if live is self.root:
            raise ValueError(f"{name}: the root holds no pages")
        return live

    # ------------------------------------------------------------------ components
    # Hybrid components keep their per-node data in `node.components`; the rules that differ between
    # kinds (splitting, where a prefix may end, spreading inserted values) are the components' hooks.
    # Every index the tree lets go of is queued in `_garbage` for the controller (`take_component_frees`).

    def _init_components(self, components: Sequence[Component]) -> None:
        seen: dict[str, Component] = {}
        for comp in components:
            if not isinstance(comp, Component):
                raise TypeError(f"components: expected Component objects, got {type(comp).__name__}")
            if comp.name in seen or comp.name == "full":
                raise ValueError(f"components: the name {comp.name!r} is taken")
            seen[comp.name] = comp
        self._components = tuple(sorted(components, key=lambda c: c.rank))
        self._component_index = seen
        for comp in self._components:
            self._comp_slots[comp.name] = [0, 0, 0]
            for tier in TIERS:
                self._comp_sets[(comp.name, tier)] = LeafSet(self.eviction_policy)

    @property
    def components(self) -> tuple[Component, ...]:
        """The tree's components in eviction order (lowest rank first); empty without components."""
        return self._components or ()

    def _cdata(self, node: TreeNode, name: str) -> ComponentData:
        comps = node.components
        if comps is None:
            comps = node.components = {}
        data = comps.get(name)
        if data is None:
            data = comps[name] = ComponentData()
        return data

    def _refresh_comp(self, node: TreeNode, name: str, data: ComponentData) -> None:
        """Recompute whether `node`'s value of `name` can be evicted, on each tier."""
        dev = self._comp_sets[(name, "device")]
        if data.device_value is not None and not data.device_lock and data.backup_pending is None:
            dev.add(node)
        else:
            dev.discard(node)
        host = self._comp_sets[(name, "host")]
        if data.host_value is not None and not data.host_lock:
            host.add(node)
        else:
            host.discard(node)

    def _set_comp(self, node: TreeNode, name: str, tier: str, value: torch.Tensor | None) -> None:
        data = self._cdata(node, name)
        old = data.device_value if tier == "device" else data.host_value
        counts = self._comp_slots[name]
        i = 0 if tier == "device" else 1
        if old is not None:
            counts[i] -= int(old.shape[0])
        if value is not None:
            counts[i] += int(value.shape[0])
        if tier == "device":
            data.device_value = value
        else:
            data.host_value = value
        self._refresh_comp(node, name, data)

    def _discard(self, name: str, tier: str, value: torch.Tensor | None) -> None:
        if value is not None and value.numel():
            self._garbage.append(ComponentFree(name, tier, value))

    def _drop_comp(self, node: TreeNode, comp: Component, tier: str) -> int:
        """Drop `comp`'s value on `tier` and, cascading, every higher-ranked component's; slots of `comp`."""
        comps = node.components
        assert comps is not None
        assert self._components is not None
        freed = 0
        for other in self._components:
            if other.rank < comp.rank:
                continue
            data = comps.get(other.name)
            if data is None:
                continue
            value = data.value(tier)
            if value is None:
                continue
            if other is comp:
                freed = int(value.shape[0])
            self._set_comp(node, other.name, tier, None)
            self._discard(other.name, tier, value)
        return freed

    def _drop_components(self, node: TreeNode, tier: str) -> None:
        """The base value on `tier` is going: every component value there goes with it."""
        comps = node.components
        assert comps is not None
        for name, data in comps.items():
            value = data.value(tier)
            if value is not None:
                self._set_comp(node, name, tier, None)
                self._discard(name, tier, value)

    def _split_components(self, node: TreeNode, upper: TreeNode, tokens: int) -> None:
        comps = node.components
        assert comps is not None
        n = node.num_tokens
        for name, data in comps.items():
            comp = self._component_index[name]
            up = ComponentData()
            if comp.lock_path:
                up.device_lock = data.device_lock
                up.host_lock = data.host_lock
            for attr in ("device_value", "host_value", "backup_pending"):
                value = getattr(data, attr)
                if value is not None:
                    upper_part, lower_part = comp.split(value, tokens, n)
                    setattr(up, attr, upper_part)
                    setattr(data, attr, lower_part)
            if not up.empty:
                if upper.components is None:
                    upper.components = {}
                upper.components[name] = up
            self._refresh_comp(node, name, data)
            self._refresh_comp(upper, name, up)

    def _component_inputs(
        self, components: Mapping[str, torch.Tensor] | None, name: str, aligned: int
    ) -> dict[str, torch.Tensor]:
        """Validate a mapping of component values for a key of `aligned` tokens; cloned (the tree owns them)."""
        if not components:
            return {}
        if self._components is None:
            raise ValueError(f"{name}: this tree has no components")
        if not isinstance(components, Mapping):
            raise TypeError(f"{name}: expected a mapping of component name to indices")
        out: dict[str, torch.Tensor] = {}
        for cname, value in components.items():
            comp = self._component_index.get(cname)
            if comp is None:
                raise ValueError(f"{name}: unknown component {cname!r}")
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
                raise TypeError(f"{name}[{cname!r}]: expected a 1-D int64 tensor")
            if aligned and (problem := comp.check_value(value, aligned, self.page_size)) is not None:
                raise ValueError(f"{name}[{cname!r}]: {problem}")
            out[cname] = value.clone()
        return out

    def _attach_components(
        self,
        path: list[TreeNode],
        start: int,
        end: int,
        key_tokens: int,
        values: dict[str, torch.Tensor],
        tier: str,
    ) -> None:
        """Spread `values` over `path` (nodes covering tokens [start, end)); the rest becomes garbage."""
        spans: list[tuple[int, int]] = []
        pos = start
        for node in path:
            spans.append((pos, pos + node.num_tokens))
            pos += node.num_tokens
        assert pos == end
        for cname, value in values.items():
            comp = self._component_index[cname]
            parts = comp.distribute(spans, value, end, key_tokens) if spans else [None] * len(spans)
            if all(part is None for part in parts):
                self._discard(cname, tier, value)
                continue
            for node, part in zip(path, parts, strict=True):
                if part is None:
                    continue
                base = node.device_value if tier == "device" else node.host_value
                data = node.components.get(cname) if node.components is not None else None
                held = None if data is None else data.value(tier)
                # Three cases: nothing held (take the part), a shorter unlocked value not being backed up
                # (a window suffix that grows: replace it), anything else (keep what is held).
                busy = data is not None and (
                    data.backup_pending is not None
                    or (data.device_lock if tier == "device" else data.host_lock)
                )
                if base is None or busy or (held is not None and held.shape[0] >= part.shape[0]):
                    self._discard(cname, tier, part)
                else:
                    self._set_comp(node, cname, tier, part)
                    self._discard(cname, tier, held)

    def take_component_frees(self) -> list[ComponentFree]:
        """Component indices the tree let go of since the last call; the caller returns them to the pools.

        Every operation that drops a node's value (eviction, demotion, a cascade, a duplicate insert)
        queues the component indices here instead of returning them, so the base API stays unchanged.
        """
        out = self._garbage
        self._garbage = []
        return out

    def queued_component_frees(self) -> tuple[ComponentFree, ...]:
        """The component indices queued for `take_component_frees`, without taking them (for checks)."""
        return tuple(self._garbage)

    def evict_component(self, name: str, num_slots: int, tier: str = "device") -> int:
        """Free at least `num_slots` slots of component `name` on `tier` while the nodes stay.

        Unlocked values go in policy order; each also drops the higher-ranked components of its node
        (a sliding-window tombstone drops the node's Mamba state). The freed indices are queued for
        `take_component_frees`. Returns the slots of `name` freed (fewer when nothing more is evictable).

        Raises:
            ValueError: an unknown component or tier; TypeError: a count that is not an int.
        """
        comp = self._component_index.get(name)
        if comp is None:
            raise ValueError(f"name: unknown component {name!r}")
        if tier not in TIERS:
            raise ValueError(f"tier: expected 'device' or 'host', got {tier!r}")
        self._check_count(num_slots, "num_slots")
        leaves = self._comp_sets[(name, tier)]
        got = 0
        while got < num_slots:
            node = leaves.pop()
            if node is None:
                break
            got += self._drop_comp(node, comp, tier)
        return got

    def component_value(self, node: TreeNode, name: str, tier: str = "device") -> torch.Tensor | None:
        """`node`'s value of component `name` on `tier` (`None` when it holds none there)."""
        comps = node.components
        if comps is None:
            return None
        data = comps.get(name)
        return None if data is None else data.value(tier)

    def component_window(self, node: TreeNode, tier: str = "device") -> dict[str, torch.Tensor]:
        """The component indices a prefix ending at `node` uses on `tier`, root-first per component.

        For each component whose `valid_end` holds there: the values it reads (sliding window: the
        window's suffix values; Mamba: the node's state). Empty entries are omitted.
        """
        out: dict[str, torch.Tensor] = {}
        if self._components is None or node is self.root:
            return out
        for comp in self._components:
            reader = _Reader(self, comp.name, tier)
            if comp.valid_end(node, self.root, reader) and reader.parts:
                reader.parts.reverse()
                out[comp.name] = _cat(reader.parts)
        return out

    def valid_end(self, node: TreeNode, tier: str = "device") -> bool:
        """Whether every component allows a prefix ending at `node` on `tier` (always without components)."""
        comps = self._components
        if comps is None or node is self.root:
            return True
        return all(comp.valid_end(node, self.root, _Reader(self, comp.name, tier)) for comp in comps)

    def _valid_mixed(self, node: TreeNode) -> bool:
        """Valid once host-only nodes are loaded: device values on device nodes, host values on the rest."""
        comps = self._components
        assert comps is not None
        return all(comp.valid_end(node, self.root, _Reader(self, comp.name, None)) for comp in comps)

    def component_statistics(self) -> dict[str, ComponentStatistics]:
        """Per component: slots on each tier, in backups in flight, and queued for freeing (O(1))."""
        out: dict[str, ComponentStatistics] = {}
        for comp in self.components:
            device, host, pending = self._comp_slots[comp.name]
            garbage = [0, 0]
            for g in self._garbage:
                if g.component == comp.name:
                    garbage[TIERS.index(g.tier)] += int(g.indices.numel())
            out[comp.name] = ComponentStatistics(
                name=comp.name,
                device_slots=device,
                host_slots=host,
                pending_backup_slots=pending,
                evictable_device_nodes=len(self._comp_sets[(comp.name, "device")]),
                evictable_host_nodes=len(self._comp_sets[(comp.name, "host")]),
                queued_free_device_slots=garbage[0],
                queued_free_host_slots=garbage[1],
            )
        return out

    def component_indices_owned(self, name: str, tier: str) -> torch.Tensor:
        """Every index of component `name` on `tier` the tree holds or queued for freeing (O(tree), tests).

        Host indices of backups in flight are included on the host tier.
        """
        parts: list[torch.Tensor] = []
        for node in self.iter_nodes():
            comps = node.components
            data = None if comps is None else comps.get(name)
            if data is None:
                continue
            value = data.value(tier)
            if value is not None:
                parts.append(value)
            if tier == "host" and data.backup_pending is not None:
                parts.append(data.backup_pending)
        parts.extend(g.indices for g in self._garbage if g.component == name and g.tier == tier)
        return _cat(parts)

    def _match_hybrid(self, kb: bytes) -> MatchResult:
        """`match_prefix` with components: the walk of the base, then truncated to where every component
        allows a prefix to end (beyond the device part once its host-only nodes are loaded, else at the
        deepest valid device node)."""
        self._clock += 1
        tick = self._clock
        step = self._step
        end = len(kb)
        root = self.root
        node = root
        pos = 0
        path: list[TreeNode] = []
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                break
            ck = child.key
            if kb.startswith(ck, pos):
                matched = len(ck)
            else:
                matched = self._matched_bytes(kb, pos, ck)
                child = self._split(child, matched)
            child.last_access = tick
            path.append(child)
            pos += matched
            node = child
        k = 0
        while k < len(path) and path[k].device_value is not None:
            k += 1
        # Components need to be valid only where the prefix ends: first try to end beyond the device
        # part (once its host-only nodes are loaded), else at the deepest valid device node.
        j = len(path) - k
        while j > 0 and not self._valid_mixed(path[k + j - 1]):
            j -= 1
        i = k
        if j == 0:
            while i > 0 and not self.valid_end(path[i - 1], "device"):
                i -= 1
        device_nodes = path[:i]
        host_nodes = path[k : k + j]
        last_device = device_nodes[-1] if device_nodes else root
        last_host = root
        for n in reversed(path[: i + j]):
            if n.host_value is not None:
                last_host = n
                break
        device_values = tuple(n.device_value for n in device_nodes if n.device_value is not None)
        return MatchResult(
            kb,
            device_values,
            sum(n.num_tokens for n in device_nodes),
            sum(n.num_tokens for n in host_nodes),
            last_device,
            last_host,
            tuple(host_nodes),
            last_device._path_indices,
            self,
        )

    # ------------------------------------------------------------------ matching and inserting

    def match_prefix(self, key: KeyLike) -> MatchResult:
        """Find the longest cached page-aligned prefix of `key` on the device and, beyond it, on the host.

        A match ending inside a node splits it; every matched node's `last_access` is advanced. With
        components the match is truncated to the deepest node where every component allows a prefix to
        end (a complete sliding window, a Mamba state): at the deepest host-only node that is valid once
        loaded (device nodes before it need not be valid ends), else at the deepest valid device node.

        Args:
            key: the token key (bytes, `array('q')`, a 1-D integer tensor or a sequence of ints).

        Raises:
            TypeError, ValueError: for a key that cannot be converted (see `hicache.keys.as_key_bytes`).
        """
        # Fast path for the common key types (the conversion is otherwise `as_key_bytes`).
        kt = type(key)
        if kt is array and key.typecode == "q" and _LITTLE:  # type: ignore[union-attr]
            kb = key.tobytes()  # type: ignore[union-attr]
        elif kt is bytes and not len(key) & 7:
            kb = key
        else:
            kb = as_key_bytes(key)
        step = self._step
        end = len(kb)
        rem = end % step
        if rem:
            end -= rem
            kb = kb[:end]
        if self._components is not None:
            return self._match_hybrid(kb)
        self._clock = tick = self._clock + 1
        node = last_host = self.root
        pos = 0
        device_values: list[torch.Tensor] = []
        # The device stretch of the path (the common case) here; host-only nodes, which by device prefix
        # continuity only follow it, in `_match_host_tail`.
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                break
            ck = child.key
            if kb.startswith(ck, pos):
                pos += len(ck)
            else:
                matched = self._matched_bytes(kb, pos, ck)
                child = self._split(child, matched)
                pos += matched
            child.last_access = tick
            dv = child.device_value
            if dv is None:
                return self._match_host_tail(kb, pos, child, node, last_host, device_values, tick)
            device_values.append(dv)
            if child.host_value is not None:
                last_host = child
            node = child
        return MatchResult(
            kb, tuple(device_values), pos >> 3, 0, node, last_host, (), node._path_indices, self
        )

    def _match_host_tail(
        self,
        kb: bytes,
        pos: int,
        child: TreeNode,
        last_device: TreeNode,
        last_host: TreeNode,
        device_values: list[torch.Tensor],
        tick: int,
    ) -> MatchResult:
        """The rest of `match_prefix` from the first host-only node `child` (ending at `pos`) on."""
        step = self._step
        end = len(kb)
        device_end = pos - len(child.key)
        host_nodes = [child]
        if child.host_value is not None:
            last_host = child
        node = child
        while pos < end:
            nxt = node.children.get(kb[pos : pos + step])
            if nxt is None:
                break
            child = nxt
            ck = child.key
            if kb.startswith(ck, pos):
                pos += len(ck)
            else:
                matched = self._matched_bytes(kb, pos, ck)
                child = self._split(child, matched)
                pos += matched
            child.last_access = tick
            host_nodes.append(child)
            if child.host_value is not None:
                last_host = child
            node = child
        return MatchResult(
            kb,
            tuple(device_values),
            device_end >> 3,
            (pos - device_end) >> 3,
            last_device,
            last_host,
            tuple(host_nodes),
            last_device._path_indices,
            self,
        )

    def insert(
        self,
        key: KeyLike,
        device_indices: torch.Tensor,
        components: Mapping[str, torch.Tensor] | None = None,
    ) -> InsertResult:
        """Insert a key whose KV pages sit at `device_indices` on the device.

        Only the page-aligned part is inserted. Nodes that already hold device data are duplicates (the
        caller frees `device_indices[:prefix_len]`); host-only nodes on the path get the caller's device
        values re-attached; the rest becomes a new leaf. Every existing node on the path counts a hit, a
        new node starts at one hit (zero under write-back); nodes reaching the policy's threshold are
        returned in `backups`.

        Args:
            key: the token key.
            device_indices: a 1-D int64 tensor with one device index per token of the (unaligned) key.
            components: device indices of hybrid components by name: a sliding window's for a
                page-aligned suffix of the aligned key, a Mamba state's one slot (taken at the end of the
                key: kept only when the key is page-aligned). The tree takes ownership of all of them:
                nodes lacking a value on the device get their part, the rest is queued for
                `take_component_frees`.

        Raises:
            TypeError: a key, `device_indices` or component indices of the wrong type or dtype.
            ValueError: `device_indices` of the wrong shape or length, or malformed component values.
        """
        kt = type(key)
        if kt is array and key.typecode == "q" and _LITTLE:  # type: ignore[union-attr]
            kb = key.tobytes()  # type: ignore[union-attr]
        elif kt is bytes and not len(key) & 7:
            kb = key
        else:
            kb = as_key_bytes(key)
        ntok = len(kb) >> 3
        step = self._step
        end = len(kb)
        rem = end % step
        if rem:
            end -= rem
            kb = kb[:end]
        if not (
            type(device_indices) is torch.Tensor
            and device_indices.dtype is _INT64
            and device_indices.dim() == 1
            and device_indices.numel() == ntok
        ):
            _check_indices(device_indices, "device_indices", ntok)
        comp_values = self._component_inputs(components, "components", end >> 3) if components else None
        self._clock = tick = self._clock + 1
        backup_hits = self._backup_hits
        backups: list[TreeNode] = []
        root = node = self.root
        pos = 0
        prefix_bytes = 0
        # The caller's indices from the first non-duplicate token, copied once (the tree owns its values).
        values: torch.Tensor | None = None
        base = 0
        first = b""
        while pos < end:
            first = kb[pos : pos + step]
            child = node.children.get(first)
            if child is None:
                break
            ck = child.key
            if kb.startswith(ck, pos):
                matched = len(ck)
            else:
                matched = self._matched_bytes(kb, pos, ck)
                child = self._split(child, matched)
            child.last_access = tick
            child.hit_count += 1
            if child.device_value is not None:
                prefix_bytes += matched
            else:
                if values is None:
                    base = pos >> 3
                    values = device_indices.narrow_copy(0, base, (end >> 3) - base)
                self._set_device(child, values[(pos >> 3) - base : (pos + matched >> 3) - base])
            if (
                backup_hits is not None
                and child.hit_count >= backup_hits
                and child.host_value is None
                and child.backup_pending is None
            ):
                backups.append(child)
            pos += matched
            node = child
        if pos < end:
            # A new device leaf below `node` (what `_new_node` and `_set_device` do, inlined: the leaf
            # holds no lock, no backup and no component yet).
            start = pos >> 3
            if values is None:
                value = device_indices.narrow_copy(0, start, (end >> 3) - start)
            else:
                value = values[start - base :]
            leaf = TreeNode(next(self._ids), node, kb[pos:] if pos else kb, self._ctx)
            node.children[first] = leaf
            self._num_nodes += 1
            leaf.last_access = tick
            if backup_hits is not None:
                leaf.hit_count = 1
                if backup_hits <= 1:
                    backups.append(leaf)
            leaf.device_value = value
            n = (end - pos) >> 3
            self._device_tokens += n
            self._evictable_size += n
            if node is not root:
                node._dev_children += 1
                self._refresh(node)
            else:
                node._dev_children += 1
            self._device_leaves.add(leaf)
            node = leaf
        if comp_values:
            self._attach_components(self._key_path(kb, root), 0, end >> 3, ntok, comp_values, "device")
        return InsertResult(prefix_bytes >> 3, end >> 3, node, tuple(backups) if backups else ())

    def _key_path(self, kb: bytes, start: TreeNode) -> list[TreeNode]:
        """The nodes below `start` that exactly cover `kb` (after an insert, every boundary is a node's)."""
        path: list[TreeNode] = []
        step = self._step
        node = start
        pos = 0
        while pos < len(kb):
            child = node.children[kb[pos : pos + step]]
            path.append(child)
            pos += len(child.key)
            node = child
        return path

    def insert_host(
        self,
        anchor: TreeNode,
        key: KeyLike,
        host_indices: torch.Tensor,
        hashes: list[bytes] | None = None,
        components: Mapping[str, torch.Tensor] | None = None,
    ) -> InsertResult:
        """Attach a storage refill (host pages) below `anchor`.

        `key` continues from the end of `anchor`'s key. Tokens already in the tree count as present (the
        caller frees `host_indices[:prefix_len]`). If the rest would hang below a node that is neither the
        root nor backed up and the policy is not write-back, nothing is attached and
        `host_insert_dropped` is set: the caller frees every host index.

        Args:
            anchor: a live node of this tree (the match's last host node, host-locked by the caller).
            key: the refill's tokens, continuing from the anchor's end.
            host_indices: a 1-D int64 tensor with one host index per token of `key`.
            hashes: the precomputed page hashes of the page-aligned `key`, if known.
            components: host indices of hybrid components by name, as for `insert` (relative to `key`).
                Unless the refill is dropped, the tree takes ownership of them (what no node takes is
                queued for `take_component_frees`); a dropped refill leaves them to the caller.

        Raises:
            TypeError, ValueError: for a dead anchor or malformed key, indices or hashes.
        """
        anchor = self._require_live(anchor, "anchor")
        kb, ntok = self._aligned_key(key)
        _check_indices(host_indices, "host_indices", ntok)
        comp_values = self._component_inputs(components, "components", len(kb) >> 3) if components else None
        step = self._step
        end = len(kb)
        if hashes is not None:
            if not isinstance(hashes, list) or not all(isinstance(h, bytes) and len(h) == 16 for h in hashes):
                raise TypeError("hashes: expected a list of 16-byte hashes")
            if len(hashes) != end // step:
                raise ValueError(f"hashes: expected {end // step} page hashes, got {len(hashes)}")
        # A dry walk first: a dropped refill must leave the tree untouched (no split either).
        node = anchor
        pos = 0
        attach_backed = True
        attach_id = node.id
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                attach_backed = node is self.root or node.host_value is not None
                attach_id = node.id
                break
            matched = self._matched_bytes(kb, pos, child.key)
            pos += matched
            if matched < len(child.key):
                attach_backed = child.host_value is not None
                attach_id = child.id
                break
            node = child
        if pos < end and not attach_backed and self.write_policy is not _WB:
            logger.info(
                "insert_host dropped %d refill tokens: attach point node %d is not backed up",
                (end - pos) >> 3,
                attach_id,
            )
            return InsertResult(0, 0, anchor, (), True)
        self._clock += 1
        tick = self._clock
        node = anchor
        pos = 0
        while pos < end:
            child = node.children.get(kb[pos : pos + step])
            if child is None:
                break
            matched = self._matched_bytes(kb, pos, child.key)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = tick
            pos += matched
            node = child
        prefix = pos >> 3
        if pos < end:
            leaf = self._new_node(node, kb[pos:])
            leaf.last_access = tick
            if hashes is not None:
                leaf._hashes = hashes[pos // step :]
            self._set_host(leaf, host_indices[prefix : end >> 3].clone())
            self._refresh(node)
            node = leaf
        if comp_values:
            self._attach_components(self._key_path(kb, anchor), 0, end >> 3, ntok, comp_values, "host")
        return InsertResult(prefix, end >> 3, node)

    # ------------------------------------------------------------------ device -> host backups

    def backup_chain(self, node: TreeNode) -> list[TreeNode]:
        """The nodes to back up so that `node` can be backed up: from the topmost un-backed, not-pending
        ancestor down to `node`, root-first ([] if `node` is detached, backed up or pending)."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"node: expected a TreeNode, got {type(node).__name__}")
        try:
            self._require_non_root(node)
        except ValueError:
            return []
        chain: list[TreeNode] = []
        cur = node
        while cur is not self.root and cur.host_value is None and cur.backup_pending is None:
            chain.append(cur)
            assert cur.parent is not None
            cur = cur.parent
        chain.reverse()
        return chain

    def begin_backup(
        self,
        node: TreeNode,
        host_indices: torch.Tensor,
        components: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Record a device-to-host backup of `node` in flight to `host_indices`; device-locks its path.

        Args:
            node: a device node that is neither backed up nor pending.
            host_indices: one host index per token of the node.
            components: host indices for the node's component device values, by name (each as long as
                the device value it copies); committed and aborted with the base backup.

        Raises:
            ValueError: the node holds no device data, is backed up or pending, or the indices mismatch.
        """
        node = self._require_non_root(node)
        _check_indices(host_indices, "host_indices", node.num_tokens)
        if node.device_value is None:
            raise ValueError(f"node: node {node.id} holds no device data to back up")
        if node.host_value is not None or node.backup_pending is not None:
            raise ValueError(f"node: node {node.id} is already backed up or has a backup in flight")
        if components:
            self._check_component_backup(node, components)
        node.backup_pending = host_indices
        node._backup_owner = None
        self._pending_tokens += node.num_tokens
        if components:
            for name, value in components.items():
                data = self._cdata(node, name)
                data.backup_pending = value
                self._comp_slots[name][2] += int(value.shape[0])
                self._refresh_comp(node, name, data)
        self.lock_device(node)

    def _check_component_backup(self, node: TreeNode, components: Mapping[str, torch.Tensor]) -> None:
        if self._components is None:
            raise ValueError("components: this tree has no components")
        for name, value in components.items():
            if name not in self._component_index:
                raise ValueError(f"components: unknown component {name!r}")
            device = self.component_value(node, name, "device")
            if device is None:
                raise ValueError(f"components[{name!r}]: node {node.id} holds no {name} value on the device")
            if self.component_value(node, name, "host") is not None:
                raise ValueError(f"components[{name!r}]: node {node.id} already holds a {name} host value")
            _check_indices(value, f"components[{name!r}]", int(device.shape[0]))

    def _settle_component_backup(self, member: TreeNode, commit: bool) -> None:
        comps = member.components
        if comps is None:
            return
        for name, data in comps.items():
            pending = data.backup_pending
            if pending is None:
                continue
            data.backup_pending = None
            self._comp_slots[name][2] -= int(pending.shape[0])
            if commit and data.device_value is not None and data.host_value is None:
                self._set_comp(member, name, "host", pending)
            else:
                self._discard(name, "host", pending)
                self._refresh_comp(member, name, data)

    def _pending_group(self, node: TreeNode) -> list[TreeNode]:
        """`node` and the upper parts split off it while its backup was in flight, root-first."""
        group = [node]
        cur = node.parent
        while cur is not None and cur._backup_owner is node and cur.backup_pending is not None:
            group.append(cur)
            cur = cur.parent
        group.reverse()
        return group

    def commit_backup(self, node: TreeNode) -> None:
        """The backup of `node` completed: its pending host indices become its host value; unlocks.

        Upper parts split off the node while the backup was in flight are committed with it.

        Raises:
            ValueError: no backup in flight, or (except under write-back) the parent is neither the root
                nor backed up: chains are committed root-first.
        """
        node = self._require_non_root(node)
        if node.backup_pending is None:
            raise ValueError(f"node: node {node.id} has no backup in flight")
        group = self._pending_group(node)
        top_parent = group[0].parent
        if self.write_policy is not _WB and top_parent is not self.root:
            assert top_parent is not None
            if top_parent.host_value is None:
                raise ValueError(
                    f"node: cannot commit the backup of node {node.id} before its parent {top_parent.id} "
                    "is backed up (commit chains root-first)"
                )
        for member in group:
            pending = member.backup_pending
            member.backup_pending = None
            member._backup_owner = None
            self._pending_tokens -= member.num_tokens
            self._set_host(member, pending)
            if member.components is not None:
                self._settle_component_backup(member, True)
        self.unlock_device(node)

    def abort_backup(self, node: TreeNode) -> torch.Tensor:
        """The backup of `node` failed or was cancelled: unlock and return its host indices to free.

        Component host indices of the backup are queued for `take_component_frees`.

        Raises:
            ValueError: no backup in flight.
        """
        node = self._require_non_root(node)
        if node.backup_pending is None:
            raise ValueError(f"node: node {node.id} has no backup in flight")
        parts = []
        for member in self._pending_group(node):
            pending = member.backup_pending
            assert pending is not None
            parts.append(pending)
            member.backup_pending = None
            member._backup_owner = None
            self._pending_tokens -= member.num_tokens
            if member.components is not None:
                self._settle_component_backup(member, False)
        self.unlock_device(node)
        return _cat(parts)

    # ------------------------------------------------------------------ host -> device and demotion

    def attach_device(
        self,
        node: TreeNode,
        device_indices: torch.Tensor,
        components: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Record that a host-only node was loaded back to the device at `device_indices`.

        Args:
            node: a host-only node whose parent is on the device (or the root).
            device_indices: one device index per token of the node.
            components: device indices of component values loaded with it, by name (each as long as the
                node's host value of that component).

        Raises:
            ValueError: the node is not host-only, its parent is not on the device, or a length mismatch.
        """
        node = self._require_non_root(node)
        _check_indices(device_indices, "device_indices", node.num_tokens)
        if node.device_value is not None or node.host_value is None:
            raise ValueError(f"node: node {node.id} is not host-only")
        parent = node.parent
        assert parent is not None
        if parent is not self.root and parent.device_value is None:
            raise ValueError(f"node: the parent {parent.id} of node {node.id} is not on the device")
        if components:
            if self._components is None:
                raise ValueError("components: this tree has no components")
            for name, value in components.items():
                if name not in self._component_index:
                    raise ValueError(f"components: unknown component {name!r}")
                host = self.component_value(node, name, "host")
                if host is None:
                    raise ValueError(
                        f"components[{name!r}]: node {node.id} holds no {name} value on the host"
                    )
                _check_indices(value, f"components[{name!r}]", int(host.shape[0]))
        self._set_device(node, device_indices)
        if components:
            for name, value in components.items():
                self._set_comp(node, name, "device", value)

    def demote(self, node: TreeNode) -> torch.Tensor:
        """Drop the device copy of a backed-up node and return its device indices for the caller to free.

        Raises:
            ValueError: the node is not backed up, holds no device data, is device-locked, or has a child
                on the device.
        """
        node = self._require_non_root(node)
        dv = node.device_value
        if dv is None:
            raise ValueError(f"node: node {node.id} holds no device data")
        if node.host_value is None:
            raise ValueError(f"node: node {node.id} is not backed up")
        if node.device_lock:
            raise ValueError(f"node: node {node.id} is device-locked")
        if node._dev_children:
            raise ValueError(f"node: node {node.id} has a child on the device")
        self._set_device(node, None)
        return dv

    # ------------------------------------------------------------------ locks and priority

    def _path(self, node: object) -> list[TreeNode]:
        live = self._require_live(node)
        path = []
        cur = live
        while cur is not self.root:
            path.append(cur)
            assert cur.parent is not None
            cur = cur.parent
        return path

    def _lock_components(self, path: list[TreeNode], tier: str, delta: int) -> None:
        """Per-component locks: along the whole path, or on the locked node only (`lock_path`)."""
        assert self._components is not None
        for comp in self._components:
            name = comp.name
            for cur in path if comp.lock_path else path[:1]:
                data = self._cdata(cur, name)
                if tier == "device":
                    data.device_lock += delta
                else:
                    data.host_lock += delta
                self._refresh_comp(cur, name, data)

    def lock_device(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from device eviction (counted; the root is excluded).

        Components are locked too: along the path, or only at `node` for those without `lock_path`.
        """
        path = self._path(node)
        for cur in path:
            cur.device_lock += 1
            if cur.device_lock == 1:
                if cur.device_value is not None:
                    n = cur.num_tokens
                    self._evictable_size -= n
                    self._protected_size += n
                elif cur.host_value is not None and not cur.host_lock:
                    self._reclaimable_host -= cur.num_tokens
                self._refresh(cur)
        if self._components is not None and path:
            self._lock_components(path, "device", 1)

    def unlock_device(self, node: TreeNode) -> None:
        """Release one device lock on `node` and its ancestors.

        Raises:
            ValueError: the node is not device-locked.
        """
        path = self._path(node)
        if path and path[0].device_lock <= 0:
            raise ValueError(f"node: node {path[0].id} is not device-locked")
        for cur in path:
            cur.device_lock -= 1
            if cur.device_lock == 0:
                if cur.device_value is not None:
                    n = cur.num_tokens
                    self._evictable_size += n
                    self._protected_size -= n
                elif cur.host_value is not None and not cur.host_lock:
                    self._reclaimable_host += cur.num_tokens
                self._refresh(cur)
        if self._components is not None and path:
            self._lock_components(path, "device", -1)

    def lock_host(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from host eviction (counted; the root is excluded)."""
        path = self._path(node)
        for cur in path:
            cur.host_lock += 1
            if cur.host_lock == 1:
                if cur.host_value is not None:
                    self._evictable_host -= cur.num_tokens
                    if cur.device_value is None and not cur.device_lock:
                        self._reclaimable_host -= cur.num_tokens
                self._refresh(cur)
        if self._components is not None and path:
            self._lock_components(path, "host", 1)

    def unlock_host(self, node: TreeNode) -> None:
        """Release one host lock on `node` and its ancestors.

        Raises:
            ValueError: the node is not host-locked.
        """
        path = self._path(node)
        if path and path[0].host_lock <= 0:
            raise ValueError(f"node: node {path[0].id} is not host-locked")
        for cur in path:
            cur.host_lock -= 1
            if cur.host_lock == 0:
                if cur.host_value is not None:
                    self._evictable_host += cur.num_tokens
                    if cur.device_value is None and not cur.device_lock:
                        self._reclaimable_host += cur.num_tokens
                self._refresh(cur)
        if self._components is not None and path:
            self._lock_components(path, "host", -1)

    def set_priority(self, node: TreeNode, priority: int) -> None:
        """Set the eviction priority of `node` (lower goes first under the priority policy)."""
        node = self._require_non_root(node)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority: expected an int, got {type(priority).__name__}")
        node.priority = priority
        if node in self._device_leaves:
            self._device_leaves.push(node)
        if node in self._host_leaves:
            self._host_leaves.push(node)
        for leaves in self._comp_sets.values():
            if node in leaves:
                leaves.push(node)

    # ------------------------------------------------------------------ eviction

    @staticmethod
    def _check_count(value: object, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name}: must be >= 0, got {value}")
        return value

    def evict_device(self, num_tokens: int, host_free_tokens: int = 0) -> EvictResult:
        """Free at least `num_tokens` device tokens from evictable device leaves, in policy order.

        Three cases for each leaf: a backed-up leaf is demoted (its device pages freed); an un-backed
        one is deleted (write-through: nothing below it is backed up either), or under write-back
        backed up first when its whole un-backed chain fits in the host room left (`backups`), and
        dropped with its host-only subtree when it does not, so eviction never waits on a host too
        small for the backup. A host-locked un-backed leaf can be neither dropped nor deleted: it is
        backed up when its chain fits (write-back), else kept. Stops early (a value, not an error) when
        nothing more is evictable.

        Args:
            num_tokens: device tokens wanted.
            host_free_tokens: host tokens the caller can provide for write-back backups (free pages plus
                what `evict_host` can reclaim: `statistics().reclaimable_host_tokens`).

        Raises:
            TypeError, ValueError: a count that is not a non-negative int.
        """
        self._check_count(num_tokens, "num_tokens")
        room = self._check_count(host_free_tokens, "host_free_tokens")
        leaves = self._device_leaves
        write_back = self.write_policy is _WB
        root = self.root
        freed_device: list[torch.Tensor] = []
        freed_host: list[torch.Tensor] = []
        backups: list[tuple[TreeNode, ...]] = []
        planned: set[TreeNode] = set()  # nodes of the chains in `backups`
        skipped: dict[TreeNode, None] = {}  # kept (pushed back at the end), in order
        got = dropped = 0
        while got < num_tokens:
            node = leaves.pop()
            if node is None:
                break
            if node in skipped:  # a second heap entry of a node kept earlier in this call
                continue
            n = len(node.key) >> 3
            dv = node.device_value
            assert dv is not None
            if node.host_value is not None:
                self._set_device(node, None)
                freed_device.append(dv)
                got += n
                continue
            if write_back:
                # What the backup really needs: the whole un-backed chain above the leaf, less what an
                # earlier chain of this plan already backs up.
                chain: list[TreeNode] = []
                cost = 0
                cur = node
                while (
                    cur is not root
                    and cur.host_value is None
                    and cur.backup_pending is None
                    and cur not in planned
                ):
                    chain.append(cur)
                    cost += len(cur.key) >> 3
                    if cost > room:
                        break
                    assert cur.parent is not None
                    cur = cur.parent
                if cost <= room:
                    room -= cost
                    chain.reverse()
                    planned.update(chain)
                    backups.append(tuple(chain))
                    skipped[node] = None
                    got += n
                    continue
            if node.host_lock:  # dropping would take host-locked pages with it
                skipped[node] = None
            elif write_back:
                self._drop_subtree(node, freed_device, freed_host)
                got += n
                dropped += n
            elif not node.children:
                self._detach(node)
                freed_device.append(dv)
                got += n
                dropped += n
            else:  # excluded by the write-through invariant (no backed-up child of an un-backed node)
                skipped[node] = None
        for node in skipped:
            leaves.push(node)
        backup_tokens = host_free_tokens - room
        return EvictResult(_cat(freed_device), _cat(freed_host), got, tuple(backups), backup_tokens, dropped)

    def _drop_subtree(
        self, node: TreeNode, freed_device: list[torch.Tensor], freed_host: list[torch.Tensor]
    ) -> None:
        """Delete `node` and its (host-only, unlocked) descendants, collecting their indices."""
        stack = [node]
        order: list[TreeNode] = []
        while stack:
            cur = stack.pop()
            order.append(cur)
            stack.extend(cur.children.values())
        for cur in reversed(order):  # children before parents
            if cur.device_value is not None:
                freed_device.append(cur.device_value)
            if cur.host_value is not None:
                freed_host.append(cur.host_value)
            self._detach(cur)

    def evict_host(self, num_tokens: int) -> HostEvictResult:
        """Free at least `num_tokens` host tokens by removing host-only leaves in policy order.

        Stops early (a value, not an error) when nothing more is evictable.

        Raises:
            TypeError, ValueError: a count that is not a non-negative int.
        """
        self._check_count(num_tokens, "num_tokens")
        leaves = self._host_leaves
        freed: list[torch.Tensor] = []
        got = 0
        while got < num_tokens:
            node = leaves.pop()
            if node is None:
                break
            hv = node.host_value
            assert hv is not None
            freed.append(hv)
            got += len(node.key) >> 3
            self._detach(node)
        return HostEvictResult(_cat(freed), got)

    # ------------------------------------------------------------------ observation

    def statistics(self) -> TreeStatistics:
        """A snapshot of the tree's sizes (O(1): the counters are kept incrementally)."""
        return TreeStatistics(
            num_nodes=self._num_nodes,
            device_tokens=self._device_tokens,
            host_tokens=self._host_tokens,
            pending_backup_tokens=self._pending_tokens,
            evictable_device_tokens=self._evictable_size,
            protected_device_tokens=self._protected_size,
            evictable_host_tokens=self._evictable_host,
            reclaimable_host_tokens=self._reclaimable_host,
        )

    def evictable_size(self) -> int:
        """Device tokens in nodes without a device lock."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Device tokens in device-locked nodes."""
        return self._protected_size

    def iter_nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children (O(tree): for tests and diagnostics)."""
        out: list[TreeNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def device_tokens_owned(self) -> torch.Tensor:
        """Every device index the tree holds (O(tree): for exact pool accounting in tests)."""
        return _cat([n.device_value for n in self.iter_nodes() if n.device_value is not None])

    def host_tokens_owned(self) -> torch.Tensor:
        """Every host index the tree holds, pending backups included (O(tree): for pool accounting)."""
        parts = []
        for n in self.iter_nodes():
            if n.host_value is not None:
                parts.append(n.host_value)
            if n.backup_pending is not None:
                parts.append(n.backup_pending)
        return _cat(parts)

    def sanity_check(self) -> None:
        """Check every invariant of the tree (O(tree)).

        Raises:
            InvariantViolation: listing every violated invariant.
        """
        from hicache.tree.sanity import check_tree

        check_tree(self)

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"RadixTree(page_size={self.page_size}, write_policy={self.write_policy.value}, "
            f"eviction_policy={self.eviction_policy.value}, nodes={s.num_nodes}, device_tokens="
            f"{s.device_tokens}, host_tokens={s.host_tokens}, "
            f"pending_backup_tokens={s.pending_backup_tokens}, "
            f"evictable_device_tokens={s.evictable_device_tokens}, device_leaves={len(self._device_leaves)}, "
            f"host_leaves={len(self._host_leaves)})"
        )
