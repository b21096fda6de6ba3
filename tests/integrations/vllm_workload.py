"""Run a multi-turn, shared-system-prompt workload through one vLLM engine and write what it returned as
JSON: a script, because vLLM spawns its engine (every `LLM(...)` must sit under `__main__`), and one engine
start per process keeps the tests' scenarios apart.

    python tests/integrations/vllm_workload.py --model DIR --out result.json [--connector hicache|example]
        [--storage-url URL] [--engine-id ID] [--host-pages N] [--dtype float32] ...

The JSON holds, per request in order, the generated token ids, their logprobs and the hit tokens the
connector reported (`kv_transfer_params`), plus, with hicache, the worker's statistics and its
`sanity_check()` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any


def workload(
    users: int, turns: int, system_prompts: int, system_len: int, turn_len: int, seed: int
) -> list[list[list[int]]]:
    """Per turn, per user, the prompt's user part (the system prompt is added by `prompts_for_turn`)."""
    rng = random.Random(seed)
    return [[[rng.randrange(3, 480) for _ in range(turn_len)] for _ in range(users)] for _ in range(turns)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--connector", choices=["none", "hicache", "example"], default="none")
    p.add_argument("--storage-url", default=None)
    p.add_argument("--engine-id", default=None)
    p.add_argument("--host-pages", type=int, default=256)
    p.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--gpu-blocks", type=int, default=10)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-len", type=int, default=128)
    p.add_argument("--turn-len", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--example-path", default=None, help="ExampleConnector's storage directory")
    p.add_argument(
        "--abort-first", type=int, default=0, help="first add and at once abort this many requests"
    )
    p.add_argument("--kill-pid", type=int, default=None, help="kill this process (a storage server) ...")
    p.add_argument("--kill-after-turn", type=int, default=0, help="... once this many turns have run")
    args = p.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv_config = None
    if args.connector == "hicache":
        extra: dict[str, Any] = {"host_pages": args.host_pages, **json.loads(args.extra)}
        if args.storage_url:
            extra["storage_url"] = args.storage_url
        kv_config = KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            **({"engine_id": args.engine_id} if args.engine_id else {}),
        )
    elif args.connector == "example":
        kv_config = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": args.example_path},
        )
    llm = LLM(
        model=args.model,
        load_format="dummy",
        dtype=args.dtype,
        enforce_eager=True,
        block_size=args.block_size,
        num_gpu_blocks_override=args.gpu_blocks,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=True,
        seed=args.seed,
        kv_transfer_config=kv_config,
    )
    engine_id = kv_config.engine_id if kv_config is not None else None
    rng = random.Random(args.seed + 1)
    systems = [[rng.randrange(3, 480) for _ in range(args.system_len)] for _ in range(args.system_prompts)]
    turns = workload(args.users, args.turns, args.system_prompts, args.system_len, args.turn_len, args.seed)
    histories = [list(systems[u % args.system_prompts]) for u in range(args.users)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    requests: list[dict[str, Any]] = []
    for i in range(args.abort_first):  # aborted while their lookup or load is in flight, or before
        prompt = {"prompt_token_ids": histories[i % args.users] + turns[0][i % args.users][:-1]}
        llm.llm_engine.add_request(f"aborted-{i}", prompt, params)
        llm.llm_engine.abort_request([f"aborted-{i}"])
    started = time.perf_counter()
    for t, turn in enumerate(turns):
        if args.kill_pid is not None and t == args.kill_after_turn:
            os.kill(args.kill_pid, signal.SIGKILL)
        prompts = []
        for u, part in enumerate(turn):
            histories[u] = histories[u] + part
            prompts.append({"prompt_token_ids": list(histories[u])})
        for u, prompt in enumerate(prompts):  # one request at a time: TTFT is the request's latency
            t0 = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            latency = time.perf_counter() - t0
            completion = out.outputs[0]
            histories[u] = histories[u] + list(completion.token_ids)
            logprobs = [
                float(step[tok].logprob)
                for step, tok in zip(completion.logprobs or [], completion.token_ids, strict=False)
            ]
            hits = (out.kv_transfer_params or {}).get("hicache_hit_tokens", {"host": 0, "storage": 0})
            requests.append(
                {
                    "prompt_len": len(prompt["prompt_token_ids"]),
                    "token_ids": list(completion.token_ids),
                    "logprobs": logprobs,
                    "hits": hits,
                    "latency_s": latency,
                }
            )
    result: dict[str, Any] = {
        "requests": requests,
        "wall_s": time.perf_counter() - started,
        "system_prompts": systems,
    }
    if args.connector == "hicache":
        from hicache.integrations.vllm import query_worker

        assert engine_id is not None
        result["statistics"] = query_worker(engine_id, "statistics")
        result["sanity"] = query_worker(engine_id, "sanity_check")
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
