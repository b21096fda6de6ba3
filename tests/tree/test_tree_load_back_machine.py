"""Stateful property test: the tree machine plus layer-wise load-backs as the controller drives them.

A load locks the device prefix above a host hit and the hit's last host node, and copies into device
pages of its own, which the tree does not know. Meanwhile every other operation of the tree machine runs
(inserts over the loading nodes and below them, refills, eviction, splits, demotion, locks, backups). The
load then lands (`attach_loaded` takes the pages of the nodes still host-only; the rest come back to be
freed, or kept for its readers) or fails (its pages go back to the pool: nothing in the tree changes).
After every step `sanity_check()` and the exact page accounting hold, a landing load's pages included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from hicache.tree import NodeRef
from tests.tree.test_tree_state_machine import TreeMachine, page_choices, tails


@dataclass
class Load:
    """A load-back in flight: its key and span, the pages it copies into, the nodes its locks are on."""

    key: list[int]
    start: int
    indices: torch.Tensor
    above: NodeRef
    last: NodeRef


class LoadBackTreeMachine(TreeMachine):
    """The tree machine (full attention) with layer-wise load-backs that land or fail."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[Load] = []

    def end(self, load: Load) -> None:
        """The load's locks go (the controller's `_end`)."""
        self.tree.unlock_host(load.last)
        self.tree.unlock_device(load.above)

    @rule(choices=page_choices, tail=tails)
    def load_back(self, choices: list[int], tail: int) -> None:
        """Match; lock the prefix above the host hit and the hit, and take device pages for its copy."""
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
        self.tree.lock_device(m.last_device_node)
        self.tree.lock_host(m.host_nodes[-1])
        self.loads.append(Load(key, m.device_len, idx, m.last_device_node, m.host_nodes[-1]))
        event("load-back started")

    @rule(index=st.integers(0, 1000))
    def land(self, index: int) -> None:
        """A copy lands: the tree takes the pages of the nodes still host-only; the rest are freed."""
        if not self.loads:
            return
        load = self.loads.pop(index % len(self.loads))
        attached = self.tree.attach_loaded(load.key, load.start, load.indices)
        assert not attached.component_frees
        self.device.release(attached.freed_device)
        assert attached.match.device_len >= load.start
        self.end(load)
        event(f"load landed, all taken={not attached.freed_device.numel()}")

    @rule(index=st.integers(0, 1000), extra=page_choices, lock=st.booleans())
    def compute_over(self, index: int, extra: list[int], lock: bool) -> None:
        """A request that computed a load's key and more inserts it (its own pages for the loading nodes,
        and a device-only child below) and, with `lock`, holds it (a lease)."""
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
        event(f"computed over a load, locked={lock}")

    @rule(index=st.integers(0, 1000))
    def fail(self, index: int) -> None:
        """A copy fails: its pages go back to the pool; the tree is left as it is."""
        if not self.loads:
            return
        load = self.loads.pop(index % len(self.loads))
        self.device.release(load.indices)
        self.end(load)
        event("load failed")

    @invariant()
    def tree_is_sound_and_every_page_is_accounted_for(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.sanity_check()
        landing = [int(i) for load in self.loads for i in load.indices.tolist()]
        pools = [
            (self.device, self.tree.device_tokens_owned().tolist() + landing),
            (self.host, self.tree.host_tokens_owned().tolist()),
        ]
        for pool, owned in pools:
            assert len(set(owned)) == len(owned), "an index held twice (the tree, a landing load)"
            assert not pool.free.intersection(owned), "a held index is free"
            assert len(pool.free) + len(owned) == pool.capacity

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
