"""One serving instance sharing KV through S3, run as a separate process by `test_s3_multi_instance.py`.

    python tests/s3/s3_instance.py produce --url s3://bucket/prefix?endpoint=... --report a.json --kv-dir DIR
    python tests/s3/s3_instance.py consume --url ... --report b.json --kv-dir DIR [--model other]

`produce` serves `PROMPTS` as a serving loop would (acquire, allocate device pages, write deterministic KV,
insert), waits until every page is backed up to host and written through to S3, and saves the KV of each
prompt's cached prefix to `KV_DIR/<i>.bin`. `consume` starts with an empty tree, acquires the same prompts
(prefetching from S3), and checks the KV it got against `kv_payload` and against the producer's files.
Both write a JSON report; the test asserts on it. Credentials come from `AWS_ACCESS_KEY_ID` and
`AWS_SECRET_ACCESS_KEY`, never from the command line.

The test module imports `LAYOUT`, `PROMPTS` and `kv_payload` from here, so both sides agree on them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio
import torch

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace
from storage_backends.s3 import S3Backend

__all__ = ["LAYOUT", "PAGE", "PROMPTS", "aligned", "instance_config", "kv_payload"]

PAGE = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, page_size=PAGE)
"""8 KiB pages: 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4 bytes."""

_SYSTEM = list(range(1000, 1096))  # 96 tokens, 6 pages, shared by every prompt
PROMPTS: list[list[int]] = [
    _SYSTEM + list(range(5000, 5040)),  # 136 tokens: 8 whole pages stored, 8 tokens never stored
    _SYSTEM + list(range(7000, 7077)),  # 173 tokens: the 6 shared pages + 4 of its own
    _SYSTEM + list(range(9000, 9005)),  # 101 tokens: only the shared pages
]
"""Three requests sharing a 96-token system prompt; 12 distinct whole pages in all."""


def aligned(n: int) -> int:
    """`n` tokens rounded down to whole pages."""
    return n // PAGE * PAGE


def kv_payload(prompt: list[int]) -> torch.Tensor:
    """Deterministic KV for `prompt`'s tokens, shaped `(layers, 2, n, heads, dim)` for `write_tokens`.

    Every value depends on the token id, its position and its coordinate, and is an integer below 2**23,
    so it is exact in float32 and a page stored at the wrong place or with the wrong layout differs.
    """
    ids = torch.tensor(prompt, dtype=torch.int64).view(1, 1, -1, 1, 1)
    pos = torch.arange(len(prompt), dtype=torch.int64).view(1, 1, -1, 1, 1)
    layer = torch.arange(LAYOUT.num_layers, dtype=torch.int64).view(-1, 1, 1, 1, 1)
    plane = torch.arange(2, dtype=torch.int64).view(1, 2, 1, 1, 1)
    head = torch.arange(LAYOUT.num_kv_heads, dtype=torch.int64).view(1, 1, 1, -1, 1)
    dim = torch.arange(LAYOUT.head_dim, dtype=torch.int64).view(1, 1, 1, 1, -1)
    mixed = ids * 1_000_003 + pos * 7_919 + layer * 131 + plane * 31 + head * 17 + dim
    return (mixed % (1 << 23)).to(torch.float32)


def instance_config(url: str, model: str = "llama-test", **overrides: Any) -> HiCacheConfig:
    """The configuration of one instance on `url`: write-through to host and S3, prefetch whole hits."""
    options: dict[str, Any] = {
        "layout": LAYOUT,
        "device_pages": 64,
        "host_pages": 64,
        "storage_url": url,
        "namespace": Namespace(model_id=model),
        "prefetch_threshold": PAGE,
        "prefetch_stop_policy": "wait_complete",
        "storage_batch_pages": 4,
    }
    options.update(overrides)
    return HiCacheConfig(**options)


def _s3_statistics(cache: HiCache) -> dict[str, int]:
    storage = cache.storage
    assert isinstance(storage, S3Backend), storage
    stats = storage.statistics()
    return {
        "pages_written": stats.pages_written,
        "pages_read": stats.pages_read,
        "misses": stats.misses,
        "errors": stats.errors,
        "checksum_failures": stats.checksum_failures,
        "requests": stats.requests,
    }


async def produce(cache: HiCache, kv_dir: Path) -> dict[str, Any]:
    """Serve every prompt, wait until it is all in S3, save each prompt's cached KV bytes."""
    requests = []
    for i, prompt in enumerate(PROMPTS):
        lease = await cache.acquire(f"a-{i}", prompt)
        n = len(prompt)
        new = await cache.alloc_device(-(-n // PAGE) * PAGE - lease.cached_len)
        assert new is not None, "device pool exhausted"
        cache.device_pool.write_tokens(
            new[: n - lease.cached_len], kv_payload(prompt)[:, :, lease.cached_len :]
        )
        await cache.insert(lease, prompt, torch.cat([lease.device_indices, new]))
        requests.append({"cached_len": lease.cached_len, "hits": lease.hit_tokens_by_tier})
    await cache.wait_idle()
    for i, prompt in enumerate(PROMPTS):
        match = cache.match(prompt)
        kv = cache.device_pool.read_tokens(match.device_indices)
        (kv_dir / f"{i}.bin").write_bytes(kv.numpy().tobytes())
    cache.sanity_check()
    return {"requests": requests, "s3": _s3_statistics(cache)}


async def consume(cache: HiCache, kv_dir: Path) -> dict[str, Any]:
    """Acquire every prompt on an empty tree; compare the KV received with the payload and the producer's."""
    requests = []
    for i, prompt in enumerate(PROMPTS):
        lease = await cache.acquire(f"b-{i}", prompt)
        got = cache.device_pool.read_tokens(lease.device_indices)
        expected = kv_payload(prompt)[:, :, : lease.cached_len]
        producer_file = kv_dir / f"{i}.bin"
        producer = producer_file.read_bytes() if producer_file.exists() else b""
        outcome = lease.prefetch
        requests.append(
            {
                "cached_len": lease.cached_len,
                "hits": lease.hit_tokens_by_tier,
                "prefetch": None
                if outcome is None
                else {
                    "status": outcome.status,
                    "completed_tokens": outcome.completed_tokens,
                    "loaded_tokens": outcome.loaded_tokens,
                    "failed_pages": outcome.failed_pages,
                },
                "matches_payload": torch.equal(got, expected),
                "matches_producer": got.numpy().tobytes() == producer[: got.numel() * got.element_size()],
            }
        )
        cache.release(lease)
    await cache.wait_idle()
    cache.sanity_check()
    return {"requests": requests, "s3": _s3_statistics(cache)}


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["produce", "consume"])
    parser.add_argument("--url", required=True, help="s3://bucket/prefix?endpoint=...&region=...")
    parser.add_argument("--report", type=Path, required=True, help="where to write the JSON report")
    parser.add_argument("--kv-dir", type=Path, required=True, help="the producer's KV files")
    parser.add_argument("--model", default="llama-test", help="the model name in the namespace")
    args = parser.parse_args(argv)
    async with HiCache(instance_config(args.url, args.model)) as cache:
        role = produce if args.role == "produce" else consume
        report = await role(cache, args.kv_dir)
        report["repr"] = repr(cache)
    args.report.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main, sys.argv[1:]))
