"""One tensor-parallel rank of the multiprocess metrics test, run as a script:
``python metrics_rank_worker.py RANK TP_SIZE TOKENS ROOT``.

Run with ``PROMETHEUS_MULTIPROC_DIR`` in its environment, so prometheus_client writes this process's values
to files there. The rank serves one prompt of TOKENS tokens through a `HiCache` over ``file://ROOT``
(write-through: device -> host -> storage), waits until every page is written, and prints one JSON line:
its pid, page size in bytes, and the samples its own registry shows.
"""

from __future__ import annotations

import json
import os
import sys

import anyio
import torch

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace
from hicache.metrics import multiprocess_dir, snapshot

PAGE = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=PAGE)


async def serve(rank: int, tp_size: int, n_tokens: int, root: str) -> dict[str, object]:
    assert multiprocess_dir() is not None, "run me with PROMETHEUS_MULTIPROC_DIR set"
    config = HiCacheConfig(
        layout=LAYOUT,
        device_pages=16,
        host_pages=16,
        storage_url=f"file://{root}",
        write_policy="write_through",
        namespace=Namespace(model_id="metrics-test", tp_rank=rank % tp_size, tp_size=tp_size),
    )
    async with HiCache(config) as cache:
        tokens = [1000 * (rank + 1) + i for i in range(n_tokens)]
        lease = await cache.acquire(f"rank-{rank}", tokens)
        new = await cache.alloc_device(n_tokens - lease.cached_len)
        assert new is not None
        cache.device_pool.write_tokens(new, torch.full((2, 2, len(new), 1, 4), float(rank)))
        await cache.insert(lease, tokens, torch.cat([lease.device_indices, new]))
        await cache.wait_idle()
        own = snapshot(cache.registry)
    return {"pid": os.getpid(), "page_nbytes": LAYOUT.page_nbytes, "own": own}


def main(argv: list[str]) -> None:
    rank, tp_size, n_tokens, root = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    print(json.dumps(anyio.run(serve, rank, tp_size, n_tokens, root)))


if __name__ == "__main__":
    main(sys.argv[1:])
