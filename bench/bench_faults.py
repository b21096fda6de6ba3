"""What storage faults and overload cost a serving loop: an S3 outage, and write-through on a saturated loop.

Two parts, each against a baseline measured in the same run:

- **storage down**: a cache whose S3 tier points at a dead endpoint (a closed loopback port). The first
  requests fail their lookups (bounded retries) until the circuit breaker opens; from then on every
  `acquire` skips storage without I/O. Baseline: the same acquires on a cache without a storage tier,
  alternating passes. Reported: the per-acquire p50/p99 of both, and the overhead (goal: p99 < 1 ms),
  plus what the failing lookups cost before the breaker opened.
- **saturated soak**: `--workers` tasks serve `--requests` requests back to back (acquire, allocate,
  write KV, insert; never pausing, so the event loop is never idle) on a cache with write-through to the
  file backend and bounded queues. Reported: pages written to storage by the end of the soak over unique
  pages inserted (goal >= 0.99), the queues' high-water marks against their limits, work shed, and the
  soak's rate against the same soak on a cache without storage; the soak is repeated on the memory
  backend to separate the controller's cost from the file backend's I/O.
- **stuck read**: a file backend with one page's read held in its thread (a read that never returns, as on a hung
  NFS or FUSE mount). `acquire` runs under a deadline that passes once the read is stuck; reported: how long
  after the deadline it returns (`stuck_read_acquire_return_ms`, the worst of `--stuck-rounds`; goal
  < 50 ms), and that the stuck pages were quarantined and came back once the read was let go.

- **one acquire alone**: what the soak's storage hits cost, without the soak's concurrency. One `acquire`
  at a time on an otherwise idle loop, `--alone` 8-page prompts each, on a cache writing through to the
  file backend: loop CPU (`time.thread_time`) and event-loop iterations (the loop's `select` calls) per
  call, for a prompt with no storage tier (a miss), one whose storage probe misses, and one that storage
  holds (probed, prefetched, committed, loaded back): `acquire_alone_loop_cpu_us_*`,
  `acquire_alone_loop_iterations_*`.

`--smoke`: one tiny pass of each part (a few acquires, 40 soak requests, one stuck read), the same JSON keys.

`--put PAGES`: instead of the parts above, the file backend's write path alone (what the soak's writer pays
per page): `FileBackend.put` of PAGES fresh 8 KiB pages with random keys, in puts of `--put-batch`, into a
fresh root whose 256 directories are made first; reported: the process's kernel and user CPU and the wall
time per page, over the puts only. With `--put-root DIR` the pages go to DIR and stay there (so
`strace -c -f` over two sizes, subtracted, counts the system calls of the puts alone, without the root's
removal or the interpreter's start). `--put-layout` measures, instead of the backend, the bare system calls
of a layout in one thread (the same pages, header bytes included, into `root/ab/`): `files`, one file per
page (create + write + close + rename: what the backend does); `links`, one group file per put written
whole, then one hard link per page named as its page file (a page-group design whose index is the
directory); `group`, one group file per put renamed into place and no name per page (the floor: such a
group needs an index of its own).

`--soak-cpu REPS`: only the soak, without storage and writing through to the memory backend, REPS times
each; reports the event loop's and the process's CPU per request (minimum over the reps), which a loaded
machine disturbs less than the rate.

Usage: python bench/bench_faults.py [--acquires 2000] [--requests 4000] [--workers 8] [--stuck-rounds 20]
       [--alone 400] [--smoke] [--soak-cpu REPS]
       python bench/bench_faults.py --put 4000 [--put-batch 64] [--put-root DIR]
       [--put-layout backend|files|links|group]
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch
from _loop_timing import run_with_ticker

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace
from hicache.controller.storage.guarded import BreakerState
from hicache.keys import ROOT_HASH, as_key_bytes, chained_page_hashes
from hicache.metrics import snapshot
from storage_backends.file import FileBackend
from storage_backends.memory import MemoryBackend

PAGE = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, page_size=PAGE)
"""8 KiB pages."""
NAMESPACE = Namespace(model_id="bench-faults")
OVERHEAD_GOAL_MS = 1.0
WRITE_FRACTION_GOAL = 0.99
"""Issue 25's goal: pages written by the end of the soak / unique pages inserted."""


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --------------------------------------------------------------------------- storage down


def prompts(n: int, pages: int, seed: int) -> list[list[int]]:
    """`n` distinct prompts of `pages` whole pages, never cached (every acquire is a full miss)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 1 << 30) for _ in range(pages * PAGE)] for _ in range(n)]


async def acquire_pass(cache: HiCache, batch: Sequence[list[int]], tag: str) -> list[float]:
    """Acquire and release each prompt; the acquire latencies in ms."""
    times: list[float] = []
    for i, tokens in enumerate(batch):
        start = time.perf_counter()
        lease = await cache.acquire(f"{tag}-{i}", tokens)
        times.append((time.perf_counter() - start) * 1000)
        cache.release(lease)
    return times


@dataclass
class DownResult:
    base_ms: list[float]
    down_ms: list[float]
    opening_ms: list[float]
    probes: int
    skipped: float


async def storage_down(acquires: int, rounds: int) -> DownResult:
    """Alternating passes of acquires on a cache without storage and on one whose S3 endpoint is dead."""
    url = (
        f"s3://bucket/p?endpoint=http://127.0.0.1:{closed_port()}&access_key_id=bench-key-id"
        "&secret_access_key=bench-secret-value"
        "&region=us-east-1"
    )
    common: dict[str, Any] = {
        "layout": LAYOUT,
        "device_pages": 256,
        "host_pages": 512,
        "namespace": NAMESPACE,
        "prefetch_threshold": PAGE,
    }
    batch = prompts(acquires // rounds, 8, seed=1)
    base_ms: list[float] = []
    down_ms: list[float] = []
    async with (
        HiCache(HiCacheConfig(**common)) as base,
        HiCache(HiCacheConfig(**common, storage_url=url)) as down,
    ):
        # The outage as a serving loop meets it: lookups fail (fast: bounded retries) until it opens.
        opening_ms: list[float] = []
        while down.storage_breaker.state is not BreakerState.OPEN:
            opening_ms.extend(await acquire_pass(down, batch[:1], f"open{len(opening_ms)}"))
        await acquire_pass(base, batch[:50], "warm")
        await acquire_pass(down, batch[:50], "warm")
        for r in range(rounds):
            times, _, _ = await run_with_ticker(lambda r=r: acquire_pass(base, batch, f"b{r}"))  # type: ignore[misc]
            base_ms.extend(times)
            times, _, _ = await run_with_ticker(lambda r=r: acquire_pass(down, batch, f"d{r}"))  # type: ignore[misc]
            down_ms.extend(times)
        probes = down.storage_breaker.statistics().probes
        skipped = down.metrics.prefetch_skipped.value(reason="storage_unavailable")
    return DownResult(base_ms, down_ms, opening_ms, probes, skipped)


# --------------------------------------------------------------------------- saturated soak


@dataclass
class SoakResult:
    seconds: float
    served: int
    unique_pages: int
    pages_written: int
    pages_written_after_drain: int
    max_backup_queue: int
    max_storage_queue: int
    shed: dict[str, float]
    later_hit_fraction: float
    backups_skipped: int
    """Host backups not begun for want of host room (their pages never reach host, nor storage)."""
    dropped_pages: int
    """Device pages evicted without a host copy (never backed up, so never written through)."""


def soak_requests(n: int, seed: int) -> list[list[int]]:
    """Requests as a chat service sees them: one of 8 system prompts (4 pages), one of 200 documents
    (2-10 pages), and a request-specific question (0-3 pages, plus a partial page)."""
    rng = random.Random(seed)
    systems = [list(range(10**6 * (s + 1), 10**6 * (s + 1) + 4 * PAGE)) for s in range(8)]
    docs = [
        list(range(10**8 + 10**4 * d, 10**8 + 10**4 * d + PAGE * rng.randrange(2, 11))) for d in range(200)
    ]
    out = []
    for i in range(n):
        question = list(range(10**9 + 1000 * i, 10**9 + 1000 * i + rng.randrange(0, 4 * PAGE)))
        out.append(systems[i % 8] + docs[rng.randrange(200)] + question)
    return out


async def soak(
    requests: list[list[int]], workers: int, storage_url: str | None, *, prefetch: bool = True
) -> SoakResult:
    """Serve `requests` from `workers` tasks with no pause; with `storage_url`, write through to it (and,
    unless `prefetch` is False, prefetch storage hits: work the soak without storage never does)."""
    config = HiCacheConfig(
        layout=LAYOUT,
        device_pages=1024,
        host_pages=4096,
        namespace=NAMESPACE,
        storage_url=storage_url,
        prefetch_threshold=4 * PAGE if prefetch else 1 << 40,
    )
    unique: set[bytes] = set()
    served = 0
    async with HiCache(config) as cache:
        cursor = iter(enumerate(requests))

        async def worker() -> None:
            nonlocal served
            for i, tokens in cursor:
                lease = await cache.acquire(f"soak-{i}", tokens)
                need = -(-len(tokens) // PAGE) * PAGE - lease.cached_len
                new = await cache.alloc_device(need)
                if new is None:
                    cache.release(lease)
                    continue
                await cache.insert(lease, tokens, torch.cat([lease.device_indices, new]))
                served += 1
                key = as_key_bytes(tokens)
                unique.update(chained_page_hashes(key, PAGE, NAMESPACE, ROOT_HASH))

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                for _ in range(workers):
                    tg.start_soon(worker)

        _, seconds, _ = await run_with_ticker(run)
        stats = cache.statistics()
        written = written_after = 0
        if isinstance(cache.storage, FileBackend | MemoryBackend):
            written = cache.storage.statistics().pages_written
            await cache.wait_idle()
            written_after = cache.storage.statistics().pages_written
        metrics = snapshot(cache.registry)
        shed = {
            f"{s['labels']['tier']}/{s['labels']['reason']}": s["value"]
            for s in metrics["hicache_writes_shed_total"]["samples"]
        }
        skipped = sum(s["value"] for s in metrics["hicache_backup_skipped_total"]["samples"])
        dropped = sum(s["value"] for s in metrics["hicache_evict_dropped_tokens_total"]["samples"]) // PAGE
        later = 0.0
    if storage_url is not None:
        # A fresh instance on the same storage: how much of the first 200 requests' prefix it can prefetch.
        later_config = HiCacheConfig(
            layout=LAYOUT,
            device_pages=4096,
            host_pages=4096,
            namespace=NAMESPACE,
            storage_url=storage_url,
            prefetch_threshold=PAGE,
        )
        async with HiCache(later_config) as reader:
            hit = total = 0
            for i, tokens in enumerate(requests[:200]):
                lease = await reader.acquire(f"later-{i}", tokens)
                hit += lease.cached_len
                total += len(tokens) // PAGE * PAGE
                reader.release(lease)
            later = hit / total
    return SoakResult(
        seconds=seconds,
        served=served,
        unique_pages=len(unique),
        pages_written=written,
        pages_written_after_drain=written_after,
        max_backup_queue=stats.backups_queued_max,
        max_storage_queue=stats.storage_writes_queued_max,
        shed=shed,
        backups_skipped=int(skipped),
        dropped_pages=int(dropped),
        later_hit_fraction=later,
    )


# --------------------------------------------------------------------------- stuck read

STUCK_READ_GOAL_MS = 50.0
STUCK_PAGES = 32
STUCK_AT = 20
"""The page whose read is stuck: its batch's read thread blocks until the round lets it go."""


@dataclass
class StuckResult:
    return_ms: list[float]
    """Per round: from the deadline passing to `acquire` returning (raising the cancellation)."""
    quarantined_pages: list[int]
    """Per round: host pages quarantined when acquire returned."""
    settled: bool
    """Every quarantined page came back once the reads were let go, and the accounting was exact."""


class _StuckFileBackend(FileBackend):
    """A file backend whose read thread, reading the group of `stuck_key`, signals `entered` and then
    blocks until `release` is set, as in `open` on a hung mount. (A FIFO at the page's path did this until
    the backend learnt to refuse non-regular files without blocking.)"""

    def __init__(self, root: str, *, namespace_digest: bytes) -> None:
        super().__init__(root, namespace_digest=namespace_digest)
        self.stuck_key = ""
        self.entered = threading.Event()
        self.release = threading.Event()
        self._before_read = self._stuck_at_key

    def _stuck_at_key(self, keys: tuple[str, ...]) -> None:
        if self.stuck_key in keys:
            self.entered.set()
            self.release.wait(60)


async def stuck_read(rounds: int) -> StuckResult:
    """`rounds` acquires, each with a fresh prompt whose page STUCK_AT's read is stuck, cancelled once the
    read of that page has started; how long each takes to return after its deadline."""
    return_ms: list[float] = []
    quarantined: list[int] = []
    quiet = [logging.getLogger(name) for name in ("storage_backends.file", "hicache.prefetch")]
    levels = [log.level for log in quiet]
    for log in quiet:  # one line per stuck or failed page otherwise
        log.setLevel(logging.ERROR)
    try:
        return await _stuck_rounds(rounds, return_ms, quarantined)
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)


async def _stuck_rounds(rounds: int, return_ms: list[float], quarantined: list[int]) -> StuckResult:
    settled = True
    config = HiCacheConfig(
        layout=LAYOUT,
        device_pages=4 * STUCK_PAGES,
        host_pages=4 * STUCK_PAGES,
        namespace=NAMESPACE,
        prefetch_threshold=PAGE,
        prefetch_stop_policy="wait_complete",
        storage_batch_pages=4,
        backup_to_storage=False,
    )
    namespace = config.namespace  # the effective one: the config adds the layout
    with tempfile.TemporaryDirectory(prefix="hicache-bench-stuck-") as root:
        async with (
            _StuckFileBackend(root, namespace_digest=namespace.digest) as backend,
            HiCache(config, storage=backend) as cache,
        ):
            for round_ in range(rounds):
                tokens = [round_ * 1_000_003 + i for i in range(STUCK_PAGES * PAGE)]
                key = as_key_bytes(tokens)
                hashes = chained_page_hashes(key, PAGE, namespace, ROOT_HASH)
                pages = [memoryview(bytearray(LAYOUT.page_nbytes)) for _ in hashes]
                assert all(await backend.put([h.hex() for h in hashes], pages))
                backend.stuck_key = hashes[STUCK_AT].hex()
                backend.entered.clear()
                backend.release.clear()
                try:
                    deadline_at: list[float] = []
                    with anyio.CancelScope() as deadline:
                        async with anyio.create_task_group() as tg:

                            async def deadline_once_stuck(
                                scope: anyio.CancelScope = deadline, at: list[float] = deadline_at
                            ) -> None:
                                await anyio.to_thread.run_sync(backend.entered.wait, 30)
                                at.append(time.perf_counter())
                                scope.cancel()

                            tg.start_soon(deadline_once_stuck)
                            await cache.acquire(f"stuck-{round_}", tokens)
                    return_ms.append((time.perf_counter() - deadline_at[0]) * 1000)
                    quarantined.append(cache.statistics().quarantined_pages)
                finally:
                    backend.release.set()
                with anyio.fail_after(30):
                    while cache.statistics().quarantined_pages:  # noqa: ASYNC110 - threads can't wake it
                        await anyio.sleep(0.005)
                await cache.wait_idle()
                try:
                    cache.sanity_check()
                except AssertionError:
                    settled = False
    return StuckResult(return_ms, quarantined, settled)


# --------------------------------------------------------------------------- put micro-run


PUT_LAYOUTS = ("backend", "files", "links", "group")
_O_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _put_layout(layout: str, root: str, keys: Sequence[str], pages: Sequence[bytes], tag: int) -> None:
    """One put of `keys` in `layout`'s bare system calls (see the module docstring)."""
    if layout == "files":
        for key, page in zip(keys, pages, strict=False):
            tmp, path = f"{root}/{key[:2]}/.{key}.tmp", f"{root}/{key[:2]}/{key}.kvp"
            fd = os.open(tmp, _O_CREATE, 0o644)
            os.writev(fd, [page])
            os.close(fd)
            os.rename(tmp, path)
        return
    tmp = f"{root}/{keys[0][:2]}/.group-{tag}.tmp"
    fd = os.open(tmp, _O_CREATE, 0o644)
    os.writev(fd, pages[: len(keys)])
    os.close(fd)
    if layout == "group":
        os.rename(tmp, f"{root}/{keys[0][:2]}/group-{tag}.kvg")
        return
    for key in keys:
        os.link(tmp, f"{root}/{key[:2]}/{key}.kvp")
    os.unlink(tmp)


async def put_run(pages: int, batch: int, root: str | None, layout: str = "backend") -> dict[str, Any]:
    """`FileBackend.put` (or `layout`'s bare system calls) of `pages` fresh 8 KiB pages in puts of
    `batch`: CPU and wall time per page."""
    rng = random.Random(25)
    keys = [rng.randbytes(16).hex() for _ in range(pages)]
    buffers = [memoryview(rng.randbytes(LAYOUT.page_nbytes)) for _ in range(min(pages, batch))]
    raw = [bytes(56) + bytes(buf) for buf in buffers]
    with tempfile.TemporaryDirectory(prefix="hicache-bench-put-") as scratch:
        root = root or scratch
        async with FileBackend(root, namespace_digest=NAMESPACE.digest) as backend:
            await backend.put(keys[:0], buffers[:0])  # the worker threads start outside the measurement
            for d in range(256):
                os.makedirs(f"{root}/{d:02x}", exist_ok=True)
            t0, wall0 = os.times(), time.perf_counter()
            for s in range(0, pages, batch):
                chunk = keys[s : s + batch]
                if layout == "backend":
                    written = await backend.put(chunk, buffers[: len(chunk)])
                    assert all(written), "a page was not written"
                else:
                    _put_layout(layout, root, chunk, raw, s)
            wall, t1 = time.perf_counter() - wall0, os.times()
    per_page = 1e6 / max(pages, 1)
    return {
        "bench": "faults_put",
        "layout": layout,
        "pages": pages,
        "batch": batch,
        "page_bytes": LAYOUT.page_nbytes,
        "sys_us_per_page": round((t1.system - t0.system) * per_page, 2),
        "user_us_per_page": round((t1.user - t0.user) * per_page, 2),
        "wall_us_per_page": round(wall * per_page, 2),
    }


# --------------------------------------------------------------------------- one acquire alone

ALONE_PAGES = 8
ALONE_MODES = ("no_storage", "probe_miss", "storage_hit")


@dataclass
class AloneResult:
    loop_cpu_us: dict[str, float]
    loop_iterations: dict[str, float]
    storage_hit_fraction: float
    """Of the storage-hit prompts' tokens, those the acquires found (1.0: every prompt was a storage hit)."""


def _alone_config(storage_url: str | None) -> HiCacheConfig:
    return HiCacheConfig(
        layout=LAYOUT,
        device_pages=4096,
        host_pages=8192,
        namespace=NAMESPACE,
        storage_url=storage_url,
        prefetch_threshold=4 * PAGE,
    )


async def acquire_alone(n: int) -> AloneResult:
    """`n` acquires one after another of `ALONE_PAGES`-page prompts, per mode (see the module's docstring);
    the first instance writes the storage-hit prompts through to storage and is closed before."""
    stored = [list(range(10**7 * i, 10**7 * i + ALONE_PAGES * PAGE)) for i in range(1, n + 1)]
    fresh = [list(range(10**7 * i + 3, 10**7 * i + 3 + ALONE_PAGES * PAGE)) for i in range(1, n + 1)]
    cpu: dict[str, float] = {}
    iterations: dict[str, float] = {}
    hit = 0
    with tempfile.TemporaryDirectory(prefix="hicache-bench-faults-") as root:
        async with HiCache(_alone_config(f"file://{root}")) as writer:
            for i, tokens in enumerate(stored):
                lease = await writer.acquire(f"w{i}", tokens)
                new = await writer.alloc_device(len(tokens))
                assert new is not None
                await writer.insert(lease, tokens, new)
            await writer.wait_idle()
        selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
        real_select = selector.select
        selects = [0]

        def counted(timeout: float | None = None) -> Any:
            selects[0] += 1
            return real_select(timeout)

        for mode in ALONE_MODES:
            url = None if mode == "no_storage" else f"file://{root}"
            prompts = stored if mode == "storage_hit" else fresh
            async with HiCache(_alone_config(url)) as cache:
                selects[0] = 0
                selector.select = counted
                try:
                    cpu0 = time.thread_time()
                    for i, tokens in enumerate(prompts):
                        lease = await cache.acquire(f"{mode}-{i}", tokens)
                        if mode == "storage_hit":
                            hit += lease.cached_len
                        cache.release(lease)
                    cpu[mode] = (time.thread_time() - cpu0) / n * 1e6
                finally:
                    del selector.select  # the selector's own method again
                iterations[mode] = selects[0] / n
    return AloneResult(cpu, iterations, hit / (n * ALONE_PAGES * PAGE))


# --------------------------------------------------------------------------- main


async def soak_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """`--soak-cpu REPS`: the soak alone, without storage and writing through to the memory backend, REPS
    times each (alternating); the CPU per request served of the event loop's thread and of the whole
    process (worker threads included), the minimum over the reps (least disturbed by other load)."""
    requests = soak_requests(args.requests, seed=3)
    cpu: dict[str, list[tuple[float, float]]] = {"no_storage": [], "memory_backend": []}
    for rep in range(args.soak_cpu):
        for name, url in (("no_storage", None), ("memory_backend", f"memory://soak-cpu-{os.getpid()}-{rep}")):
            loop0, proc0 = time.thread_time(), time.process_time()
            result = await soak(requests, args.workers, url)
            loop, proc = time.thread_time() - loop0, time.process_time() - proc0
            cpu[name].append((loop / result.served * 1e6, proc / result.served * 1e6))
    best = {name: (min(r[0] for r in runs), min(r[1] for r in runs)) for name, runs in cpu.items()}
    for name, (loop, proc) in best.items():
        print(
            f"  soak {name}: loop {loop:.0f} us, process {proc:.0f} us of CPU per request (min of {args.soak_cpu})"
        )
    return {
        "bench": "faults-soak-cpu",
        "soak_loop_cpu_us_no_storage": round(best["no_storage"][0], 1),
        "soak_loop_cpu_us_memory_backend": round(best["memory_backend"][0], 1),
        "soak_process_cpu_us_no_storage": round(best["no_storage"][1], 1),
        "soak_process_cpu_us_memory_backend": round(best["memory_backend"][1], 1),
        "soak_loop_cpu_ratio_no_storage_vs_memory_backend": round(
            best["no_storage"][0] / best["memory_backend"][0], 3
        ),
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.soak_cpu:
        return await soak_cpu(args)
    down = await storage_down(args.acquires, args.rounds)
    base_p50, base_p99 = quantile(down.base_ms, 0.5), quantile(down.base_ms, 0.99)
    down_p50, down_p99 = quantile(down.down_ms, 0.5), quantile(down.down_ms, 0.99)
    overhead_p99 = down_p99 - base_p99
    print(f"storage down (S3 endpoint refused), {len(down.down_ms)} acquires of 8-page misses per cache:")
    print(
        f"  before the breaker opened: {len(down.opening_ms)} acquires, "
        f"median {statistics.median(down.opening_ms):.1f} ms (bounded retries of a refused connection)"
    )
    print(f"  no storage tier (baseline): p50 {base_p50:.3f} ms  p99 {base_p99:.3f} ms")
    print(
        f"  breaker open:               p50 {down_p50:.3f} ms  p99 {down_p99:.3f} ms  "
        f"(ratio p99 {down_p99 / base_p99:.2f}; {down.probes} probes, {down.skipped:.0f} prefetches skipped "
        "as storage_unavailable)"
    )
    print(f"  overhead p99 {overhead_p99:.3f} ms (goal < {OVERHEAD_GOAL_MS} ms)")

    stuck = await stuck_read(args.stuck_rounds)
    stuck_worst = max(stuck.return_ms)
    print(f"stuck read (a read thread held at a page), {len(stuck.return_ms)} acquires cancelled once stuck:")
    print(
        f"  returned after the deadline: median {statistics.median(stuck.return_ms):.2f} ms, worst "
        f"{stuck_worst:.2f} ms (goal < {STUCK_READ_GOAL_MS} ms); quarantined pages per round "
        f"{sorted(set(stuck.quarantined_pages))}; all came back, accounting exact: {stuck.settled}"
    )

    alone = await acquire_alone(args.alone)
    print(f"one acquire alone on the loop ({args.alone} prompts of {ALONE_PAGES} pages each, file backend):")
    for mode in ALONE_MODES:
        print(
            f"  {mode}: loop CPU {alone.loop_cpu_us[mode]:.1f} us, {alone.loop_iterations[mode]:.2f} loop "
            "iterations per acquire"
        )
    print(f"  storage-hit prompts found in storage: {alone.storage_hit_fraction:.3f} of their tokens")

    requests = soak_requests(args.requests, seed=3)
    base = await soak(requests, args.workers, None)
    with tempfile.TemporaryDirectory(prefix="hicache-bench-faults-") as root:
        wt = await soak(requests, args.workers, f"file://{root}")
    with tempfile.TemporaryDirectory(prefix="hicache-bench-faults-") as root:
        write_only = await soak(requests, args.workers, f"file://{root}", prefetch=False)
    mem = await soak(requests, args.workers, f"memory://bench-faults-{os.getpid()}")
    limits = HiCacheConfig(layout=LAYOUT, device_pages=1, host_pages=1)
    fraction = wt.pages_written / wt.unique_pages
    print(
        f"saturated soak: {args.requests} requests, {args.workers} workers, no pause "
        f"(file backend, write-through):"
    )
    print(
        f"  requests/s: no storage {base.served / base.seconds:.0f}, write-through "
        f"{wt.served / wt.seconds:.0f} (ratio {(wt.served / wt.seconds) / (base.served / base.seconds):.2f})"
    )
    print(
        f"  pages written by the end of the soak {wt.pages_written} / unique pages inserted "
        f"{wt.unique_pages} = {fraction:.3f} (goal >= {WRITE_FRACTION_GOAL}); after draining "
        f"{wt.pages_written_after_drain}"
    )
    print(
        f"  max backup queue {wt.max_backup_queue} (limit {limits.backup_queue_limit}), max storage queue "
        f"{wt.max_storage_queue} (limit {limits.storage_write_queue_limit}); shed {wt.shed or 'nothing'}"
    )
    print(
        f"  pages that never reached host (so never storage): {wt.backups_skipped} backups skipped for host "
        f"room, {wt.dropped_pages} device pages evicted un-backed"
    )
    wo_ratio = (write_only.served / write_only.seconds) / (base.served / base.seconds)
    print(
        f"  the same soak with prefetching off (the write-through's own cost: no storage hit is served): "
        f"ratio {wo_ratio:.2f}, write fraction {write_only.pages_written / write_only.unique_pages:.3f}"
    )
    print(f"  a fresh instance then hits {wt.later_hit_fraction:.3f} of the first 200 requests' pages")
    mem_ratio = (mem.served / mem.seconds) / (base.served / base.seconds)
    print(
        f"  the same soak writing through to the memory backend (the controller's share, no file I/O): "
        f"{mem.served / mem.seconds:.0f} requests/s (ratio {mem_ratio:.2f}), write fraction "
        f"{mem.pages_written / mem.unique_pages:.3f}, max queues {mem.max_backup_queue}/{mem.max_storage_queue}"
    )
    return {
        "bench": "faults",
        "acquire_overhead_ms_p99_storage_down": round(overhead_p99, 4),
        "acquire_ms_p99_no_storage": round(base_p99, 4),
        "acquire_ms_p99_storage_down": round(down_p99, 4),
        "acquire_ms_median_before_breaker_opened": round(statistics.median(down.opening_ms), 2),
        "soak_storage_write_fraction": round(fraction, 4),
        "soak_later_hit_fraction": round(wt.later_hit_fraction, 4),
        "soak_rate_ratio_vs_no_storage": round((wt.served / wt.seconds) / (base.served / base.seconds), 3),
        "soak_rate_ratio_memory_backend_vs_no_storage": round(mem_ratio, 3),
        "soak_rate_ratio_no_prefetch_vs_no_storage": round(wo_ratio, 3),
        "soak_storage_write_fraction_no_prefetch": round(
            write_only.pages_written / write_only.unique_pages, 4
        ),
        "soak_backups_skipped": wt.backups_skipped,
        "soak_dropped_pages": wt.dropped_pages,
        "soak_storage_write_fraction_memory_backend": round(mem.pages_written / mem.unique_pages, 4),
        "max_backup_queue": wt.max_backup_queue,
        "max_storage_queue": wt.max_storage_queue,
        "backup_queue_limit": limits.backup_queue_limit,
        "storage_write_queue_limit": limits.storage_write_queue_limit,
        "writes_shed": wt.shed,
        **{f"acquire_alone_loop_cpu_us_{m}": round(alone.loop_cpu_us[m], 1) for m in ALONE_MODES},
        **{f"acquire_alone_loop_iterations_{m}": round(alone.loop_iterations[m], 2) for m in ALONE_MODES},
        "acquire_alone_storage_hit_fraction": round(alone.storage_hit_fraction, 4),
        "stuck_read_acquire_return_ms": round(stuck_worst, 3),
        "stuck_read_acquire_return_ms_median": round(statistics.median(stuck.return_ms), 3),
        "stuck_read_quarantined_pages": max(stuck.quarantined_pages),
        "stuck_read_settled": stuck.settled,
        "goals_met": overhead_p99 < OVERHEAD_GOAL_MS
        and stuck_worst < STUCK_READ_GOAL_MS
        and stuck.settled
        and fraction >= WRITE_FRACTION_GOAL
        and wt.max_backup_queue <= limits.backup_queue_limit
        and wt.max_storage_queue <= limits.storage_write_queue_limit,
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="  log %(name)s: %(message)s")
    logging.getLogger("hicache.cache").setLevel(logging.ERROR)  # one line per failed lookup otherwise
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--acquires", type=int, default=2000, help="acquires per cache in the storage-down part"
    )
    parser.add_argument("--rounds", type=int, default=4, help="alternating passes in the storage-down part")
    parser.add_argument("--requests", type=int, default=4000, help="requests in the soak")
    parser.add_argument("--workers", type=int, default=8, help="serving tasks in the soak")
    parser.add_argument("--stuck-rounds", type=int, default=20, help="acquires in the stuck-read part")
    parser.add_argument("--alone", type=int, default=400, help="acquires per mode in the one-acquire part")
    parser.add_argument("--smoke", action="store_true", help="one tiny pass of each part, the same JSON keys")
    parser.add_argument("--put", type=int, default=None, metavar="PAGES", help="the put micro-run instead")
    parser.add_argument("--put-batch", type=int, default=64, help="pages per put in the put micro-run")
    parser.add_argument(
        "--put-root", default=None, help="the put micro-run's root (kept), default a fresh one"
    )
    parser.add_argument(
        "--put-layout", choices=PUT_LAYOUTS, default="backend", help="what the put micro-run puts"
    )
    parser.add_argument(
        "--soak-cpu",
        type=int,
        default=0,
        metavar="REPS",
        help="only the soak, without storage and on the memory backend, REPS times each: min CPU per request",
    )
    args = parser.parse_args()
    if args.put is not None:
        summary = anyio.run(put_run, args.put, args.put_batch, args.put_root, args.put_layout)
        print(
            f"put ({args.put_layout}), {args.put} fresh pages of {LAYOUT.page_nbytes} bytes, puts of {args.put_batch}: "
            f"sys {summary['sys_us_per_page']} us, user {summary['user_us_per_page']} us, "
            f"wall {summary['wall_us_per_page']} us per page"
        )
        print(json.dumps(summary))
        raise SystemExit(0)
    if args.smoke:
        args.acquires, args.rounds, args.requests, args.workers, args.stuck_rounds = 20, 1, 40, 2, 1
        args.alone = 10
    summary = anyio.run(main, args)
    print(json.dumps(summary))
