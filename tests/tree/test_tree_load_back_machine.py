"""Stateful property test: the tree machine plus layer-wise load-backs as the controller drives them.

A load attaches device pages to host-only nodes before its copy landed (`attach_loaded`) and locks them;
it then lands (unlock), fails (`drop_failed_load`: its pages leave the device tier or, held below, stay
poisoned and are copied again once; that copy lands, `clear_poison`, or fails too), or is hidden first
while its copy may still write (`poison_load`, then failed). Every other operation of the tree machine
(inserts and refills below poisoned nodes, eviction, splits, demotion, locks, backups) runs between them.
After every step `sanity_check()` and the exact page accounting hold; a match never serves a poisoned
node or anything below it, and touches no LRU clock from a poisoned node down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from hicache.tree import NodeRef
from tests.tree.test_tree_state_machine import TreeMachine, page_choices, tails


@dataclass
class Load:
    """A load-back in flight: what it attached, the node its locks are on, and how it may end."""

    key: list[int]
    start: int
    indices: torch.Tensor
    locked: NodeRef
    recopy: bool = False
    hidden: bool = False


class LoadBackTreeMachine(TreeMachine):
    """The tree machine (full attention) with load-backs that land, fail, are copied again or hidden."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[Load] = []

    def poisoned_subtrees(self) -> list[NodeRef]:
        """Every poisoned node and every node below one."""
        out: list[NodeRef] = []
        stack = [n for n in self.tree.iter_nodes() if self.tree.poisoned(n)]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(self.info(node).children)
        return out

    def end(self, load: Load) -> None:
        """The load's locks go (the controller's `_finish`)."""
        self.tree.unlock_host(load.locked)
        self.tree.unlock_device(load.locked)

    @rule(choices=page_choices, tail=tails)
    def load_back(self, choices: list[int], tail: int) -> None:
        """Match; attach fresh device pages to the host-only part and lock it, as the copy starts."""
        key = self.key(choices, tail)
        m = self.tree.match_prefix(key)
        if not m.host_len:  # a storage refill first, as a prefetch's commit before the load-back
            self.refill(choices, [], tail)
            m = self.tree.match_prefix(key)
            if not m.host_len:
                return
        idx = self.device.alloc(m.host_len)
        if idx is None:
            return
        attached = self.tree.attach_loaded(key, m.device_len, idx)
        assert not attached.freed_device.numel(), "nothing moved since the match"
        assert attached.match.device_len == m.device_len + m.host_len
        locked = attached.match.last_device_node
        self.tree.lock_device(locked)
        self.tree.lock_host(locked)
        self.loads.append(Load(key, m.device_len, idx, locked))
        event("load-back attached")

    @rule(index=st.integers(0, 1000))
    def land(self, index: int) -> None:
        """A copy lands: its pages stay; a copy again of poisoned pages makes them hits again."""
        live = [load for load in self.loads if not load.hidden]
        if not live:
            return
        load = live[index % len(live)]
        self.loads.remove(load)
        if load.recopy:
            cleared = self.tree.clear_poison(load.key, load.start, load.indices)
            event(f"copy again landed, cleared={cleared > 0}")
        self.end(load)

    @rule(index=st.integers(0, 1000), extra=page_choices, lock=st.booleans())
    def compute_below(self, index: int, extra: list[int], lock: bool) -> None:
        """A request that computed a load's key and more inserts it (a device-only child below the
        loading pages) and, with `lock`, holds it (a lease): what keeps failed pages on the device."""
        if not self.loads or not extra:
            return
        load = self.loads[index % len(self.loads)]
        page = self.tree.page_size
        aligned = len(load.key) - len(load.key) % page
        key = load.key[:aligned] + [50 + c for c in extra for _ in range(page)]
        idx = self.device.alloc(len(key))
        if idx is None:
            return
        result = self.tree.insert(key, idx)
        self.device.release(idx[: result.prefix_len])
        if lock:
            self.tree.lock_device(result.node)
            self.device_locks.append(result.node)
        event(f"computed below a load, locked={lock}")

    @rule(index=st.integers(0, 1000))
    def hide(self, index: int) -> None:
        """A load's task ended with its copy running: its nodes are hidden until it settled."""
        live = [load for load in self.loads if not load.hidden and not load.recopy]
        if not live:
            return
        load = live[index % len(live)]
        load.hidden = True
        hidden = self.tree.poison_load(load.key, load.start, load.indices)
        event(f"load hidden, nodes={hidden > 0}")

    @rule(index=st.integers(0, 1000), copy_again=st.booleans())
    def fail(self, index: int, copy_again: bool) -> None:
        """A copy fails (or a hidden one settled): its pages leave the device tier; those held below stay,
        poisoned, and (once, with `copy_again`) are copied again."""
        if not self.loads:
            return
        load = self.loads.pop(index % len(self.loads))
        freed, kept = self.tree.drop_failed_load(load.key, load.start, load.indices)
        self.device.release(freed.freed_device)
        assert not freed.component_frees
        for ref in kept:
            assert self.tree.poisoned(ref)
            assert bool(torch.isin(self.info(ref).device_value[:1], load.indices).all())
        self.end(load)
        event(f"load failed, kept={bool(kept)}")
        if kept and copy_again and not load.recopy:
            indices = torch.cat([self.info(ref).device_value for ref in kept])
            self.tree.lock_device(kept[-1])
            self.tree.lock_host(kept[-1])
            self.loads.append(Load(load.key, load.start, indices, kept[-1], recopy=True))

    @rule(choices=page_choices, tail=tails)
    def match_never_serves_poisoned_nodes(self, choices: list[int], tail: int) -> None:
        """No match or peek reaches a poisoned node or anything below it, nor touches their LRU clock."""
        below = self.poisoned_subtrees()
        if not below:
            return
        event("match with poisoned nodes")
        key = self.key(choices, tail)
        before = {ref: self.info(ref).last_access for ref in below}
        bad = torch.cat(
            [v for ref in below if (v := self.info(ref).device_value) is not None]
            or [torch.empty(0, dtype=torch.int64)]
        )
        peeked = self.tree.peek(key)
        m = self.tree.match_prefix(key)
        assert (peeked.device_len, peeked.host_len) == (m.device_len, m.host_len)
        assert not bool(torch.isin(m.device_indices, bad).any()), "a match served a poisoned page"
        assert not set(m.host_nodes) & set(below), "a match served a node below a poisoned one"
        for ref, last in before.items():
            if self.tree.is_live(ref):
                assert self.info(ref).last_access == last, "a match touched a node past a poisoned one"

    def teardown(self) -> None:
        if hasattr(self, "tree"):
            for load in self.loads:
                self.end(load)
            self.loads.clear()
        super().teardown()


LoadBackTreeMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tree_load_back_machine = LoadBackTreeMachine.TestCase
