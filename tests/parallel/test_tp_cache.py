"""`HiCache` on 2 and 4 gloo ranks: the ranks agree every decision that depends on rank-local facts.

Each test spawns the ranks (`run_ranks`, with a watchdog that kills them and fails the test rather than
hanging). The workload is drawn from a seed shared by the ranks; faults, slowness and cancellations hit
one rank only. After every request the ranks compare tree fingerprints (`sanity_check(across_ranks=True)`)
and cached lengths, and each checks the KV it got against its own content oracle.
"""

from __future__ import annotations

from pathlib import Path

import cache_workers
import pytest

from hicache.parallel.launch import run_ranks

WATCHDOG_S = 240.0
FAULTS = {"miss_p": 0.25, "error_p": 0.1, "short_p": 0.3}


def _ok(outcomes: list) -> None:  # type: ignore[type-arg]
    assert all(o.ok for o in outcomes), [(o.rank, o.error_type, o.error) for o in outcomes if not o.ok]


def test_storage_faults_on_one_rank_shorten_every_ranks_prefix(tmp_path: Path) -> None:
    """Rank 1's storage drops pages, fails reads and undercounts lookups; rank 0's is healthy and its
    event loop is kept busy. Both get the same cached lengths and hits from every tier, and identical
    trees after every request."""
    out = run_ranks(
        cache_workers.random_workload,
        2,
        (str(tmp_path), 3, 1, 40, FAULTS, None, 0),
        timeout_s=WATCHDOG_S,
    )
    _ok(out)
    assert out[1].value["faults"] > 0
    assert out[0].value["checks"] == out[1].value["checks"] > 40 * 3
    assert out[0].value["hits"] == out[1].value["hits"]
    assert out[0].value["hits"]["storage"] > 0


def test_four_ranks_with_one_slow_and_faulty_storage_whose_prefetches_time_out(tmp_path: Path) -> None:
    """Four ranks; rank 2's storage is slow and faulty and its prefetches hit their 50 ms timeout while
    the others' complete: no divergence, no hang, the same hits on every rank."""
    faults = dict(FAULTS, slow_s=0.1)  # each read outlasts the timeout (0.03 did not: reads overlap)
    timeouts = {
        "prefetch_stop_policy": "timeout",
        "prefetch_timeout_base": 0.05,
        "prefetch_timeout_per_1k_tokens": 0.0,
        "prefetch_timeout_max": 0.05,
    }
    out = run_ranks(
        cache_workers.random_workload, 4, (str(tmp_path), 5, 2, 16, faults, timeouts), timeout_s=WATCHDOG_S
    )
    _ok(out)
    assert len({repr(o.value["hits"]) for o in out}) == 1
    assert out[2].value["faults"] > 0
    assert out[2].value["stopped_short"] > 0  # every read there outlasts the timeout: they did time out


def test_a_cancelled_acquire_on_one_rank_while_the_other_commits(tmp_path: Path) -> None:
    """Rank 0's acquire is cancelled mid-prefetch; rank 1's prefetch completes. The commit agrees 0
    pages: rank 1 attaches nothing, both trees agree, and no prefetch page stays held."""
    out = run_ranks(cache_workers.cancel_on_one_rank, 2, (str(tmp_path), 0), timeout_s=WATCHDOG_S)
    _ok(out)
    assert out[1].value["cached"] == 0
    assert out[0].value["tree_nodes"] == out[1].value["tree_nodes"] == 0
    assert out[0].value["host_used"] == out[1].value["host_used"] == 0


def test_a_rank_killed_mid_prefetch_makes_the_others_raise_and_release(tmp_path: Path) -> None:
    """Rank 1 exits while its prefetch reads; rank 0's acquire raises RankFailed within the group
    timeout, and its cache then holds no prefetch and passes its own sanity check."""
    out = run_ranks(
        cache_workers.killed_mid_prefetch, 2, (str(tmp_path), 1), timeout_s=WATCHDOG_S, group_timeout_s=5.0
    )
    assert out[1].exitcode == 23
    _ok(out[:1])
    assert out[0].value == {"error": "RankFailed", "in_flight": 0, "prefetch_tokens": 0}


def test_ranks_with_different_page_sizes_refuse_to_start(tmp_path: Path) -> None:
    """Pages of 8 tokens on one rank and 4 on the other cannot make identical trees: refused everywhere."""
    out = run_ranks(cache_workers.unequal_pages, 2, (str(tmp_path),), timeout_s=WATCHDOG_S)
    _ok(out)
    for o in out:
        assert o.value.startswith("tp_group: every rank needs the same page_size")
        assert "[4, 8]" in o.value


def test_a_smaller_host_pool_on_one_rank_never_diverges(tmp_path: Path) -> None:
    """Rank 1's host pool is half of rank 0's and its storage is faulty: host evictions, backups' host
    room and prefetch buffers are agreed, so the trees agree after every call, and nothing hangs."""
    per_rank = {"per_rank": {"1": {"host_pages": 12}}}
    out = run_ranks(
        cache_workers.random_workload, 2, (str(tmp_path), 11, 1, 30, FAULTS, per_rank), timeout_s=WATCHDOG_S
    )
    _ok(out)
    assert out[0].value["hits"] == out[1].value["hits"]
    assert out[0].value["checks"] == out[1].value["checks"] > 30 * 3
    assert out[0].value["host_tokens"] == out[1].value["host_tokens"]


def test_a_smaller_device_pool_on_one_rank_never_diverges(tmp_path: Path) -> None:
    """Rank 0's device pool is smaller (12 pages, rank 1's 16) and rank 1's storage is faulty: device
    evictions are agreed (the most any rank lacks), so the ranks allocate, evict and back up alike."""
    per_rank = {"per_rank": {"0": {"device_pages": 12}}}
    out = run_ranks(
        cache_workers.random_workload, 2, (str(tmp_path), 12, 1, 30, FAULTS, per_rank), timeout_s=WATCHDOG_S
    )
    _ok(out)
    assert out[0].value["hits"] == out[1].value["hits"]
    assert out[0].value["hits"]["host"] > 0  # device pressure pushed prefixes to host and back


def test_a_backup_that_fails_on_one_rank_backs_up_nothing_anywhere(tmp_path: Path) -> None:
    """Rank 1's backup copy fails: after the agreeing step SEQ is backed up on no rank and every rank's
    host pages went back to its pool; the next backup succeeds on both."""
    out = run_ranks(cache_workers.backup_fails_on_one_rank, 2, (str(tmp_path), 1), timeout_s=WATCHDOG_S)
    _ok(out)
    for o in out:
        assert o.value["host_tokens"] == 0
        assert o.value["host_used"] == 0
        assert o.value["pending"] == 0
        assert o.value["then_host_tokens"] == 6 * cache_workers.PAGE
    assert out[0].value == out[1].value


def test_a_backup_is_pending_on_every_rank_until_every_copy_landed(tmp_path: Path) -> None:
    """Rank 1's copy is held back while rank 0's lands: the node is backed up on neither until the
    step that agrees it (the trees agree meanwhile), then on both."""
    out = run_ranks(cache_workers.backup_lands_on_one_rank_first, 2, (str(tmp_path), 1), timeout_s=WATCHDOG_S)
    _ok(out)
    for o in out:
        assert o.value["pending"] == len(cache_workers.SEQ)
        assert o.value["host_during"] == 0
        assert o.value["host_after"] == len(cache_workers.SEQ)
        assert o.value["pending_after"] == 0


def test_a_load_back_that_fails_on_one_rank_loads_nothing_anywhere(tmp_path: Path) -> None:
    """Rank 1's host-to-device copy fails: its acquire raises; rank 0 frees its finished copy and gets
    no host hit, and the trees agree afterwards. The next acquire loads the prefix back on both."""
    out = run_ranks(cache_workers.load_back_fails_on_one_rank, 2, (str(tmp_path), 1), timeout_s=WATCHDOG_S)
    _ok(out)
    assert out[1].value == {"error": "injected: host-to-device copy failed", "then_host_hit": 40}
    assert out[0].value == {"cached": 0, "host_hit": 0, "then_host_hit": 40}


def test_the_cross_rank_check_does_not_block_the_event_loop(tmp_path: Path) -> None:
    """`sanity_check_async(across_ranks=True)`: rank 0's loop runs other tasks while it waits for rank 1
    in the collective (rank 1 calls only after seeing that), and a difference still raises on both."""
    out = run_ranks(cache_workers.cross_rank_check_off_the_loop, 2, (str(tmp_path),), timeout_s=WATCHDOG_S)
    _ok(out)
    for o in out:
        assert o.value["error"].startswith("TreeDivergence: rank ")
        assert "device_lock=1" in o.value["error"]


@pytest.mark.parametrize("failing", [None, 1])
def test_a_refill_below_an_unbacked_prefix_is_rescued_on_every_rank_or_none(
    tmp_path: Path, failing: int | None
) -> None:
    """`refill_under_unbacked=backup_then_attach` under TP: the rescue's backup is agreed. With every
    copy working, every rank backs the prefix up and attaches the refill; when rank 1's copy fails, no
    rank does, and every rank drops the refill (the same cached length everywhere)."""
    out = run_ranks(
        cache_workers.refill_rescued_on_every_rank, 2, (str(tmp_path), failing), timeout_s=WATCHDOG_S
    )
    _ok(out)
    assert out[0].value == out[1].value
    if failing is None:
        assert out[0].value == {"cached": 40, "storage_hit": 24, "rescued": True, "drop": None}
    else:
        assert out[0].value == {
            "cached": 16,
            "storage_hit": 0,
            "rescued": False,
            "drop": "anchor_not_backed_up",
        }


def test_four_ranks_with_different_host_and_device_pools_never_diverge(tmp_path: Path) -> None:
    """Four ranks: rank 1's host pool and rank 3's device pool are smaller, rank 2's storage faulty:
    every pool-dependent decision is agreed, the trees agree after every call, the hits on every rank."""
    per_rank = {"per_rank": {"1": {"host_pages": 12}, "3": {"device_pages": 12}}}
    out = run_ranks(
        cache_workers.random_workload, 4, (str(tmp_path), 13, 2, 16, FAULTS, per_rank), timeout_s=WATCHDOG_S
    )
    _ok(out)
    assert len({repr(o.value["hits"]) for o in out}) == 1
    assert len({o.value["checks"] for o in out}) == 1
    assert len({o.value["host_tokens"] for o in out}) == 1


@pytest.mark.parametrize(("why", "reason"), [("error", "storage_error"), ("capacity", "capacity")])
def test_a_prefetch_skipped_on_one_rank_is_skipped_on_every_rank_with_that_ranks_reason(
    tmp_path: Path, why: str, reason: str
) -> None:
    """Rank 1's storage lookup fails, or its capacity cannot take the hit; rank 0 would admit the
    prefetch. Every rank skips alike (nothing cached, the trees equal) and reports rank 1's reason, an
    agreed skip code: before one admission path for 1 and N ranks, N ranks reported `storage_miss`."""
    out = run_ranks(cache_workers.skip_reason_on_one_rank, 2, (str(tmp_path), 1, why), timeout_s=WATCHDOG_S)
    _ok(out)
    assert [o.value for o in out] == [{"cached": 0, "skipped": reason}] * 2


def test_a_pending_backup_split_by_a_later_request_commits_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's copies are held while a second request splits the first one's pending node: once they
    land and the ranks agree, both requests are backed up on every rank, nothing skipped or aborted."""
    out = run_ranks(
        cache_workers.pending_backup_split_on_every_rank, 2, (str(tmp_path), 1), timeout_s=WATCHDOG_S
    )
    _ok(out)
    for o in out:
        assert o.value["pending"] == 8 * cache_workers.PAGE
        assert o.value["host_after"] == 8 * cache_workers.PAGE
        assert o.value["pending_after"] == 0
        assert o.value["backed"] == [1, 1]
        assert o.value["skipped"] == 0
    assert out[0].value == out[1].value


def test_alloc_device_waits_for_a_begun_backup_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's copy is held while every rank asks for every device page, held only by the pending
    node: every rank gets them once the backup is agreed (the node demoted, its host copy kept)."""
    out = run_ranks(
        cache_workers.alloc_waits_for_pending_backups, 2, (str(tmp_path), 1), timeout_s=WATCHDOG_S
    )
    _ok(out)
    for o in out:
        assert o.value["pending"] == 6 * cache_workers.PAGE
        assert o.value["taken"] == 16 * cache_workers.PAGE
        assert o.value["host"] == 6 * cache_workers.PAGE
    assert out[0].value == out[1].value
