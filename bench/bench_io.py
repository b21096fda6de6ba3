"""Read throughput of the file backend against raw `os.preadv`, hot and cold page cache.

Reads `--total-mib` of pages (payloads of 1 MiB and 64 KiB) into one host-pool-like CPU tensor (pinned when
CUDA is available), each figure as a ratio against a raw baseline measured in the same run: threads calling
`os.preadv` on the same files straight into the same tensor, at the same concurrency, with no checks. The
backend run happens inside an event loop with a ticker task that records its own lateness, so the table
shows the loop's longest stall too. Cold passes drop each file from the page cache first
(`posix_fadvise(DONTNEED)` after an `os.sync()`).

`measure_load(load, keys, views)` takes any async "load these pages into these views" callable, so the
same figures can be taken through the controller's prefetch path later.

Usage: python bench/bench_io.py [--total-mib 1024] [--concurrency 16] [--repeats 3]
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import torch

from storage_backends.file import FileBackend
from storage_backends.page_format import HEADER_SIZE, page_key

Load = Callable[[Sequence[str], Sequence[memoryview]], Awaitable[list[bool]]]

NS = bytes(range(16))
GOALS = {1 << 20: 0.9, 64 << 10: 0.7}
STALL_GOAL_MS = 10.0


@dataclass
class LoadResult:
    seconds: float
    max_stall_ms: float
    ok: int


def host_pool(total_bytes: int) -> torch.Tensor:
    """A flat uint8 tensor like the host pool: pinned when CUDA is available, plain memory otherwise."""
    if torch.cuda.is_available():
        try:
            return torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(total_bytes, dtype=torch.uint8)


def page_views(pool: torch.Tensor, page_bytes: int) -> list[memoryview]:
    """One writable memoryview per page of the pool."""
    flat = memoryview(pool.numpy()).cast("B")
    return [flat[i : i + page_bytes] for i in range(0, pool.numel(), page_bytes)]


def drop_page_cache(paths: Sequence[str]) -> None:
    """Evict the files from the page cache (they must be clean: call after os.sync())."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(paths: Sequence[str], views: Sequence[memoryview], concurrency: int) -> float:
    """The baseline: `concurrency` threads, each open + preadv(header, page view) + close; returns seconds."""
    cursor = iter(range(len(paths)))
    lock = threading.Lock()

    def worker() -> None:
        header = bytearray(HEADER_SIZE)
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.preadv(fd, [header, views[i]], 0)
            finally:
                os.close(fd)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


async def measure_load(load: Load, keys: Sequence[str], views: Sequence[memoryview]) -> LoadResult:
    """Time one `load(keys, views)` call while a ticker measures the event loop's longest stall."""
    done = anyio.Event()
    worst = 0.0

    async def ticker() -> None:
        nonlocal worst
        while not done.is_set():
            t = time.perf_counter()
            await anyio.sleep(0.001)
            worst = max(worst, time.perf_counter() - t - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.005)  # let the ticker settle
        start = time.perf_counter()
        flags = await load(keys, views)
        seconds = time.perf_counter() - start
        done.set()
    return LoadResult(seconds, worst * 1000, flags.count(True))


async def bench_page_size(
    root: Path, page_bytes: int, total_bytes: int, concurrency: int, repeats: int, pool: torch.Tensor
) -> dict[str, dict[str, float]]:
    """Write the pages once, then time raw and backend reads, hot and cold; medians per state."""
    n = total_bytes // page_bytes
    views = page_views(pool[: n * page_bytes], page_bytes)
    keys = [page_key(i.to_bytes(16, "little")) for i in range(n)]
    out: dict[str, dict[str, float]] = {}
    async with FileBackend(root, namespace_digest=NS, max_concurrency=concurrency) as backend:
        pool.random_(0, 256)
        assert all(await backend.put(keys, views))
        expected = pool[: n * page_bytes].clone()
        os.sync()
        paths = [str(backend.path_of(k)) for k in keys]
        await backend.get(keys[:64], views[:64])  # start the worker threads outside the timed runs
        for state in ("hot", "cold"):
            raw_s: list[float] = []
            be_s: list[float] = []
            stalls: list[float] = []
            if state == "hot":
                raw_read(paths, views, concurrency)  # warm the page cache
            for _ in range(repeats):
                if state == "cold":
                    drop_page_cache(paths)
                pool.zero_()
                raw_s.append(raw_read(paths, views, concurrency))
                if state == "cold":
                    drop_page_cache(paths)
                pool.zero_()
                result = await measure_load(backend.get, keys, views)
                assert result.ok == n, f"backend loaded {result.ok} of {n} pages"
                be_s.append(result.seconds)
                stalls.append(result.max_stall_ms)
            assert torch.equal(pool[: n * page_bytes], expected), "backend read wrong bytes"
            raw_med, be_med = statistics.median(raw_s), statistics.median(be_s)
            out[state] = {
                "raw_gbps": total_bytes / raw_med / 1e9,
                "backend_gbps": total_bytes / be_med / 1e9,
                "ratio": raw_med / be_med,
                "max_stall_ms": max(stalls),
            }
        del expected
    shutil.rmtree(root, ignore_errors=True)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    total = args.total_mib << 20
    pool = host_pool(total)
    results: dict[int, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="hicache-bench-io-", dir=args.dir) as tmp:
        for page_bytes in (1 << 20, 64 << 10):
            results[page_bytes] = await bench_page_size(
                Path(tmp) / f"p{page_bytes}", page_bytes, total, args.concurrency, args.repeats, pool
            )
    print(
        f"file backend vs raw preadv: {args.total_mib} MiB, concurrency {args.concurrency}, "
        f"median of {args.repeats}, pinned={pool.is_pinned()}, cpus={os.cpu_count()}"
    )
    print(
        f"{'page':>8} {'cache':>5} {'raw GB/s':>9} {'backend GB/s':>13} {'ratio':>6} {'goal':>5} {'loop stall ms':>14}"
    )
    for page_bytes, states in results.items():
        label = f"{page_bytes >> 20} MiB" if page_bytes >= 1 << 20 else f"{page_bytes >> 10} KiB"
        for state, r in states.items():
            print(
                f"{label:>8} {state:>5} {r['raw_gbps']:9.2f} {r['backend_gbps']:13.2f} {r['ratio']:6.2f} "
                f"{GOALS[page_bytes]:5.2f} {r['max_stall_ms']:14.2f}"
            )
    mib, kib = results[1 << 20], results[64 << 10]
    return {
        "bench": "io",
        "total_mib": args.total_mib,
        "concurrency": args.concurrency,
        "ratio_1mib_hot": round(mib["hot"]["ratio"], 3),
        "ratio_64kib_hot": round(kib["hot"]["ratio"], 3),
        "ratio_1mib_cold": round(mib["cold"]["ratio"], 3),
        "ratio_64kib_cold": round(kib["cold"]["ratio"], 3),
        "gbps_1mib_hot": round(mib["hot"]["backend_gbps"], 2),
        "gbps_64kib_hot": round(kib["hot"]["backend_gbps"], 2),
        "max_loop_stall_ms": round(max(r["max_stall_ms"] for s in results.values() for r in s.values()), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    summary = anyio.run(main_async, args)
    sys.stdout.flush()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
