"""hicache under vLLM's `LLM`: a tiny random-weight Llama whose KV space is two prompts small, so vLLM's own
prefix cache evicts and the second round of requests is served from hicache's host tier and file storage.

Run it in the vLLM environment (`make venv-vllm`):

    PYTHONPATH=. VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python examples/vllm_offline.py
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))

from tiny_model import write_tiny_llama

if __name__ == "__main__":  # vLLM spawns its engine process: every LLM(...) sits under __main__
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    work = Path(tempfile.mkdtemp(prefix="hicache-vllm-example-"))
    model = write_tiny_llama(work / "model")
    (work / "storage").mkdir()
    llm = LLM(
        model=str(model),
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        num_gpu_blocks_override=10,
        max_model_len=256,
        gpu_memory_utilization=0.3,
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"host_pages": 256, "storage_url": f"file://{work / 'storage'}"},
        ),
    )
    rng = random.Random(0)
    systems = [[rng.randrange(3, 480) for _ in range(160)] for _ in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for round_ in range(2):
        for i, system in enumerate(systems):
            prompt = {"prompt_token_ids": [*system, *(rng.randrange(3, 480) for _ in range(16))]}
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            hits = (out.kv_transfer_params or {}).get("hicache_hit_tokens")
            print(f"round {round_} system prompt {i}: hicache hit tokens {json.dumps(hits)}")
