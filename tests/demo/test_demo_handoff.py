"""The demo's `handoff` scenario: storage hits below prefixes this instance computed itself, so refills are
dropped under `refill_under_unbacked="drop"` and rescued under `"backup_then_attach"`, which then saves
more prefill; every output still matches recompute under both."""

from __future__ import annotations

import dataclasses

import anyio
import pytest

pytest.importorskip("transformers")

from hicache.demo.llama_serve import run_demo
from hicache.demo.model import ModelSpec
from hicache.demo.records import DemoConfig
from hicache.demo.report import summarize
from hicache.demo.workload import WorkloadSpec
from hicache.policy import RefillPolicy

SMALL = DemoConfig(
    users=2,
    turns=3,
    page_size=16,
    device_pages=48,
    host_pages=48,
    prefetch_threshold=16,
    scenario="handoff",
    model=ModelSpec(
        num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
    ),
    workload=WorkloadSpec(system_prompts=1, system_prompt_tokens=96, user_tokens=(16, 48), decode_tokens=4),
)


def test_handoff_drops_under_drop_and_rescues_under_backup_then_attach() -> None:
    """Guards against a demo where the rescue never runs: the first returning user's refill hangs below
    the fresh system prompt; `drop` drops it (the user recomputes its conversation), `backup_then_attach`
    backs the system prompt up and attaches it. Same requests, same replies, more prefill saved."""
    summaries = {}
    for policy in (RefillPolicy.DROP, RefillPolicy.BACKUP_THEN_ATTACH):
        result = anyio.run(run_demo, dataclasses.replace(SMALL, refill_policy=policy))
        assert result.all_identical, [r.request_id for r in result.records if not r.identical]
        assert [r.request_id for r in result.records] == [
            "s0",
            "u0t0",
            "u1t0",
            "u0t1",
            "u1t1",
            "u0t2",
            "u1t2",
        ]
        summaries[policy] = summarize(result)
    drop, rescue = summaries[RefillPolicy.DROP], summaries[RefillPolicy.BACKUP_THEN_ATTACH]
    assert drop["scenario"] == "handoff"
    assert drop["prefetch"]["dropped"] > 0
    assert drop["prefetch"]["rescued"] == 0
    assert rescue["prefetch"]["rescued"] > 0
    assert rescue["prefetch"]["dropped"] == 0
    assert rescue["prefill_tokens_saved"] > drop["prefill_tokens_saved"]
    # The last phase alone: the returning users' turns are where the two policies differ.
    assert drop["handoff"]["returning_requests"] == rescue["handoff"]["returning_requests"] == 2
    assert (drop["handoff"]["dropped"], rescue["handoff"]["rescued"]) == (1, 1)
    assert rescue["handoff"]["prefill_tokens_saved"] > drop["handoff"]["prefill_tokens_saved"]


def test_handoff_refuses_a_single_turn() -> None:
    with pytest.raises(ValueError, match="turns"):
        anyio.run(run_demo, dataclasses.replace(SMALL, turns=1))


def test_an_unknown_scenario_is_refused() -> None:
    with pytest.raises(ValueError, match="scenario"):
        anyio.run(run_demo, dataclasses.replace(SMALL, scenario="elsewhere"))
