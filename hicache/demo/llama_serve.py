"""`hicache demo` (the default `--model llama`): the serving loop over a seeded small Llama, checked bit for bit.

Each request matches, loads back host hits, prefetches storage hits, restores the prefix's K/V from the
device pool, prefills only the uncached suffix, decodes a few tokens and inserts its K/V. Every request is
then verified:

1. the K/V restored from the cache (whatever tier it came from) equal bit for bit the K/V the model
   produced for those tokens earlier (`KVOracle`);
2. the logits equal bit for bit those of the model continuing from its own in-memory cache with the same
   split (prefix length);
3. the logits and the greedy reply agree with the no-cache full recompute within `RECOMPUTE_TOLERANCE`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial

import torch

from hicache.config import HiCacheConfig
from hicache.controller import HiCache, Lease
from hicache.demo.handoff import SCENARIOS, serve_handoff
from hicache.demo.loop import ServingLoop
from hicache.demo.model import DecodeResult, DemoModel, PrefillResult, cache_from_kv
from hicache.demo.oracle import KVOracle
from hicache.demo.records import DemoConfig, DemoResult, ProgressFn, Served, noop_progress
from hicache.demo.run import demo_cache_config, intra_op_threads, run_serving
from hicache.demo.workload import Workload, make_workload
from hicache.memory import KVLayout
from hicache.memory.layerwise import read_layer_tokens
from hicache.policy import WritePolicy
from storage_backends.cancellation import run_in_thread

__all__ = ["LlamaRunner", "run_demo"]


class LlamaRunner(ServingLoop[DemoModel]):
    """The Llama demo's runner: one request through the cache, and checks 1 and 2."""

    def __init__(
        self, config: DemoConfig, model: DemoModel, workload: Workload, progress: ProgressFn
    ) -> None:
        super().__init__(model, workload, config.max_running, config.torch_threads, progress, config.lockstep)
        self.config = config
        self.oracle = KVOracle(config.page_size)
        # What each request computed itself, recorded in the oracle by `verify`: the oracle is the
        # checks' bookkeeping, not the cache's, so it stays off the serving path.
        self.to_record: list[tuple[torch.Tensor, PrefillResult, int]] = []

    # ------------------------------------------------------------------ with the cache

    async def serve_cached(self, cache: HiCache) -> None:
        """Serve the workload through `cache`, as its scenario says (`hicache.demo.handoff`)."""
        if self.config.scenario == "handoff":
            await serve_handoff(self, cache)
        else:
            await super().serve_cached(cache)

    def _restore_and_prefill(
        self, cache: HiCache, lease: Lease, prompt: torch.Tensor, reused: int
    ) -> tuple[torch.Tensor | None, PrefillResult]:
        """Read the prefix's K/V out of the device pool and prefill the rest (in the worker thread).

        The prefix is read layer by layer, each layer just before the model's attention needs it, after
        `lease.layers.wait_layer` (a layer-wise load-back may still be copying later layers). The lease
        keeps the prefix's pages locked until it is released, after this returns. Read on the event loop
        instead, the copy would wait for the GIL behind the other request's forward pass (up to a switch
        interval per handoff), on this request's time to first token.
        """
        if not reused:
            return None, self.model.prefill(prompt, None)
        read = partial(_read_layer, cache, lease, lease.device_indices[:reused])
        prefill, restored = self.model.prefill_layerwise(prompt, reused, read)
        return restored, prefill

    async def _run(
        self, cache: HiCache, lease: Lease, request_id: str, prompt: torch.Tensor, arrival: float
    ) -> Served:
        page = self.config.page_size
        new_indices: torch.Tensor | None = None
        try:
            cached = lease.cached_len
            # A fully cached prompt still needs one token run through the model for its logits.
            reused = min(cached, (prompt.numel() - 1) // page * page)
            restored, prefill = await self.compute(
                partial(self._restore_and_prefill, cache, lease, prompt, reused)
            )
            ttft = time.perf_counter() - arrival
            steps = self.workload.spec.decode_tokens
            decoded: DecodeResult = await self.compute_steps(self.model.decode_steps(prefill, steps))
            reply = decoded.tokens
            seq = torch.cat([prompt, torch.tensor(reply[:-1], dtype=torch.int64)])
            self.to_record.append((seq, prefill, reused))
            kv_all = torch.cat([prefill.kv_new, decoded.kv], dim=2)  # K/V of seq[reused:]
            padded = -(-seq.numel() // page) * page
            new_indices = await cache.alloc_device(padded - cached)
            inserted = new_indices is not None
            if new_indices is not None:
                n_new = seq.numel() - cached
                cache.device_pool.write_tokens(new_indices[:n_new], kv_all[:, :, cached - reused :])
                indices = torch.cat([lease.device_indices[:cached], new_indices])
                await cache.insert(lease, seq, indices)
                new_indices = None  # owned by the tree from here on
        finally:
            cache.release(lease, new_indices)  # and the pages it allocated but did not insert, if any
        return Served(reused, inserted, ttft, reply, decoded.logits, restored_kv=restored)

    # ------------------------------------------------------------------ checks 1 and 2

    def verify(self) -> None:
        config = self.model.model.config
        for seq, prefill, reused in self.to_record:
            self.oracle.record(seq, prefill.cache, reused, seq.numel())
        self.to_record.clear()
        for i, record in enumerate(self.records):
            if record.restored_kv is not None:
                restored = cache_from_kv(record.restored_kv, config=config)
                check = self.oracle.check(record.prompt, restored, config=config)
                record.kv_bitwise = check.ok
                logits = self.model.continue_from(check.reference_cache, record.prompt)
                record.same_split_bitwise = torch.equal(logits, record.logits[0])
                record.restored_kv = None
            self.progress("verify", i + 1, len(self.records))


def _read_layer(cache: HiCache, lease: Lease, indices: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer` of the lease's prefix, once it has landed (blocks the model's thread until then)."""
    lease.layers.wait_layer(layer)
    return read_layer_tokens(cache.device_pool, indices, layer).cpu()


async def run_demo(
    config: DemoConfig, progress: ProgressFn = noop_progress, announce: Callable[[str], None] | None = None
) -> DemoResult:
    """Serve the workload with a `HiCache`, then without, verify every request, and return the records.

    Args:
        config: the run's configuration.
        progress: called as requests complete, per phase.
        announce: called with the metrics URL once it is being served.
    """
    if config.scenario not in SCENARIOS:
        raise ValueError(f"scenario: expected one of {SCENARIOS}, got {config.scenario!r}")
    if config.scenario == "handoff":
        if config.turns < 2:
            raise ValueError(f"turns: the handoff scenario needs at least 2 turns, got {config.turns}")
        # Reproducible drops: one request at a time, the caches settled in between; this instance backs a
        # prefix up once it is hit twice, so the system prompts it computed itself stay un-backed.
        config = dataclasses.replace(config, lockstep=True, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    with intra_op_threads(config.torch_threads):
        return await _run_demo(config, progress, announce)


async def _run_demo(
    config: DemoConfig, progress: ProgressFn, announce: Callable[[str], None] | None
) -> DemoResult:
    wall: dict[str, float] = {}
    t = time.perf_counter()
    model = await run_in_thread(DemoModel, config.model)
    wall["model"] = time.perf_counter() - t
    workload = make_workload(config.workload_spec())
    runner = LlamaRunner(config, model, workload, progress)
    spec = config.model
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32, config.page_size)

    def cache_config(url: str) -> HiCacheConfig:
        base = demo_cache_config(config, layout, url, f"hicache-demo-{spec.seed}")
        return dataclasses.replace(base, layerwise_load_back=True, refill_under_unbacked=config.refill_policy)

    return await run_serving(runner, config, cache_config, wall, announce)
