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


def test_two_ranks_with_and_without_layerwise_load_back_save_the_same() -> None:
    """The TP demo loads host hits back layer by layer (each rank's forward waits for every layer,
    agreed across the ranks); loading whole instead serves the same hits, and both pass every check."""
    layerwise = run_tp_demo(TPDemoConfig(tp=2, users=3, turns=3))
    whole = run_tp_demo(TPDemoConfig(tp=2, users=3, turns=3, layerwise=False))
    assert layerwise.failures == whole.failures == []
    assert layerwise.hits["host"] > 0
    assert (layerwise.saved_tokens, layerwise.hits) == (whole.saved_tokens, whole.hits)


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
        "agreement_steps": 0,
    }


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--model", "hybrid"], "--model"),
        (["--system-prompts", "2"], "--system-prompts"),
        (["--write-policy", "write_back"], "--write-policy"),
        (["--refill-policy", "backup_then_attach"], "--refill-policy"),
        (["--plot", "hits.png"], "--plot"),
        (["--snapshot", "state.json"], "--snapshot"),
        (["--metrics-port", "9999"], "--metrics-port"),
    ],
)
def test_a_flag_the_tp_demo_does_not_support_is_refused_by_name(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `--tp` silently ignored these flags. Each is refused, naming the flag; nothing runs."""
    assert main(["demo", "--tp", "2", *argv]) == 2
    assert f"hicache demo: {flag} is not supported with --tp" in capsys.readouterr().err


def test_the_tp_demo_honours_the_workload_and_pool_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--users, --turns, --seed, --device-pages and --host-pages reach the TP demo's config as given
    (before: users and turns were clamped to 4 and 3, the pool sizes ignored)."""
    seen: list[TPDemoConfig] = []

    def record(config: TPDemoConfig, root: str | None) -> TPDemoResult:
        seen.append(config)
        return TPDemoResult(2, 0, 0, 0, {}, True, [], 0.0)

    monkeypatch.setattr("hicache.demo.tp.run_tp_demo", record)
    argv = ["--users", "7", "--turns", "5", "--seed", "3", "--device-pages", "40", "--host-pages", "50"]
    assert main(["demo", "--tp", "2", "--lockstep", *argv]) == 0
    config = seen[0]
    assert (config.tp, config.users, config.turns, config.seed) == (2, 7, 5, 3)
    assert (config.device_pages, config.host_pages) == (40, 50)
    assert main(["demo", "--tp", "2", "--host-pages", "0"]) == 2
    assert "--host-pages must be >= 1, got 0" in capsys.readouterr().err


def test_the_tp_demo_serves_the_users_and_turns_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    """A real run on one rank: 2 users x 1 turn is 2 requests, every check passing."""
    assert main(["demo", "--tp", "1", "--users", "2", "--turns", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["requests"] == 2
    assert out["all_identical"] is True
