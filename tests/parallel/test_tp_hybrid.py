"""Hybrid components (a sliding window and a Mamba state) on 2 gloo ranks: each rank keeps its own shard
of component state, and every decision that depends on a rank's component pools, copies or storage is
agreed, so a component missing on any rank is missing on every rank.

The workload is drawn from a seed shared by the ranks; component faults (copies that fail, pages storage
drops) hit one rank only. After every cache call the ranks compare tree fingerprints, which include each
node's component tiers, and each checks that every page of every pool has one owner and that every
component value it is handed is its own, of that prefix.
"""

from __future__ import annotations

from pathlib import Path

import hybrid_workers
import pytest

from hicache import HiCache
from hicache.parallel.launch import run_ranks
from tests.parallel.cache_workers import PAGE, tp_config

WATCHDOG_S = 300.0
FAULTS = {"copy_p": 0.15, "miss_p": 0.3, "short_p": 0.2}


def _ok(outcomes: list) -> None:  # type: ignore[type-arg]
    assert all(o.ok for o in outcomes), [(o.rank, o.error_type, o.error) for o in outcomes if not o.ok]


@pytest.mark.parametrize("seed", [3, 8])
def test_hybrid_workloads_with_component_faults_on_one_rank_never_diverge(tmp_path: Path, seed: int) -> None:
    """Rank 1's component copies (backups and load-backs) fail at random and its storage drops component
    pages: the ranks agree every component backup, load, staged read and eviction, so the trees (with
    their component tiers) agree after every call and the cached lengths and hits are the same."""
    out = run_ranks(
        hybrid_workers.hybrid_workload, 2, (str(tmp_path), seed, 1, 36, FAULTS), timeout_s=WATCHDOG_S
    )
    _ok(out)
    assert out[0].value["hits"] == out[1].value["hits"]
    assert out[0].value["checks"] == out[1].value["checks"] > 36 * 4
    assert out[0].value["component_slots"] == out[1].value["component_slots"]
    assert out[1].value["copy_failures"] + out[1].value["storage_faults"] > 0
    assert sum(out[0].value["hits"].values()) > 0  # prefixes were reused (which tier: load-dependent)


def test_smaller_component_pools_on_one_rank_never_diverge(tmp_path: Path) -> None:
    """Rank 0's window and state pools are smaller than rank 1's: component evictions are agreed (the
    most any rank lacks), so both evict the same values and keep the same component tiers."""
    per_rank = {"0": {"swa_pages": 3, "state_slots": 2}}
    out = run_ranks(
        hybrid_workers.hybrid_workload,
        2,
        (str(tmp_path), 5, 0, 30, {}, per_rank),
        timeout_s=WATCHDOG_S,
    )
    _ok(out)
    assert out[0].value["hits"] == out[1].value["hits"]
    assert out[0].value["component_slots"] == out[1].value["component_slots"]


def test_a_dead_peer_makes_an_agreed_component_allocation_raise_rank_failed(tmp_path: Path) -> None:
    """Rank 1 exits after a hybrid request: rank 0's `alloc_components_async` raises `RankFailed` within
    the group timeout, and its cache is still sane. (The synchronous `alloc_component`, which would evict
    on this rank's own pool facts, is refused under TP, naming the call to make instead.)"""
    out = run_ranks(
        hybrid_workers.hybrid_dead_peer, 2, (str(tmp_path), 1), timeout_s=WATCHDOG_S, group_timeout_s=5.0
    )
    assert out[1].exitcode == 23
    _ok(out[:1])
    assert out[0].value["error"] == "RankFailed"
    assert out[0].value["refused"].startswith("alloc_component: under tensor parallelism")
    assert "alloc_components_async" in out[0].value["refused"]


@pytest.mark.parametrize(
    ("faults", "skipped", "drop"),
    [({"short_p": 1.0}, "component_miss", None), ({"miss_p": 1.0}, None, "component_incomplete")],
)
def test_a_prefetch_whose_components_are_incomplete_on_one_rank_is_dropped_on_every_rank(
    tmp_path: Path, faults: dict[str, float], skipped: str | None, drop: str | None
) -> None:
    """Rank 1's storage lacks the component pages of a stored prefix (its lookup finds them short, or its
    reads miss them), rank 0's has them: rank 0 must not attach the prefix alone. The staged lookup is
    agreed (every rank skips) and the commit counts no page of a rank whose components are incomplete
    (every rank drops): the same outcome and cached length on both, the trees equal."""
    out = run_ranks(
        hybrid_workers.component_pages_missing_on_one_rank,
        2,
        (str(tmp_path), 1, faults),
        timeout_s=WATCHDOG_S,
    )
    _ok(out)
    assert out[1].value["faults"] > 0
    for o in out:
        assert (o.value["cached"], o.value["skipped"], o.value["drop"]) == (0, skipped, drop)


def test_a_prefetch_with_every_component_page_on_every_rank_lands_on_every_rank(tmp_path: Path) -> None:
    """The control of the test above, so that it cannot pass with the agreed staging always skipping:
    with every rank's storage healthy the staged lookup agrees, the prefetch commits on both ranks and
    each caches the whole prefix with its own window and state (`check_lease`), the trees equal."""
    out = run_ranks(
        hybrid_workers.component_pages_missing_on_one_rank,
        2,
        (str(tmp_path), 1, {}),
        timeout_s=WATCHDOG_S,
    )
    _ok(out)
    for o in out:
        assert (o.value["cached"], o.value["skipped"], o.value["drop"]) == (
            len(hybrid_workers.HYBRID_SEQ),
            None,
            None,
        )


def test_ranks_with_different_windows_refuse_to_start(tmp_path: Path) -> None:
    """A window of 8 tokens on one rank and 12 on the other would end prefixes at different nodes:
    refused on every rank, naming `tp_group`."""
    out = run_ranks(hybrid_workers.unequal_windows, 2, (str(tmp_path),), timeout_s=WATCHDOG_S)
    _ok(out)
    for o in out:
        assert o.value.startswith("tp_group: every rank needs the same hybrid components")


async def test_alloc_components_async_on_one_rank_is_alloc_component_for_each() -> None:
    """With one rank there is nothing to agree: each component's slots come as from `alloc_component`
    (None when its pool cannot take them), and an unknown name is refused naming `name`."""
    config = tp_config(None, 0, 1, components=hybrid_workers.components(swa_pages=4, state_slots=2))
    async with HiCache(config) as cache:
        got = await cache.alloc_components_async({"swa": 2 * PAGE, "mamba": 1})
        assert {name: None if t is None else int(t.numel()) for name, t in got.items()} == {
            "swa": 2 * PAGE,
            "mamba": 1,
        }
        too_many = await cache.alloc_components_async({"swa": 4 * PAGE})
        assert too_many == {"swa": None}  # 2 of its 4 pages are held above: nothing to evict
        with pytest.raises(ValueError, match=r"^name: unknown component 'conv'"):
            await cache.alloc_components_async({"conv": 1})
        held = {name: [t] for name, t in got.items() if t is not None}
        cache.sanity_check(held_components=held)  # the caller holds exactly those slots
