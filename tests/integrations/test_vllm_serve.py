"""vLLM's OpenAI server (`vllm serve`) with `HiCacheConnector` on 127.0.0.1, driven by the `openai` client package: responses
complete, repeated prefixes are served from hicache, and `/metrics` shows hicache's series beside vLLM's."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
import urllib.request
import uuid
from pathlib import Path

import pytest
from vllm_helpers import ROOT, vllm_python

sys.path.insert(0, str(ROOT / "tests"))
from s3_servers import free_port, wait_for_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

_CLIENT = textwrap.dedent(
    """
    import json, random, sys
    from openai import OpenAI
    client = OpenAI(base_url=sys.argv[1], api_key="unused")
    rng = random.Random(0)
    systems = [" ".join(f"w{rng.randrange(3, 480)}" for _ in range(128)) for _ in range(4)]
    out = []
    for turn in range(2):
        for user in range(4):  # one at a time: vLLM's 10 blocks hold two of the 4 system prompts
            words = " ".join(f"w{rng.randrange(3, 480)}" for _ in range(24))
            reply = client.completions.create(model=sys.argv[2], prompt=systems[user] + " " + words,
                                              max_tokens=4, temperature=0.0)
            out.append({"finish_reason": reply.choices[0].finish_reason, "text": reply.choices[0].text})
    print(json.dumps(out))
    """
)


def _metric(text: str, name: str) -> float:
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not in /metrics"
    return sum(values)


def test_vllm_serve_with_the_connector_serves_repeated_prefixes_from_hicache(
    tiny_model: Path, tmp_path: Path
) -> None:
    """A served engine: every completion finishes, hicache loads tokens, and its series are on /metrics."""
    port = free_port()
    prom = tmp_path / "prometheus"
    prom.mkdir()
    kv_config = {
        "kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm",
        "kv_role": "kv_both",
        "engine_id": f"serve-{uuid.uuid4().hex[:12]}",
        "kv_connector_extra_config": {"host_pages": 256},
    }
    env = dict(os.environ)
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "PROMETHEUS_MULTIPROC_DIR": str(prom),
            "PYTHONUNBUFFERED": "1",
        }
    )
    log = tmp_path / "serve.log"
    # `vllm serve`'s CLI reads `importlib.metadata.version("vllm")`, which fails for the `vllm-cpu`
    # distribution; its OpenAI server module is the same server without that line.
    argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy", "--dtype", "float32"]
    argv += ["--enforce-eager", "--block-size", "32", "--num-gpu-blocks-override", "10"]
    argv += ["--max-model-len", "256", "--gpu-memory-utilization", "0.3", "--served-model-name", "tiny"]
    argv += ["--kv-transfer-config", json.dumps(kv_config)]
    with log.open("wb") as sink:
        server = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for_port(port, server, log, timeout_s=600)
            base = f"http://127.0.0.1:{port}"
            _wait_healthy(base, server, log)
            client = subprocess.run(
                [vllm_python(), "-c", _CLIENT, f"{base}/v1", "tiny"],
                capture_output=True,
                text=True,
                timeout=600,
                check=True,
            )
            replies = json.loads(client.stdout.strip().splitlines()[-1])
            with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
                metrics = response.read().decode()
        finally:
            server.terminate()
            server.wait(timeout=120)
    assert len(replies) == 8
    assert all(r["finish_reason"] == "length" for r in replies), replies
    assert "vllm:" in metrics
    assert _metric(metrics, "hicache_vllm_loaded_tokens_total") > 0
    assert _metric(metrics, "hicache_vllm_failed_tokens_total") == 0
    assert "hicache_backup_tokens_total" in metrics


def _wait_healthy(base: str, server: subprocess.Popen[bytes], log: Path) -> None:
    """The port listens before the engine is ready: poll /health (bounded) until it answers 200."""
    for _ in range(600):
        if server.poll() is not None:
            pytest.fail(f"vllm serve exited {server.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            server_wait(server)
    pytest.fail("vllm serve never became healthy")


def server_wait(server: subprocess.Popen[bytes]) -> None:
    """Give the server a second to start (a bounded wait on the process, not an ordering sleep)."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=1)
