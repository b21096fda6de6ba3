"""One serving instance sharing KV through a network store (Valkey, Mooncake), run as its own process.

    python tests/storage/net_instance.py produce --url valkey://127.0.0.1:7000/p --report a.json
    python tests/storage/net_instance.py consume --url ... --report b.json [--model other]

The same instance as the S3 sharing test's (`tests/s3/s3_instance.py`: its layout, prompts, payload and
configuration), through the real controller: `produce` serves the prompts and waits until every page is
written through; `consume` starts with an empty tree, acquires the same prompts (prefetching from the
store) and checks the KV it got against the payload. Both write a JSON report with the backend's counters.
`run_instance` runs one and returns its report; `run_demo` runs `hicache demo` on a URL.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "s3"))

from s3_instance import PAGE, PROMPTS, instance_config, kv_payload

from hicache import HiCache

ROOT = Path(__file__).resolve().parents[2]


def _statistics(cache: HiCache) -> dict[str, int]:
    stats = cache.storage.statistics()  # type: ignore[attr-defined]
    return {name: getattr(stats, name) for name in ("pages_written", "pages_read", "misses", "errors")}


async def produce(cache: HiCache) -> dict[str, Any]:
    for i, prompt in enumerate(PROMPTS):
        lease = await cache.acquire(f"a-{i}", prompt)
        n = len(prompt)
        new = await cache.alloc_device(-(-n // PAGE) * PAGE - lease.cached_len)
        assert new is not None, "device pool exhausted"
        cache.device_pool.write_tokens(
            new[: n - lease.cached_len], kv_payload(prompt)[:, :, lease.cached_len :]
        )
        await cache.insert(lease, prompt, torch.cat([lease.device_indices, new]))
    await cache.wait_idle()
    cache.sanity_check()
    return {"storage": _statistics(cache)}


async def consume(cache: HiCache) -> dict[str, Any]:
    requests = []
    for i, prompt in enumerate(PROMPTS):
        lease = await cache.acquire(f"b-{i}", prompt)
        got = cache.device_pool.read_tokens(lease.device_indices)
        expected = kv_payload(prompt)[:, :, : lease.cached_len]
        requests.append({"hits": lease.hit_tokens_by_tier, "matches_payload": torch.equal(got, expected)})
        cache.release(lease)
    await cache.wait_idle()
    cache.sanity_check()
    return {"requests": requests, "storage": _statistics(cache)}


def run_instance(
    role: str, url: str, report: Path, *, model: str | None = None, timeout_s: float = 120
) -> Any:
    """Run one instance process and return its JSON report (asserting it exited 0)."""
    argv = [sys.executable, "-W", "error", __file__, role, "--url", url, "--report", str(report)]
    if model is not None:
        argv += ["--model", model]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, f"{role} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"
    return json.loads(report.read_text())


def run_demo(url: str, *, timeout_s: float = 300) -> str:
    """Run `hicache demo --backend url` with a small workload; return its output (asserting it exited 0)."""
    argv = [sys.executable, "-m", "hicache.cli", "demo", "--backend", url, "--users", "2", "--turns", "2"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, f"demo exited {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["produce", "consume"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--model", default="llama-test")
    args = parser.parse_args(argv)
    async with HiCache(instance_config(args.url, args.model)) as cache:
        report = await (produce if args.role == "produce" else consume)(cache)
    args.report.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(anyio.run(main, sys.argv[1:]))
