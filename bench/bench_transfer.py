"""Device<->host page copies: `copy_pages_async` and the controller's backup and load-back, against raw `copy_`.

Runs on the device that exists: a CUDA device pool and a pinned host pool when CUDA is available, two CPU
pools otherwise (then both are pageable and the "device" pool is ordinary memory, as in the cache itself).
For each layout — a Llama-8B-like KV (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB per token) with
`--page-sizes` tokens per page (16 -> 2 MiB pages, 1 -> 128 KiB pages) — `--total-mib` of pages are moved:

- raw: the baseline, measured in the same run: one contiguous `copy_` of the same total bytes between the
  same two pool buffers (`non_blocking` when the host side is pinned, then a synchronize), on the calling
  thread. The best a plain torch op does between those two kinds of memory.
- async: `copy_pages_async` of every page, scattered (a random page permutation on each side, so no two
  pages form a run), awaited inside the event loop.
- host-run: the same with the host pages consecutive and the device pages scattered: a backup into a
  fresh host run, or the load-back of one into a fragmented device pool.
- controller: a `HiCache` (write-through, no storage) over the same two pools, fragmented first so that
  its allocations are scattered too: `--sequences` requests insert their pages and the timed pass ends
  when every write-through backup has landed (`wait_idle`); then every device copy is evicted and the
  timed load-back is `load_back` of every request, all concurrently.

Backup is device->host, load is host->device; ratio = raw seconds / seconds (1.0 = as fast as raw).
Every async and controller pass runs next to a ticker task that records its own lateness: the event
loop's longest stall (goal < 10 ms). Every pass is checked bitwise, every page, after the timing (the
destination is overwritten with a marker first, so a copy that did not happen cannot pass). Figures are
medians over `--repeats`; raw and hicache passes alternate so drift in the machine's load hits both.

Usage: python bench/bench_transfer.py [--total-mib N] [--repeats 3] [--page-sizes 16,1] [--sequences 16]
       [--no-controller]
(--total-mib defaults to 4096 with CUDA, 512 without.) Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import torch
from _loop_timing import run_with_ticker

from hicache import HiCache, HiCacheConfig, KVLayout, WritePolicy
from hicache.memory import KVPool, Owner, copy_pages_async, make_device_pool, make_host_pool
from hicache.tree import NodeRef, RadixTree

STALL_GOAL_MS = 10.0
MARKER = 0xA5
"""Byte written over a destination before each pass."""
VERIFY_CHUNK_BYTES = 256 << 20
"""Bytes of pages compared per step when verifying, so a check never gathers the whole pool at once."""


def llama8b_layout(page_size: int) -> KVLayout:
    """Llama-3-8B's KV: 32 layers, 8 KV heads of 128, bf16 (128 KiB per token)."""
    return KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, page_size=page_size)


def label(page_bytes: int) -> str:
    """`2mib`, `128kib`, or a byte count: the suffix of a layout's JSON keys."""
    if page_bytes % (1 << 20) == 0:
        return f"{page_bytes >> 20}mib"
    return f"{page_bytes >> 10}kib" if page_bytes % 1024 == 0 else f"{page_bytes}b"


@dataclass
class Series:
    """The timed passes of one way of copying in one direction."""

    seconds: list[float] = field(default_factory=list)
    stalls: list[float] = field(default_factory=list)

    def add(self, seconds: float, stall_ms: float = 0.0) -> None:
        self.seconds.append(seconds)
        self.stalls.append(stall_ms)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


# ---------------------------------------------------------------------------------------------- helpers


def sync(pool: KVPool) -> None:
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)


def flat_bytes(pool: KVPool) -> torch.Tensor:
    return pool.buffer.view(-1).view(torch.uint8)


def fill_pattern(pool: KVPool, seed: int) -> None:
    """Write a distinct 8-byte word everywhere (no temporary): a misplaced or stale page cannot match."""
    words = pool.buffer.view(-1).view(torch.int64)
    start = seed << 40
    torch.arange(start, start + words.numel(), dtype=torch.int64, device=words.device, out=words)
    sync(pool)


def mark(pool: KVPool) -> None:
    flat_bytes(pool).fill_(MARKER)
    sync(pool)


def compare_device(*pools: KVPool) -> torch.device:
    return next((p.device for p in pools if p.device.type == "cuda"), torch.device("cpu"))


def same_pages(src: KVPool, src_pages: torch.Tensor, dst: KVPool, dst_pages: torch.Tensor) -> bool:
    """Whether `dst`'s pages `dst_pages` hold, bitwise, `src`'s pages `src_pages` (compared in chunks)."""
    assert src_pages.numel() == dst_pages.numel()
    dev = compare_device(src, dst)
    # A host pool is brought over in one contiguous copy rather than gathered page by page on the CPU.
    a = src.buffer.to(dev)
    b = dst.buffer.to(dev)
    chunk = max(1, VERIFY_CHUNK_BYTES // src.layout.page_nbytes)
    try:
        for i in range(0, src_pages.numel(), chunk):
            x = a[src_pages[i : i + chunk].to(dev)].view(torch.uint8)
            y = b[dst_pages[i : i + chunk].to(dev)].view(torch.uint8)
            if not torch.equal(x, y):
                return False
        return True
    finally:
        del a, b


def same_bytes(src: KVPool, dst: KVPool, nbytes: int) -> bool:
    dev = compare_device(src, dst)
    return torch.equal(flat_bytes(src)[:nbytes].to(dev), flat_bytes(dst)[:nbytes].to(dev))


def raw_copy(src: KVPool, dst: KVPool, nbytes: int) -> float:
    """The baseline: one contiguous `copy_` of `nbytes` between the two buffers; returns seconds."""
    non_blocking = src.pinned or dst.pinned
    s, d = flat_bytes(src)[:nbytes], flat_bytes(dst)[:nbytes]
    start = time.perf_counter()
    d.copy_(s, non_blocking=non_blocking)
    sync(src)
    sync(dst)
    return time.perf_counter() - start


async def timed_with_ticker(run: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """Seconds `run()` takes, and the loop's longest stall (ms) meanwhile (see `run_with_ticker`)."""
    _, seconds, stall_ms = await run_with_ticker(run)
    return seconds, stall_ms


def tokens_of(pool: KVPool, pages: torch.Tensor) -> torch.Tensor:
    return pool.allocator.pages_to_tokens(pages)


def fragment(pool: KVPool, generator: torch.Generator) -> None:
    """Allocate every page and free them in a random order, so the pool's next allocations are scattered."""
    cap = pool.allocator.capacity_pages
    indices = pool.alloc(cap * pool.page_size)
    assert indices is not None, f"{pool!r} is not empty"
    pages = pool.page_ids(indices)[torch.randperm(cap, generator=generator)]
    pool.free(tokens_of(pool, pages))


def path_values(tree: RadixTree, node: NodeRef) -> tuple[torch.Tensor, torch.Tensor]:
    """Device and host token indices of the root path ending at `node`, root first."""
    devices: list[torch.Tensor] = []
    hosts: list[torch.Tensor] = []
    info = tree.node_info(node)
    while info.parent is not None:
        assert info.device_value is not None, info
        assert info.host_value is not None, info
        devices.append(info.device_value)
        hosts.append(info.host_value)
        info = tree.node_info(info.parent)
    return torch.cat(devices[::-1]), torch.cat(hosts[::-1])


# ---------------------------------------------------------------------------------------------- passes


@dataclass
class LayoutResult:
    """Every series measured for one layout."""

    layout: KVLayout
    pages: int
    raw_backup: Series = field(default_factory=Series)
    raw_load: Series = field(default_factory=Series)
    backup: Series = field(default_factory=Series)
    load: Series = field(default_factory=Series)
    backup_host_runs: Series = field(default_factory=Series)
    load_host_runs: Series = field(default_factory=Series)
    controller_backup: Series = field(default_factory=Series)
    controller_load: Series = field(default_factory=Series)

    @property
    def nbytes(self) -> int:
        return self.pages * self.layout.page_nbytes


async def async_pass(
    src: KVPool,
    dst: KVPool,
    n: int,
    generator: torch.Generator,
    series: Series,
    what: str,
    host_consecutive: bool = False,
) -> None:
    """`copy_pages_async` of all `n` pages, scattered on both sides (or on the device side only, the
    host pages consecutive: a backup into a fresh host run, or its load-back); timed, checked bitwise."""
    src_pages = torch.randperm(n, generator=generator)
    dst_pages = torch.randperm(n, generator=generator)
    if host_consecutive:
        if src.device.type == "cpu":
            src_pages = torch.arange(n)
        else:
            dst_pages = torch.arange(n)
    src_idx, dst_idx = tokens_of(src, src_pages), tokens_of(dst, dst_pages)
    mark(dst)

    async def run() -> None:
        await copy_pages_async(src, src_idx, dst, dst_idx)

    series.add(*await timed_with_ticker(run))
    assert same_pages(src, src_pages, dst, dst_pages), f"{what}: copy_pages_async moved wrong bytes"


def raw_pass(src: KVPool, dst: KVPool, nbytes: int, series: Series, what: str) -> None:
    mark(dst)
    gc.collect()
    series.add(raw_copy(src, dst, nbytes))
    assert same_bytes(src, dst, nbytes), f"{what}: the raw copy moved wrong bytes"


async def controller_pass(
    device: KVPool,
    host: KVPool,
    n_sequences: int,
    seed: int,
    generator: torch.Generator,
    result: LayoutResult,
) -> None:
    """Write-through backup of `n_sequences` inserted requests, then load-back of all of them, timed."""
    layout, n = result.layout, result.pages
    page = layout.page_size
    per = n // n_sequences
    assert per * n_sequences == n
    fragment(device, generator)
    fragment(host, generator)
    fill_pattern(device, seed)
    config = HiCacheConfig(
        layout=layout,
        device_pages=n,
        host_pages=n,
        write_policy=WritePolicy.WRITE_THROUGH,
        backup_to_storage=False,
    )
    seqs = [torch.arange(s * 10**9, s * 10**9 + per * page, dtype=torch.int64) for s in range(n_sequences)]
    async with HiCache(config, device_pool=device, host_pool=host) as cache:
        # Untimed: each request acquires (nothing cached) and gets its device pages, already holding KV.
        prepared = []
        for i, seq in enumerate(seqs):
            lease = await cache.acquire(f"bench-{i}", seq)
            assert lease.cached_len == 0
            indices = await cache.alloc_device(seq.numel())
            assert indices is not None, "device pool too small"
            prepared.append((lease, seq, indices))

        async def backup() -> None:
            for lease, seq, indices in prepared:
                await cache.insert(lease, seq, indices)
            await cache.wait_idle()

        result.controller_backup.add(*await timed_with_ticker(backup))
        assert cache.statistics().tree.host_tokens == n_sequences * per * page, cache.statistics()
        d, h = map(
            torch.cat,
            zip(*(path_values(cache._tree, cache.match(seq).last_device_node) for seq in seqs), strict=True),
        )
        assert same_pages(device, device.page_ids(d), host, host.page_ids(h)), "backup moved wrong bytes"

        # Untimed: evict every device copy (all are backed up), and overwrite the device pool.
        everything = await cache.alloc_device(n * page)
        assert everything is not None, "could not evict the device pool"
        cache.device_pool.free(everything)
        mark(device)
        matches = [cache.match(seq) for seq in seqs]
        assert all(
            m.device_len == 0 and m.host_len == seq.numel() for m, seq in zip(matches, seqs, strict=True)
        )

        async def load() -> None:
            async with anyio.create_task_group() as tg:
                for m in matches:
                    tg.start_soon(cache.load_back, m)

        result.controller_load.add(*await timed_with_ticker(load))
        loaded = [cache.match(seq) for seq in seqs]
        for m, seq in zip(loaded, seqs, strict=True):
            assert m.device_len == seq.numel(), f"load-back left {seq.numel() - m.device_len} tokens on host"
        d, h = map(
            torch.cat, zip(*(path_values(cache._tree, m.last_device_node) for m in loaded), strict=True)
        )
        assert same_pages(host, host.page_ids(h), device, device.page_ids(d)), "load-back moved wrong bytes"
        cache.sanity_check()

        # Untimed: hand both pools back empty, for the next pass.
        everything = await cache.alloc_device(n * page)
        assert everything is not None
        cache.device_pool.free(everything)
        host.free(cache._tree.evict_host(n * page).freed_host, Owner.TREE)  # the bench's own host pool
    for pool in (device, host):
        assert pool.allocator.free_pages == pool.allocator.capacity_pages, pool


async def run_layout(device: KVPool, host: KVPool, result: LayoutResult, args: argparse.Namespace) -> None:
    """Warm up, then `--repeats` rounds of raw, async and controller passes in both directions."""
    n, nbytes = result.pages, result.nbytes
    generator = torch.Generator().manual_seed(result.layout.page_size)

    # Warm-up (untimed): the first copies of each kind pay for streams, threads and page mappings.
    fill_pattern(device, 0)
    warm = torch.arange(min(n, 8), dtype=torch.int64)
    raw_copy(device, host, nbytes)
    raw_copy(host, device, nbytes)
    await copy_pages_async(device, tokens_of(device, warm), host, tokens_of(host, warm.flip(0)))
    await copy_pages_async(host, tokens_of(host, warm), device, tokens_of(device, warm.flip(0)))

    for r in range(args.repeats):
        fill_pattern(device, 2 * r + 1)
        raw_pass(device, host, nbytes, result.raw_backup, "backup")
        await async_pass(device, host, n, generator, result.backup, "backup")
        await async_pass(device, host, n, generator, result.backup_host_runs, "backup", host_consecutive=True)
        raw_pass(host, device, nbytes, result.raw_load, "load")
        await async_pass(host, device, n, generator, result.load, "load")
        await async_pass(host, device, n, generator, result.load_host_runs, "load", host_consecutive=True)
        if not args.no_controller:
            await controller_pass(device, host, args.sequences, 2 * r + 2, generator, result)


async def bench_layout(layout: KVLayout, args: argparse.Namespace) -> LayoutResult:
    # A whole number of pages per controller request, so that every pass moves the same pages.
    n = (args.total_mib << 20) // layout.page_nbytes // args.sequences * args.sequences
    if n == 0:
        raise SystemExit(
            f"--total-mib {args.total_mib} holds fewer than --sequences {args.sequences} pages of "
            f"{layout.page_nbytes} bytes"
        )
    result = LayoutResult(layout, n)
    with (
        make_device_pool(layout, n, name="bench-device") as device,
        make_host_pool(layout, n, name="bench-host") as host,
    ):
        await run_layout(device, host, result, args)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------- report


def gbps(nbytes: int, series: Series) -> float:
    return nbytes / series.median / 1e9


def summarize(result: LayoutResult) -> dict[str, float]:
    """Per-layout figures: GB/s of each way, ratios against raw, longest stalls."""
    nb = result.nbytes
    out = {
        "raw_backup_gbps": gbps(nb, result.raw_backup),
        "backup_gbps": gbps(nb, result.backup),
        "backup_ratio": result.raw_backup.median / result.backup.median,
        "raw_load_gbps": gbps(nb, result.raw_load),
        "load_gbps": gbps(nb, result.load),
        "load_ratio": result.raw_load.median / result.load.median,
        "backup_host_runs_gbps": gbps(nb, result.backup_host_runs),
        "backup_host_runs_ratio": result.raw_backup.median / result.backup_host_runs.median,
        "load_host_runs_gbps": gbps(nb, result.load_host_runs),
        "load_host_runs_ratio": result.raw_load.median / result.load_host_runs.median,
        "max_loop_stall_ms": max(
            result.backup.stalls
            + result.load.stalls
            + result.backup_host_runs.stalls
            + result.load_host_runs.stalls
        ),
    }
    if result.controller_backup.seconds:
        out |= {
            "controller_backup_gbps": gbps(nb, result.controller_backup),
            "controller_backup_ratio": result.raw_backup.median / result.controller_backup.median,
            "controller_load_gbps": gbps(nb, result.controller_load),
            "controller_load_ratio": result.raw_load.median / result.controller_load.median,
            "controller_max_loop_stall_ms": max(
                result.controller_backup.stalls + result.controller_load.stalls
            ),
        }
    return out


def device_description() -> tuple[str, str, bool]:
    """The device kind, its name, and whether a host pool is pinned here."""
    if torch.cuda.is_available():
        with make_host_pool(llama8b_layout(1), 1) as probe:
            return "cuda", torch.cuda.get_device_name(0), probe.pinned
    return "cpu", "cpu", False


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    started = time.perf_counter()
    kind, name, pinned = device_description()
    results = [await bench_layout(llama8b_layout(p), args) for p in args.page_sizes]
    print(
        f"device<->host page copies vs raw copy_: {args.total_mib} MiB per pass on {kind} ({name}), "
        f"host pool pinned={pinned}, Llama-8B-like KV (32 layers x 8 KV heads x 128, bf16), median of "
        f"{args.repeats}, controller: {args.sequences} requests, cpus={os.cpu_count()}, load average "
        f"{os.getloadavg()[0]:.2f}, {time.perf_counter() - started:.0f} s"
    )
    print(
        f"{'page':>8} {'pages':>6} {'direction':>9} {'raw GB/s':>9} {'async':>7} {'ratio':>6} {'stall ms':>9} "
        f"{'host-run':>9} {'ratio':>6} {'controller':>11} {'ratio':>6} {'stall ms':>9}"
    )
    summary: dict[str, object] = {
        "bench": "transfer",
        "device": kind,
        "device_name": name,
        "pinned": pinned,
        "total_mib": args.total_mib,
        "repeats": args.repeats,
    }
    stalls: list[float] = []
    controller_stalls: list[float] = []
    for result in results:
        tag = label(result.layout.page_nbytes)
        s = summarize(result)
        for direction, raw, way, runs, ctl in (
            ("backup", result.raw_backup, result.backup, result.backup_host_runs, result.controller_backup),
            ("load", result.raw_load, result.load, result.load_host_runs, result.controller_load),
        ):
            ctl_cols = (
                f"{gbps(result.nbytes, ctl):11.2f} {raw.median / ctl.median:6.2f} {max(ctl.stalls):9.2f}"
                if ctl.seconds
                else f"{'-':>11} {'-':>6} {'-':>9}"
            )
            print(
                f"{tag:>8} {result.pages:>6} {direction:>9} {gbps(result.nbytes, raw):9.2f} "
                f"{gbps(result.nbytes, way):7.2f} {raw.median / way.median:6.2f} {max(way.stalls):9.2f} "
                f"{gbps(result.nbytes, runs):9.2f} {raw.median / runs.median:6.2f} {ctl_cols}"
            )
        stalls.append(s["max_loop_stall_ms"])
        if "controller_max_loop_stall_ms" in s:
            controller_stalls.append(s["controller_max_loop_stall_ms"])
        summary |= {f"{key}_{tag}": round(value, 3) for key, value in s.items()}
    summary["max_loop_stall_ms"] = round(max(stalls), 2)
    if controller_stalls:
        summary["max_loop_stall_ms_controller"] = round(max(controller_stalls), 2)
    worst = max(stalls + controller_stalls)
    print(f"longest event-loop stall {worst:.2f} ms (goal < {STALL_GOAL_MS:.0f} ms)")
    summary["load_average"] = round(os.getloadavg()[0], 2)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--total-mib",
        type=int,
        default=None,
        help="bytes moved per pass (default: 4096 with CUDA, 512 without)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--page-sizes", default="16,1", help="tokens per page of the Llama-8B-like layout, one layout each"
    )
    parser.add_argument("--sequences", type=int, default=16, help="requests in the controller pass")
    parser.add_argument("--no-controller", action="store_true", help="skip the controller passes")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny pass (seconds): the same JSON keys, no figure worth reading",
    )
    args = parser.parse_args()
    if args.smoke:
        args.total_mib, args.repeats, args.sequences = 8, 1, 2
    if args.total_mib is None:
        args.total_mib = 4096 if torch.cuda.is_available() else 512
    args.page_sizes = [int(p) for p in args.page_sizes.split(",")]
    if args.repeats < 1 or args.total_mib < 1 or args.sequences < 1:
        parser.error("--total-mib, --repeats and --sequences must be >= 1")
    summary = anyio.run(main_async, args)
    sys.stdout.flush()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
