"""The hybrid demo: restoring a LaraMini prefix from its three parts, and a small run through the cache."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from hicache.demo.hybrid import HybridModel, HybridPrefix, HybridSpec
from hicache.demo.hybrid_oracle import HybridOracle
from hicache.demo.hybrid_serve import HybridDemoConfig, hybrid_demo_config, run_hybrid_demo
from hicache.demo.workload import WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model() -> HybridModel:
    return HybridModel(HybridSpec())


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def prefix_at(model: HybridModel, seq: torch.Tensor, at: int) -> tuple[HybridPrefix, torch.Tensor]:
    """The model's own prefix of `seq[:at]` in the pool layouts, and the logits of its own continuation."""
    own = model.prefill(seq, None, snapshot_at=at)
    full, swa = model.new_kv(own.cache, 0, at)
    window = min(model.spec.window, at)
    return HybridPrefix(at, full, swa[:, :, at - window :], own.state_at[at]), own.logits_last


@pytest.mark.parametrize(("at", "length"), [(8, 9), (16, 50), (40, 70), (64, 110)])
def test_restored_prefix_continues_bitwise_like_the_models_own_cache(
    model: HybridModel, at: int, length: int
) -> None:
    """Full K/V, the last window of sliding K/V and the packed conv+recurrent state are all a prefix needs:
    the continuation and the decode from them equal the model's own same-split run bit for bit."""
    seq = tokens(length)
    prefix, own_logits = prefix_at(model, seq, at)
    assert prefix.swa_kv.shape[2] == min(model.spec.window, at)
    assert prefix.state.dtype == torch.uint8
    assert prefix.state.numel() == model.spec.state_nbytes
    restored = model.prefill(seq, prefix)
    assert torch.equal(restored.logits_last, own_logits)
    own = model.prefill(seq, None, snapshot_at=at)
    assert torch.equal(model.decode(restored, 4).logits, model.decode(own, 4).logits)
    recompute = model.full_logits(seq)[-1]
    assert float((restored.logits_last - recompute).abs().max()) <= 1e-4


def test_a_wrong_state_changes_the_continuation(model: HybridModel) -> None:
    """Guards the check itself: a state from another prefix gives different logits (it is really used)."""
    seq = tokens(60)
    prefix, own_logits = prefix_at(model, seq, 40)
    other, _ = prefix_at(model, tokens(60, seed=2), 40)
    wrong = dataclasses.replace(prefix, state=other.state)
    assert not torch.equal(model.prefill(seq, wrong).logits_last, own_logits)


def test_oracle_accepts_recorded_parts_and_names_each_mismatch(model: HybridModel) -> None:
    seq = tokens(48)
    own = model.prefill(seq, None, snapshot_at=40)
    oracle = HybridOracle(model, page_size=8)
    oracle.record(seq, own.cache, 0, 48, own.state_at)
    prefix, _ = prefix_at(model, seq, 40)
    assert oracle.check(seq, model.parts_from_prefix(prefix)).ok
    bad_swa = prefix.swa_kv.clone()
    bad_swa[0, 1, -1, 0, 0] += 1.0
    bad_state = prefix.state.clone()
    bad_state[0] ^= 1
    bad = dataclasses.replace(prefix, swa_kv=bad_swa, state=bad_state)
    assert oracle.check(seq, model.parts_from_prefix(bad)).mismatched == ("swa@4", "state")


def test_window_must_be_whole_pages() -> None:
    with pytest.raises(ValueError, match="multiple of the page size"):
        HybridDemoConfig(hybrid_demo_config(page_size=16), HybridSpec(sliding_window=9))


def test_small_hybrid_run_restores_every_component_bitwise() -> None:
    """Three users with their own system prompts, pools small enough to evict to storage: every request is
    identical to recompute, and prefixes come back with their window and state from host and storage.

    In lockstep (one request at a time, the cache settled in between) the hits depend on the workload only:
    under concurrency they shifted with the machine's load, and this test failed under heavy load.
    """
    config = HybridDemoConfig(
        hybrid_demo_config(
            users=3,
            turns=3,
            device_pages=48,
            host_pages=64,
            lockstep=True,
            workload=WorkloadSpec(
                system_prompts=3, system_prompt_tokens=128, user_tokens=(16, 40), decode_tokens=9
            ),
        ),
        swa_device_pages=12,
        swa_host_pages=24,
        state_device_slots=4,
        state_host_slots=8,
    )
    result = anyio.run(run_hybrid_demo, config)
    records = result.records
    assert len(records) == 9
    bad = [
        (r.request_id, r.kv_bitwise, r.same_split_bitwise, r.recompute_max_diff)
        for r in records
        if not r.identical
    ]
    assert not bad
    reused = [r for r in records if r.reused_len]
    assert len(reused) >= 4  # of the 6 returning turns
    assert all(r.turn > 0 for r in reused)  # a user's own earlier turn: states are per conversation
    assert any(r.hits["host"] for r in reused)
    assert any(r.hits["storage"] for r in reused)
    assert result.details["restored"]["states"] == len(reused)
    # Every request decodes past a page boundary, where its state is kept: no prefill is cut in two.
    assert result.details["restored"]["split_prefills"] == 0
    assert result.details["component_tree"]["mamba"]["host_slots"] >= 1


@pytest.mark.slow
def test_cli_hybrid_demo_json(tmp_path: Path) -> None:
    """`hicache demo --model hybrid --json` exits 0 with every request identical and the components listed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hicache.cli",
            "demo",
            "--model",
            "hybrid",
            "--users",
            "2",
            "--turns",
            "3",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert summary["requests"] == 6
    assert summary["identical"] == 6
    assert summary["hybrid"]["layer_types"].count("sliding_attention") == 2
    assert summary["hybrid"]["state_nbytes"] == HybridSpec().state_nbytes
