"""Read throughput of the file backend and of the controller's prefetch path against raw `os.preadv`.

Prefetches `--total-mib` of pages (payloads of 1 MiB and of 64 KiB), hot and cold page cache, three ways:

- raw: the baseline, measured in the same run: threads calling `os.open` + `os.preadv(header, page view)`
  + `os.close` on the same files straight into a host-pool-like tensor, with no checks. It runs at every
  thread count of `--raw-threads` and the fastest counts, so the backend cannot win by picking a thread
  count that suits it and handicaps the baseline.
- backend: `FileBackend.get` of every page in one call (its default options unless `--threads`).
- controller: a `HiCache` whose storage tier is the backend pass's `FileBackend` (same root and worker
  threads), holding those same pages as written by another instance: `--sequences` requests, each
  `prefetch` + `commit_prefetch` under the `wait_complete` stop policy, all concurrently, into the cache's
  host pool. The ratio includes everything a serving loop pays: the storage `exists`, the host
  allocation, batch-by-batch streaming and the tree insert.

Every backend and controller pass runs inside the event loop next to a ticker task that records its own
lateness: the longest stall of the loop is reported too (goal < 10 ms), as wall time and as the loop thread's
CPU time between two ticks (its own work alone, which the load of a shared machine does not inflate). Cold passes drop each file from
the page cache first (`posix_fadvise(DONTNEED)`, after `os.sync()`); raw and backend passes alternate so
drift in the machine's load hits both. Figures are medians over `--repeats`.

Where the time goes, per pass: the event-loop thread's CPU over the pass (`loop_cpu_ms`: on 2 cores every
millisecond of it is taken from the read threads) and the mean number of page groups the read threads were
reading at once (`groups_reading`, from `FileBackend.read_statistics()`; at most the thread count: below it
the threads waited for work), under `passes` in the JSON line.

Side by side with SGLang: when `../shared/baselines/sglang-file/run` is present (and not `--no-sglang`), it runs
after our passes on the same page sizes, total and filesystem (`--dir`), in its own process: SGLang's
`HiCacheFile` read through SGLang's real prefetch path (`_page_transfer`, 128-page batches, into a host pool;
its README says what it times). `vs_sglang_file_1mib_{hot,cold}` is our controller's GB/s over SGLang's (one
I/O thread, as SGLang runs it); `vs_sglang_file_t16_*` the same over its 16-caller variant.

Loop CPU per GiB: `loop_cpu_ratio_controller_vs_backend_max` is the worst pass's controller loop CPU over
the backend pass's (the same bytes: the ratio is per GiB). The loop CPU comes from passes of their own,
run without the ticker, one after each ticked pass (the same cache state): the ticker wakes the loop about
1,000 times a second, so its CPU follows a pass's wall time (a slower pass or a loaded machine pays more)
and no estimate of it taken off afterwards was sound (an idle ticked pass read 30-110 ms per second in one
run, and took a backend pass's whole figure to 0). `loop_cpu_ticked_ms` (and
`loop_cpu_ratio_ticked_controller_vs_backend_max`) are the ticked passes' figures, as reported before.
`loop_cpu_ms_per_gib_{backend,controller}_max` are the worst passes' unticked figures per GiB.

Of the longest wall stall, `*stall_runqueue_ms` is the time the loop thread waited for a core (the
kernel's run-queue wait) and `*stall_at_cpu_ms` its own CPU in that stall; the rest it slept, waiting for
the GIL (see `time_with_ticker`). `--busy N` runs everything beside N processes
that spin on the CPU (a machine shared with other jobs); the JSON line then says `busy: N`.

`python_calls_per_prefetch_{size}` and `loop_callbacks_per_prefetch_{size}`: one more hot controller pass
per page size with its prefetches' Python calls in the loop's thread and the loop callbacks it ran counted
(`calls_counted`; the cache's start and close left out): what a prefetch costs the loop, in counts that a
loaded machine does not disturb.

`--no-pacer`: the controller passes run with the loop pacer switched off (`LoopPacer.turn` returns at once,
counted, never queued: every prefetch stage runs in the iteration its await ended in, as before issue 12),
the A/B of whether the pacer earns its place; the JSON line says `pacer: false`. There is no configuration
for it (the pacer is no option of the cache), so the bench replaces the method for its controller passes.

`--reader-nice N`: the read threads' nice increment (`storage_backends.threads._NICE`, 10 as shipped: they
give a core to the loop thread as soon as it wakes, and to any other process as well), the A/B of what
that costs beside a competitor (`--busy`); the JSON line says `reader_nice`.

Usage: python bench/bench_io.py [--total-mib 1024] [--repeats 3] [--raw-threads 2,4,16] [--threads N]
       [--sequences 16] [--batch-pages N] [--page-kib 1024,64] [--states hot,cold] [--no-controller]
       [--no-sglang] [--busy N] [--no-pacer] [--reader-nice N] [--smoke]
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch
from _loop_timing import time_with_ticker

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace, StopPolicy
from hicache.controller.prefetch.pacing import LoopPacer
from hicache.keys import ROOT_HASH, chained_page_hashes
from storage_backends import threads as read_threads
from storage_backends.file import FileBackend
from storage_backends.page_format import HEADER_SIZE
from storage_backends.protocol import PageStatus

SGLANG_FILE = Path(__file__).resolve().parents[1] / ".." / "shared" / "baselines" / "sglang-file" / "run"
GOALS = {1 << 20: 0.9, 64 << 10: 0.7}
STALL_GOAL_MS = 10.0
PAGE_TOKENS = 64
"""Tokens per page in the controller pass; bytes per token set the page payload."""
NAMESPACE = Namespace(model_id="bench-io")


@dataclass
class Timed:
    """One timed pass: seconds, the loop's longest stall (wall, and the loop thread's CPU between two
    ticks: see `time_with_ticker`), pages loaded, the loop thread's CPU over the whole pass, and the mean
    number of page groups the backend's read threads were reading at once."""

    seconds: float
    max_stall_ms: float
    pages: int
    max_stall_cpu_ms: float = 0.0
    loop_cpu_ms: float = 0.0
    reading: float = 0.0
    pacer_queued: int = 0
    """Controller passes: the pacer's turns that waited for another caller's (0 with `--no-pacer`)."""
    stall_runqueue_ms: float = 0.0
    """Of the longest wall stall, the loop thread's wait for a core (see `Ticked`)."""
    stall_at_cpu_ms: float = 0.0
    """Of the longest wall stall, the loop thread's own CPU."""


@dataclass
class Series:
    """The passes of one way of reading, for one page size and cache state."""

    seconds: list[float] = field(default_factory=list)
    stalls: list[Timed] = field(default_factory=list)
    loop_cpu: list[float] = field(default_factory=list)
    loop_cpu_ticked: list[float] = field(default_factory=list)
    reading: list[float] = field(default_factory=list)
    pacer_queued: list[int] = field(default_factory=list)

    def add(self, timed: Timed) -> None:
        """One ticked pass: its time, stalls, ticked loop CPU and groups read."""
        self.seconds.append(timed.seconds)
        self.stalls.append(timed)
        self.loop_cpu_ticked.append(timed.loop_cpu_ms)
        self.reading.append(timed.reading)
        self.pacer_queued.append(timed.pacer_queued)

    def add_work(self, untimed: Timed) -> None:
        """One pass run without the ticker: its loop CPU is the pass's own work."""
        self.loop_cpu.append(untimed.loop_cpu_ms)

    def worst_stall(self, prefix: str) -> dict[str, float]:
        """The longest wall stall over the passes and what it was made of, and the longest CPU stretch."""
        worst = max(self.stalls, key=lambda t: t.max_stall_ms)
        return {
            f"{prefix}max_stall_ms": round(worst.max_stall_ms, 2),
            f"{prefix}max_stall_runqueue_ms": round(worst.stall_runqueue_ms, 1),
            f"{prefix}max_stall_at_cpu_ms": round(worst.stall_at_cpu_ms, 1),
            f"{prefix}max_stall_cpu_ms": round(max(t.max_stall_cpu_ms for t in self.stalls), 2),
        }

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def figures(self, prefix: str) -> dict[str, float]:
        """The medians of the loop's CPU and of the groups read at once, under `prefix`."""
        return {
            f"{prefix}loop_cpu_ms": round(statistics.median(self.loop_cpu), 1),
            f"{prefix}loop_cpu_ticked_ms": round(statistics.median(self.loop_cpu_ticked), 1),
            f"{prefix}groups_reading": round(statistics.median(self.reading), 2),
        }


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
    flat = pool.numpy().data.cast("B")
    return [flat[i : i + page_bytes] for i in range(0, pool.numel(), page_bytes)]


def drop_page_cache(paths: Sequence[str]) -> None:
    """Evict the files from the page cache (they must be clean: call after os.sync())."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(
    paths: Sequence[str], offsets: Sequence[int], views: Sequence[memoryview], threads: int
) -> float:
    """The baseline: `threads` threads, each open + preadv(header, page view) at the page's offset in its
    group file + close; returns seconds."""
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
                os.preadv(fd, [header, views[i]], offsets[i])
            finally:
                os.close(fd)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return time.perf_counter() - start


async def timed_with_ticker(
    run: Callable[[], Awaitable[int]], backend: FileBackend, *, ticked: bool = True
) -> Timed:
    """Time `run()` (which returns the pages it loaded) and the loop's longest stall (see
    `time_with_ticker`: garbage is collected and the survivors frozen first), the loop thread's CPU
    over the pass (the ticker's included) and the mean groups `backend`'s read threads read at once.

    Not `ticked`: `run()` alone, its loop CPU and seconds (no stall figures), garbage collected and
    frozen alike: the pass's own loop work."""
    if not ticked:
        gc.collect()
        gc.freeze()
        try:
            start, wall = time.thread_time(), time.perf_counter()
            pages = await run()
            spent, seconds = time.thread_time() - start, time.perf_counter() - wall
        finally:
            gc.unfreeze()
        return Timed(seconds, 0.0, pages, loop_cpu_ms=spent * 1000)
    cpu: list[float] = []

    async def counted() -> int:
        start = time.thread_time()
        pages = await run()
        cpu.append(time.thread_time() - start)
        return pages

    before = backend.read_statistics().reading_s
    ticked = await time_with_ticker(counted)
    reading = (backend.read_statistics().reading_s - before) / ticked.seconds
    return Timed(
        ticked.seconds,
        ticked.stall_ms,
        ticked.result,
        ticked.stall_cpu_ms,
        cpu[0] * 1000,
        reading,
        stall_runqueue_ms=ticked.stall_runqueue_ms,
        stall_at_cpu_ms=ticked.stall_at_cpu_ms,
    )


def sequences(n_pages: int, count: int) -> list[torch.Tensor]:
    """`count` distinct token sequences (int64 tensors) of whole pages, `n_pages` pages in all."""
    per = n_pages // count
    return [torch.arange(s * 10**9, s * 10**9 + per * PAGE_TOKENS, dtype=torch.int64) for s in range(count)]


def storage_keys(seqs: Sequence[torch.Tensor], namespace: Namespace) -> list[str]:
    """The storage keys a cache in `namespace` (its config's effective one) looks up for `seqs`, in order."""
    keys: list[str] = []
    for seq in seqs:
        hashes = chained_page_hashes(seq.numpy().tobytes(), PAGE_TOKENS, namespace, ROOT_HASH)
        keys.extend(h.hex() for h in hashes)
    return keys


def controller_config(
    root: Path, page_bytes: int, n_pages: int, threads: int | None, batch_pages: int | None
) -> HiCacheConfig:
    """A cache whose host pool holds every page and whose storage tier is the bench's file root."""
    options: dict[str, Any] = {} if threads is None else {"max_concurrency": threads}
    extra: dict[str, Any] = {} if batch_pages is None else {"storage_batch_pages": batch_pages}
    return HiCacheConfig(
        layout=KVLayout.flat(page_bytes // PAGE_TOKENS, PAGE_TOKENS),
        device_pages=4,
        host_pages=n_pages,
        storage_url=f"file://{root}",
        storage_options=options,
        namespace=NAMESPACE,
        backup_to_storage=False,
        prefetch_stop_policy=StopPolicy.WAIT_COMPLETE,
        prefetch_capacity_tokens=n_pages * PAGE_TOKENS,
        **extra,
    )


@contextlib.contextmanager
def pacer_switched_off(off: bool) -> Iterator[None]:
    """With `off`, every `LoopPacer.turn` returns at once while inside (counted, never queued); restored
    on the way out. Without `off`, nothing changes."""
    if not off:
        yield
        return
    shipped = LoopPacer.turn

    async def turn(self: LoopPacer, ticket: int | None = None) -> None:
        self.turns += 1

    LoopPacer.turn = turn  # type: ignore[method-assign]
    try:
        yield
    finally:
        LoopPacer.turn = shipped  # type: ignore[method-assign]


async def controller_pass(
    config: HiCacheConfig,
    seqs: Sequence[torch.Tensor],
    backend: FileBackend,
    *,
    no_pacer: bool = False,
    ticked: bool = True,
    counts: dict[str, int] | None = None,
) -> Timed:
    """Prefetch and commit every sequence concurrently in a fresh cache reading through `backend` (the
    same worker threads as the backend pass); time it with the ticker (`ticked`, see
    `timed_with_ticker`). `no_pacer`: see `pacer_switched_off`. With `counts`, the prefetches' Python
    calls and loop callbacks (not the cache's start and close) are counted into it (`calls_counted`)."""
    with pacer_switched_off(no_pacer):
        async with HiCache(config, storage=backend) as cache:

            async def one(i: int, seq: torch.Tensor, loaded: list[int]) -> None:
                prefetch = await cache.prefetch(f"bench-{i}", seq)
                assert prefetch is not None, "prefetch was skipped"
                outcome = await cache.commit_prefetch(f"bench-{i}")
                assert outcome.status == "committed", outcome
                loaded[i] = outcome.loaded_tokens // PAGE_TOKENS

            async def run() -> int:
                loaded = [0] * len(seqs)
                async with anyio.create_task_group() as tg:
                    for i, seq in enumerate(seqs):
                        tg.start_soon(one, i, seq, loaded)
                return sum(loaded)

            queued = cache._prefetches.pacer.queued
            if counts is not None:
                with calls_counted() as counted:
                    timed = await timed_with_ticker(run, backend, ticked=False)
                counts.update(counted)
            else:
                timed = await timed_with_ticker(run, backend, ticked=ticked)
            timed.pacer_queued = cache._prefetches.pacer.queued - queued
            cache.sanity_check()
        return timed


@contextlib.contextmanager
def calls_counted() -> Iterator[dict[str, int]]:
    """Count, while inside, the Python function calls made in this (the loop's) thread and the loop
    callbacks it runs (each `asyncio.Handle` run: a task step or a `call_soon`); deterministic, unlike
    the time they take on a loaded machine."""
    counts = {"calls": 0, "callbacks": 0}
    shipped = asyncio.events.Handle._run

    def run(handle: asyncio.events.Handle) -> None:
        counts["callbacks"] += 1
        shipped(handle)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counts["calls"] += 1

    asyncio.events.Handle._run = run  # type: ignore[method-assign]
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)
        asyncio.events.Handle._run = shipped  # type: ignore[method-assign]


async def bench_page_size(
    root: Path, page_bytes: int, args: argparse.Namespace, pool: torch.Tensor
) -> dict[str, dict[str, Any]]:
    """Write the pages once, then time raw, backend and controller reads, hot and cold."""
    total = args.total_mib << 20
    n = total // page_bytes
    seqs = sequences(n, args.sequences)
    config = controller_config(root, page_bytes, n, args.threads, args.batch_pages)
    keys = storage_keys(seqs, config.namespace)
    assert len(keys) == n
    views = page_views(pool[: n * page_bytes], page_bytes)
    backend_options: dict[str, Any] = {} if args.threads is None else {"max_concurrency": args.threads}
    if args.group_mib is not None:
        backend_options["group_bytes"] = args.group_mib << 20
    raw_threads = [int(t) for t in args.raw_threads.split(",")]
    out: dict[str, dict[str, Any]] = {}
    async with FileBackend(root, namespace_digest=config.namespace.digest, **backend_options) as backend:
        pool.random_(0, 256)
        assert all(await backend.put(keys, views))
        expected = pool[: n * page_bytes].clone()
        os.sync()
        extents = [backend.page_extent(k) for k in keys]  # a put's pages share one group file
        paths, offsets = [str(path) for path, _, _ in extents], [offset for _, offset, _ in extents]
        await backend.get(keys[:64], views[:64])  # start the worker threads outside the timed runs

        async def backend_run() -> int:
            return (await backend.get(keys, views)).count(PageStatus.HIT)

        for state in args.states.split(","):
            raws = {t: Series() for t in raw_threads}
            direct, controller = Series(), Series()
            if state == "hot":
                raw_read(paths, offsets, views, max(raw_threads))  # warm the page cache
            for _ in range(args.repeats):
                for t, series in raws.items():
                    if state == "cold":
                        drop_page_cache(paths)
                    pool.zero_()
                    gc.collect()
                    series.add(Timed(raw_read(paths, offsets, views, t), 0.0, n))
                for ticked in (True, False):  # timed and ticked; then the same for its loop work alone
                    if state == "cold":
                        drop_page_cache(paths)
                    pool.zero_()
                    result = await timed_with_ticker(backend_run, backend, ticked=ticked)
                    assert result.pages == n, f"backend loaded {result.pages} of {n} pages"
                    if ticked:
                        direct.add(result)
                    else:
                        direct.add_work(result)
                    if not args.no_controller:
                        if state == "cold":
                            drop_page_cache(paths)
                        result = await controller_pass(
                            config, seqs, backend, no_pacer=args.no_pacer, ticked=ticked
                        )
                        assert result.pages == n, f"controller loaded {result.pages} of {n} pages"
                        if ticked:
                            controller.add(result)
                        else:
                            controller.add_work(result)
            assert torch.equal(pool[: n * page_bytes], expected), "backend read wrong bytes"
            best_threads = min(raws, key=lambda t: raws[t].median)
            raw_med = raws[best_threads].median
            entry: dict[str, Any] = {
                "raw_gbps": total / raw_med / 1e9,
                "raw_threads": best_threads,
                "raw_gbps_by_threads": {t: round(total / s.median / 1e9, 2) for t, s in raws.items()},
                "backend_gbps": total / direct.median / 1e9,
                "ratio": raw_med / direct.median,
                **direct.worst_stall(""),
                **direct.figures(""),
            }
            if controller.seconds:
                entry |= {
                    "controller_gbps": total / controller.median / 1e9,
                    "controller_ratio": raw_med / controller.median,
                    **controller.worst_stall("controller_"),
                    "controller_pacer_queued": max(controller.pacer_queued),
                    **controller.figures("controller_"),
                }
            out[state] = entry
        if not args.no_controller:  # one more hot pass, its calls counted: what a prefetch costs the loop
            counts: dict[str, int] = {}
            await controller_pass(config, seqs, backend, no_pacer=args.no_pacer, counts=counts)
            for entry in out.values():
                entry["python_calls_per_prefetch"] = counts["calls"] / len(seqs)
                entry["loop_callbacks_per_prefetch"] = counts["callbacks"] / len(seqs)
        del expected
    shutil.rmtree(root, ignore_errors=True)
    return out


def label(page_bytes: int) -> str:
    return f"{page_bytes >> 20} MiB" if page_bytes >= 1 << 20 else f"{page_bytes >> 10} KiB"


def size_name(page_bytes: int) -> str:
    """A page size as the JSON keys spell it: `1mib`, `64kib`."""
    return label(page_bytes).replace(" ", "").lower()


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    total = args.total_mib << 20
    pool = host_pool(total)
    results: dict[int, dict[str, dict[str, Any]]] = {}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hicache-bench-io-", dir=args.dir) as tmp:
        for page_bytes in [int(kib) << 10 for kib in args.page_kib.split(",")]:
            results[page_bytes] = await bench_page_size(Path(tmp) / f"p{page_bytes}", page_bytes, args, pool)
    threads = "default" if args.threads is None else args.threads
    print(
        f"file backend and controller prefetch vs raw preadv: {args.total_mib} MiB, backend threads "
        f"{threads}, raw = fastest of {args.raw_threads} threads, median of {args.repeats}, "
        f"{args.sequences} concurrent prefetches (batch pages {args.batch_pages or 'default'}), pinned={pool.is_pinned()}, cpus={os.cpu_count()}, "
        f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, "
        f"{time.perf_counter() - started:.0f} s; stall ms = the loop's longest lateness (wall / the loop "
        "thread's CPU between two ticks, which the machine's load does not inflate)"
    )
    print(
        f"{'page':>8} {'cache':>5} {'raw GB/s':>9} {'(threads)':>9} {'backend':>8} {'ratio':>6} "
        f"{'stall ms':>11} {'controller':>11} {'ratio':>6} {'stall ms':>11} {'goal':>5}"
    )
    for page_bytes, states in results.items():
        for state, r in states.items():
            ctl = (
                f"{r['controller_gbps']:11.2f} {r['controller_ratio']:6.2f} "
                f"{r['controller_max_stall_ms']:5.1f}/{r['controller_max_stall_cpu_ms']:5.1f}"
                if "controller_gbps" in r
                else f"{'-':>11} {'-':>6} {'-':>11}"
            )
            print(
                f"{label(page_bytes):>8} {state:>5} {r['raw_gbps']:9.2f} {r['raw_threads']:>9} "
                f"{r['backend_gbps']:8.2f} {r['ratio']:6.2f} {r['max_stall_ms']:5.1f}/{r['max_stall_cpu_ms']:5.1f} {ctl} "
                f"{GOALS.get(page_bytes, 0.0):5.2f}"
            )
        for state, r in states.items():
            print(f"  {label(page_bytes)} {state} raw GB/s by threads: {r['raw_gbps_by_threads']}")
            where = (
                f"backend loop CPU {r['loop_cpu_ms']:.1f} ms, {r['groups_reading']:.2f} groups read at once"
            )
            if "controller_gbps" in r:
                where += (
                    f"; controller loop CPU {r['controller_loop_cpu_ms']:.1f} ms, "
                    f"{r['controller_groups_reading']:.2f} groups read at once"
                )
            print(f"  {label(page_bytes)} {state}: {where}")
    summary: dict[str, object] = {"bench": "io", "total_mib": args.total_mib, "threads": threads}
    for page_bytes, states in results.items():
        for state, r in states.items():
            name = f"{size_name(page_bytes)}_{state}"
            summary[f"ratio_{name}"] = round(r["ratio"], 3)
            if "python_calls_per_prefetch" in r:
                summary[f"python_calls_per_prefetch_{size_name(page_bytes)}"] = round(
                    r["python_calls_per_prefetch"], 1
                )
                summary[f"loop_callbacks_per_prefetch_{size_name(page_bytes)}"] = round(
                    r["loop_callbacks_per_prefetch"], 1
                )
            if state == "hot":
                summary[f"gbps_{name}"] = round(r["backend_gbps"], 2)

    def worst(figure: str) -> float:
        return round(max(r[figure] for s in results.values() for r in s.values()), 2)

    if not args.no_controller:
        passes = [r for s in results.values() for r in s.values()]
        for name, figure in (("", "loop_cpu_ms"), ("ticked_", "loop_cpu_ticked_ms")):
            summary[f"loop_cpu_ratio_{name}controller_vs_backend_max"] = round(
                max(r[f"controller_{figure}"] / max(r[figure], 0.1) for r in passes), 3
            )
        gib = args.total_mib / 1024
        for side, prefix in (("backend", ""), ("controller", "controller_")):
            summary[f"loop_cpu_ms_per_gib_{side}_max"] = round(
                max(r[f"{prefix}loop_cpu_ms"] for r in passes) / gib, 1
            )
    summary["busy"] = args.busy
    summary["pacer"] = not args.no_pacer
    summary["reader_nice"] = read_threads._NICE
    summary["max_loop_stall_ms"] = worst("max_stall_ms")
    summary["max_loop_stall_cpu_ms"] = worst("max_stall_cpu_ms")
    if not args.no_controller:
        for page_bytes, states in results.items():
            for state, r in states.items():
                summary[f"ratio_{size_name(page_bytes)}_{state}_controller"] = round(r["controller_ratio"], 3)
        summary["max_loop_stall_ms_controller"] = worst("controller_max_stall_ms")
        summary["max_loop_stall_cpu_ms_controller"] = worst("controller_max_stall_cpu_ms")
        slowest = max(passes, key=lambda r: r["controller_max_stall_ms"])
        summary["max_loop_stall_runqueue_ms_controller"] = slowest["controller_max_stall_runqueue_ms"]
        summary["max_loop_stall_at_cpu_ms_controller"] = slowest["controller_max_stall_at_cpu_ms"]
    if not args.no_controller:
        sglang = run_sglang(args)
        if sglang is not None:
            summary |= sglang_summary(results, sglang)
    summary["controller_gbps"] = {
        f"{size_name(p)}_{state}": round(r["controller_gbps"], 2)
        for p, states in results.items()
        for state, r in states.items()
        if "controller_gbps" in r
    }
    # Where the time goes (issue 12): the loop thread's CPU per pass and the groups read at once.
    summary["passes"] = {
        f"{size_name(p)}_{state}": {
            k: v
            for k, v in r.items()
            if k.endswith(("loop_cpu_ms", "loop_cpu_ticked_ms", "groups_reading", "pacer_queued"))
            or "max_stall" in k
        }
        for p, states in results.items()
        for state, r in states.items()
    }
    summary["load_average"] = round(os.getloadavg()[0], 2)
    summary["load_average_before"] = round(load_before, 2)
    return summary


def run_sglang(args: argparse.Namespace) -> dict[str, Any] | None:
    """SGLang's file backend on the same page sizes, total and filesystem: its JSON line, or None."""
    if args.no_sglang or not SGLANG_FILE.exists():
        return None
    cmd = [str(SGLANG_FILE), "--total-mib", str(args.total_mib), "--page-kib", args.page_kib]
    cmd += ["--reps", str(args.repeats), "--dir", args.dir]
    print(f"running SGLang's file backend baseline: {' '.join(cmd)}", file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        print(f"SGLang baseline failed (exit {done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
        return None
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def sglang_summary(ours: dict[int, dict[str, dict[str, Any]]], sglang: dict[str, Any]) -> dict[str, object]:
    """Our controller's GB/s over SGLang's, per page size and cache state, and SGLang's own figures."""
    out: dict[str, object] = {}
    for page_bytes, states in ours.items():
        name = size_name(page_bytes)
        for state, r in states.items():
            ctl = r.get("controller_gbps")
            theirs = sglang.get(f"gbps_{name}_{state}")
            theirs16 = sglang.get(f"gbps_{name}_{state}_t16")
            if ctl is not None and theirs:
                out[f"vs_sglang_file_{name}_{state}"] = round(ctl / theirs, 2)
            if ctl is not None and theirs16:
                out[f"vs_sglang_file_t16_{name}_{state}"] = round(ctl / theirs16, 2)
    keep = [k for k in sglang if k.startswith(("gbps_", "raw_gbps_", "ratio_"))]
    out["sglang_file"] = {k: sglang[k] for k in keep}
    return out


def _spin(stop: Any) -> None:
    """A competing CPU-bound process: spins until `stop` is set."""
    while not stop.is_set():
        for _ in range(10_000):
            pass


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU for the duration (none for 0)."""
    if n <= 0:
        yield
        return
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()


def states(value: str) -> str:
    """The `--states` argument: a comma-separated list of `hot` and `cold` (a typo must not time an unwarmed
    cache as hot)."""
    names = value.split(",")
    if not names or any(name not in ("hot", "cold") for name in names):
        raise argparse.ArgumentTypeError(f"expected hot, cold or hot,cold; got {value!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--raw-threads", default="2,4,16", help="thread counts tried for the raw baseline")
    parser.add_argument(
        "--threads", type=int, default=None, help="backend max_concurrency (default: its own)"
    )
    parser.add_argument(
        "--sequences", type=int, default=16, help="concurrent prefetches in the controller pass"
    )
    parser.add_argument(
        "--batch-pages", type=int, default=None, help="storage_batch_pages of the cache (default: its own)"
    )
    parser.add_argument(
        "--group-mib", type=int, default=None, help="the file backend's group_bytes in MiB (default: its own)"
    )
    parser.add_argument("--no-controller", action="store_true", help="skip the controller passes")
    parser.add_argument("--page-kib", default="1024,64", help="page payload sizes in KiB, comma-separated")
    parser.add_argument(
        "--states", type=states, default="hot,cold", help="page cache states: hot, cold or both"
    )
    parser.add_argument(
        "--no-sglang", action="store_true", help="skip SGLang's file backend baseline (../shared/baselines)"
    )
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes competing for the CPU")
    parser.add_argument(
        "--no-pacer",
        action="store_true",
        help="controller passes with the loop pacer switched off (the pacer's A/B)",
    )
    parser.add_argument(
        "--reader-nice",
        type=int,
        default=None,
        help="the read threads' nice increment (default: the shipped one)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny pass (16 MiB, one repeat), no SGLang, the same JSON keys",
    )
    args = parser.parse_args()
    if args.busy < 0:
        parser.error(f"--busy: expected >= 0, got {args.busy}")
    if args.reader_nice is not None:
        if not 0 <= args.reader_nice <= 19:
            parser.error(f"--reader-nice: expected 0-19, got {args.reader_nice}")
        read_threads._NICE = args.reader_nice  # read when each worker thread starts, after this
    if args.smoke:
        args.total_mib, args.repeats, args.raw_threads, args.sequences = 16, 1, "2", 2
        args.no_sglang = True
    with busy_processes(args.busy):
        summary = anyio.run(main_async, args)
    sys.stdout.flush()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
