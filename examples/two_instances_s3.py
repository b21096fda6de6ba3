"""Two serving instances sharing KV through S3: a producer process fills the bucket, a consumer reuses it.

    python examples/two_instances_s3.py                      # starts its own moto server on loopback
    python examples/two_instances_s3.py --endpoint http://127.0.0.1:9000 --bucket mybucket

With no `--endpoint`, a `moto_server` (PyPI `moto[server]`) is started on a free 127.0.0.1 port and
stopped at the end. Credentials come from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (moto accepts
any); they are handed to the two processes in their environment, never on a command line.

The producer serves three requests that share a system prompt (acquire, allocate device pages, write KV,
insert), waits until every page is backed up to host and written through to S3, and exits. The consumer,
a fresh process with an empty tree, acquires the same prompts: the cache prefetches their pages from S3,
and the consumer checks that the KV it got is exactly what the producer computed. Exits 0 on success.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace

PAGE = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, page_size=PAGE)
SYSTEM = list(range(1000, 1064))  # a 64-token system prompt shared by every request
PROMPTS = {
    "alice": SYSTEM + list(range(5000, 5040)),
    "bob": SYSTEM + list(range(6000, 6050)),
    "carol": SYSTEM + list(range(7000, 7003)),
}


def fake_model_kv(prompt: list[int]) -> torch.Tensor:
    """Stand-in for a model's prefill: deterministic K/V of `prompt` in the pool layout (L, 2, n, H, D)."""
    ids = torch.tensor(prompt, dtype=torch.float32).view(1, 1, -1, 1, 1)
    pos = torch.arange(len(prompt), dtype=torch.float32).view(1, 1, -1, 1, 1)
    return (ids * 1000 + pos).expand(*LAYOUT.tokens_shape(len(prompt))).clone()


def make_config(url: str) -> HiCacheConfig:
    """Both instances run the same model, so they share a namespace and with it the pages in S3."""
    return HiCacheConfig(
        layout=LAYOUT,
        device_pages=64,
        host_pages=64,
        storage_url=url,
        namespace=Namespace(model_id="example-model"),
        prefetch_threshold=PAGE,
        prefetch_stop_policy="wait_complete",
    )


async def producer(url: str) -> None:
    async with HiCache(make_config(url)) as cache:
        for request_id, prompt in PROMPTS.items():
            lease = await cache.acquire(request_id, prompt)
            n = len(prompt)
            indices = await cache.alloc_device(-(-n // PAGE) * PAGE - lease.cached_len)
            assert indices is not None, "device pool exhausted"
            cache.device_pool.write_tokens(
                indices[: n - lease.cached_len], fake_model_kv(prompt)[:, :, lease.cached_len :]
            )
            await cache.insert(lease, prompt, torch.cat([lease.device_indices, indices]))
        await cache.wait_idle()  # backed up to host and written through to S3
        written = cache.metrics.storage_bytes_written.value()
        print(
            f"producer: wrote {int(written) // LAYOUT.page_nbytes} pages ({int(written)} bytes) to S3",
            flush=True,
        )


async def consumer(url: str) -> None:
    async with HiCache(make_config(url)) as cache:
        identical, from_storage = True, 0
        for request_id, prompt in PROMPTS.items():
            lease = await cache.acquire(request_id, prompt)
            got = cache.device_pool.read_tokens(lease.device_indices)
            same = torch.equal(got, fake_model_kv(prompt)[:, :, : lease.cached_len])
            identical &= same and lease.cached_len > 0
            from_storage += lease.hit_tokens_by_tier["storage"]
            print(f"consumer: {request_id} reused {lease.cached_len} tokens {lease.hit_tokens_by_tier}")
            cache.release(lease)
    if not identical or from_storage == 0:
        sys.exit("consumer: the KV read back differs from the producer's, or nothing came from S3")
    print("consumer: KV identical to the producer's for every request")


def run_role(role: str, url: str, credentials: dict[str, str]) -> None:
    """Run this file as a separate process in `role`, with the credentials in its environment."""
    env = dict(os.environ, **credentials)
    done = subprocess.run([sys.executable, __file__, "--role", role, "--url", url], env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"{role} exited with {done.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="an S3 endpoint (default: start a moto server on loopback)")
    parser.add_argument("--bucket", default="hicache", help="an existing bucket (default: hicache)")
    parser.add_argument("--prefix", default="two-instances", help="the key prefix inside the bucket")
    parser.add_argument("--region", default="us-east-1")
    parser.add_argument("--role", choices=["producer", "consumer"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        asyncio.run((producer if args.role == "producer" else consumer)(args.url))
        return

    credentials = {
        "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
        "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing-secret"),
    }
    with tempfile.TemporaryDirectory(prefix="hicache-moto-") as workdir:
        stop = None
        endpoint, bucket = args.endpoint, args.bucket
        if endpoint is None:
            # The loopback server helper the tests use (tests/s3_servers.py in this checkout).
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from s3_servers import start_moto

            server = start_moto(Path(workdir), bucket=bucket)
            endpoint, stop = server.endpoint, server.stop
            print(f"started moto on {endpoint}, bucket {bucket!r}", flush=True)
        try:
            url = f"s3://{bucket}/{args.prefix}?endpoint={endpoint}&region={args.region}"
            run_role("producer", url, credentials)
            run_role("consumer", url, credentials)
        finally:
            if stop is not None:
                stop()


if __name__ == "__main__":
    main()
