"""The serving loop's run modes: lockstep runs are reproducible, and the demo pins torch's intra-op threads."""

from __future__ import annotations

import anyio
import pytest
import torch

pytest.importorskip("transformers")

from hicache.demo.llama_serve import run_demo
from hicache.demo.model import ModelSpec
from hicache.demo.records import DemoConfig, DemoResult
from hicache.demo.run import intra_op_threads
from hicache.demo.workload import WorkloadSpec

SMALL = DemoConfig(
    users=2,
    turns=3,
    page_size=16,
    device_pages=24,
    host_pages=24,
    prefetch_threshold=16,
    lockstep=True,
    model=ModelSpec(
        num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
    ),
    workload=WorkloadSpec(system_prompts=1, system_prompt_tokens=96, user_tokens=(16, 48), decode_tokens=4),
)


def hits_by_request(result: DemoResult) -> dict[str, tuple[int, dict[str, int], str | None]]:
    return {r.request_id: (r.reused_len, r.hits, r.prefetch) for r in result.records}


def test_lockstep_runs_hit_the_same_tiers_every_time() -> None:
    """In lockstep, requests run one at a time in turn order and the cache settles in between: two runs
    give every request the same hits from the same tiers (and every output matches recompute)."""
    first = anyio.run(run_demo, SMALL)
    second = anyio.run(run_demo, SMALL)
    assert first.all_identical
    assert second.all_identical
    assert [r.request_id for r in first.records] == ["u0t0", "u1t0", "u0t1", "u1t1", "u0t2", "u1t2"]
    assert hits_by_request(first) == hits_by_request(second)
    assert sum(r.reused_len for r in first.records) > 0


def test_intra_op_threads_sets_and_restores_the_calling_threads_setting() -> None:
    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before
