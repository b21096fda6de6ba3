"""Layer-wise load-back on 2 and 4 gloo ranks: every rank's `wait_layer(i)` returns, or raises, alike,
and a load lands or is dropped on every rank at the same agreement step.

Without this, a copy that failed on one rank would make that rank's forward raise at layer i while
another rank ran layer i and then waited forever in the model's own collective; and the failed rank would
drop the prefix from its tree while the others kept it. Each test spawns the ranks under a watchdog.
"""

from __future__ import annotations

from pathlib import Path

import layerwise_workers
import pytest

from hicache.parallel.launch import run_ranks

WATCHDOG_S = 240.0


def _ok(outcomes: list) -> None:  # type: ignore[type-arg]
    assert all(o.ok for o in outcomes), [(o.rank, o.error_type, o.error) for o in outcomes if not o.ok]


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_a_copy_that_fails_on_one_rank_makes_wait_layer_raise_on_every_rank(
    tmp_path: Path, layer: int
) -> None:
    """Rank 1's copy fails at `layer` (the first, a middle, the last); rank 0's lands. Both forwards
    read the layers below and raise at `layer`; both fail the load at the same step, touching nothing in
    the tree (trees compared after every call), refuse its insert, and load SEQ from host again on the
    next acquire."""
    out = run_ranks(
        layerwise_workers.copy_fails_on_one_rank, 2, (str(tmp_path), 1, layer), timeout_s=WATCHDOG_S
    )
    _ok(out)
    first, second = out[0].value, out[1].value
    assert second["faults"] == 1
    assert first["faults"] == 0
    assert first["failed"] == second["failed"] == layer
    assert first["host_hit"] == second["host_hit"] == len(layerwise_workers.SEQ)
    assert first["insert"] == second["insert"] == "LoadBackFailed"
    assert first["device_after"] == second["device_after"] == first["device_during"]
    assert first["again"] == second["again"]
    assert first["again"]["cached"] == len(layerwise_workers.SEQ)
    assert first["again"]["failed_first"] == -1


def test_a_layer_is_ready_only_once_it_landed_on_every_rank(tmp_path: Path) -> None:
    """Rank 0's copy is held before layer 1 until its own forward waits for it; rank 1's forward waits
    in `wait_layer(1)` meanwhile instead of running ahead. Both read every layer, the same number of
    readiness collectives, and the load lands on both."""
    out = run_ranks(layerwise_workers.slow_copy_on_one_rank, 2, (str(tmp_path), 0), timeout_s=WATCHDOG_S)
    _ok(out)
    assert out[0].value == out[1].value
    assert out[0].value["failed"] == -1
    assert out[0].value["host_hit"] == len(layerwise_workers.SEQ)
    assert out[0].value["collectives"] >= 1


@pytest.mark.parametrize(("size", "fault_rank", "seed"), [(2, 1, 5), (4, 2, 7)])
def test_random_workloads_with_copy_faults_on_one_rank_never_diverge(
    tmp_path: Path, size: int, fault_rank: int, seed: int
) -> None:
    """Random workloads with layer-wise load-back on and each layer's copy failing at random on one
    rank: the same failed layers, cached lengths and retries on every rank, identical trees after every
    cache call, and every layer read is the rank's own KV."""
    out = run_ranks(
        layerwise_workers.random_layerwise_workload,
        size,
        (str(tmp_path), seed, fault_rank, 30 if size == 2 else 14, 0.06),
        timeout_s=WATCHDOG_S,
    )
    _ok(out)
    values = [o.value for o in out]
    assert values[fault_rank]["faults"] > 0
    assert values[0]["failed_loads"] > 0
    for key in ("failed_loads", "retried", "cached", "device_tokens"):
        assert len({v[key] for v in values}) == 1, (key, values)


def test_a_peer_that_dies_mid_forward_makes_wait_layer_raise_rank_failed(tmp_path: Path) -> None:
    """Rank 1 exits after its acquire attached a layer-wise load: rank 0's `wait_layer` raises
    `RankFailed` within the group timeout, and so does its next `tp_sync`; the failed agreement drops
    the load, and rank 0's cache passes its own sanity check."""
    out = run_ranks(
        layerwise_workers.peer_dies_during_forward,
        2,
        (str(tmp_path), 1),
        timeout_s=WATCHDOG_S,
        group_timeout_s=5.0,
    )
    assert out[1].exitcode == 23
    _ok(out[:1])
    assert out[0].value["errors"] == ["RankFailed", "RankFailed"]


def test_a_load_failing_under_a_prefix_inserted_meanwhile_touches_nothing_on_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 1's copy fails while a request that computed the prefix and a page more inserted it and a
    lease holds all of it (before: the kept path, poisoned and copied again): both ranks' loading
    forwards raise at the same layer, the holder reads the inserted KV on both, only the loading lease's
    insert is refused, and the prefix is a correct device hit on both, with identical trees after every
    call."""
    out = run_ranks(layerwise_workers.kept_below_a_failed_load, 2, (str(tmp_path), 1), timeout_s=WATCHDOG_S)
    _ok(out)
    assert out[0].value == out[1].value
    value = out[0].value
    assert value["held"] == len(layerwise_workers.SEQ) + 4
    assert value["failed"] == [1, -1]
    assert value["refused"] == 1
    assert value["device_hit"] == len(layerwise_workers.SEQ) + 4
    assert value["correct"]
