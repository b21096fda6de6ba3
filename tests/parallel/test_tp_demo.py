"""`hicache demo --tp N`: the tiny model on N gloo ranks, each caching its slice of the KV heads."""

from __future__ import annotations

import json

import pytest

from hicache.cli import main
from hicache.demo.tp import TPDemoConfig, TPDemoResult, run_tp_demo


def test_two_ranks_pass_every_check_and_save_what_one_rank_saves() -> None:
    """K/V bitwise on the gathered slices, logits bitwise, replies equal to recompute, the ranks' cached
    lengths and trees equal after every request; storage hits included; the same savings as TP 1."""
    config = TPDemoConfig(tp=2, users=3, turns=3)
    two = run_tp_demo(config)
    assert two.failures == []
    assert two.all_identical
    assert two.hits["storage"] > 0
    one = run_tp_demo(TPDemoConfig(tp=1, users=3, turns=3))
    assert one.all_identical
    assert (two.saved_tokens, two.hits) == (one.saved_tokens, one.hits)


@pytest.mark.parametrize("tp", ["3", "0"])
def test_a_tp_size_that_does_not_divide_the_heads_is_refused(
    tp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--tp", tp]) == 2
    assert "--tp" in capsys.readouterr().err


def test_the_json_result_carries_every_field_with_the_wall_time_rounded() -> None:
    result = TPDemoResult(
        tp=2,
        requests=3,
        prompt_tokens=90,
        saved_tokens=40,
        hits={"device": 40},
        all_identical=True,
        failures=[],
        wall_s=1.23456,
    )
    assert json.loads(json.dumps(result.to_json())) == {
        "tp": 2,
        "requests": 3,
        "prompt_tokens": 90,
        "saved_tokens": 40,
        "hits": {"device": 40},
        "all_identical": True,
        "failures": [],
        "wall_s": 1.235,
    }
