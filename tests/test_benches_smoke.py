"""Every bench in `bench/` runs: its `--smoke` pass (one tiny pass, no baselines) in a subprocess, and the
last line it prints is the JSON object a full run prints, with the bench's keys.

Guards against benchmarks that rot unseen (issue 22: `bench_s3.py` asserted a 40-byte page header for a
whole format version, and no test ran 7 of the 10 benches). The figures of a smoke pass mean nothing;
only that the bench ran through and reported what it reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "bench").glob("bench_*.py"))

KEYS: dict[str, set[str]] = {
    "faults": {
        "acquire_ms_p99_storage_down", "soak_storage_write_fraction", "stuck_read_acquire_return_ms",
        "stuck_read_settled", "writes_shed", "goals_met", "acquire_alone_loop_iterations_storage_hit",
        "acquire_alone_loop_cpu_us_probe_miss",
    },
    "io": {
        "total_mib", "threads", "ratio_1mib_hot", "ratio_64kib_cold", "ratio_1mib_hot_controller",
        "max_loop_stall_ms", "max_loop_stall_ms_controller", "loop_cpu_ratio_controller_vs_backend_max",
        "busy", "pacer", "reader_nice",
    },
    "layerwise": {
        "device", "prefix_tokens", "suffix_tokens", "repeats", "ttft_ms_layerwise", "ttft_ms_whole",
        "copy_hidden_fraction", "copy_ms", "compute_ms", "acquire_ms_layerwise", "gather_gbps", "whole_gbps",
        "host_hit_acquire_us_p50_layerwise", "host_hit_acquire_us_p50_whole", "host_hit_acquire_ratio",
        "host_hit_request_us_p50_layerwise", "host_hit_request_us_p50_whole", "host_hit_request_ratio",
    },
    "network": {
        "gbps_1mib_valkey", "gbps_1mib_mooncake", "ratio_64kib_valkey", "ratio_64kib_mooncake",
        "max_loop_stall_ms_valkey", "max_loop_stall_ms_mooncake",
    },
    "ownership": {"requests", "insert_us", "cycle_us", "free_alloc_32_pages_us", "ownership_check_us"},
    "refill": {"requests", "tokens_per_request", "drop", "backup_then_attach", "seconds"},
    "s3": {
        "page_bytes", "pages", "ratio_1mib_moto", "raw_gbps_moto", "backend_gbps_moto",
        "ratio_1mib_juicefs", "raw_gbps_juicefs", "backend_gbps_juicefs",
    },
    "tp": {
        "iterations", "backend", "agree_us_p50_tp1", "agree_us_p50_tp2", "agree_us_p50_tp4",
        "raw_all_gather_us_p50_tp4", "raw_all_reduce_min_us_p50_tp4", "saved_tokens_tp1", "saved_tokens_tp4",
        "savings_identical", "layerwise_request_us_p50_tp4", "hybrid_steps_per_request_tp4",
        "goal_agree_p50_tp4_under_1ms",
    },
    "tree": {
        "match_us", "insert_us", "evict_us_per_page", "acquire_device_hit_us_p50", "scaling_match",
        "vs_sglang_match", "reps",
    },
    "transfer": {
        "device", "pinned", "total_mib", "repeats", "backup_ratio_2mib", "load_ratio_2mib",
        "backup_ratio_128kib", "load_ratio_128kib", "controller_backup_ratio_2mib",
        "controller_load_ratio_2mib", "max_loop_stall_ms", "max_loop_stall_ms_controller",
    },
    "vllm": {
        "requests", "identical", "hit_tokens_host", "hit_tokens_storage", "ttft_p50_ms_vllm",
        "ttft_p50_ms_example_connector", "ttft_p50_ms_hicache", "ttft_p50_ratio_vs_vllm",
        "ttft_p50_ratio_vs_example_connector", "scheduler_lookup_us_p50",
    },
}  # fmt: skip
"""What each bench's final JSON line holds (besides `"bench": NAME`), in a smoke pass as in a full run."""

SLOW = {"tp", "vllm"}
"""Benches whose smoke pass starts processes: tp 1, 2 and 4 gloo ranks for its loops, then for the demo;
vllm three engines (alone, ExampleConnector, HiCacheConnector) in the vLLM environment."""


def _param(name: str) -> object:
    marks: list[pytest.MarkDecorator] = []
    if name in SLOW:
        marks += [pytest.mark.slow, pytest.mark.timeout(900)]
    return pytest.param(name, marks=marks, id=name)


def test_every_bench_is_run_here() -> None:
    """Guards the parametrized test against a glob that finds nothing."""
    assert {
        "faults",
        "io",
        "layerwise",
        "network",
        "ownership",
        "refill",
        "s3",
        "tp",
        "transfer",
        "tree",
        "vllm",
    } <= set(BENCHES)


@pytest.mark.parametrize("name", [_param(n) for n in BENCHES])
def test_the_bench_smoke_pass_reports_its_keys(name: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"bench_{name}.py"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=840 if name in SLOW else 280,
        check=False,
    )
    assert done.returncode == 0, f"bench_{name}.py --smoke failed:\n{done.stderr[-4000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"bench_{name}.py --smoke printed nothing"
    result = json.loads(lines[-1])
    assert result["bench"] == name
    missing = KEYS.get(name, set()) - set(result)
    assert not missing, f"bench_{name}.py --smoke lacks {sorted(missing)}"


@pytest.mark.parametrize("pacer", [True, False], ids=["pacer", "no-pacer"])
def test_bench_io_switches_the_pacer_off_for_its_ab(pacer: bool) -> None:
    """`bench_io.py --no-pacer` is the pacer's A/B (BENCHMARKS.md cited a script outside the repository):
    with the flag no controller turn waits for another's, without it the two prefetches started together
    take turns. `--reader-nice` (the read threads' nice A/B) rides along: the run reports what it used."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    args = ["--smoke", "--page-kib", "64", "--states", "hot"]
    args += [] if pacer else ["--no-pacer", "--reader-nice", "3"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_io.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, f"bench_io.py {' '.join(args)} failed:\n{done.stderr[-4000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["pacer"] is pacer
    assert result["reader_nice"] == (10 if pacer else 3)
    queued = result["passes"]["64kib_hot"]["controller_pacer_queued"]
    assert (queued > 0) if pacer else (queued == 0), queued
