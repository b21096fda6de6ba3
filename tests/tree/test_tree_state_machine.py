"""Stateful property test: random operation sequences against the tree with exact pool accounting.

After every step the tree must pass `sanity_check()` and every device and host token index must be in
exactly one place: the test's free pool, the tree, or the test's hands. The machine runs four times: with
full attention only, and with a sliding window, a Mamba state, or both as components (each component
has its own device and host pools, accounted for exactly like the base's).
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hicache.components import Component, MambaState, SlidingWindow
from hicache.memory import KVLayout
from hicache.policy import EvictionPolicy, WritePolicy
from hicache.tree import ComponentFree, NodeInfo, NodeRef, RadixTree

DEVICE_PAGES = 40
HOST_PAGES = 40
COMPONENT_PAGES = 24
WINDOW = 6  # tokens: a window of 2 pages at page size 4, of 6 pages at page size 1, inside a page at 16

page_choices = st.lists(st.integers(0, 2), min_size=0, max_size=6)
tails = st.integers(0, 15)


class Pool:
    """A page allocator over token indices: pages are aligned runs of `page_size` tokens."""

    def __init__(self, pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.capacity = pages * page_size
        self.free: set[int] = set(range(self.capacity))

    def alloc(self, tokens: int) -> torch.Tensor | None:
        """Whole pages covering `tokens` tokens (the rest of the last page included), or None."""
        pages = -(-tokens // self.page_size)
        starts = sorted(t for t in self.free if t % self.page_size == 0)[:pages]
        if len(starts) < pages:
            return None
        out = [s + i for s in starts for i in range(self.page_size)]
        self.free.difference_update(out)
        return torch.tensor(out, dtype=torch.int64)

    def release(self, indices: torch.Tensor) -> None:
        values = indices.tolist()
        assert len(set(values)) == len(values), "duplicate indices freed"
        assert not self.free.intersection(values), "double free"
        self.free.update(values)


def make_key(choices: list[int], tail: int, page_size: int) -> list[int]:
    """Pages drawn from three patterns (so prefixes are shared) plus a partial tail page."""
    key: list[int] = []
    for c in choices:
        key.extend(c * 10 + (t % 3) for t in range(page_size))
    key.extend(7 for _ in range(tail % page_size))
    return key


class TreeMachine(RuleBasedStateMachine):
    """Random operations over every write policy, eviction policy and page sizes 1, 4 and 16."""

    components: tuple[str, ...] = ()
    """Which components the tree keeps: a subset of ("swa", "mamba")."""

    def __init__(self) -> None:
        super().__init__()
        self.tree: RadixTree
        self.device: Pool
        self.host: Pool
        self.device_locks: list[NodeRef] = []
        self.host_locks: list[NodeRef] = []
        self.comp_pools: dict[tuple[str, str], Pool] = {}

    @initialize(
        page_size=st.sampled_from([1, 4, 16]),
        write=st.sampled_from(list(WritePolicy)),
        evict=st.sampled_from(list(EvictionPolicy)),
    )
    def setup(self, page_size: int, write: WritePolicy, evict: EvictionPolicy) -> None:
        comps: list[Component] = []
        for name in self.components:
            if name == "swa":
                layout = KVLayout.flat(8, page_size)
                comps.append(SlidingWindow(WINDOW, layout, COMPONENT_PAGES, COMPONENT_PAGES))
            else:
                comps.append(MambaState(16, COMPONENT_PAGES, COMPONENT_PAGES))
            for tier in ("device", "host"):
                self.comp_pools[(name, tier)] = Pool(COMPONENT_PAGES, page_size if name == "swa" else 1)
        self.tree = RadixTree(
            page_size,
            write_policy=write,
            eviction_policy=evict,
            write_through_threshold=2,
            components=comps or None,
        )
        self.device = Pool(DEVICE_PAGES, page_size)
        self.host = Pool(HOST_PAGES, page_size)

    # ------------------------------------------------------------------ helpers

    def key(self, choices: list[int], tail: int) -> list[int]:
        return make_key(choices, tail, self.tree.page_size)

    def pick(self, nodes: list[NodeRef], index: int) -> NodeRef | None:
        return nodes[index % len(nodes)] if nodes else None

    def info(self, node: NodeRef) -> NodeInfo:
        return self.tree.node_info(node)

    def on_device_children(self, node: NodeRef) -> bool:
        return any(self.info(c).device_value is not None for c in self.info(node).children)

    def free_components(self, frees: tuple[ComponentFree, ...]) -> None:
        """Return what a result says the tree let go of (there is no queue to drain)."""
        for free in frees:
            self.comp_pools[(free.component, free.tier)].release(free.indices)

    def start_backup(self, node: NodeRef) -> None:
        for n in self.tree.backup_chain(node):
            size = self.info(n).num_tokens
            idx = self.host.alloc(size)
            if idx is None:
                return
            self.host.release(idx[size:])
            comps: dict[str, torch.Tensor] = {}
            for name in self.components:
                value = self.tree.component_value(n, name, "device")
                if value is not None:
                    host = self.comp_pools[(name, "host")].alloc(value.numel())
                    if host is not None:
                        comps[name] = host
            self.tree.begin_backup(n, idx[:size], comps or None)

    def component_values(self, tier: str, aligned: int, key_len: int) -> dict[str, torch.Tensor]:
        """Fresh component indices for a key of `aligned` page-aligned tokens (`key_len` before aligning)."""
        out: dict[str, torch.Tensor] = {}
        page = self.tree.page_size
        for name in self.components:
            pool = self.comp_pools[(name, tier)]
            if name == "swa":
                n = min(aligned, -(-WINDOW // page) * page)
                if n == 0:
                    continue
                idx = pool.alloc(n)
            else:
                if aligned == 0:
                    continue
                idx = pool.alloc(1)
            if idx is not None:
                out[name] = idx
        return out

    # ------------------------------------------------------------------ rules

    @rule(choices=page_choices, tail=tails, back_up=st.booleans())
    def insert(self, choices: list[int], tail: int, back_up: bool) -> None:
        key = self.key(choices, tail)
        idx = self.device.alloc(len(key))
        if idx is None:
            r = self.tree.evict_device(len(key) + self.tree.page_size)
            self.device.release(r.freed_device)
            self.host.release(r.freed_host)
            self.free_components(r.component_frees)
            idx = self.device.alloc(len(key))
            if idx is None:
                return
        aligned = len(key) - len(key) % self.tree.page_size
        comps = self.component_values("device", aligned, len(key))
        result = self.tree.insert(key, idx[: len(key)], comps or None)
        self.free_components(result.component_frees)
        if aligned != len(key) and "mamba" in comps:
            event("insert mamba state on an unaligned key")
        if (
            self.components
            and aligned == len(key) > 0
            and len(comps) == len(self.components)
            and self.tree.protected_size() == 0
        ):
            # Nothing is locked: the insert completed every component at the key's end.
            assert self.tree.match_prefix(key).device_len == aligned
            event("insert with every component, then a full match")
        event(f"insert duplicate={result.prefix_len > 0}")
        assert result.total_len == len(key) - len(key) % self.tree.page_size
        assert 0 <= result.prefix_len <= result.total_len
        self.device.release(idx[: result.prefix_len])
        self.device.release(idx[result.total_len :])
        if back_up:
            for node in result.backups:
                self.start_backup(node)

    @rule(choices=page_choices, tail=tails)
    def match(self, choices: list[int], tail: int) -> None:
        key = self.key(choices, tail)
        # `peek` foretells the match and changes nothing: no split, no clock tick, no LRU touch.
        before = (
            self.tree.statistics(),
            self.tree._clock,
            {n.id: self.info(n).last_access for n in self.tree.iter_nodes()},
        )
        peeked = self.tree.peek(key)
        after = (
            self.tree.statistics(),
            self.tree._clock,
            {n.id: self.info(n).last_access for n in self.tree.iter_nodes()},
        )
        assert after == before
        m = self.tree.match_prefix(key)
        anchor_len = self.tree.depth(m.last_host_node)
        assert (peeked.device_len, peeked.host_len, peeked.anchor_len) == (
            m.device_len,
            m.host_len,
            anchor_len,
        )
        joined = m.device_indices
        assert joined.shape == (m.device_len,)
        if m.device_values:
            assert torch.equal(joined, torch.cat(m.device_values))
        assert torch.equal(self.tree.device_indices(m.last_device_node), joined)
        # A second match may serve the joined indices from the path cache: they must be the same.
        assert torch.equal(self.tree.match_prefix(key).device_indices, joined)
        assert m.device_len + m.host_len <= len(key)
        assert sum(self.info(n).num_tokens for n in m.host_nodes) == m.host_len
        for n in m.host_nodes:
            assert self.info(n).device_value is None
            assert self.info(n).host_value is not None
        host_values = [self.info(n).host_value for n in m.host_nodes]
        assert m.host_values == tuple(host_values)

    @rule(choices=page_choices, extra=page_choices, tail=tails)
    def refill(self, choices: list[int], extra: list[int], tail: int) -> None:
        key = self.key(choices + extra, tail)
        m = self.tree.match_prefix(key)
        anchor = m.last_host_node
        start = m.device_len + m.host_len
        # The anchor is the deepest backed-up node: the refill continues from its end.
        depth = self.tree.depth(anchor)
        rest = key[depth:]
        assert depth <= start
        if not rest:
            return
        idx = self.host.alloc(len(rest))
        if idx is None:
            return
        if anchor != self.tree.root:
            self.tree.lock_host(anchor)
        aligned = len(rest) - len(rest) % self.tree.page_size
        comps = self.component_values("host", aligned, len(rest))
        r = self.tree.insert_host(anchor, rest, idx[: len(rest)], components=comps or None)
        event(f"refill dropped={r.host_insert_dropped}")
        if r.host_insert_dropped:
            assert self.tree.write_policy is not WritePolicy.WRITE_BACK
            assert (r.prefix_len, r.node) == (0, anchor)
            self.host.release(idx)
            for name, value in comps.items():
                self.comp_pools[(name, "host")].release(value)
        else:
            self.host.release(idx[: r.prefix_len])
            self.host.release(idx[r.total_len :])
            self.free_components(r.component_frees)
        if anchor != self.tree.root:
            self.tree.unlock_host(anchor)

    @rule(index=st.integers(0, 1000))
    def begin_backup(self, index: int) -> None:
        nodes = [
            n
            for n in self.tree.iter_nodes()
            if self.info(n).device_value is not None and self.info(n).host_value is None
        ]
        node = self.pick(nodes, index)
        if node is not None:
            self.start_backup(node)

    def pending(self) -> list[NodeRef]:
        """Nodes the controller began a backup on (white-box: not the upper parts split off them)."""
        return [
            n
            for n in self.tree.iter_nodes()
            if self.info(n).backup_pending is not None and self.tree._require_live(n)._backup_owner is None
        ]

    @rule(index=st.integers(0, 1000))
    def commit_backup(self, index: int) -> None:
        node = self.pick(self.pending(), index)
        if node is None:
            return
        try:
            done = self.tree.commit_backup(node)
        except ValueError:
            event("commit refused")
            assert self.tree.write_policy is not WritePolicy.WRITE_BACK
            assert self.info(node).backup_pending is not None
            return
        event("commit")
        self.free_components(done.component_frees)
        assert self.info(node).backed_up

    @rule(index=st.integers(0, 1000))
    def abort_backup(self, index: int) -> None:
        node = self.pick(self.pending(), index)
        if node is not None:
            aborted = self.tree.abort_backup(node)
            self.host.release(aborted.freed_host)
            self.free_components(aborted.component_frees)

    @rule(index=st.integers(0, 1000))
    def demote(self, index: int) -> None:
        node = self.pick(self.tree.iter_nodes(), index)
        if node is None:
            return
        i = self.info(node)
        legal = (
            i.device_value is not None
            and i.host_value is not None
            and i.device_lock == 0
            and not self.on_device_children(node)
        )
        try:
            freed = self.tree.demote(node)
        except ValueError:
            assert not legal
            return
        assert legal
        event("demote")
        self.device.release(freed.freed_device)
        self.free_components(freed.component_frees)

    @rule(index=st.integers(0, 1000), host=st.booleans())
    def lock(self, index: int, host: bool) -> None:
        node = self.pick(self.tree.iter_nodes(), index)
        if node is None:
            return
        if host:
            self.tree.lock_host(node)
            self.host_locks.append(node)
        else:
            self.tree.lock_device(node)
            self.device_locks.append(node)

    @rule(index=st.integers(0, 1000))
    def unlock(self, index: int) -> None:
        if not self.device_locks and not self.host_locks:
            return
        pool = (
            self.device_locks if self.device_locks and (index % 2 or not self.host_locks) else self.host_locks
        )
        node = pool.pop(index % len(pool))
        if pool is self.device_locks:
            self.tree.unlock_device(node)
        else:
            self.tree.unlock_host(node)

    @rule(
        tokens=st.integers(0, 80),
        host_free=st.integers(0, 40),
        real_room=st.booleans(),
        back_up=st.booleans(),
    )
    def evict_device(self, tokens: int, host_free: int, real_room: bool, back_up: bool) -> None:
        """Evict, check the plan's shape, and (sometimes) carry out its backups as the controller does.

        With `real_room` the plan gets the host room the controller would offer (free host tokens plus
        what `evict_host` can reclaim): then every planned backup must find its host pages.
        """
        if real_room:
            host_free = len(self.host.free) + self.tree.statistics().reclaimable_host_tokens
        before = self.tree.statistics().evictable_device_tokens
        r = self.tree.evict_device(tokens, host_free)
        assert r.evicted_tokens >= min(tokens, 1) or r.evicted_tokens == 0
        assert r.freed_device.numel() <= before
        assert r.dropped_tokens <= r.freed_device.numel()
        self.check_plan(r.backups, r.backup_tokens, host_free)
        if r.evicted_tokens < tokens:
            # Stopped early: every device leaf left is locked, backing up, or kept for a reason.
            targets = set(r.backup_first)
            for n in self.tree.iter_nodes():
                i = self.info(n)
                if (
                    i.device_value is not None
                    and not i.device_lock
                    and i.backup_pending is None
                    and not self.on_device_children(n)
                ):
                    assert i.host_lock or n in targets, f"evictable leaf {i} kept"
        event(
            f"evict_device freed={bool(r.freed_device.numel())} host={bool(r.freed_host.numel())} "
            f"backups={bool(r.backups)} dropped={r.dropped_tokens > 0} real_room={real_room}"
        )
        self.device.release(r.freed_device)
        self.host.release(r.freed_host)
        self.free_components(r.component_frees)
        if back_up:
            for chain in r.backups:
                self.back_up_chain(chain, must_fit=real_room)

    def check_plan(self, backups: tuple[tuple[NodeRef, ...], ...], backup_tokens: int, room: int) -> None:
        """Each chain root-first from a backed-up, pending or earlier-planned parent down to an un-backed
        device leaf; chains disjoint; their tokens counted exactly and within the room given."""
        root = self.tree.root
        planned: set[NodeRef] = set()
        total = 0
        for chain in backups:
            assert chain, "an empty backup chain"
            top = self.info(chain[0]).parent
            assert top is not None
            t = self.info(top)
            assert top == root or t.host_value is not None or t.backup_pending is not None or top in planned
            for upper, lower in itertools.pairwise(chain):
                assert self.info(lower).parent == upper
            for n in chain:
                i = self.info(n)
                assert i.device_value is not None
                assert i.host_value is None
                assert i.backup_pending is None
                assert n not in planned
                total += i.num_tokens
            assert not self.on_device_children(chain[-1])
            planned.update(chain)
        assert total == backup_tokens <= room

    def back_up_chain(self, chain: tuple[NodeRef, ...], must_fit: bool) -> None:
        """Begin the backups of a planned chain root-first, reclaiming host pages as the controller does."""
        need = sum(self.info(n).num_tokens for n in chain)
        if len(self.host.free) < need:
            freed = self.tree.evict_host(need - len(self.host.free))
            self.host.release(freed.freed_host)
            self.free_components(freed.component_frees)
        if len(self.host.free) < need:
            assert not must_fit, f"planned backup of {need} tokens finds {len(self.host.free)} host tokens"
            return
        event("evict_device backup chain")
        for n in chain:
            self.start_backup(n)

    @rule(tokens=st.integers(0, 80))
    def evict_host(self, tokens: int) -> None:
        r = self.tree.evict_host(tokens)
        assert r.freed_host.numel() == r.evicted_tokens
        event(f"evict_host freed={r.evicted_tokens > 0}")
        self.host.release(r.freed_host)
        self.free_components(r.component_frees)

    @rule(index=st.integers(0, 1000))
    def attach_device(self, index: int) -> None:
        root = self.tree.root
        nodes = []
        for n in self.tree.iter_nodes():
            i = self.info(n)
            assert i.parent is not None
            if i.device_value is None and (i.parent == root or self.info(i.parent).device_value is not None):
                nodes.append(n)
        node = self.pick(nodes, index)
        if node is None:
            return
        idx = self.device.alloc(self.info(node).num_tokens)
        if idx is None:
            return
        comps: dict[str, torch.Tensor] = {}
        for name in self.components:
            host = self.tree.component_value(node, name, "host")
            if host is not None:
                got = self.comp_pools[(name, "device")].alloc(host.numel())
                if got is not None:
                    comps[name] = got
        self.tree.attach_device(node, idx, comps or None)  # nodes are whole pages: no tail
        event(f"attach_device components={sorted(comps)}")

    @rule(which=st.integers(0, 1), tier=st.sampled_from(["device", "host"]), slots=st.integers(0, 24))
    def evict_component(self, which: int, tier: str, slots: int) -> None:
        if not self.components:
            return
        name = self.components[which % len(self.components)]
        r = self.tree.evict_component(name, slots, tier)
        got = r.evicted_slots
        event(f"evict_component {name} {tier} freed={got > 0}")
        frees = r.component_frees
        assert sum(f.indices.numel() for f in frees if f.component == name and f.tier == tier) == got
        self.free_components(frees)

    @rule(choices=page_choices, tail=tails)
    def match_is_valid_for_every_component(self, choices: list[int], tail: int) -> None:
        if not self.components:
            return
        m = self.tree.match_prefix(self.key(choices, tail))
        if m.host_nodes:
            # The prefix ends on the host: it must be valid once its host-only nodes are loaded; the
            # device part before it need not be a valid end on its own.
            assert self.tree.valid_end(m.host_nodes[-1], None)
            last = m.last_device_node
            assert last == self.tree.root or self.info(last).device_value is not None
            window = self.tree.component_window(m.last_device_node)
            assert set(window) <= set(self.components)
        else:
            assert self.tree.valid_end(m.last_device_node, "device")
        event(f"component match device={m.device_len > 0} host={m.host_len > 0}")

    @rule(index=st.integers(0, 1000), priority=st.integers(-3, 3))
    def set_priority(self, index: int, priority: int) -> None:
        node = self.pick(self.tree.iter_nodes(), index)
        if node is not None:
            self.tree.set_priority(node, priority)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tree_is_sound_and_every_page_is_accounted_for(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.sanity_check()
        for ref in self.tree.iter_nodes():  # the one-field accessors say what the snapshot says
            info = self.tree.node_info(ref)
            assert self.tree.node_size(ref) == info.num_tokens
            assert self.tree.parent_of(ref) == info.parent
            assert self.tree.device_value(ref) is info.device_value
            assert self.tree.is_backed_up(ref) == (info.host_value is not None)
        pools = [
            (self.device, self.tree.device_tokens_owned().tolist()),
            (self.host, self.tree.host_tokens_owned().tolist()),
        ]
        for (name, tier), pool in self.comp_pools.items():
            pools.append((pool, self.tree.component_indices_owned(name, tier).tolist()))
        for pool, owned in pools:
            assert len(set(owned)) == len(owned), "the tree holds an index twice"
            assert not pool.free.intersection(owned), "the tree holds a free index"
            assert len(pool.free) + len(owned) == pool.capacity

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        for node in self.device_locks:
            self.tree.unlock_device(node)
        for node in self.host_locks:
            self.tree.unlock_host(node)
        self.tree.sanity_check()


class SwaTreeMachine(TreeMachine):
    components = ("swa",)


class MambaTreeMachine(TreeMachine):
    components = ("mamba",)


class HybridTreeMachine(TreeMachine):
    components = ("swa", "mamba")


TreeMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
_component_settings = settings(
    max_examples=100,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
SwaTreeMachine.TestCase.settings = _component_settings
MambaTreeMachine.TestCase.settings = _component_settings
HybridTreeMachine.TestCase.settings = _component_settings
test_tree_state_machine = TreeMachine.TestCase
test_tree_state_machine_full_and_swa = SwaTreeMachine.TestCase
test_tree_state_machine_full_and_mamba = MambaTreeMachine.TestCase
test_tree_state_machine_full_swa_and_mamba = HybridTreeMachine.TestCase
