"""`AgreedLayerReadiness` over a CUDA copy's readiness (its events stubbed, no GPU): each rank waits for
the whole enqueue (launches only) before one collective, so a forward costs one readiness collective per
load, and an enqueue that stopped short on one rank makes the same layer raise on every rank."""

from __future__ import annotations

import readiness_workers

from hicache.parallel.launch import run_ranks


def test_a_fully_enqueued_copy_costs_one_collective_per_forward() -> None:
    out = run_ranks(readiness_workers.forward_over_cuda_copy, 2, ([4, 4],), timeout_s=120)
    assert all(o.ok for o in out), [(o.rank, o.error) for o in out]
    for o in out:
        assert o.value == {"failed": -1, "collectives": 1, "stream_waits": [0, 1, 2, 3]}


def test_an_enqueue_short_on_one_rank_raises_at_the_same_layer_on_every_rank() -> None:
    """Rank 1's enqueue stopped after 2 layers: both ranks' streams wait for layers 0 and 1 only, and
    `wait_layer(2)` raises on both, after one collective."""
    out = run_ranks(readiness_workers.forward_over_cuda_copy, 2, ([4, 2],), timeout_s=120)
    assert all(o.ok for o in out), [(o.rank, o.error) for o in out]
    for o in out:
        assert o.value == {"failed": 2, "collectives": 1, "stream_waits": [0, 1]}


def test_a_copy_finishing_while_a_rank_looks_is_not_reported_stopped_short() -> None:
    """Guards against reading whether the copy stopped after counting its landed layers: a copy that
    finished in between was reported as stopped at the stale count, and every later layer raised
    `LoadBackFailed` on every rank although every layer had landed."""
    out = run_ranks(readiness_workers.forward_over_finishing_copy, 2, (), timeout_s=120)
    assert all(o.ok for o in out), [(o.rank, o.error) for o in out]
    for o in out:
        assert o.value == {"failed": -1, "collectives": 1}


def test_the_group_itself_is_refused_as_its_readiness_group() -> None:
    """Guards against one process group carrying both the agreement's steps (event loop) and the
    readiness collectives (the model's thread): their collectives could pair up across the ranks."""
    out = run_ranks(readiness_workers.readiness_group_is_the_group_itself, 2, (), timeout_s=120)
    assert all(o.ok for o in out), [(o.rank, o.error) for o in out]
    for o in out:
        assert o.value.startswith("readiness_process_group: must be a second process group")


def test_a_load_dropped_on_one_rank_though_every_layer_landed_raises_on_every_rank() -> None:
    """Guards against a load dropped although every layer landed (cancelled after its copy, or the
    agreement failed): its pages were freed, yet every rank's readiness said its layers were ready and a
    forward starting then read pages that were no longer its KV. Now the revoked rank offers none."""
    out = run_ranks(readiness_workers.forward_over_a_load_revoked_on_one_rank, 2, (), timeout_s=120)
    assert all(o.ok for o in out), [(o.rank, o.error) for o in out]
    for o in out:
        assert o.value == {"failed": 0, "collectives": 1}
