"""vLLM alone vs vLLM + ExampleConnector vs vLLM + HiCacheConnector on a multi-turn, shared-prefix workload.

Three engines, one after another, each in its own process (`tests/integrations/vllm_workload.py`, run with
the vLLM environment's interpreter, `.venv-vllm`): vLLM alone (prefix caching on), vLLM's reference
connector `ExampleConnector` (safetensors files per request), and `HiCacheConnector` (host tier plus a file
storage tier). vLLM's KV space is set to hold about two prompts, so its own prefix cache evicts a system
prompt before the next user of it arrives. Every request generates one token, so its latency is its TTFT.
vLLM's `SimpleCPUOffloadConnector` and `OffloadingConnector` move blocks with CUDA streams and do not run
on the CPU backend, so they are not in the comparison.

Model (random weights, `load_format="dummy"`, float32): a Llama of hidden 512, 8 layers, 8 heads, 4 KV
heads (head dim 64), MLP 1536; 4 system prompts of 1,024 tokens, 8 users (2 per system prompt) x 3 turns of
64 new tokens; blocks of 64 tokens, 40 of them in vLLM. `--smoke`: the tests' tiny model, 4 users x 2 turns.

Prints one JSON line: requests, identical (requests whose tokens match vLLM alone), hit_tokens_host,
hit_tokens_storage, ttft_p50_ms_{vllm,example_connector,hicache}, ttft_p50_ratio_vs_vllm,
ttft_p50_ratio_vs_example_connector, scheduler_lookup_us_p50 (what one `get_num_new_matched_tokens` of a
miss costs the scheduler: the lookup round trip to the worker's cache).

    python bench/bench_vllm.py [--smoke] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integrations"))

from tiny_model import write_tiny_llama  # noqa: E402
from vllm_helpers import run_workload, vllm_python  # noqa: E402

_LOOKUP_SNIPPET = r"""
import json, statistics, time, uuid
from types import SimpleNamespace as NS
import torch
from hicache import HiCacheConfig, KVLayout
from hicache.integrations.vllm import _Runtime, _SchedulerSide, lookup_endpoint

layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype=torch.float32, page_size=64)
endpoint = lookup_endpoint(uuid.uuid4().hex)
runtime = _Runtime(HiCacheConfig(layout=layout, device_pages=8, host_pages=64), [], endpoint)
runtime.start()
side = _SchedulerSide(64, endpoint, 1.0)
samples = []
for i in range(2000):
    tokens = list(range(i * 1000, i * 1000 + 1088))  # a miss: nothing of it was ever cached
    request = NS(request_id=f"r{i}", all_token_ids=tokens, num_tokens=len(tokens))
    t0 = time.perf_counter_ns()
    side.lookup(request, 0)
    samples.append(time.perf_counter_ns() - t0)
side.close()
runtime.close()
print(json.dumps({"p50_us": statistics.median(samples[200:]) / 1000}))
"""


def p50_ms(result: dict[str, Any]) -> float:
    return statistics.median(r["latency_s"] for r in result["requests"]) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one tiny pass (the same JSON keys)")
    parser.add_argument("--out", default=None, help="also write the JSON line here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hicache-bench-vllm-") as tmp:
        work = Path(tmp)
        if args.smoke:
            model = write_tiny_llama(work / "model")
            shape = ["--users", "4", "--turns", "2", "--system-prompts", "2", "--system-len", "128"]
            shape += [
                "--turn-len",
                "24",
                "--block-size",
                "32",
                "--gpu-blocks",
                "10",
                "--max-model-len",
                "256",
            ]
        else:
            model = write_tiny_llama(
                work / "model",
                hidden_size=512,
                num_layers=8,
                num_heads=8,
                num_kv_heads=4,
                intermediate_size=1536,
            )
            shape = ["--users", "8", "--turns", "3", "--system-prompts", "4", "--system-len", "1024"]
            shape += [
                "--turn-len",
                "64",
                "--block-size",
                "64",
                "--gpu-blocks",
                "40",
                "--max-model-len",
                "1408",
            ]
        common = ["--model", str(model), "--max-tokens", "1", *shape]
        alone = run_workload(work / "vllm.json", *common)
        example_dir = work / "example"
        example = run_workload(
            work / "example.json", *common, "--connector", "example", "--example-path", str(example_dir)
        )
        storage = work / "storage"
        storage.mkdir()
        hicache = run_workload(
            work / "hicache.json",
            *common,
            "--connector",
            "hicache",
            "--engine-id",
            "bench-hicache",
            "--storage-url",
            f"file://{storage}",
            "--host-pages",
            "512",
        )
        lookup = subprocess.run(
            [vllm_python(), "-c", _LOOKUP_SNIPPET],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            timeout=600,
        )
        lookup_us = json.loads(lookup.stdout.strip().splitlines()[-1])["p50_us"]
    identical = sum(
        a["token_ids"] == b["token_ids"] for a, b in zip(alone["requests"], hicache["requests"], strict=True)
    )
    ttft = {"vllm": p50_ms(alone), "example_connector": p50_ms(example), "hicache": p50_ms(hicache)}
    line = {
        "bench": "vllm",
        "mode": "smoke" if args.smoke else "full",
        "requests": len(hicache["requests"]),
        "identical": identical,
        "hit_tokens_host": sum(r["hits"]["host"] for r in hicache["requests"]),
        "hit_tokens_storage": sum(r["hits"]["storage"] for r in hicache["requests"]),
        **{f"ttft_p50_ms_{name}": round(value, 2) for name, value in ttft.items()},
        "ttft_p50_ratio_vs_vllm": round(ttft["hicache"] / ttft["vllm"], 3),
        "ttft_p50_ratio_vs_example_connector": round(ttft["hicache"] / ttft["example_connector"], 3),
        "scheduler_lookup_us_p50": round(lookup_us, 1),
        "sanity_ok": hicache["sanity"]["ok"],
    }
    text = json.dumps(line)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
