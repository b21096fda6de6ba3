"""Prefetch throughput of `S3Backend.get` into a host tensor's page views, against the raw obstore client.

Starts a loopback moto server and a JuiceFS S3 gateway (the same helpers the tests use, from
`tests/s3_servers.py`), writes `--pages` pages of `--page-mib` MiB through the backend, then alternates
timed rounds of

* raw: obstore GETs of the same objects under the same concurrency bound, bodies kept in memory;
* backend: `S3Backend.get(keys, views)` into one host tensor, with header + xxh3 verification and the copy.

and reports the median throughput of each and their ratio. The last line of output is one JSON object:
`{"bench": "s3", "ratio_1mib_moto": R, "ratio_1mib_juicefs": R, ...}`.

Run: `python bench/bench_s3.py` (about a minute), or `make bench-s3`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import obstore
import torch
from obstore.store import S3Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from s3_servers import S3Server, start_juicefs, start_moto

from storage_backends.batching import gather_bounded
from storage_backends.page_format import HEADER_SIZE
from storage_backends.protocol import PageStatus
from storage_backends.s3 import S3Backend

NAMESPACE = bytes(range(16))


async def _timed(run: Callable[[], Coroutine[Any, Any, Any]]) -> float:
    start = time.perf_counter()
    await run()
    return time.perf_counter() - start


async def bench_server(
    server: S3Server, pages: int, page_bytes: int, rounds: int, limit: int
) -> dict[str, float]:
    """Median GB/s of raw GETs and of backend prefetch on `server`, and their ratio."""
    keys = [f"{i:016x}" for i in range(pages)]
    src = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8)
    host = torch.zeros_like(src)
    src_views = [memoryview(src[i].numpy()) for i in range(pages)]
    host_views = [memoryview(host[i].numpy()) for i in range(pages)]
    async with S3Backend.from_url(
        server.url("bench"), namespace_digest=NAMESPACE, max_concurrency=limit, **server.options()
    ) as backend:
        assert await backend.put(keys, src_views) == [True] * pages
        paths = [backend.object_path(k) for k in keys]
        raw = S3Store(
            server.bucket,
            endpoint=server.endpoint,
            region=server.region,
            access_key_id=server.access_key_id,
            secret_access_key=server.secret_access_key,
            client_options={"allow_http": True},
        )
        sink: list[Any] = [None] * pages

        async def raw_one(i: int) -> None:
            result = await obstore.get_async(raw, paths[i])
            sink[i] = await result.bytes_async()

        async def raw_round() -> None:
            await gather_bounded([lambda i=i: raw_one(i) for i in range(pages)], limit)  # type: ignore[misc]
            assert all(len(b) == page_bytes + HEADER_SIZE for b in sink)

        async def backend_round() -> None:
            statuses = await backend.get(keys, host_views)
            assert all(s is PageStatus.HIT for s in statuses), statuses  # every PageStatus is truthy

        await raw_round()  # warm both connection pools
        await backend_round()
        assert torch.equal(src, host)
        raw_s: list[float] = []
        ours_s: list[float] = []
        for r in range(rounds):
            # Alternate which goes first so neither always runs on a cache the other warmed.
            if r % 2:
                ours_s.append(await _timed(backend_round))
                raw_s.append(await _timed(raw_round))
            else:
                raw_s.append(await _timed(raw_round))
                ours_s.append(await _timed(backend_round))
        stats = backend.statistics()
    total_gb = pages * page_bytes / 1e9
    raw_gbps = total_gb / statistics.median(raw_s)
    ours_gbps = total_gb / statistics.median(ours_s)
    return {
        "raw_gbps": raw_gbps,
        "backend_gbps": ours_gbps,
        "ratio": ours_gbps / raw_gbps,
        "retries": float(stats.retries),
        "errors": float(stats.errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--page-mib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one tiny pass (seconds): the same JSON keys, no figure worth reading",
    )
    args = parser.parse_args()
    if args.smoke:  # 1 MiB pages still: the keys name the page size
        args.pages, args.rounds, args.concurrency = 2, 1, 2
    page_bytes = int(args.page_mib * (1 << 20))
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
        for kind, start in (("moto", start_moto), ("juicefs", start_juicefs)):
            workdir = Path(tmp) / kind
            workdir.mkdir()
            server = start(workdir)
            try:
                results[kind] = asyncio.run(
                    bench_server(server, args.pages, page_bytes, args.rounds, args.concurrency)
                )
            finally:
                server.stop()
    print(
        f"S3 prefetch, {args.pages} pages x {page_bytes} B, concurrency {args.concurrency}, median of {args.rounds}"
    )
    print(f"{'server':<10}{'raw GB/s':>10}{'backend GB/s':>14}{'ratio':>8}{'retries':>9}{'errors':>8}")
    for kind, r in results.items():
        print(
            f"{kind:<10}{r['raw_gbps']:>10.3f}{r['backend_gbps']:>14.3f}{r['ratio']:>8.3f}"
            f"{int(r['retries']):>9}{int(r['errors']):>8}"
        )
    suffix = "1mib" if page_bytes == 1 << 20 else f"{page_bytes}b"
    line: dict[str, Any] = {"bench": "s3", "page_bytes": page_bytes, "pages": args.pages}
    for kind, r in results.items():
        line[f"ratio_{suffix}_{kind}"] = round(r["ratio"], 4)
        line[f"raw_gbps_{kind}"] = round(r["raw_gbps"], 4)
        line[f"backend_gbps_{kind}"] = round(r["backend_gbps"], 4)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
