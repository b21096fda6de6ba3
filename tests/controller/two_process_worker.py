"""One side of the two-process test, run as a script: ``python two_process_worker.py ROLE ROOT MODEL OUT``.

``serve``: serve `PROMPTS` with a `HiCache` over ``file://ROOT`` (KV from the oracle), wait until every
page has gone device -> host -> storage, dump each prompt's device KV to ``OUT/orig-<i>.bin`` and exit.
``load``: a fresh process acquires the same prompts (prefetch from storage, commit, load back) and
compares the device KV with the originals and with the oracle. Both print one JSON line with their
figures; the test reads the last line of stdout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from hicache import HiCache, HiCacheConfig
from hicache.keys import TOKEN_BYTES, Namespace, as_key_bytes
from hicache.metrics import render

# Run as a script: its own directory is on the path, `tests/` (cache_internals, which kv_oracle uses) is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kv_oracle import chain_payload, layout_for

PAGE = 4
LAYOUT = layout_for(PAGE)
SHARED = [5000 + i for i in range(24)]
PROMPTS = [
    SHARED + [100 + i for i in range(18)],  # 42 tokens: 10 full pages and a partial one
    SHARED + [200 + i for i in range(12)],  # shares 6 pages with the first
    [300 + i for i in range(33)],
]


def aligned(tokens: list[int]) -> int:
    return len(tokens) // PAGE * PAGE


def make_config(root: str, model: str) -> HiCacheConfig:
    return HiCacheConfig(
        layout=LAYOUT,
        device_pages=64,
        host_pages=64,
        storage_url=f"file://{root}",
        namespace=Namespace(model_id=model),
        prefetch_threshold=PAGE,
        prefetch_stop_policy="wait_complete",
    )


async def serve(root: str, model: str, out: Path) -> dict[str, Any]:
    ns = Namespace(model_id=model)
    async with HiCache(make_config(root, model)) as cache:
        for i, tokens in enumerate(PROMPTS):
            lease = await cache.acquire(f"serve-{i}", tokens)
            padded = -(-len(tokens) // PAGE) * PAGE
            new = await cache.alloc_device(padded - lease.cached_len)
            assert new is not None
            n = aligned(tokens)
            kv = chain_payload(as_key_bytes(tokens)[: n * TOKEN_BYTES], LAYOUT, ns)
            cache.device_pool.write_tokens(new[: n - lease.cached_len], kv[:, :, lease.cached_len :])
            await cache.insert(lease, tokens, torch.cat([lease.device_indices, new]))
        await cache.wait_idle()
        for i, tokens in enumerate(PROMPTS):
            match = cache.match(tokens)
            assert match.device_len == aligned(tokens)
            assert match.last_host_node is match.last_device_node  # backed up to host
            original = cache.device_pool.read_tokens(match.device_indices)
            original.numpy().tofile(out / f"orig-{i}.bin")
        written = cache.metrics.storage_bytes_written.value()
        stats = cache.statistics()
    return {"role": "serve", "bytes_written": written, "nodes": stats.tree.num_nodes}


async def load(root: str, model: str, out: Path) -> dict[str, Any]:
    ns = Namespace(model_id=model)
    results: list[dict[str, Any]] = []
    async with HiCache(make_config(root, model)) as cache:
        for i, tokens in enumerate(PROMPTS):
            lease = await cache.acquire(f"load-{i}", tokens)
            kv = cache.device_pool.read_tokens(lease.device_indices)
            n = lease.cached_len
            original = np.fromfile(out / f"orig-{i}.bin", dtype=np.float32)
            original = original.reshape(LAYOUT.num_layers, 2, -1, LAYOUT.num_kv_heads, LAYOUT.head_dim)
            oracle = chain_payload(as_key_bytes(tokens)[: n * TOKEN_BYTES], LAYOUT, ns)
            results.append(
                {
                    "cached": n,
                    "aligned": aligned(tokens),
                    "tiers": lease.hit_tokens_by_tier,
                    "equal_original": bool(np.array_equal(kv.numpy(), original[:, :, :n])),
                    "equal_oracle": bool(torch.equal(kv, oracle)),
                }
            )
            cache.release(lease)
        await cache.wait_idle()
        cache.sanity_check()
        text = render(cache.registry)
    skipped = [line for line in text.splitlines() if line.startswith("hicache_prefetch_skipped_total")]
    return {"role": "load", "results": results, "skipped": skipped}


def main(argv: list[str]) -> None:
    role, root, model, out = argv
    func = serve if role == "serve" else load
    result = anyio.run(func, root, model, Path(out))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
