"""The controller's stateful property test with hybrid-model components: full attention beside a sliding
window, a Mamba state, or both.

The machine is `ControllerMachine` (`test_controller_state_machine.py`) with every request's window KV and
end state supplied on insert the way a serving loop does (`alloc_component`, written, handed to `insert`;
the whole window or only its newly computed part, sometimes a component left out), storage holding
component pages beside the base pages (the window and state at a sequence's end, at every page, or none),
and rules of its own: another instance storing more sequences, serving a prefix of a stored sequence (a
later prefetch of the whole attaches below it, and is dropped when it is not backed up under
write-through), component device pressure (evictions that cascade from the window to the state of the
same node) and faults on component pages (a staged read that fails, lies or finds corrupt bytes, so the
all-or-nothing prefetch is dropped).

After every step, on top of the base machine's checks: exact index-level accounting of every component
pool (each used slot is the tree's, the test's, or staged by a prefetch in flight; nothing the tree let go
of is left unfreed), every component value in the tree and under every lease holds the oracle payload of
its own prefix (`component_oracle`), a lease that caches anything has every component, and every component
page in storage holds the oracle bytes of its key. At the end all component pools must be free too.

Below the machine: the scenarios it found, each reduced to a deterministic test.
"""

from __future__ import annotations

import dataclasses

import anyio
import torch
from cache_internals import component_pools_of, release_queue_of, tree_of
from component_oracle import (
    check_component_kv,
    check_component_pools_exact,
    check_leased_components,
    component_page_bytes,
    make_components,
    stage_components,
    state_payload,
    store_components,
    swa_payload,
)
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from kv_oracle import chain_payload, check_pools_exact, check_tree_kv, layout_for
from test_controller_state_machine import ControllerMachine, make_tokens, sequences

from hicache import HiCache, HiCacheConfig, KVLayout, Lease
from hicache.components import component_storage_key
from hicache.keys import ROOT_HASH, TOKEN_BYTES, Namespace, as_key_bytes, chained_page_hashes
from hicache.policy import StopPolicy, WritePolicy

WINDOW = 6
"""Tokens of window KV a prefix needs: 2 pages at page size 4, 6 pages at page size 1."""
SWA_PAGES = 12
STATE_SLOTS = 4

store_modes = st.sampled_from(["every", "end", "every", "end", "none"])
"""Which component pages another instance stored with a sequence: a window page and a state at every page
(its tree split the sequence at every page), the window and state at its end, or none (a prefetch then
finds a component miss)."""


class ComponentControllerMachine(ControllerMachine):
    """`ControllerMachine` over a hybrid model; `components` names the components kept beside full KV."""

    components: tuple[str, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[str] = []
        self.omit: frozenset[str] = frozenset()
        self.whole_window = False

    # ------------------------------------------------------------------ hooks

    @initialize(
        page_size=st.sampled_from([1, 4]),
        write=st.sampled_from(list(WritePolicy)),
        stop=st.sampled_from([StopPolicy.BEST_EFFORT, StopPolicy.WAIT_COMPLETE]),
        gated=st.booleans(),
        prefill=st.lists(sequences, min_size=1, max_size=3),
        modes=st.lists(store_modes, min_size=3, max_size=3),
    )
    def setup(
        self,
        page_size: int,
        write: WritePolicy,
        stop: StopPolicy,
        gated: bool,
        prefill: list[tuple[list[int], int]],
        modes: list[str],
    ) -> None:
        self.modes = modes
        super().setup(page_size, write, stop, gated, prefill)

    def cache_config(self, layout: KVLayout, write: WritePolicy, stop: StopPolicy) -> HiCacheConfig:
        comps = make_components(
            self.components, self.page_size, window=WINDOW, swa_pages=SWA_PAGES, state_slots=STATE_SLOTS
        )
        return dataclasses.replace(super().cache_config(layout, write, stop), components=comps)

    async def store_prefill(self, key: bytes, index: int) -> None:
        await super().store_prefill(key, index)
        mode = self.modes[index]
        if mode == "none":
            return
        await store_components(
            self.inner,
            key,
            self.page_size,
            self.namespace,
            window=WINDOW,
            names=self.components,
            every_page=mode == "every",
        )

    def remember(self, tokens: list[int]) -> None:
        super().remember(tokens)
        aligned = len(tokens) // self.page_size * self.page_size
        if aligned:
            key = self.key_of(tokens)[: aligned * TOKEN_BYTES]
            self.expected_pages.update(component_page_bytes(key, self.page_size, self.namespace))

    def stage_components(self, lease: Lease, tokens: list[int]) -> dict[str, torch.Tensor]:
        """The request's window KV and end state in fresh device slots, less the components omitted."""
        names = [name for name in self.components if name not in self.omit]
        got = stage_components(
            self.c, names, lease.key, lease.cached_len, window=WINDOW, whole_window=self.whole_window
        )
        for name in names:
            if name not in got:
                event(f"no {name} handed to insert")
        return got

    async def check(self) -> None:
        await super().check()
        cache = self.c
        held: dict[str, list[torch.Tensor]] = {}
        for h in self.leases.values():
            for name, slots in h.components.items():
                held.setdefault(name, []).append(slots)
        staged = [t for p in self.prefetches.values() for t in p.staged]
        check_component_pools_exact(cache, held=held, staged=staged)
        # Every index the tree let go of was handed to the caller in a result (the tree keeps none aside),
        # and the exact pool check above found each back in its pool.
        tree_of(cache).sanity_check()
        if check_component_kv(cache):
            stats = tree_of(cache).component_statistics()
            tiers = [t for t in ("device", "host") if any(getattr(s, f"{t}_slots") for s in stats.values())]
            event(f"component values on {'+'.join(tiers)}")
        for h in self.leases.values():
            check_leased_components(cache, h.lease)
            if h.lease.cached_len and h.lease.hit_tokens_by_tier["storage"]:
                event("a lease's components came from storage")

    async def release_everything(self, cache: HiCache) -> None:
        m = cache.metrics
        for reason in ("anchor_not_backed_up", "component_incomplete"):
            if m.prefetch_dropped_tokens.value(reason=reason):
                event(f"a prefetch with components was dropped: {reason}")
        for reason in ("component_miss", "component_host_full"):
            if m.prefetch_skipped.value(reason=reason):
                event(f"a prefetch was skipped: {reason}")
        if m.prefetch_loaded_tokens.value():
            event("a prefetch attached pages with their components")
        await super().release_everything(cache)

    # ------------------------------------------------------------------ rules of the hybrid model

    @rule(seq=sequences, mode=store_modes)
    def another_instance_stores(self, seq: tuple[list[int], int], mode: str) -> None:
        """Another instance serves a request and writes its pages (and `mode`'s component pages) through."""
        tokens = make_tokens(*seq, self.page_size)
        aligned = len(tokens) // self.page_size * self.page_size
        if aligned == 0:
            return
        self.remember(tokens)
        self.prefilled.append(tokens)
        self.modes.append(mode)

        async def go() -> None:
            await self.store_prefill(self.key_of(tokens[:aligned]), len(self.modes) - 1)

        self.run(go)

    @rule(omit=st.frozensets(st.sampled_from(["swa", "mamba"])), whole_window=st.booleans())
    def staging(self, omit: frozenset[str], whole_window: bool) -> None:
        """From now on, leave `omit` out of inserts, and hand over the whole window or only its new part."""
        self.omit = omit & frozenset(self.components)
        self.whole_window = whole_window

    @rule(pick=st.integers(0, 1 << 16), pages=st.integers(1, 3))
    def serve_stored_prefix(self, pick: int, pages: int) -> None:
        """Serve the first `pages` pages of a sequence in storage: a device node that a later prefetch of
        the whole sequence attaches below (dropped when it is not backed up under write-through)."""
        if not self.prefilled:
            return
        tokens = self.prefilled[pick % len(self.prefilled)]
        n = min(len(tokens) // self.page_size, pages) * self.page_size
        if n:
            self.serve_tokens(tokens[:n])

    @rule(which=st.integers(0, 1), extra=st.integers(1, 3))
    def component_pressure(self, which: int, extra: int) -> None:
        """Ask for `extra` pages more of one component's device pool than are free (evicting its unlocked
        values, and with a window the state of the same node), then give them back."""
        name = self.components[which % len(self.components)]

        async def go() -> None:
            cache = self.c
            pool = cache.component_pool(name)
            stats = pool.statistics()
            n = min(stats.free_pages + extra, stats.capacity_pages)
            before = tree_of(cache).component_statistics()
            got = cache.alloc_component(name, n * pool.page_size)
            after = tree_of(cache).component_statistics()
            if got is None:
                event(f"component pressure {name}: could not evict enough")
                return
            cache.component_pool(name).free(got)
            cascaded = [
                other
                for other in after
                if other != name and after[other].device_slots < before[other].device_slots
            ]
            if cascaded:
                event(f"component pressure {name}: cascaded to {cascaded}")

        self.run(go)

    @rule(
        pick=st.integers(0, 1 << 16),
        page=st.integers(0, 7),
        which=st.integers(0, 1),
        mode=st.sampled_from(["false", "error", "corrupt", "delete"]),
    )
    def inject_component_fault(self, pick: int, page: int, which: int, mode: str) -> None:
        """Make one component page of a known sequence fail to read, or damage or delete it in storage."""
        if not self.known_keys:
            return
        key = self.known_keys[pick % len(self.known_keys)]
        hashes = chained_page_hashes(key, self.page_size, self.namespace, ROOT_HASH)
        name = self.components[which % len(self.components)]
        target = component_storage_key(hashes[page % len(hashes)], name)

        async def go() -> None:
            if mode in ("false", "error"):
                self.backend.faults[target] = mode
            elif await self.inner.exists([target]):
                if mode == "corrupt":
                    self.inner.corrupt(target, offset=-3)
                    self.corrupted.add(target)
                else:
                    await self.inner.delete([target])
                event(f"component page {mode}")

        self.run(go)


class SwaControllerMachine(ComponentControllerMachine):
    components = ("swa",)


class MambaControllerMachine(ComponentControllerMachine):
    components = ("mamba",)


class HybridControllerMachine(ComponentControllerMachine):
    components = ("swa", "mamba")


_settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
SwaControllerMachine.TestCase.settings = _settings
MambaControllerMachine.TestCase.settings = _settings
HybridControllerMachine.TestCase.settings = _settings
test_controller_machine_full_and_swa = SwaControllerMachine.TestCase
test_controller_machine_full_and_mamba = MambaControllerMachine.TestCase
test_controller_machine_full_swa_and_mamba = HybridControllerMachine.TestCase


def test_the_oracle_tells_prefixes_apart() -> None:
    """The component oracle is prefix-sensitive: equal last pages under different prefixes differ."""
    ns = Namespace(model_id="oracle")
    a = as_key_bytes([1, 2, 3, 4, 9, 9, 9, 9])
    b = as_key_bytes([5, 6, 7, 8, 9, 9, 9, 9])
    assert not torch.equal(swa_payload(a, 4, ns)[:, :, 4:], swa_payload(b, 4, ns)[:, :, 4:])
    assert not torch.equal(state_payload(a, 4, ns), state_payload(b, 4, ns))
    pages = component_page_bytes(a, 4, ns)
    assert len(pages) == 4  # a window page and a state per page


# ---------------------------------------------------------------------- scenarios found by the machine

SCENARIO_PAGE = 4


def scenario_config(*, state_slots: int = 4) -> HiCacheConfig:
    """Write-through, 4-token pages, 8 device pages, no storage; a 6-token window and a Mamba state."""
    return HiCacheConfig(
        layout=layout_for(SCENARIO_PAGE),
        device_pages=8,
        host_pages=16,
        namespace=Namespace(model_id="scenario"),
        components=make_components(
            ("swa", "mamba"), SCENARIO_PAGE, window=WINDOW, swa_pages=8, state_slots=state_slots
        ),
    )


async def serve_request(cache: HiCache, tokens: list[int], names: tuple[str, ...]) -> None:
    """Acquire, compute the oracle KV beyond the hit, hand over the components `names`, insert."""
    lease = await cache.acquire(f"serve-{len(tokens)}", tokens)
    new = await cache.alloc_device(len(tokens) - lease.cached_len)
    assert new is not None
    kv = chain_payload(lease.key, cache.config.layout, cache.config.namespace)
    cache.device_pool.write_tokens(new, kv[:, :, lease.cached_len :])
    components = stage_components(cache, names, lease.key, lease.cached_len, window=WINDOW)
    assert set(components) == set(names)
    await cache.insert(lease, tokens, torch.cat([lease.device_indices, new]), components or None)


async def host_only_tail(cache: HiCache) -> list[int]:
    """A 12-token sequence as two nodes: [0, 4) on device and host with no component (not a valid end),
    and [4, 12) backed up with its window and state, then evicted from the device (host-only)."""
    seq = list(range(40, 52))
    await serve_request(cache, seq[:4], ())
    await serve_request(cache, seq, ("swa", "mamba"))
    await cache.wait_idle()
    # Ask for all but the first node's page: the leaf [4, 12) (backed up) is evicted from the device.
    room = await cache.alloc_device(7 * SCENARIO_PAGE)
    assert room is not None
    cache.device_pool.free(room)
    match = cache.match(seq)
    assert (match.device_len, match.host_len) == (4, 8)
    return seq


def assert_every_slot_owned(cache: HiCache, held: dict[str, list[torch.Tensor]] | None = None) -> None:
    held = held or {}
    cache.sanity_check(held_components={name: held.get(name, []) for name in component_pools_of(cache)})
    check_pools_exact(cache)
    check_component_pools_exact(cache, held=held, staged=[])
    check_tree_kv(cache)
    check_component_kv(cache)


async def test_two_loads_of_the_same_host_nodes_free_the_loser_s_component_copies() -> None:
    """Two requests load the same host-only node back at once. The second to attach finds it on the
    device already and frees its base pages as duplicates; its window and state copies must be freed
    too (they leaked: `_attach_loaded` freed only the copies of nodes it walked as host-only)."""
    async with HiCache(scenario_config()) as cache:
        seq = await host_only_tail(cache)
        match = cache.match(seq)
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.load_back, match)
            tg.start_soon(cache.load_back, match)
        after = cache.match(seq)
        assert (after.device_len, after.host_len) == (12, 0)
        await release_queue_of(cache).drain()
        assert_every_slot_owned(cache)


async def test_a_duplicate_load_whose_device_end_is_not_valid_frees_all_of_its_pages() -> None:
    """As above, but no state slot can be had on the device, so the node is loaded without its state and
    the path's device end is no valid end: the second loader's re-match is cut back to the root, before
    where its pages start. Every one of its pages must still be freed (it freed only the last
    `start - device_len` of them: a negative slice)."""
    async with HiCache(scenario_config(state_slots=1)) as cache:
        seq = await host_only_tail(cache)
        taken = cache.alloc_component("mamba", 1)  # the only device state slot, held by the test
        assert taken is not None
        match = cache.match(seq)
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.load_back, match)
            tg.start_soon(cache.load_back, match)
        after = cache.match(seq)
        assert after.device_len == 0  # no state on the device anywhere on the path
        await release_queue_of(cache).drain()
        assert_every_slot_owned(cache, {"mamba": [taken]})
        cache.component_pool("mamba").free(taken)
