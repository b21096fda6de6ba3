"""The cost of tensor-parallel agreement on gloo, and the TP demo's savings at TP 1, 2 and 4.

Agreement: on 1, 2 and 4 spawned gloo ranks on 127.0.0.1, each rank runs what an `acquire` with a
storage hit agrees (the probe's hit length, then the pages the prefetch completed) and what a commit
agrees alone: propose, settle with a rank-local value, step until resolved (`Agreement.agree`). The
figure is the wall time of one such blocking agreement, p50 and p99 over the iterations, from rank 0.

Raw collective: interleaved with the agreements (one per iteration, so both see the same load), the
ranks time a bare `all_gather_single` of the agreement's tensor: `agree_vs_raw_p50_tpN` is the agreement's
p50 over that one's (the goal: <= 1.25). Then the same agreements beside a ticker task (1 ms sleeps,
as bench_io's `max_loop_stall_ms`): `agree_max_loop_stall_ms_tpN` is its worst lateness (wall: the
steps' short waits for their collective block the loop), `agree_max_loop_stall_cpu_ms_tpN` the most loop
CPU between two ticks, and `idle_max_loop_stall_ms_tpN` the worst lateness over an idle pass as long
(what the machine's load alone does). Then, alone, the same ranks time gloo's `all_gather_single` (what `RankGroup.min_reduce` runs on gloo)
and `all_reduce(MIN)` of the agreement's tensor (`AGREEMENT_CAPACITY + 2` rows of 5 int64), synchronous,
with no event loop: the floor under one agreement, and why a MIN on gloo is an all-gather.

Savings: the TP demo (`hicache demo --tp N`) on one seeded workload at TP 1, 2 and 4; the prompt tokens
served from the cache must be equal at every TP size. `demo_steps_per_request_tpN` is the agreement steps
(collectives) rank 0 ran per request there: probe, commit, device allocation, a backup's host room, and
the steps `tp_sync` runs until backups and write-through are agreed.

Layer-wise load-back: on 1, 2 and 4 ranks each rank runs a `HiCache` (8 layers, no storage) whose device
pool holds one of two 256-token sequences at a time; requests alternate between them, so each acquire
loads its prefix back from host, then a "forward" calls `wait_layer` for every layer in a worker
thread, the lease is released and the scheduling step ends (`tp_sync`). Timed on rank 0, with
`layerwise_load_back` on and off: `layerwise_request_us_p50_tpN` and `whole_request_us_p50_tpN` (acquire
+ forward waits + `tp_sync`), `layerwise_wait_us_p50_tpN` (the forward's waits alone: under TP the
readiness collectives), `readiness_collectives_per_load_tpN` and the agreement steps per request
(`layerwise_steps_per_request_tpN`, `whole_steps_per_request_tpN`). `BENCH_TP_ONLY=layerwise` runs this part
alone (and adds the load average).

Hybrid components: on 1, 2 and 4 ranks each rank serves one seeded workload (page-aligned conversations
over three system prompts, file storage) through a cache with a sliding window and a Mamba state, and
through one without: acquire, allocate (the window's new part and the end state too, with
`alloc_components_async`), insert; every third request ends a scheduling step. Rank 0's agreement steps
per request (`hybrid_steps_per_request_tpN`, `plain_steps_per_request_tpN`), p50 time per request and
cached tokens. `BENCH_TP_ONLY=hybrid` runs this part alone (with the load average);
`BENCH_TP_ONLY=agree` the agreement and raw collectives alone.

Prints one JSON line: {"bench": "tp", "agree_us_p50_tp1": .., "agree_us_p50_tp2": .., "agree_us_p50_tp4":
.., "raw_all_gather_us_p50_tp4": .., "raw_all_reduce_min_us_p50_tp4": .., "saved_tokens_tp1": .., "saved_tokens_tp2": .., "saved_tokens_tp4": .., ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _loop_timing import time_with_ticker

from hicache.demo.tp import TPDemoConfig, run_tp_demo
from hicache.parallel import AGREEMENT_CAPACITY, Agreement, RankGroup
from hicache.parallel.launch import run_ranks

ITERATIONS = int(os.environ.get("BENCH_TP_ITERATIONS", "300"))


async def agree_loop(group: RankGroup, iterations: int) -> dict[str, float]:
    """Each iteration: an acquire's two agreements (probe, then commit: the commit is the figure) and,
    interleaved with them, one bare gloo all-gather of the agreement's tensor, so the agreement and its
    floor are timed under the same load (a 2-core machine shared with other work moves a lot)."""
    ag = Agreement(group, idle_s=0.0)
    samples: list[float] = []
    acquire: list[float] = []
    raw: list[float] = []
    tensor = torch.zeros(AGREEMENT_CAPACITY + 2, 5, dtype=torch.int64)
    collectives = 0
    for i in range(iterations + 20):
        before = group.collectives
        t0 = time.perf_counter()
        probe = ag.propose("probe", f"r{i}")
        probe.settle(10 + group.tp_rank)
        await ag.agree(probe)
        t1 = time.perf_counter()
        commit = ag.propose("commit", f"r{i}")
        commit.settle(8 + group.tp_rank)
        await ag.agree(commit)
        t2 = time.perf_counter()
        collectives += group.collectives - before
        group.gather(tensor)
        t3 = time.perf_counter()
        if i >= 20:  # warm-up
            samples.append((t2 - t1) * 1e6)
            acquire.append((t2 - t0) * 1e6)
            raw.append((t3 - t2) * 1e6)
    inline = group.inline_completions
    samples.sort()
    acquire.sort()

    async def agreements() -> None:
        for i in range(iterations):
            commit = ag.propose("commit", f"s{i}")
            commit.settle(8 + group.tp_rank)
            await ag.agree(commit)

    # What the steps cost the rest of the loop (the <= 1 ms wait on the loop blocks it): a ticker's worst
    # lateness over `iterations` agreements, and over an idle pass as long (the machine's own floor).
    ticked = await time_with_ticker(agreements)
    idle = await time_with_ticker(lambda: asyncio.sleep(ticked.seconds))
    return {
        "stall_ms": ticked.stall_ms,
        "stall_cpu_ms": ticked.stall_cpu_ms,
        "idle_stall_ms": idle.stall_ms,
        "p50": statistics.median(samples),
        "p99": samples[int(0.99 * (len(samples) - 1))],
        "acquire_p50": statistics.median(acquire),
        "raw_interleaved_p50": statistics.median(raw),
        "collectives_per_agreement": collectives / (2 * (iterations + 20)),
        "inline_fraction": inline / max(1, 2 * (iterations + 20)),
    }


def raw_collectives(group: RankGroup, iterations: int) -> dict[str, float]:
    """p50 of the bare gloo collectives on the agreement's tensor, in microseconds."""
    tensor = torch.zeros(AGREEMENT_CAPACITY + 2, 5, dtype=torch.int64)
    timed: dict[str, list[float]] = {"all_gather": [], "all_reduce_min": []}
    for i in range(iterations + 20):
        t0 = time.perf_counter()
        group.gather(tensor)
        t1 = time.perf_counter()
        work = dist.all_reduce(tensor.clone(), op=dist.ReduceOp.MIN, group=group.process_group, async_op=True)
        assert work is not None
        work.wait(timeout=datetime.timedelta(seconds=group.timeout_s))
        t2 = time.perf_counter()
        if i >= 20:  # warm-up
            timed["all_gather"].append((t1 - t0) * 1e6)
            timed["all_reduce_min"].append((t2 - t1) * 1e6)
    return {name: statistics.median(samples) for name, samples in timed.items()}


LW_LAYERS, LW_PAGE, LW_TOKENS = 8, 16, 256


async def layerwise_loop(group: RankGroup, iterations: int, layerwise: bool) -> dict[str, float]:
    """Alternate two sequences that do not fit the device together: every acquire loads from host."""
    import anyio.to_thread

    from hicache import HiCache, HiCacheConfig, KVLayout, Namespace

    tp = group.tp_size
    layout = KVLayout(LW_LAYERS, 2, 64, torch.float32, LW_PAGE)
    config = HiCacheConfig(
        layout=layout,
        device_pages=LW_TOKENS // LW_PAGE + 4,
        host_pages=4 * LW_TOKENS // LW_PAGE,
        namespace=Namespace(model_id="bench-tp-lw", tp_rank=group.tp_rank, tp_size=tp),
        tp_group=group if tp > 1 else None,
        layerwise_load_back=layerwise,
    )
    seqs = [[1 + 3000 * k + i for i in range(LW_TOKENS)] for k in range(2)]
    request: list[float] = []
    waits: list[float] = []
    collectives = 0
    loads = 0
    steps = 0
    async with HiCache(config) as cache:
        for k, seq in enumerate(seqs):  # computed once, backed up to host
            lease = await cache.acquire(f"init{k}", seq)
            new = await cache.alloc_device(LW_TOKENS)
            assert new is not None
            await cache.insert(lease, seq, new)
            await cache.wait_idle()
        for i in range(iterations + 10):
            seq = seqs[i % 2]
            steps_before = 0 if cache.agreement is None else cache.agreement.statistics().steps
            t0 = time.perf_counter()
            lease = await cache.acquire(f"r{i}", seq)
            assert lease.hit_tokens_by_tier["host"] == LW_TOKENS, lease.hit_tokens_by_tier
            layers = lease.layers
            t1 = time.perf_counter()

            def forward() -> None:
                for layer in range(LW_LAYERS):
                    layers.wait_layer(layer)  # noqa: B023 - called before the loop moves on

            await anyio.to_thread.run_sync(forward)
            t2 = time.perf_counter()
            cache.release(lease)
            await cache.tp_sync()
            t3 = time.perf_counter()
            if i >= 10:  # warm-up
                request.append((t3 - t0) * 1e6)
                waits.append((t2 - t1) * 1e6)
                collectives += int(getattr(layers, "collectives", 0))
                loads += 1
                if cache.agreement is not None:
                    steps += cache.agreement.statistics().steps - steps_before
    return {
        "request_p50": statistics.median(request),
        "wait_p50": statistics.median(waits),
        "collectives_per_load": collectives / max(1, loads),
        "steps_per_request": steps / max(1, loads),
    }


HY_PAGE = 16
HY_WINDOW = 32
HY_REQUESTS = int(os.environ.get("BENCH_TP_HYBRID_REQUESTS", "90"))


def _hybrid_requests(n: int) -> list[list[int]]:
    """Page-aligned conversations over three system prompts that grow and come back (seeded)."""
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(1, 30000) for _ in range(8 * HY_PAGE)] for _ in range(3)]
    seen: list[list[int]] = []
    out = []
    for _ in range(n):
        base = rng.choice(seen) if seen and rng.random() < 0.5 else list(rng.choice(prompts))
        seq = base + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 4) * HY_PAGE)]
        seen.append(seq)
        out.append(seq)
    return out


async def hybrid_loop(group: RankGroup, root: str, n: int, hybrid: bool) -> dict[str, float]:
    """Serve `n` seeded requests through a cache with a sliding window and a Mamba state (`hybrid`) or
    without, over file storage in `root`: acquire, allocate (and, hybrid, the window's new part and the
    end state, `alloc_components_async`), insert, release; every third request ends a scheduling step."""
    from hicache import HiCache, HiCacheConfig, KVLayout, Namespace
    from hicache.components import MambaState, SlidingWindow

    tp = group.tp_size
    comps = (
        (
            SlidingWindow(HY_WINDOW, KVLayout.flat(64, HY_PAGE), device_pages=24, host_pages=48),
            MambaState(256, device_slots=12, host_slots=24),
        )
        if hybrid
        else ()
    )
    config = HiCacheConfig(
        layout=KVLayout(4, 2, 32, torch.float32, HY_PAGE),
        device_pages=48,
        host_pages=96,
        storage_url=f"file://{root}/{'hybrid' if hybrid else 'plain'}",
        namespace=Namespace(model_id="bench-tp-hybrid", tp_rank=group.tp_rank, tp_size=tp),
        prefetch_threshold=HY_PAGE,
        components=comps,
        tp_group=group if tp > 1 else None,
    )
    times: list[float] = []
    steps = 0
    cached_tokens = 0
    async with HiCache(config) as cache:
        for i, seq in enumerate(_hybrid_requests(n)):
            before = 0 if cache.agreement is None else cache.agreement.statistics().steps
            t0 = time.perf_counter()
            lease = await cache.acquire(f"r{i}", seq)
            cached, total = lease.cached_len, len(seq)
            new = await cache.alloc_device(total - cached)
            owned: dict[str, torch.Tensor] = {}
            if new is not None and hybrid:
                start = max(total - HY_WINDOW, cached)
                got = await cache.alloc_components_async({"swa": total - start, "mamba": 1})
                owned = {name: slots for name, slots in got.items() if slots is not None}
            if new is not None:
                await cache.insert(lease, seq, torch.cat([lease.device_indices[:cached], new]), owned or None)
            else:
                cache.release(lease)
            if i % 3 == 2:
                await cache.tp_sync()
            times.append((time.perf_counter() - t0) * 1e6)
            cached_tokens += cached
            if cache.agreement is not None:
                steps += cache.agreement.statistics().steps - before
        await cache.wait_idle()
    return {
        "request_p50": statistics.median(times),
        "steps_per_request": steps / max(1, n),
        "cached_tokens": cached_tokens,
    }


async def rank_loops(
    group: RankGroup, parts: tuple[str, ...], iterations: int, requests: int, root: str
) -> dict[str, dict[str, float]]:
    """Every measured loop of `parts` in one set of rank processes (spawning ranks costs seconds each)."""
    out: dict[str, dict[str, float]] = {}
    if "agree" in parts:
        out["agree"] = await agree_loop(group, iterations)
    if "raw" in parts and group.tp_size > 1:
        out["raw"] = raw_collectives(group, iterations)
    if "layerwise" in parts:
        for layerwise in (True, False):
            out["layerwise" if layerwise else "whole"] = await layerwise_loop(group, iterations, layerwise)
    if "hybrid" in parts:
        for hybrid in (False, True):
            name = "hybrid" if hybrid else "plain"
            os.makedirs(os.path.join(root, name), exist_ok=True)
            out[name] = await hybrid_loop(group, os.path.join(root, name), requests, hybrid)
    return out


def figures(out: dict[str, object], parts: tuple[str, ...], iterations: int, requests: int) -> None:
    """Run `parts` at TP 1, 2 and 4 (one `run_ranks` each) and add their figures to `out`."""
    import tempfile

    for tp in (1, 2, 4):
        with tempfile.TemporaryDirectory(prefix="bench-tp-") as root:
            ranks = run_ranks(rank_loops, tp, (parts, iterations, requests, root), timeout_s=1200)
        bad = [r for r in ranks if not r.ok]
        if bad:
            raise SystemExit(f"tp={tp}: {bad[0].error_type}: {bad[0].error}")
        v = ranks[0].value
        if "agree" in v:
            a = v["agree"]
            out[f"agree_us_p50_tp{tp}"] = round(a["p50"], 1)
            out[f"agree_us_p99_tp{tp}"] = round(a["p99"], 1)
            out[f"acquire_agree_us_p50_tp{tp}"] = round(a["acquire_p50"], 1)
            out[f"collectives_per_agreement_tp{tp}"] = round(a["collectives_per_agreement"], 3)
            if tp > 1:
                out[f"raw_interleaved_all_gather_us_p50_tp{tp}"] = round(a["raw_interleaved_p50"], 1)
                out[f"agree_vs_raw_p50_tp{tp}"] = round(a["p50"] / a["raw_interleaved_p50"], 3)
                out[f"inline_fraction_tp{tp}"] = round(a["inline_fraction"], 3)
                out[f"agree_max_loop_stall_ms_tp{tp}"] = round(a["stall_ms"], 2)
                out[f"agree_max_loop_stall_cpu_ms_tp{tp}"] = round(a["stall_cpu_ms"], 2)
                out[f"idle_max_loop_stall_ms_tp{tp}"] = round(a["idle_stall_ms"], 2)
        if "raw" in v:
            out[f"raw_all_gather_us_p50_tp{tp}"] = round(v["raw"]["all_gather"], 1)
            out[f"raw_all_reduce_min_us_p50_tp{tp}"] = round(v["raw"]["all_reduce_min"], 1)
        for name in ("layerwise", "whole"):
            if name in v:
                out[f"{name}_request_us_p50_tp{tp}"] = round(v[name]["request_p50"], 1)
                out[f"{name}_steps_per_request_tp{tp}"] = round(v[name]["steps_per_request"], 2)
        if "layerwise" in v:
            out[f"layerwise_wait_us_p50_tp{tp}"] = round(v["layerwise"]["wait_p50"], 1)
            out[f"readiness_collectives_per_load_tp{tp}"] = round(v["layerwise"]["collectives_per_load"], 2)
        for name in ("plain", "hybrid"):
            if name in v:
                out[f"{name}_steps_per_request_tp{tp}"] = round(v[name]["steps_per_request"], 2)
                out[f"{name}_request_us_p50_tp{tp}"] = round(v[name]["request_p50"], 1)
                out[f"{name}_cached_tokens_tp{tp}"] = v[name]["cached_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="one tiny pass: the same JSON keys, no figure worth reading"
    )
    args = parser.parse_args()
    iterations, requests = (5, 6) if args.smoke else (ITERATIONS, HY_REQUESTS)
    demo_sizes = {"users": 1, "turns": 1} if args.smoke else {}
    out: dict[str, object] = {"bench": "tp", "iterations": iterations, "backend": "gloo"}
    only = os.environ.get("BENCH_TP_ONLY")
    if only in ("agree", "layerwise", "hybrid"):
        if only == "hybrid":
            out["requests"] = requests
        figures(out, ("agree", "raw") if only == "agree" else (only,), iterations, requests)
        out["load_average"] = os.getloadavg()[0]
        print(json.dumps(out))
        return
    figures(out, ("agree", "raw", "layerwise", "hybrid"), iterations, requests)
    for tp in (1, 2, 4):
        result = run_tp_demo(TPDemoConfig(tp=tp, **demo_sizes))
        if not result.all_identical:
            raise SystemExit(f"tp={tp}: the demo failed its checks: {result.failures[:5]}")
        out[f"saved_tokens_tp{tp}"] = result.saved_tokens
        out[f"demo_wall_s_tp{tp}"] = round(result.wall_s, 2)
        out[f"demo_steps_per_request_tp{tp}"] = round(result.agreement_steps / max(1, result.requests), 2)
    out["savings_identical"] = out["saved_tokens_tp1"] == out["saved_tokens_tp2"] == out["saved_tokens_tp4"]
    out["goal_agree_p50_tp4_under_1ms"] = float(out["agree_us_p50_tp4"]) < 1000.0  # type: ignore[arg-type]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
