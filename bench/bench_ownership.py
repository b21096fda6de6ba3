#!/usr/bin/env python3
"""Benchmark of the page-ownership checks on the request path.

Usage:
    .venv/bin/python bench/bench_ownership.py [--requests 1000] [--reps 3] [--write-policy write_back]

Workload (bench_tree's shape): requests of 1,024 tokens, each one of 50 shared 512-token prefixes plus a
random 512-token suffix, page size 16, served through a `HiCache` without storage, by default under
write-back (no background backups; `--write-policy write_through` begins a backup in every insert, with a
host pool as large as the device pool): acquire, `alloc_device` for the uncached part, `insert`. Reports, in CPU time per
request (minimum over --reps): `insert` alone, the whole acquire + alloc + insert cycle, and the ownership
work inside insert measured on its own (`check_owned` of 32 caller pages, the prefix comparison and the
re-tag), plus a free + alloc of 32 pages. Run it with another checkout first on PYTHONPATH to compare.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import timeit

import anyio
import torch

from hicache import HiCache, HiCacheConfig, KVLayout
from hicache.memory import PageAllocator

PAGE = 16


def workload(n: int) -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(1 << 20) for _ in range(512)] for _ in range(50)]
    return [prefixes[rng.randrange(50)] + [rng.randrange(1 << 20) for _ in range(512)] for _ in range(n)]


async def serve(seqs: list[list[int]], policy: str) -> tuple[float, float]:
    """CPU seconds in `insert` and in the whole cycle (the backups' background work included)."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16, page_size=PAGE)
    pages = len(seqs) * 1024 // PAGE + 64
    config = HiCacheConfig(
        layout=layout,
        device_pages=pages,
        host_pages=64 if policy == "write_back" else pages,
        write_policy=policy,
    )
    async with HiCache(config) as cache:
        in_insert = 0.0
        start = time.process_time()
        for i, seq in enumerate(seqs):
            lease = await cache.acquire(f"r{i}", seq)
            new = await cache.alloc_device(len(seq) - lease.cached_len)
            assert new is not None
            indices = torch.cat([lease.device_indices, new])
            t = time.process_time()
            await cache.insert(lease, seq, indices)
            in_insert += time.process_time() - t
        await cache.wait_idle()
        return in_insert, time.process_time() - start


def micro(number: int) -> dict[str, float]:
    """Per-call microseconds of the allocator work alone, where the API has it (None otherwise)."""
    alloc = PageAllocator(70_000, PAGE)
    prefix, new = alloc.alloc(512 * 2), alloc.alloc(512)
    assert prefix is not None
    assert new is not None
    full = torch.cat([prefix, new])
    out: dict[str, float] = {}

    def free_alloc() -> None:
        alloc.free(new)
        alloc.alloc(512)

    out["free_alloc_32_pages_us"] = timeit.timeit(free_alloc, number=number) / number * 1e6
    if hasattr(alloc, "check_owned"):
        from hicache.memory import Owner

        def ownership() -> None:  # what `insert` does, plus a tag back so the next call finds LEASE
            view = full.numpy()
            alloc.check_owned(view[1024:], Owner.LEASE, name="device_indices")
            assert (view[:1024] == prefix.numpy()).all()
            alloc.set_owner(view[1024:], Owner.TREE)
            alloc.set_owner(view[1024:], Owner.LEASE)

        out["ownership_check_us"] = timeit.timeit(ownership, number=number) / number * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--write-policy",
        default="write_back",
        choices=["write_back", "write_through", "write_through_selective"],
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny pass (seconds): the same JSON keys, no figure worth reading",
    )
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.reps = 20, 1
    seqs = workload(args.requests)
    best_insert = best_cycle = float("inf")
    for _ in range(args.reps):
        in_insert, cycle = anyio.run(serve, seqs, args.write_policy)
        best_insert, best_cycle = min(best_insert, in_insert), min(best_cycle, cycle)
    result: dict[str, object] = {
        "bench": "ownership",
        "write_policy": args.write_policy,
        "requests": args.requests,
        "insert_us": round(best_insert / args.requests * 1e6, 1),
        "cycle_us": round(best_cycle / args.requests * 1e6, 1),
    }
    result.update({k: round(v, 1) for k, v in micro(50 if args.smoke else 5000).items()})
    for key, value in result.items():
        print(f"{key:28s} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
