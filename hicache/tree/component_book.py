"""Hybrid components' per-node bookkeeping: values per tier, locks, counters, evictable sets, cascades.

Hybrid components keep their per-node data in `node.components` (`ComponentData` records); the rules
that differ between kinds (splitting, where a prefix may end, spreading inserted values) are the
components' hooks, which see values and token counts, never nodes. Every index the book lets go of is
collected in `frees` until the operation that caused it returns it in its result.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from hicache.components.base import TIERS, Component
from hicache.policy import EvictionPolicy
from hicache.tree.checks import cat_indices, check_indices
from hicache.tree.leaf_set import LeafSet
from hicache.tree.node import ComponentData, TreeNode
from hicache.tree.results import ComponentFree, ComponentStatistics

__all__ = ["ComponentBook"]


def _recording(
    values: Iterator[tuple[int, torch.Tensor | None]], parts: list[torch.Tensor]
) -> Iterator[tuple[int, torch.Tensor | None]]:
    """`values`, appending to `parts` each value the reader actually reads."""
    for n, value in values:
        if value is not None:
            parts.append(value)
        yield n, value


class _Slots:
    """Slots one component holds on the device, on the host, and in backups in flight."""

    __slots__ = ("device", "host", "pending")

    def __init__(self) -> None:
        self.device = 0
        self.host = 0
        self.pending = 0


class ComponentBook:
    """The per-node values of a tree's hybrid components, and every counter and set over them.

    Args:
        components: the components (distinct names, none called `"full"`).
        policy: the eviction policy ordering each component's evictable nodes.
        page_size: the tree's page size (for checking values).

    Raises:
        TypeError: a member that is not a `Component`.
        ValueError: two components with one name, or one named `"full"`.
    """

    def __init__(self, components: Sequence[Component], policy: EvictionPolicy, page_size: int) -> None:
        seen: dict[str, Component] = {}
        for comp in components:
            if not isinstance(comp, Component):
                raise TypeError(f"components: expected Component objects, got {type(comp).__name__}")
            if comp.name in seen or comp.name == "full":
                raise ValueError(f"components: the name {comp.name!r} is taken")
            seen[comp.name] = comp
        self.page_size = page_size
        self.components: tuple[Component, ...] = tuple(sorted(components, key=lambda c: c.rank))
        self.index = seen
        self.slots = {comp.name: _Slots() for comp in self.components}
        self.sets: dict[tuple[str, str], LeafSet] = {
            (c.name, str(tier)): LeafSet(policy) for c in self.components for tier in TIERS
        }
        self.frees: list[ComponentFree] = []

    def take_frees(self) -> tuple[ComponentFree, ...]:
        """The indices let go of since the last call (what the operation that just ran returns)."""
        out = tuple(self.frees)
        self.frees.clear()
        return out

    # ------------------------------------------------------------------ one node's data

    def data(self, node: TreeNode, name: str) -> ComponentData:
        """`node`'s record of component `name`, created empty when missing."""
        comps = node.components
        if comps is None:
            comps = node.components = {}
        data = comps.get(name)
        if data is None:
            data = comps[name] = ComponentData()
        return data

    @staticmethod
    def value(node: TreeNode, name: str, tier: str) -> torch.Tensor | None:
        """`node`'s value of component `name` on `tier` (`None` when it holds none there)."""
        comps = node.components
        if comps is None:
            return None
        data = comps.get(name)
        return None if data is None else data.value(tier)

    def refresh(self, node: TreeNode, name: str, data: ComponentData) -> None:
        """Recompute whether `node`'s value of `name` can be evicted, on each tier."""
        dev = self.sets[(name, "device")]
        if data.device_value is not None and not data.device_lock and data.backup_pending is None:
            dev.add(node)
        else:
            dev.discard(node)
        host = self.sets[(name, "host")]
        if data.host_value is not None and not data.host_lock:
            host.add(node)
        else:
            host.discard(node)

    def set(self, node: TreeNode, name: str, tier: str, value: torch.Tensor | None) -> None:
        """Set `node`'s value of `name` on `tier`, keeping the counters and sets (the old value is not freed)."""
        data = self.data(node, name)
        old = data.value(tier)
        counts = self.slots[name]
        delta = (0 if value is None else int(value.shape[0])) - (0 if old is None else int(old.shape[0]))
        if tier == "device":
            counts.device += delta
            data.device_value = value
        else:
            counts.host += delta
            data.host_value = value
        self.refresh(node, name, data)

    def discard(self, name: str, tier: str, value: torch.Tensor | None) -> None:
        """Let go of `value` (collected in `frees`)."""
        if value is not None and value.numel():
            self.frees.append(ComponentFree(name, tier, value))

    def drop_cascade(self, node: TreeNode, comp: Component, tier: str) -> int:
        """Drop `comp`'s value on `tier` and, cascading, every higher-ranked component's; slots of `comp`."""
        comps = node.components
        assert comps is not None
        freed = 0
        for other in self.components:
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
            self.set(node, other.name, tier, None)
            self.discard(other.name, tier, value)
        return freed

    def drop_all(self, node: TreeNode, tier: str) -> None:
        """The base value on `tier` is going: every component value there goes with it."""
        comps = node.components
        assert comps is not None
        for name, data in comps.items():
            value = data.value(tier)
            if value is not None:
                self.set(node, name, tier, None)
                self.discard(name, tier, value)

    def split(self, node: TreeNode, upper: TreeNode, tokens: int) -> None:
        """`node`'s first `tokens` tokens became its new parent `upper`: split every component value."""
        comps = node.components
        assert comps is not None
        n = node.num_tokens
        for name, data in comps.items():
            comp = self.index[name]
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
            self.refresh(node, name, data)
            self.refresh(upper, name, up)

    # ------------------------------------------------------------------ inserting

    def inputs(
        self, components: Mapping[str, torch.Tensor], name: str, aligned: int
    ) -> dict[str, torch.Tensor]:
        """Validate a mapping of component values for a key of `aligned` tokens; cloned (the tree owns them)."""
        if not isinstance(components, Mapping):
            raise TypeError(f"{name}: expected a mapping of component name to indices")
        out: dict[str, torch.Tensor] = {}
        for cname, value in components.items():
            comp = self.index.get(cname)
            if comp is None:
                raise ValueError(f"{name}: unknown component {cname!r}")
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
                raise TypeError(f"{name}[{cname!r}]: expected a 1-D int64 tensor")
            if aligned and (problem := comp.check_value(value, aligned, self.page_size)) is not None:
                raise ValueError(f"{name}[{cname!r}]: {problem}")
            out[cname] = value.clone()
        return out

    def attach(
        self,
        path: list[TreeNode],
        start: int,
        end: int,
        key_tokens: int,
        values: dict[str, torch.Tensor],
        tier: str,
    ) -> None:
        """Spread `values` over `path` (nodes covering tokens [start, end)); the rest is let go of."""
        spans: list[tuple[int, int]] = []
        pos = start
        for node in path:
            spans.append((pos, pos + node.num_tokens))
            pos += node.num_tokens
        assert pos == end
        for cname, value in values.items():
            comp = self.index[cname]
            parts = comp.distribute(spans, value, end, key_tokens) if spans else []
            if all(part is None for part in parts):
                self.discard(cname, tier, value)
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
                    self.discard(cname, tier, part)
                else:
                    self.set(node, cname, tier, part)
                    self.discard(cname, tier, held)

    # ------------------------------------------------------------------ backups, load-back, locks

    def check_backup(self, node: TreeNode, components: Mapping[str, torch.Tensor]) -> None:
        """Validate the host indices of a backup of `node`'s component device values."""
        self._check_copies(node, components, "device")

    def _check_copies(self, node: TreeNode, components: Mapping[str, torch.Tensor], source: str) -> None:
        """Validate indices for copies of `node`'s component values on `source` to the other tier: a
        known component, a value on `source` (and, for a backup, none on the host yet), as many entries."""
        for name, value in components.items():
            if name not in self.index:
                raise ValueError(f"components: unknown component {name!r}")
            held = self.value(node, name, source)
            if held is None:
                raise ValueError(
                    f"components[{name!r}]: node {node.id} holds no {name} value on the {source}"
                )
            if source == "device" and self.value(node, name, "host") is not None:
                raise ValueError(f"components[{name!r}]: node {node.id} already holds a {name} host value")
            check_indices(value, f"components[{name!r}]", int(held.shape[0]))

    def begin_backup(self, node: TreeNode, components: Mapping[str, torch.Tensor]) -> None:
        """Record component backups of `node` in flight (validated by `check_backup`)."""
        for name, value in components.items():
            data = self.data(node, name)
            data.backup_pending = value
            self.slots[name].pending += int(value.shape[0])
            self.refresh(node, name, data)

    def settle_backup(self, member: TreeNode, commit: bool) -> None:
        """The component backups of `member` completed (`commit`) or failed: host values or frees."""
        comps = member.components
        if comps is None:
            return
        for name, data in comps.items():
            pending = data.backup_pending
            if pending is None:
                continue
            data.backup_pending = None
            self.slots[name].pending -= int(pending.shape[0])
            if commit and data.device_value is not None and data.host_value is None:
                self.set(member, name, "host", pending)
            else:
                self.discard(name, "host", pending)
                self.refresh(member, name, data)

    def check_attach(self, node: TreeNode, components: Mapping[str, torch.Tensor]) -> None:
        """Validate device indices for `node`'s component host values being loaded back."""
        self._check_copies(node, components, "host")

    def lock(self, path: list[TreeNode], tier: str, delta: int) -> None:
        """Per-component locks: along the whole path (deepest first), or on its first node only."""
        for comp in self.components:
            name = comp.name
            for cur in path if comp.lock_path else path[:1]:
                data = self.data(cur, name)
                if tier == "device":
                    data.device_lock += delta
                else:
                    data.host_lock += delta
                self.refresh(cur, name, data)

    # ------------------------------------------------------------------ queries

    def _path_values(
        self, node: TreeNode, root: TreeNode, name: str, tier: str | None
    ) -> Iterator[tuple[int, torch.Tensor | None]]:
        """(tokens, value) of `name` from `node` up to the root; tier `None`: the device value on device
        nodes and the host value on the others (the state after loading the host-only nodes back)."""
        cur = node
        while cur is not root:
            t = tier if tier is not None else ("device" if cur.device_value is not None else "host")
            yield cur.num_tokens, self.value(cur, name, t)
            assert cur.parent is not None
            cur = cur.parent

    def valid_end(self, node: TreeNode, root: TreeNode, tier: str | None) -> bool:
        """Whether every component allows a prefix ending at `node` on `tier` (`None`: mixed, see above)."""
        return all(comp.valid_end(self._path_values(node, root, comp.name, tier)) for comp in self.components)

    def window(self, node: TreeNode, root: TreeNode, tier: str) -> dict[str, torch.Tensor]:
        """The component indices a prefix ending at `node` uses on `tier`, root-first per component."""
        out: dict[str, torch.Tensor] = {}
        for comp in self.components:
            parts: list[torch.Tensor] = []
            values = self._path_values(node, root, comp.name, tier)
            if comp.valid_end(_recording(values, parts)) and parts:
                parts.reverse()
                out[comp.name] = cat_indices(parts)
        return out

    def statistics(self) -> dict[str, ComponentStatistics]:
        """Per component: slots on each tier and in backups in flight, and evictable nodes."""
        out: dict[str, ComponentStatistics] = {}
        for comp in self.components:
            slots = self.slots[comp.name]
            out[comp.name] = ComponentStatistics(
                name=comp.name,
                device_slots=slots.device,
                host_slots=slots.host,
                pending_backup_slots=slots.pending,
                evictable_device_nodes=len(self.sets[(comp.name, "device")]),
                evictable_host_nodes=len(self.sets[(comp.name, "host")]),
            )
        return out

    def indices_owned(self, nodes: list[TreeNode], name: str, tier: str) -> torch.Tensor:
        """Every index of `name` on `tier` held by `nodes` (pending backups on the host tier)."""
        parts: list[torch.Tensor] = []
        for node in nodes:
            comps = node.components
            data = None if comps is None else comps.get(name)
            if data is None:
                continue
            value = data.value(tier)
            if value is not None:
                parts.append(value)
            if tier == "host" and data.backup_pending is not None:
                parts.append(data.backup_pending)
        return cat_indices(parts)
