"""`hicache demo --model hybrid`: the serving loop over the hybrid model, with every component cached.

The cache is configured with the hybrid model's components beside its full-attention K/V: a
`SlidingWindow` (the sliding layers' K/V of the last `window` tokens) and a `MambaState` (every linear
layer's conv and recurrent state, one slot). Each request matches, loads back host hits, prefetches storage
hits (pages, window pages and the state, all or nothing), restores all three from the device pools,
prefills only the uncached suffix, decodes a few tokens and inserts its K/V, window and the state at the
sequence's last page boundary (the forward pass is cut there so that the state exists).

A recurrent state exists only where some request's sequence ended, so a cached prefix can only be used up
to such a point: returning users resume their own conversations, but users who merely share a system
prompt do not share its state (the tree matches the full-attention pages, then stops at a node without a
state).

Verification is the main demo's: restored K/V, window and state equal bit for bit what the model itself
produced (`HybridOracle`); the logits equal bit for bit those of the model continuing from those recorded
tensors with the same split; and they agree with a no-cache recompute within `RECOMPUTE_TOLERANCE`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from hicache.components import MambaState, SlidingWindow
from hicache.config import HiCacheConfig
from hicache.controller import HiCache, Lease
from hicache.demo.hybrid import HybridDecode, HybridModel, HybridPrefill, HybridPrefix, HybridSpec
from hicache.demo.hybrid_oracle import HybridOracle
from hicache.demo.loop import ServingLoop
from hicache.demo.records import DemoConfig, DemoResult, ProgressFn, Served, noop_progress
from hicache.demo.run import demo_cache_config, intra_op_threads, run_serving
from hicache.demo.snapshot import pool_json
from hicache.demo.workload import WorkloadSpec, make_workload
from hicache.memory import KVLayout
from storage_backends.cancellation import run_in_thread

__all__ = ["HybridDemoConfig", "hybrid_demo_config", "run_hybrid_demo"]


@dataclass(frozen=True, slots=True)
class HybridDemoConfig:
    """A hybrid demo run: the main demo's knobs plus the model and the component pools.

    Attributes:
        demo: users, turns, workload, base pools (full-attention K/V), backend and the rest.
        model: the hybrid model's shape and weight seed (`sliding_window - 1` must be a multiple of the
            page size, so that a window is whole pages).
        swa_device_pages: pages of the sliding-window component's device pool.
        swa_host_pages: pages of its host pool.
        state_device_slots: states the Mamba component's device pool holds.
        state_host_slots: states its host pool holds.
    """

    demo: DemoConfig
    model: HybridSpec = field(default_factory=HybridSpec)
    swa_device_pages: int = 24
    swa_host_pages: int = 40
    state_device_slots: int = 8
    state_host_slots: int = 14

    def __post_init__(self) -> None:
        if self.model.window % self.demo.page_size:
            raise ValueError(
                f"model: the window ({self.model.window} tokens) is not a multiple of the page size "
                f"{self.demo.page_size}"
            )


def hybrid_demo_config(**overrides: Any) -> DemoConfig:
    """The main demo's `DemoConfig` with the hybrid run's defaults, then `overrides` on top.

    8-token pages (the window is two), a 768-token system prompt per user and turns of 16 to 64 tokens, so
    that a prefill's cost grows with its length as in a real model rather than being the fixed cost of a
    forward pass: a full prefill (~800 tokens) then costs several times what a cached request's fixed costs
    (acquire, restore, a suffix prefill) and its decode do, on an idle machine and on a saturated one
    (with a 384-token prompt a full prefill cost about one 9-token decode, and the ratio of the TTFTs
    followed queueing noise: see BENCHMARKS.md). Pools small enough that eviction, host hits and storage
    prefetch all happen. A request
    decodes `page_size + 1` tokens, so that its sequence always crosses a page boundary while decoding:
    the state kept there is snapshotted between decode steps, and the prefill (the time to first token)
    runs as one forward pass, never cut for a snapshot.
    """
    values: dict[str, Any] = {
        "page_size": 8,
        "device_pages": 384,
        "host_pages": 640,
        "prefetch_threshold": 16,
        "workload": WorkloadSpec(system_prompt_tokens=768, user_tokens=(16, 64), decode_tokens=9),
    }
    values.update(overrides)
    return DemoConfig(**values)


@dataclass(slots=True)
class _Restored:
    """What a request restored from the cache and how its prefill was cut, kept for verification."""

    prefix: HybridPrefix
    splits: tuple[int, ...]


class _HybridRunner(ServingLoop[HybridModel]):
    """State shared by the users of one hybrid demo run."""

    def __init__(self, config: HybridDemoConfig, model: HybridModel, progress: ProgressFn) -> None:
        demo = config.demo
        workload = make_workload(replace(demo.workload_spec(), vocab_size=config.model.vocab_size))
        super().__init__(model, workload, demo.max_running, demo.torch_threads, progress, demo.lockstep)
        self.config = config
        self.demo = demo
        self.oracle = HybridOracle(model, demo.page_size)
        self.restored: dict[str, _Restored] = {}
        # What each request computed itself, recorded in the oracle by `verify`: the oracle is the
        # checks' bookkeeping, not the cache's, so it stays off the serving path.
        self.to_record: list[tuple[torch.Tensor, HybridPrefill]] = []
        self.split_prefills = 0

    # ------------------------------------------------------------------ with the cache

    def _read_prefix(self, cache: HiCache, lease: Lease, reused: int) -> HybridPrefix:
        """The prefix's K/V, window and state, read out of the three device pools."""
        window = min(self.model.spec.window, reused)
        swa_pool = cache.component_pool("swa")
        state_pool = cache.component_pool("mamba")
        # A usable match ends where the window is complete and a state exists: both are there.
        swa_indices = lease.component_indices["swa"]
        return HybridPrefix(
            length=reused,
            full_kv=cache.device_pool.read_tokens(lease.device_indices[:reused]).cpu(),
            swa_kv=swa_pool.read_tokens(swa_indices[swa_indices.numel() - window :]).cpu(),
            state=state_pool.read_tokens(lease.component_indices["mamba"]).cpu().reshape(-1),
        )

    def _restore_and_prefill(
        self, cache: HiCache, lease: Lease, prompt: torch.Tensor, reused: int, snapshot_at: int | None
    ) -> tuple[HybridPrefix | None, HybridPrefill]:
        """Read the prefix out of the pools and prefill the rest (in the model thread).

        The lease keeps the prefix's pages and slots locked until it is released, after this returns. Read
        on the event loop instead, the copies would wait for the GIL behind the other request's forward
        pass (up to a switch interval per handoff), on this request's time to first token.
        """
        prefix = self._read_prefix(cache, lease, reused) if reused else None
        return prefix, self.model.prefill(prompt, prefix, snapshot_at)

    async def _run(
        self, cache: HiCache, lease: Lease, request_id: str, prompt: torch.Tensor, arrival: float
    ) -> Served:
        page = self.demo.page_size
        steps = self.workload.spec.decode_tokens
        window = self.model.spec.window
        new_indices: torch.Tensor | None = None
        owned: dict[str, torch.Tensor] = {}
        try:
            cached = lease.cached_len
            n_prompt = int(prompt.numel())
            # A state exists only at the cached end; a fully cached prompt (no token left to run from
            # there) is recomputed.
            reused = cached if cached < n_prompt else 0
            n_seq = n_prompt + steps - 1
            aligned = n_seq // page * page
            snapshot_at = aligned if aligned > reused else None
            restore = partial(self._restore_and_prefill, cache, lease, prompt, reused, snapshot_at)
            prefix, prefill = await self.compute(restore)
            ttft = time.perf_counter() - arrival
            self.split_prefills += bool(prefill.splits)
            decoded: HybridDecode = await self.compute_steps(
                self.model.decode_steps(prefill, steps, snapshot_at)
            )
            if prefix is not None:
                self.restored[request_id] = _Restored(prefix, prefill.splits)
            reply = decoded.tokens
            seq = torch.cat([prompt, torch.tensor(reply[:-1], dtype=torch.int64)])
            self.to_record.append((seq, prefill))
            # A state is kept only at the end of an inserted key, and keys end on page boundaries: the
            # sequence is inserted up to its last boundary, where the forward pass was cut.
            inserted = aligned <= cached
            if not inserted:
                full_new, swa_new = self.model.new_kv(prefill.cache, reused, aligned)
                new_indices = await cache.alloc_device(aligned - cached)
                inserted = new_indices is not None
            if new_indices is not None:
                cache.device_pool.write_tokens(new_indices, full_new[:, :, cached - reused :])
                await self._stage_components(cache, owned, swa_new, prefill, reused, aligned, window)
                indices = torch.cat([lease.device_indices[:cached], new_indices])
                new_indices = None  # owned by the tree from here on, and so are the components
                components, owned = owned, {}
                await cache.insert(lease, seq[:aligned], indices, components or None)
        finally:
            # With the pages and component slots it allocated but did not insert, if any.
            cache.release(lease, new_indices, owned or None)
        return Served(reused, inserted, ttft, reply, decoded.logits)

    async def _stage_components(
        self,
        cache: HiCache,
        owned: dict[str, torch.Tensor],
        swa_new: torch.Tensor,
        prefill: HybridPrefill,
        reused: int,
        aligned: int,
        window: int,
    ) -> None:
        """Write the window before `aligned` and the state at `aligned` into fresh component slots.

        The window's part before `reused` is already in the tree (locked by the lease); only the newly
        computed part is written. A component whose slots cannot be had is left out: the new node is then
        a tombstone for it, which is valid, only not reusable.
        """
        start = max(aligned - window, reused)
        swa = cache.alloc_component("swa", aligned - start)
        if swa is not None:
            owned["swa"] = swa
            cache.component_pool("swa").write_tokens(swa, swa_new[:, :, start - reused : aligned - reused])
        state = cache.alloc_component("mamba", 1)
        if state is not None:
            owned["mamba"] = state
            packed = prefill.state_at[aligned]
            cache.component_pool("mamba").write_tokens(state, packed.view(1, 1, 1, 1, -1))

    # ------------------------------------------------------------------ checks 1 and 2

    def verify(self) -> None:
        for seq, prefill in self.to_record:
            self.oracle.record(seq, prefill.cache, prefill.start, seq.numel(), prefill.state_at)
        self.to_record.clear()
        for i, record in enumerate(self.records):
            restored = self.restored.pop(record.request_id, None)
            if restored is not None:
                check = self.oracle.check(record.prompt, self.model.parts_from_prefix(restored.prefix))
                record.kv_bitwise = check.ok
                reference = self.model.cache_from_parts(check.reference)
                logits = self.model.continue_from(reference, record.prompt, restored.splits)
                record.same_split_bitwise = torch.equal(logits, record.logits[0])
            self.progress("verify", i + 1, len(self.records))


async def run_hybrid_demo(
    config: HybridDemoConfig,
    progress: ProgressFn = noop_progress,
    announce: Callable[[str], None] | None = None,
) -> DemoResult:
    """Serve the workload over the hybrid model with a component-aware `HiCache`, then without, and verify.

    Args:
        config: the run's configuration.
        progress: called as requests complete, per phase.
        announce: called with the metrics URL once it is being served.
    """
    with intra_op_threads(config.demo.torch_threads):
        return await _run_hybrid_demo(config, progress, announce)


async def _run_hybrid_demo(
    config: HybridDemoConfig, progress: ProgressFn, announce: Callable[[str], None] | None
) -> DemoResult:
    demo = config.demo
    spec = config.model
    wall: dict[str, float] = {}
    t = time.perf_counter()
    model = await run_in_thread(HybridModel, spec)
    wall["model"] = time.perf_counter() - t
    runner = _HybridRunner(config, model, progress)
    page = demo.page_size
    layout = KVLayout(len(model.full_layers), spec.num_kv_heads, spec.head_dim, torch.float32, page)
    swa_layout = KVLayout(len(model.swa_layers), spec.num_kv_heads, spec.head_dim, torch.float32, page)
    components = (
        SlidingWindow(spec.window, swa_layout, config.swa_device_pages, config.swa_host_pages),
        MambaState(spec.state_nbytes, config.state_device_slots, config.state_host_slots),
    )

    def cache_config(url: str) -> HiCacheConfig:
        return demo_cache_config(demo, layout, url, f"hicache-demo-hybrid-{spec.seed}", components)

    def inspect(cache: HiCache) -> dict[str, Any]:
        stats = cache.statistics()
        return {
            "component_pools": {
                name: {"device": pool_json(dev), "host": pool_json(host)}
                for name, (dev, host) in stats.component_pools.items()
            },
            "component_tree": {
                name: {"device_slots": s.device_slots, "host_slots": s.host_slots}
                for name, s in stats.components.items()
            },
        }

    result = await run_serving(runner, demo, cache_config, wall, announce, inspect)
    records = result.records
    result.details = {
        "model": repr(model),
        "layer_types": list(spec.layer_types),
        "window_tokens": spec.window,
        "state_nbytes": spec.state_nbytes,
        "restored": {
            "requests": sum(1 for r in records if r.reused_len),
            "window_tokens": sum(min(spec.window, r.reused_len) for r in records),
            "states": sum(1 for r in records if r.reused_len),
            "split_prefills": runner.split_prefills,
        },
        **result.details,
    }
    return result
