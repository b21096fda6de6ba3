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

import time
from collections.abc import Callable
from functools import partial

import anyio
import torch

from hicache.config import HiCacheConfig
from hicache.controller import HiCache, Lease
from hicache.demo.loop import ServingLoop
from hicache.demo.model import DecodeResult, DemoModel, PrefillResult, cache_from_kv
from hicache.demo.oracle import KVOracle
from hicache.demo.records import DemoConfig, DemoResult, ProgressFn, Served, noop_progress
from hicache.demo.run import demo_cache_config, run_serving
from hicache.demo.workload import Workload, make_workload
from hicache.memory import KVLayout

__all__ = ["LlamaRunner", "run_demo"]


class LlamaRunner(ServingLoop[DemoModel]):
    """The Llama demo's runner: one request through the cache, and checks 1 and 2."""

    def __init__(
        self, config: DemoConfig, model: DemoModel, workload: Workload, progress: ProgressFn
    ) -> None:
        super().__init__(model, workload, config.max_running, config.torch_threads, progress)
        self.config = config
        self.oracle = KVOracle(config.page_size)

    # ------------------------------------------------------------------ with the cache

    def _decode_and_record(self, prefill: PrefillResult, prompt: torch.Tensor, reused: int) -> DecodeResult:
        """Decode, then record the K/V the model computed itself in the oracle (in the worker thread)."""
        decoded = self.model.decode(prefill, self.workload.spec.decode_tokens)
        seq = torch.cat([prompt, torch.tensor(decoded.tokens[:-1], dtype=torch.int64)])
        self.oracle.record(seq, prefill.cache, reused, seq.numel())
        return decoded

    async def _run(
        self, cache: HiCache, lease: Lease, request_id: str, prompt: torch.Tensor, arrival: float
    ) -> Served:
        page = self.config.page_size
        new_indices: torch.Tensor | None = None
        try:
            cached = lease.cached_len
            # A fully cached prompt still needs one token run through the model for its logits.
            reused = min(cached, (prompt.numel() - 1) // page * page)
            restored = cache.device_pool.read_tokens(lease.device_indices[:reused]).cpu() if reused else None
            prefill: PrefillResult = await self.compute(partial(self.model.prefill, prompt, restored))
            ttft = time.perf_counter() - arrival
            decode = partial(self._decode_and_record, prefill, prompt, reused)
            decoded: DecodeResult = await self.compute(decode)
            reply = decoded.tokens
            seq = torch.cat([prompt, torch.tensor(reply[:-1], dtype=torch.int64)])
            kv_all = torch.cat([prefill.kv_new, decoded.kv], dim=2)  # K/V of seq[reused:]
            padded = -(-seq.numel() // page) * page
            new_indices = await cache.alloc_device(padded - cached)
            inserted = new_indices is not None
            if new_indices is not None:
                n_new = seq.numel() - cached
                cache.device_pool.write_tokens(new_indices[:n_new], kv_all[:, :, cached - reused :])
                indices = torch.cat([lease.device_indices[:cached], new_indices])
                new_indices = None  # owned by the tree from here on
                await cache.insert(lease, seq, indices)
        finally:
            cache.release(lease, new_indices)  # and the pages it allocated but did not insert, if any
        return Served(reused, inserted, ttft, reply, decoded.logits, restored_kv=restored)

    # ------------------------------------------------------------------ checks 1 and 2

    def verify(self) -> None:
        config = self.model.model.config
        for i, record in enumerate(self.records):
            if record.restored_kv is not None:
                restored = cache_from_kv(record.restored_kv, config=config)
                check = self.oracle.check(record.prompt, restored, config=config)
                record.kv_bitwise = check.ok
                logits = self.model.continue_from(check.reference_cache, record.prompt)
                record.same_split_bitwise = torch.equal(logits, record.logits[0])
                record.restored_kv = None
            self.progress("verify", i + 1, len(self.records))


async def run_demo(
    config: DemoConfig, progress: ProgressFn = noop_progress, announce: Callable[[str], None] | None = None
) -> DemoResult:
    """Serve the workload with a `HiCache`, then without, verify every request, and return the records.

    Args:
        config: the run's configuration.
        progress: called as requests complete, per phase.
        announce: called with the metrics URL once it is being served.
    """
    wall: dict[str, float] = {}
    t = time.perf_counter()
    model = await anyio.to_thread.run_sync(DemoModel, config.model)
    wall["model"] = time.perf_counter() - t
    workload = make_workload(config.workload_spec())
    runner = LlamaRunner(config, model, workload, progress)
    spec = config.model
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32, config.page_size)

    def cache_config(url: str) -> HiCacheConfig:
        return demo_cache_config(config, layout, url, f"hicache-demo-{spec.seed}")

    return await run_serving(runner, config, cache_config, wall, announce)
