"""Layer-wise load-back: time to first token of prompts with long host hits, with and without it.

A random Llama-shaped model (weights drawn from a seed, nothing downloaded) serves prompts whose prefix is
a host hit: two prefixes take turns on a device pool that holds one, so each request loads its prefix back
from host while the other is evicted (write-through keeps both backed up). The model's attention reads
layer i of the prefix from the device pool after `lease.layers.wait_layer(i)`.

- whole: `layerwise_load_back=False`: `acquire` copies every layer back before it returns, then the model
  runs.
- layerwise: `acquire` returns at once and the copy of later layers runs while earlier layers compute.

TTFT is from `acquire` until the prefill's last layer is done (synchronized on CUDA). `copy_ms` is the
acquire time of the whole mode (the exposed load-back), `compute_ms` the model time there (nothing to wait
for). `copy_hidden_fraction` = (ttft_whole - ttft_layerwise) / copy_ms, clipped to [0, 1]: the share of
the copy that layer-wise load-back took off the critical path.

It also measures how a layer-wise copy reads page-first pools: the per-layer strided gather
(`LayerwiseCopy`) against the whole-page copy (`copy_pages_async`) of the same pages (`gather_gbps`,
`whole_gbps`).

Shapes: with CUDA, Llama-3-8B (32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, MLP 14336,
bf16) with an 8192-token host hit and a 256-token suffix; on CPU a small float32 shape (8 layers, hidden
512, 4 KV heads of 64) with a 4096-token hit and a 32-token suffix. Medians over `--repeats`.

On CPU the model runs with one torch thread (`--threads`): the copy thread needs a core of its own, and
an OpenMP team that spans a core the copy holds spins at each barrier (on a GPU the copy engine is
separate hardware and the question does not arise).

Host-hit acquire: the cost of one request whose prefix is a host hit, in a cache of 8 layers and a device
pool that holds one of two 256-token prefixes (requests alternate, so each loads its prefix back):
`acquire`, a "forward" that calls `wait_layer` for every layer in a worker thread, `release`.
`host_hit_acquire_us_p50_{layerwise,whole}` is the `acquire` alone (whole: the copy included; layer-wise:
until it returns, the copy running on), `host_hit_request_us_p50_{layerwise,whole}` all of it; each p50
over `--host-hit-iterations`, both modes twice in opposite orders, and the ratios layer-wise / whole.

Usage: python bench/bench_layerwise.py [--repeats 5] [--prefix N] [--suffix N] [--threads N]
[--host-hit-iterations N]. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import anyio
import anyio.to_thread
import torch

from hicache import HiCache, HiCacheConfig, KVLayout, WritePolicy
from hicache.memory import KVPool, copy_pages_async
from hicache.memory.layerwise import LayerReadiness, LayerwiseCopy, read_layer_tokens


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    dtype: torch.dtype
    page_size: int


GPU_SHAPE = Shape(32, 4096, 32, 8, 128, 14336, torch.bfloat16, 16)
CPU_SHAPE = Shape(8, 512, 8, 4, 64, 1024, torch.float32, 16)


class RandomLlama:
    """The prefill of a Llama decoder stack with random weights (RMSNorm, GQA attention over a cached
    prefix, SwiGLU MLP); enough to cost what a real layer costs, not to say anything."""

    def __init__(self, shape: Shape, device: torch.device, seed: int = 0) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        s = shape
        self.shape = s

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=g, dtype=torch.float32) / math.sqrt(cols)
            return w.to(device=device, dtype=s.dtype)

        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.layers = [
            (weight(s.hidden, q), weight(s.hidden, 2 * kv), weight(q, s.hidden), weight(s.hidden, 2 * s.mlp),
             weight(s.mlp, s.hidden))
            for _ in range(s.layers)
        ]  # fmt: skip
        self.device = device

    def prefill(
        self,
        x: torch.Tensor,
        pool: KVPool,
        prefix: torch.Tensor,
        layers: LayerReadiness,
        threads: int,
    ) -> None:
        """Run the suffix `x` (tokens, hidden) over the cached prefix at device indices `prefix`, with
        `threads` torch threads (set in this worker thread: OpenMP's count is per OS thread)."""
        torch.set_num_threads(threads)
        s = self.shape
        n = x.shape[0]
        with torch.inference_mode():
            for i, (wq, wkv, wo, wup, wdown) in enumerate(self.layers):
                h = torch.nn.functional.rms_norm(x, (s.hidden,))
                q = (h @ wq).view(n, s.heads, s.head_dim).transpose(0, 1)
                k_new, v_new = (h @ wkv).view(n, 2, s.kv_heads, s.head_dim).unbind(1)
                layers.wait_layer(i)  # the attention reads layer i of the prefix: wait for it
                past = read_layer_tokens(pool, prefix, i)  # (2, P, kv_heads, head_dim)
                k = torch.cat([past[0], k_new]).transpose(0, 1)
                v = torch.cat([past[1], v_new]).transpose(0, 1)
                rep = s.heads // s.kv_heads
                k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
                attn = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                x = x + attn.transpose(0, 1).reshape(n, -1) @ wo
                gate, up = (torch.nn.functional.rms_norm(x, (s.hidden,)) @ wup).chunk(2, dim=-1)
                x = x + (torch.nn.functional.silu(gate) * up) @ wdown
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)


async def serve(
    shape: Shape, device: torch.device, prefix: int, suffix: int, repeats: int, layerwise: bool
) -> dict[str, float]:
    """TTFT of `repeats` requests each loading a `prefix`-token host hit back; medians in ms."""
    layout = KVLayout(shape.layers, shape.kv_heads, shape.head_dim, shape.dtype, shape.page_size)
    prefix_pages = prefix // shape.page_size
    suffix_pages = -(-suffix // shape.page_size)
    config = HiCacheConfig(
        layout=layout,
        device_pages=prefix_pages + suffix_pages + 2,
        host_pages=2 * prefix_pages + 4,
        write_policy=WritePolicy.WRITE_THROUGH,
        layerwise_load_back=layerwise,
    )
    model = RandomLlama(shape, device)
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(1)
    prompts = [list(range(1, prefix + 1)), list(range(10**6, 10**6 + prefix))]
    ttft, acquire, compute = [], [], []
    async with HiCache(config) as cache:
        for seq in prompts:  # both prefixes on host, the last one on device too
            lease = await cache.acquire(f"fill-{seq[0]}", seq)
            new = await cache.alloc_device(prefix)
            assert new is not None
            kv = torch.randn(layout.tokens_shape(prefix), generator=g).to(shape.dtype)
            cache.device_pool.write_tokens(new, kv)
            await cache.insert(lease, seq, new)
            await cache.wait_idle()
        for r in range(repeats + 1):  # the first is a warm-up
            seq = prompts[r % 2] + [2 * 10**6 + r * suffix + j for j in range(suffix)]
            x = torch.randn(suffix, shape.hidden, generator=g).to(device=device, dtype=shape.dtype)
            await cache.wait_idle()
            t0 = time.perf_counter()
            lease = await cache.acquire(f"r{r}", seq)
            t1 = time.perf_counter()
            assert lease.cached_len == prefix, (lease.cached_len, lease.hit_tokens_by_tier)
            assert lease.hit_tokens_by_tier["host"] == prefix
            await anyio.to_thread.run_sync(
                model.prefill, x, cache.device_pool, lease.device_indices, lease.layers, threads
            )
            t2 = time.perf_counter()
            cache.release(lease)
            if r:
                ttft.append(t2 - t0)
                acquire.append(t1 - t0)
                compute.append(t2 - t1)
    ms = 1e3
    return {
        "ttft_ms": statistics.median(ttft) * ms,
        "acquire_ms": statistics.median(acquire) * ms,
        "compute_ms": statistics.median(compute) * ms,
    }


async def gather_vs_whole(shape: Shape, device: torch.device, prefix: int, repeats: int) -> dict[str, float]:
    """Bandwidth of the per-layer strided gather against the whole-page copy, host -> device."""
    layout = KVLayout(shape.layers, shape.kv_heads, shape.head_dim, shape.dtype, shape.page_size)
    pages = prefix // shape.page_size
    with (
        KVPool(layout, pages, device="cpu", name="host") as host,
        KVPool(layout, pages, device=device, pin_memory=False, name="device") as dev,
    ):
        src = host.alloc(prefix)
        dst = dev.alloc(prefix)
        assert src is not None
        assert dst is not None
        nbytes = pages * layout.page_nbytes
        whole, gather = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            await copy_pages_async(host, src, dev, dst)
            whole.append(time.perf_counter() - t)
            t = time.perf_counter()
            await LayerwiseCopy(host, src, dev, dst).run()
            gather.append(time.perf_counter() - t)
    return {
        "whole_gbps": nbytes / statistics.median(whole) / 1e9,
        "gather_gbps": nbytes / statistics.median(gather) / 1e9,
    }


HH_LAYERS, HH_PAGE, HH_TOKENS = 8, 16, 256


async def host_hit_loop(device: torch.device, iterations: int, layerwise: bool) -> dict[str, float]:
    """p50 of a host-hit request's `acquire` and of the whole request (see the module docstring)."""
    layout = KVLayout(HH_LAYERS, 2, 64, torch.float32, HH_PAGE)
    config = HiCacheConfig(
        layout=layout,
        device_pages=HH_TOKENS // HH_PAGE + 4,
        host_pages=4 * HH_TOKENS // HH_PAGE,
        layerwise_load_back=layerwise,
    )
    seqs = [[1 + 3000 * k + i for i in range(HH_TOKENS)] for k in range(2)]
    acquire: list[float] = []
    request: list[float] = []
    async with HiCache(config) as cache:
        for k, seq in enumerate(seqs):  # computed once, backed up to host
            lease = await cache.acquire(f"init{k}", seq)
            new = await cache.alloc_device(HH_TOKENS)
            assert new is not None
            await cache.insert(lease, seq, new)
            await cache.wait_idle()
        for i in range(iterations + 10):
            seq = seqs[i % 2]
            t0 = time.perf_counter()
            lease = await cache.acquire(f"r{i}", seq)
            t1 = time.perf_counter()
            assert lease.hit_tokens_by_tier["host"] == HH_TOKENS, lease.hit_tokens_by_tier
            layers = lease.layers

            def forward() -> None:
                for layer in range(HH_LAYERS):
                    layers.wait_layer(layer)  # noqa: B023 - called before the loop moves on
                if device.type == "cuda":
                    torch.cuda.current_stream().synchronize()

            await anyio.to_thread.run_sync(forward)
            cache.release(lease)
            t2 = time.perf_counter()
            if i >= 10:  # warm-up
                acquire.append((t1 - t0) * 1e6)
                request.append((t2 - t0) * 1e6)
        await cache.wait_idle()
    return {"acquire": statistics.median(acquire), "request": statistics.median(request)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefix", type=int, default=8192 if cuda else 4096)
    parser.add_argument("--suffix", type=int, default=256 if cuda else 32)
    parser.add_argument(
        "--threads", type=int, default=None if cuda else 1, help="torch threads of the model (CPU: 1)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny pass (seconds): the same JSON keys, no figure worth reading",
    )
    parser.add_argument("--host-hit-iterations", type=int, default=300)
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.prefix, args.suffix, args.host_hit_iterations = 1, 256, 16, 10
    shape = GPU_SHAPE if cuda else CPU_SHAPE
    device = torch.device("cuda" if cuda else "cpu")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t = time.perf_counter()
    # Two rounds in opposite orders, so drift in the machine's load hits both modes alike.
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for order in ((False, True), (True, False)):
        for layerwise in order:
            runs[layerwise].append(
                await serve(shape, device, args.prefix, args.suffix, args.repeats, layerwise=layerwise)
            )
    whole, layered = (
        {key: statistics.mean(run[key] for run in runs[mode]) for key in runs[mode][0]}
        for mode in (False, True)
    )
    copy_ms = whole["acquire_ms"]
    hidden = (whole["ttft_ms"] - layered["ttft_ms"]) / copy_ms if copy_ms > 0 else 0.0
    bandwidth = await gather_vs_whole(shape, device, args.prefix, args.repeats)
    hits: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for order in ((False, True), (True, False)):
        for layerwise in order:
            hits[layerwise].append(await host_hit_loop(device, args.host_hit_iterations, layerwise))
    hit_whole, hit_layered = (
        {key: statistics.mean(run[key] for run in hits[mode]) for key in ("acquire", "request")}
        for mode in (False, True)
    )
    result = {
        "bench": "layerwise",
        "device": str(device),
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "shape": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in vars(shape).items()},
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "ttft_ms_layerwise": round(layered["ttft_ms"], 2),
        "ttft_ms_whole": round(whole["ttft_ms"], 2),
        "copy_hidden_fraction": round(min(1.0, max(0.0, hidden)), 3),
        "copy_ms": round(copy_ms, 2),
        "compute_ms": round(whole["compute_ms"], 2),
        "acquire_ms_layerwise": round(layered["acquire_ms"], 2),
        "gather_gbps": round(bandwidth["gather_gbps"], 2),
        "whole_gbps": round(bandwidth["whole_gbps"], 2),
        "host_hit_acquire_us_p50_layerwise": round(hit_layered["acquire"], 1),
        "host_hit_acquire_us_p50_whole": round(hit_whole["acquire"], 1),
        "host_hit_acquire_ratio": round(hit_layered["acquire"] / hit_whole["acquire"], 3),
        "host_hit_request_us_p50_layerwise": round(hit_layered["request"], 1),
        "host_hit_request_us_p50_whole": round(hit_whole["request"], 1),
        "host_hit_request_ratio": round(hit_layered["request"] / hit_whole["request"], 3),
        "load_average": round(os.getloadavg()[0], 2),
        "seconds": round(time.perf_counter() - t, 1),
    }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    anyio.run(main)
