"""The radix tree of KV pages: pure, synchronous bookkeeping over the device and host tiers.

The tree decides and the controller executes: operations return records (`MatchResult`, `InsertResult`,
`EvictResult`, ...) saying which indices to free and which nodes to back up; the tree never awaits and
never touches a pool or a storage backend. `RadixTree` puts together the parts, one module each: the
state and its bookkeeping (`state`), matching and queries (`matching`), inserting (`inserting`), backups
and locks (`backups`), load-back (`load_back`), eviction planning (`eviction`) and hybrid components
(`component_book`). Callers hold `NodeRef` handles (`handles`), never nodes.
"""

from __future__ import annotations

import torch

from hicache.components.base import Component
from hicache.tree.checks import check_tier
from hicache.tree.eviction import Eviction
from hicache.tree.handles import ComponentInfo, NodeRef
from hicache.tree.inserting import Inserting
from hicache.tree.load_back import LoadBack
from hicache.tree.results import EMPTY_INDICES, BranchStatistics, ComponentStatistics
from hicache.tree.sanity import check_tree

__all__ = ["RadixTree"]


class RadixTree(LoadBack, Inserting, Eviction):
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

    # ------------------------------------------------------------------ components

    @property
    def components(self) -> tuple[Component, ...]:
        """The tree's components in eviction order (lowest rank first); empty without components."""
        return self._book.components if self._book is not None else ()

    def component_value(self, node: NodeRef, name: str, tier: str = "device") -> torch.Tensor | None:
        """`node`'s value of component `name` on `tier` (`None` when it holds none there)."""
        live = self._require_live(node)
        if self._book is None:
            return None
        return self._book.value(live, name, tier)

    def component_info(self, node: NodeRef) -> dict[str, ComponentInfo]:
        """A snapshot of every component record `node` holds, by component name (empty without any).

        Raises:
            TypeError, ValueError: `node` is not a handle on a live node of this tree.
        """
        live = self._require_live(node)
        return {
            name: ComponentInfo(d.device_value, d.host_value, d.backup_pending, d.device_lock, d.host_lock)
            for name, d in (live.components or {}).items()
        }

    def component_window(self, node: NodeRef, tier: str = "device") -> dict[str, torch.Tensor]:
        """The component indices a prefix ending at `node` uses on `tier`, root-first per component.

        For each component whose `valid_end` holds there: the values it reads (sliding window: the
        window's suffix values; Mamba: the node's state). Empty entries are omitted.
        """
        live = self._require_live(node)
        if self._book is None or live is self._root:
            return {}
        return self._book.window(live, self._root, tier)

    def valid_end(self, node: NodeRef, tier: str | None = "device") -> bool:
        """Whether every component allows a prefix ending at `node` on `tier` (always without components).

        Tier `None` reads the device value on device nodes and the host value on the others: whether the
        prefix is valid once its host-only nodes are loaded back.
        """
        live = self._require_live(node)
        if self._book is None or live is self._root:
            return True
        return self._book.valid_end(live, self._root, tier)

    def component_statistics(self) -> dict[str, ComponentStatistics]:
        """Per component: slots on each tier and in backups in flight, and evictable nodes (O(1))."""
        return self._book.statistics() if self._book is not None else {}

    def component_indices_owned(self, name: str, tier: str) -> torch.Tensor:
        """Every index of component `name` on `tier` the tree holds (O(tree), for tests).

        Host indices of backups in flight are included on the host tier.
        """
        if self._book is None:
            return EMPTY_INDICES
        return self._book.indices_owned(self._iter_nodes(), name, check_tier(tier))

    # ------------------------------------------------------------------ observation

    def branches(self) -> list[BranchStatistics]:
        """Every top-level branch (a child of the root and its subtree), in the root's child order (O(tree):
        for diagnostics, such as the demo's table of the most hit prefixes)."""
        out = []
        for top in self._root.children.values():
            nodes = device = host = 0
            stack = [top]
            while stack:
                node = stack.pop()
                nodes += 1
                if node.device_value is not None:
                    device += node.num_tokens
                if node.host_value is not None:
                    host += node.num_tokens
                stack.extend(node.children.values())
            out.append(BranchStatistics(self._ref(top), top.key, top.hit_count, nodes, device, host))
        return out

    def sanity_check(self) -> None:
        """Check every invariant of the tree (O(tree)).

        Raises:
            InvariantViolation: listing every violated invariant.
        """
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
