#!/usr/bin/env python3
"""Benchmark of hicache's radix tree core, side by side with SGLang's Python RadixCache.

Usage:
    .venv/bin/python bench/bench_tree.py [--reps 3] [--no-baseline] [--smoke]

Workload (mirrors ../shared/baselines/sglang-radix/bench.py, same generator and seed): 2,000 sequences of
1,024 tokens, each one of 50 shared 512-token prefixes plus a random 512-token suffix, `array('q')` keys,
one int64 value tensor per sequence. Phases on a fresh tree (wall clock, median of --reps, as the baseline
times SGLang): insert all, match all, evict half the tokens in 1,024-token calls. With the baseline, the
page-16 passes run --reps times before it and --reps times after it, and the figures are the medians of
all of them (the machine's load drifts: one round before the baseline alone weighed the drift on one side).

Matching is timed twice. `match_lazy` is the like-for-like figure against SGLang: SGLang's
`RadixCache.match_prefix` (0.5.23) returns the prefix length and the last node and joins no index tensors
(`device_prefix_len = sum(len(v) for v in value)`; `path_device_indices(node)` joins them on request), and
hicache's `match_prefix` likewise joins them only when `MatchResult.device_indices` is read. `match` also
reads `device_indices` (one `torch.cat` per first match of a path; a later match ending at the same node
reuses the joined tensor cached there). `vs_sglang_match` uses the former, `vs_sglang_match_joined` the
latter.

Per request through the cache: `acquire` + `release` of a 1,024-token prompt given as a Python list (one of
the workload's sequences, all of it a device hit in a `HiCache` holding 50 of them), timed call by call:
`acquire_device_hit_us_p50` / `_p99`, set beside SGLang's `match_prefix` on the same 1,024-token sequences (the
baseline's `match_us`, whose keys are `RadixKey`s over `array('q')`: it matches and does not lock).

Key conversion: `as_key_bytes` of a 1,024-token Python list against `array('q', list).tobytes()`, CPU time
per list (`key_convert_us`).

Scaling: the same per-op costs on trees of about 10^4, 10^5 and 10^6 tokens, in CPU time of this process
(`time.process_time`, minimum of --reps): a ratio of our own costs, which wall time on a machine shared
with other jobs does not measure. Prints a table, then one JSON line.

Instruction counts (`--instructions insert|match|acquire`), for comparing two commits on a loaded machine,
where time cannot: run under `valgrind --tool=callgrind --instr-atstart=no`; only the measured calls are
instrumented (switched on and off with `callgrind_control`), and valgrind prints the count (`Collected`)
at exit. `insert`: the reference workload's 2,000 inserts into a fresh tree (`--page-size`, default 16);
`match`: as many first matches of its keys on a tree holding all of them, each reading `device_indices`
(the `match_joined` figure); `acquire`: 500 `acquire` + `release` pairs, as timed above. Subtract a run with `--count 0` (the
switching itself).

Storage refills (`--insert-host`): `insert_host` of refills of 1,024 and 32,768 tokens (with their page
hashes) below the root of a tree holding 200 of them, CPU time per call (`time.process_time`, median of
200 calls): what a prefetch's commit costs the loop in the tree. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import torch

from hicache import HiCache, HiCacheConfig, KVLayout
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from hicache.tree import RadixTree

BASELINE = Path(__file__).resolve().parents[1] / ".." / "shared" / "baselines" / "sglang-radix" / "run"


def make_workload(
    n_seqs: int, n_prefixes: int, prefix_len: int, suffix_len: int, vocab: int, seed: int
) -> tuple[list[array[int]], list[torch.Tensor]]:
    """Exactly bench.py's generator: same RNG calls in the same order."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(n_prefixes)]
    seqs = []
    for i in range(n_seqs):
        toks = prefixes[i % n_prefixes] + [rng.randrange(vocab) for _ in range(suffix_len)]
        seqs.append(array("q", toks))
    seq_len = prefix_len + suffix_len
    values = [torch.arange(i * seq_len, (i + 1) * seq_len, dtype=torch.int64) for i in range(n_seqs)]
    return seqs, values


def timed(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> tuple[float, object]:
    gc.collect()
    t0 = clock()
    out = fn()
    return clock() - t0, out


def cpu_timed(fn: Callable[[], object]) -> tuple[float, object]:
    return timed(fn, time.process_time)


def insert_all(tree: RadixTree, seqs: list[array[int]], values: list[torch.Tensor]) -> None:
    for s, v in zip(seqs, values, strict=True):
        tree.insert(s, v)


def match_all(tree: RadixTree, queries: list[array[int]]) -> int:
    total = 0
    for q in queries:
        m = tree.match_prefix(q)
        m.device_indices  # noqa: B018 - materialised, as SGLang's match_prefix does
        total += m.device_len
    return total


def match_all_lazy(tree: RadixTree, queries: list[array[int]]) -> int:
    total = 0
    for q in queries:
        total += tree.match_prefix(q).device_len
    return total


def evict_chunked(tree: RadixTree, target: int, chunk: int) -> tuple[int, int]:
    done = calls = 0
    while done < target:
        r = tree.evict_device(min(chunk, target - done))
        calls += 1
        if r.evicted_tokens == 0:
            break
        done += r.evicted_tokens
    return done, calls


def bench_main(
    page_size: int,
    seqs: list[array[int]],
    values: list[torch.Tensor],
    reps: int,
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Per-op costs on the reference workload: medians of `reps` passes on fresh trees, together with the
    passes already in `samples` (which this extends: timing one round before SGLang's baseline and one
    after it, so a change in the machine's load between the two weighs on both sides alike)."""
    samples = {} if samples is None else samples
    t_ins, t_match, t_lazy, t_ev = (samples.setdefault(k, []) for k in ("insert", "match", "lazy", "evict"))
    calls_seen = samples.setdefault("calls", [])
    calls = int(calls_seen[0]) if calls_seen else 0
    for _ in range(reps):
        tree = RadixTree(page_size)
        t_ins.append(timed(lambda: insert_all(tree, seqs, values))[0])  # noqa: B023
        t_match.append(timed(lambda: match_all(tree, seqs))[0])  # noqa: B023
        t_lazy.append(timed(lambda: match_all_lazy(tree, seqs))[0])  # noqa: B023
        half = tree.statistics().evictable_device_tokens // 2
        dt, out = timed(lambda: evict_chunked(tree, half, 1024))  # noqa: B023
        calls = out[1]  # type: ignore[index]
        calls_seen[:] = [calls]
        t_ev.append(dt)
        tree.sanity_check()
    n = len(seqs)
    return {
        "insert_us": statistics.median(t_ins) / n * 1e6,
        "match_us": statistics.median(t_match) / n * 1e6,
        "match_lazy_us": statistics.median(t_lazy) / n * 1e6,
        "evict_us_per_call": statistics.median(t_ev) / calls * 1e6,
        "evict_us_per_page": statistics.median(t_ev) / calls * 1e6 / (1024 // page_size),
    }


SCALES = (("1e4", 18, 2), ("1e5", 190, 10), ("1e6", 2000, 50))
"""(label, sequences, shared prefixes) of bench.py's scaling shapes."""
SMOKE_SCALES = (("1e4", 4, 2), ("1e5", 6, 2), ("1e6", 8, 2))
"""`--smoke`: the same labels on tiny trees (the figures mean nothing; the keys are the same)."""


def bench_scale(
    page_size: int, reps: int, seed: int, vocab: int, shapes: tuple[tuple[str, int, int], ...] = SCALES
) -> dict[str, dict[str, float]]:
    """Per-op costs on trees of about 10^4, 10^5 and 10^6 tokens (bench.py's scaling shapes)."""
    out: dict[str, dict[str, float]] = {}
    n_new = 200 if shapes is SCALES else 4
    for label, n_seqs, n_pref in shapes:
        seqs, values = make_workload(n_seqs + n_new, n_pref, 512, 512, vocab, seed)
        base, fresh = seqs[:n_seqs], seqs[n_seqs:]
        rng = random.Random(seed + 1)
        hits = [base[rng.randrange(n_seqs)] for _ in range(2000 if shapes is SCALES else 20)]
        # The same key working set at every size (16 distinct keys, as the 10^4 tree holds only 18): the
        # distinct-key variant also measures the queries' own cache misses, which grow with the key count.
        pool = [base[rng.randrange(n_seqs)] for _ in range(16)]
        fixed = [pool[i % 16] for i in range(len(hits))]
        t_m, t_md, t_i, t_e = [], [], [], []
        tokens = 0
        for _ in range(reps):
            tree = RadixTree(page_size)
            insert_all(tree, base, values[:n_seqs])
            tokens = tree.statistics().device_tokens
            match_all(tree, hits)  # warm-up
            match_all(tree, fixed)
            t_m.append(cpu_timed(lambda: match_all(tree, fixed))[0] / len(fixed))  # noqa: B023
            t_md.append(cpu_timed(lambda: match_all(tree, hits))[0] / len(hits))  # noqa: B023
            # inserts of new sequences (shared prefix hit + new 512-token suffix)
            t_i.append(cpu_timed(lambda: insert_all(tree, fresh, values[n_seqs:]))[0] / n_new)  # noqa: B023
            dt, out_ = cpu_timed(lambda: evict_chunked(tree, n_new * 512, 1024))  # noqa: B023
            t_e.append(dt / (out_[0] // page_size))  # type: ignore[index]
        out[label] = {
            "tree_tokens": tokens,
            "match_us": min(t_m) * 1e6,
            "match_distinct_us": min(t_md) * 1e6,
            "insert_us": min(t_i) * 1e6,
            "evict_us_per_page": min(t_e) * 1e6,
        }
    return out


@asynccontextmanager
async def device_hit_cache(
    seqs: list[array[int]], page_size: int
) -> AsyncIterator[tuple[HiCache, list[list[int]]]]:
    """A cache holding 50 of `seqs` (distinct prefixes: no two share a page) on the device, and those
    prompts as lists: every `acquire` of one is a full device hit."""
    prompts = [list(s) for s in seqs[:50]]
    pages = sum(len(p) for p in prompts) // page_size
    config = HiCacheConfig(layout=KVLayout.flat(8, page_size), device_pages=pages + 64, host_pages=pages + 64)
    async with HiCache(config) as cache:
        for i, prompt in enumerate(prompts):
            lease = await cache.acquire(f"seed-{i}", prompt)
            indices = await cache.alloc_device(len(prompt))
            assert indices is not None
            await cache.insert(lease, prompt, indices)
        yield cache, prompts


async def bench_acquire(seqs: list[array[int]], page_size: int, rounds: int) -> dict[str, float]:
    """`acquire` + `release` of 1,024-token lists that are all device hits, timed one request at a time."""
    async with device_hit_cache(seqs, page_size) as (cache, prompts):
        times: list[float] = []
        gc.collect()
        gc.disable()
        try:
            for r in range(rounds):
                for i, prompt in enumerate(prompts):
                    t0 = time.perf_counter()
                    lease = await cache.acquire(f"r{r}-{i}", prompt)
                    cache.release(lease)
                    times.append(time.perf_counter() - t0)
                    assert lease.cached_len == len(prompt), "not a full device hit"
        finally:
            gc.enable()
        cache.sanity_check()
    times.sort()
    return {
        "p50_us": times[len(times) // 2] * 1e6,
        "p99_us": times[int(len(times) * 0.99)] * 1e6,
    }


def bench_key_convert(seqs: list[array[int]], reps: int) -> dict[str, float]:
    """Converting a 1,024-token Python list to key bytes: `as_key_bytes` against `array('q')` (CPU time per
    list, minimum of `reps` passes over 1,000 lists)."""
    lists = [list(s) for s in seqs[:1000]]

    def with_struct() -> object:
        return [as_key_bytes(t) for t in lists]

    def with_array() -> object:
        return [array("q", t).tobytes() for t in lists]

    return {
        name: min(cpu_timed(fn)[0] for _ in range(reps)) / len(lists) * 1e6
        for name, fn in (("as_key_bytes_us", with_struct), ("array_q_us", with_array))
    }


def run_baseline(reps: int) -> dict[str, float] | None:
    """SGLang's RadixCache on the same workload, from `../shared/baselines/sglang-radix/run` (None, with a
    note, when that checkout is missing or the run fails: the ratios are then skipped)."""
    if not BASELINE.exists():
        print(
            f"note: SGLang baseline not found at {BASELINE.resolve()}; the vs_sglang_* ratios are skipped",
            file=sys.stderr,
        )
        return None
    cmd = [str(BASELINE.resolve()), "--reps", str(reps), "--page-sizes", "16", "--no-scaling"]
    print(f"running SGLang baseline: {' '.join(cmd)}", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=os.environ.copy())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"baseline failed (rc={proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
        return None
    main = json.loads(lines[-1])["results"]["page_size_16"]["main"]
    return {
        "insert_us": main["insert"]["us_per_op"],
        "match_us": main["match_prefix"]["us_per_op"],
        "evict_us_per_call": main["evict_half_in_1024_token_calls"]["us_per_op"],
    }


def _callgrind(on: bool) -> None:
    """Switch callgrind's instrumentation of this process on or off."""
    subprocess.run(
        ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], check=True, capture_output=True
    )


def count_instructions(
    what: str, seqs: list[array[int]], values: list[torch.Tensor], page_size: int, count: int
) -> None:
    """Run `count` inserts (or acquire + release pairs) with callgrind's instrumentation on (see the docstring)."""
    if what == "insert":
        warm = RadixTree(page_size)  # lazy imports and first-call caches, outside the count
        insert_all(warm, seqs[:100], values[:100])
        tree = RadixTree(page_size)
        gc.collect()
        gc.disable()
        _callgrind(True)
        insert_all(tree, seqs[:count], values[:count])
        _callgrind(False)
        return
    if what == "match":
        warm = RadixTree(page_size)
        insert_all(warm, seqs[:100], values[:100])
        match_all(warm, seqs[:100])
        tree = RadixTree(page_size)
        insert_all(tree, seqs, values)
        gc.collect()
        gc.disable()
        _callgrind(True)
        match_all(tree, seqs[:count])
        _callgrind(False)
        return

    async def acquire_release() -> None:
        async with device_hit_cache(seqs, page_size) as (cache, prompts):
            for i, prompt in enumerate(prompts):
                cache.release(await cache.acquire(f"warm-{i}", prompt))
            gc.collect()
            gc.disable()
            _callgrind(True)
            for r in range(count // len(prompts)):
                for i, prompt in enumerate(prompts):
                    cache.release(await cache.acquire(f"r{r}-{i}", prompt))
            _callgrind(False)

    anyio.run(acquire_release)


def bench_insert_host(page_size: int, seed: int, vocab: int, calls: int = 200) -> dict[str, float]:
    """`insert_host` of fresh refills below the root, CPU time per call (median), by refill length."""
    out: dict[str, float] = {}
    rng = random.Random(seed)
    for n in (1024, 32768):
        tree = RadixTree(page_size)
        keys = [array("q", [rng.randrange(vocab) for _ in range(n)]).tobytes() for _ in range(calls)]
        hashes = [chained_page_hashes(k, page_size, tree.namespace, ROOT_HASH) for k in keys]
        host = torch.arange(n, dtype=torch.int64)
        root = tree.root
        times = []
        gc.collect()
        for k, h in zip(keys, hashes, strict=True):
            t0 = time.process_time()
            tree.insert_host(root, k, host, h)
            times.append(time.process_time() - t0)
        tree.sanity_check()
        out[f"insert_host_{n}_us"] = round(statistics.median(times) * 1e6, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true", help="skip SGLang's RadixCache side by side")
    ap.add_argument(
        "--instructions", choices=("insert", "match", "acquire"), help="count instructions (callgrind)"
    )
    ap.add_argument(
        "--count", type=int, default=None, help="calls counted (2,000 inserts or matches, 500 acquires)"
    )
    ap.add_argument("--page-size", type=int, default=16, help="the page size of --instructions")
    ap.add_argument("--smoke", action="store_true", help="one tiny pass, no baseline, the same JSON keys")
    ap.add_argument("--insert-host", action="store_true", help="time insert_host of storage refills only")
    a = ap.parse_args()
    vocab = 128000
    if a.smoke:
        a.reps, a.no_baseline = 1, True
    seqs, values = make_workload(60 if a.smoke else 2000, 50, 512, 512, vocab, a.seed)
    if a.insert_host:
        print(
            json.dumps(
                {"bench": "tree_insert_host", **bench_insert_host(16, a.seed, vocab, 20 if a.smoke else 200)}
            )
        )
        return
    if a.instructions:
        default = 500 if a.instructions == "acquire" else 2000
        count_instructions(a.instructions, seqs, values, a.page_size, default if a.count is None else a.count)
        return
    result: dict[str, object] = {"bench": "tree"}
    load_start = round(os.getloadavg()[0], 2)
    page16: dict[str, list[float]] = {}
    mains = {ps: bench_main(ps, seqs, values, a.reps, page16 if ps == 16 else None) for ps in (1, 16)}
    shapes = SMOKE_SCALES if a.smoke else SCALES
    scales = {ps: bench_scale(ps, a.reps, a.seed, vocab, shapes) for ps in (1, 16)}
    acquire = anyio.run(bench_acquire, seqs, 16, 1 if a.smoke else 40 * a.reps)
    convert = bench_key_convert(seqs, max(3, a.reps))
    base = None if a.no_baseline else run_baseline(a.reps)
    if base is not None:  # a second round of ours after the baseline; the page-16 figures use both
        mains[16] = bench_main(16, seqs, values, a.reps, page16)

    print("Reference workload (2,000 x 1,024 tokens, 50 shared prefixes), per op in microseconds")
    print(
        f"{'page':>5} {'insert':>9} {'match':>9} {'match(lazy)':>12} {'evict/1024-tok call':>20} {'evict/page':>11}"
    )
    for ps, m in mains.items():
        print(
            f"{ps:>5} {m['insert_us']:>9.2f} {m['match_us']:>9.2f} {m['match_lazy_us']:>12.2f} "
            f"{m['evict_us_per_call']:>20.2f} {m['evict_us_per_page']:>11.3f}"
        )
    print(
        "\nScaling, CPU time (1,024-token match full hit; insert of a new 512-token suffix; eviction per page)"
    )
    print(
        f"{'page':>5} {'tree':>5} {'tokens':>9} {'match':>9} {'match(2000 keys)':>17} {'insert':>9} {'evict/page':>11}"
    )
    for ps, sc in scales.items():
        for label, r in sc.items():
            print(
                f"{ps:>5} {label:>5} {int(r['tree_tokens']):>9} {r['match_us']:>9.2f} "
                f"{r['match_distinct_us']:>17.2f} {r['insert_us']:>9.2f} "
                f"{r['evict_us_per_page']:>11.3f}"
            )
    s16 = scales[16]
    for op in ("match", "insert", "evict"):
        k = "evict_us_per_page" if op == "evict" else f"{op}_us"
        result[f"scaling_{op}"] = round(s16["1e6"][k] / s16["1e4"][k], 2)
    result["scaling_match_distinct_keys"] = round(
        s16["1e6"]["match_distinct_us"] / s16["1e4"]["match_distinct_us"], 2
    )
    m16 = mains[16]
    if base is not None:
        print("\nSGLang RadixCache (page 16), per op in microseconds, and speed-up = SGLang / ours")
        for op, ours_k, base_k in (
            ("match", "match_lazy_us", "match_us"),
            ("match_joined", "match_us", "match_us"),
            ("insert", "insert_us", "insert_us"),
            ("evict", "evict_us_per_call", "evict_us_per_call"),
        ):
            ratio = base[base_k] / m16[ours_k]
            result[f"vs_sglang_{op}"] = round(ratio, 2)
            print(f"{op:>12}: sglang {base[base_k]:>9.2f}  ours {m16[ours_k]:>9.2f}  speed-up {ratio:>6.2f}x")
        result["sglang_us"] = {k: round(v, 2) for k, v in base.items()}
    else:
        for op in ("match", "match_joined", "insert", "evict"):
            result[f"vs_sglang_{op}"] = None
    result["acquire_device_hit_us_p50"] = round(acquire["p50_us"], 2)
    result["acquire_device_hit_us_p99"] = round(acquire["p99_us"], 2)
    if base is not None:
        result["sglang_match_prefix_us"] = round(base["match_us"], 2)
    print(
        f"\nacquire + release, 1,024-token list, all device hit: p50 {acquire['p50_us']:.2f} us, "
        f"p99 {acquire['p99_us']:.2f} us"
        + (f" (SGLang match_prefix of the same keys: {base['match_us']:.2f} us)" if base is not None else "")
    )
    print(
        f"key bytes of a 1,024-token list: as_key_bytes {convert['as_key_bytes_us']:.2f} us, "
        f"array('q') {convert['array_q_us']:.2f} us"
    )
    result["key_convert_us"] = {k: round(v, 2) for k, v in convert.items()}
    result["match_us"] = round(s16["1e6"]["match_us"], 2)
    result["match_distinct_keys_us"] = round(s16["1e6"]["match_distinct_us"], 2)
    result["insert_us"] = round(s16["1e6"]["insert_us"], 2)
    result["evict_us_per_page"] = round(s16["1e6"]["evict_us_per_page"], 3)
    result["page16_reference"] = {k: round(v, 3) for k, v in m16.items()}
    result["page1_reference"] = {k: round(v, 3) for k, v in mains[1].items()}
    result["reps"] = a.reps
    result["load_avg_1m"] = [load_start, round(os.getloadavg()[0], 2)]  # at the start and at the end
    print(json.dumps(result))


if __name__ == "__main__":
    main()
