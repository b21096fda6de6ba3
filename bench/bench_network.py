"""Read throughput of the Valkey and Mooncake backends into host-tensor page views, against their raw clients.

Starts a loopback 3-node Valkey cluster and a `mooncake_master` (the test helpers, `tests/net_servers.py`),
writes `--pages` pages through each backend at 1 MiB and at 64 KiB, then alternates timed rounds of

* raw: the client library reading the same objects with the same batching (redis-py asyncio cluster
  pipelines of GETs, bodies kept in memory; `batch_get_into` of the backend's own Mooncake client into
  one registered buffer),
* backend: `backend.get(keys, views)` into one host tensor, header and xxh3 verification included,

and reports the median GB/s of each and their ratio, and the event loop's longest stall while 16 such
reads run at once. The last line of output is one JSON object with the keys `ratio_1mib_valkey`,
`ratio_64kib_valkey`, `max_loop_stall_ms_valkey`, `ratio_1mib_mooncake`, `ratio_64kib_mooncake`,
`max_loop_stall_ms_mooncake` (and the GB/s behind them). It measures backend reads, not the whole
controller prefetch path. With `--sglang` (and `../shared/baselines/sglang-mooncake/run` beside the
checkout) it then runs SGLang's own Mooncake backend through SGLang's real paths on the same amount and
page sizes, and adds `vs_sglang_mooncake_1mib` (ours / SGLang's get GB/s at 1 MiB); null without it.

Run: `python bench/bench_network.py` (a few minutes), `--smoke` (seconds), or `make bench-network`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _loop_timing import run_with_ticker
from net_servers import MooncakeMaster, ValkeyCluster, start_mooncake, start_valkey

from storage_backends.batching import gather_bounded
from storage_backends.mooncake import MooncakeBackend
from storage_backends.protocol import StorageBackend
from storage_backends.valkey import ValkeyBackend

NAMESPACE = bytes(range(16))
HEADER = 56
SGLANG_RUN = Path(__file__).resolve().parents[2] / "shared" / "baselines" / "sglang-mooncake" / "run"
"""SGLang's Mooncake backend through SGLang's real paths (`--sglang`), where this checkout has it beside."""


async def _timed(run: Callable[[], Awaitable[Any]]) -> float:
    start = time.perf_counter()
    await run()
    return time.perf_counter() - start


async def _measure(
    backend: StorageBackend,
    raw_round: Callable[[list[str]], Awaitable[None]],
    pages: int,
    page_bytes: int,
    rounds: int,
) -> dict[str, float]:
    keys = [f"{i:032x}" for i in range(1, pages + 1)]
    src = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8)
    host = torch.zeros_like(src)
    flat = host.view(-1).numpy().data
    views = [flat[i * page_bytes : (i + 1) * page_bytes] for i in range(pages)]
    src_views = [memoryview(src[i].numpy()) for i in range(pages)]
    assert all(await backend.put(keys, src_views))

    async def ours() -> None:
        assert all(await backend.get(keys, views))

    await raw_round(keys)
    await ours()
    assert torch.equal(src, host)
    raw_s: list[float] = []
    ours_s: list[float] = []
    for r in range(rounds):
        first, second = (ours, partial(raw_round, keys)) if r % 2 else (partial(raw_round, keys), ours)
        a, b = await _timed(first), await _timed(second)
        ours_s.append(a if r % 2 else b)
        raw_s.append(b if r % 2 else a)
    gb = pages * page_bytes / 1e9

    async def sixteen() -> None:
        chunk = max(1, pages // 16)
        await gather_bounded(
            [partial(backend.get, keys[i : i + chunk], views[i : i + chunk]) for i in range(0, pages, chunk)],
            16,
        )

    _, _, stall_ms = await run_with_ticker(sixteen)
    raw_gbps, ours_gbps = gb / statistics.median(raw_s), gb / statistics.median(ours_s)
    return {
        "raw_gbps": raw_gbps,
        "backend_gbps": ours_gbps,
        "ratio": ours_gbps / raw_gbps,
        "stall_ms": stall_ms,
    }


async def bench_valkey(cluster: ValkeyCluster, pages: int, page_bytes: int, rounds: int) -> dict[str, float]:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    async with ValkeyBackend.from_url(
        cluster.url(f"bench{page_bytes}"), namespace_digest=NAMESPACE
    ) as backend:
        raw = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in cluster.nodes])
        await raw.initialize()
        group = max(1, (16 << 20) // page_bytes)  # the backend's batch_bytes

        async def raw_round(keys: list[str]) -> None:
            async def one(part: list[str]) -> None:
                pipe = raw.pipeline(transaction=False)
                for k in part:
                    pipe.get(backend.server_key(k))
                values = await pipe.execute()
                assert all(len(v) == page_bytes + HEADER for v in values)

            parts = [keys[i : i + group] for i in range(0, len(keys), group)]
            await gather_bounded([partial(one, p) for p in parts], 8)

        try:
            return await _measure(backend, raw_round, pages, page_bytes, rounds)
        finally:
            await raw.aclose()


async def bench_mooncake(
    master: MooncakeMaster, pages: int, page_bytes: int, rounds: int
) -> dict[str, float]:
    segment = 2 * pages * (page_bytes + HEADER) + (64 << 20)
    url = master.url(f"bench{page_bytes}")
    async with MooncakeBackend.from_url(url, namespace_digest=NAMESPACE, segment_bytes=segment) as backend:
        raw = backend.acquire_client()  # the same process-wide client the backend reads through
        sink = bytearray(pages * (page_bytes + HEADER))
        base = ctypes.addressof((ctypes.c_char * len(sink)).from_buffer(sink))
        raw.register_buffer(base, len(sink))
        group = max(1, (32 << 20) // page_bytes)  # the backend's batch_bytes

        def read(keys: list[str], first: int) -> None:
            names = [backend.object_name(k) for k in keys]
            ptrs = [base + (first + i) * (page_bytes + HEADER) for i in range(len(keys))]
            codes = raw.batch_get_into(names, ptrs, [page_bytes + HEADER] * len(keys))
            assert all(c == page_bytes + HEADER for c in codes), codes[:3]

        async def raw_round(keys: list[str]) -> None:
            parts = [(keys[i : i + group], i) for i in range(0, len(keys), group)]
            await gather_bounded([partial(anyio.to_thread.run_sync, read, *p) for p in parts], 4)

        try:
            return await _measure(backend, raw_round, pages, page_bytes, rounds)
        finally:
            raw.unregister_buffer(base)
            backend.drop_client()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"bench": "network"}
    workdir = Path(tempfile.mkdtemp(prefix="bench-network-"))
    sizes = {"1mib": 1 << 20, "64kib": 64 << 10}
    cluster = start_valkey(workdir)
    try:
        stalls = []
        for label, size in sizes.items():
            pages = max(4, args.mib * (1 << 20) // size)
            result = await bench_valkey(cluster, pages, size, args.rounds)
            print(f"valkey {label}: {json.dumps(result)}", flush=True)
            out[f"ratio_{label}_valkey"] = round(result["ratio"], 3)
            out[f"gbps_{label}_valkey"] = round(result["backend_gbps"], 3)
            out[f"raw_gbps_{label}_valkey"] = round(result["raw_gbps"], 3)
            stalls.append(result["stall_ms"])
        out["max_loop_stall_ms_valkey"] = round(max(stalls), 2)
    finally:
        cluster.stop()
    master = start_mooncake(workdir)
    try:
        stalls = []
        for label, size in sizes.items():
            pages = max(4, args.mib * (1 << 20) // size)
            result = await bench_mooncake(master, pages, size, args.rounds)
            print(f"mooncake {label}: {json.dumps(result)}", flush=True)
            out[f"ratio_{label}_mooncake"] = round(result["ratio"], 3)
            out[f"gbps_{label}_mooncake"] = round(result["backend_gbps"], 3)
            out[f"raw_gbps_{label}_mooncake"] = round(result["raw_gbps"], 3)
            stalls.append(result["stall_ms"])
        out["max_loop_stall_ms_mooncake"] = round(max(stalls), 2)
    finally:
        master.stop()
    out["vs_sglang_mooncake_1mib"] = None
    if args.sglang and SGLANG_RUN.is_file():
        sglang = _run_sglang(args.mib, args.rounds)
        out["sglang_get_gbps_1mib"] = sglang.get("get_gbps_1mib")
        out["sglang_get_gbps_64kib"] = sglang.get("get_gbps_64kib")
        if sglang.get("get_gbps_1mib"):
            out["vs_sglang_mooncake_1mib"] = round(out["gbps_1mib_mooncake"] / sglang["get_gbps_1mib"], 3)
    return out


def _run_sglang(mib: int, reps: int) -> dict[str, Any]:
    """SGLang's own Mooncake backend reading the same amount at the same page sizes, in this run."""
    done = subprocess.run(
        [str(SGLANG_RUN), "--total-mib", str(mib), "--reps", str(reps)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"sglang-mooncake baseline failed ({done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
        return {}
    result: dict[str, Any] = json.loads(lines[-1])
    print(f"sglang-mooncake: get 1mib {result.get('get_gbps_1mib')} 64kib {result.get('get_gbps_64kib')}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB read per round and page size")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="a few MiB and rounds: checks it runs")
    parser.add_argument(
        "--sglang",
        action="store_true",
        help=f"also run SGLang's Mooncake backend ({SGLANG_RUN}) on the same sizes",
    )
    args = parser.parse_args()
    if args.smoke:
        args.mib, args.rounds, args.sglang = 4, 2, False
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
