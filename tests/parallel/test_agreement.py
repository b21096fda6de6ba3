"""The batched agreement step on real gloo ranks (spawned processes on 127.0.0.1).

Every test runs under `run_ranks`' watchdog: a hang fails the test (the ranks are killed) instead of
hanging CI. The single-rank tests run in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import anyio
import pytest
import torch
import tp_workers

from hicache.parallel import Agreement, RankDivergence, RankFailed, RankGroup
from hicache.parallel.agreement import encode_max
from hicache.parallel.launch import run_ranks

WATCHDOG_S = 120.0


def test_the_agreed_value_is_the_minimum_on_every_rank() -> None:
    """Two ranks settle 20 decisions in their own random orders and paces, 8 slots per step."""
    out = run_ranks(tp_workers.minimum_of_rank_values, 2, (20, 1), timeout_s=WATCHDOG_S)
    assert all(o.ok for o in out), [o.error for o in out]
    a, b = out[0].value, out[1].value
    assert a["agreed"] == b["agreed"] == [min(x, y) for x, y in zip(a["local"], b["local"], strict=True)]
    assert a["steps"] == b["steps"]
    assert a["collectives"] == b["collectives"] == a["steps"]


def test_four_ranks_agree_the_minimum() -> None:
    out = run_ranks(tp_workers.minimum_of_rank_values, 4, (12, 2), timeout_s=WATCHDOG_S)
    assert all(o.ok for o in out), [o.error for o in out]
    locals_ = [o.value["local"] for o in out]
    expected = [min(col) for col in zip(*locals_, strict=True)]
    assert all(o.value["agreed"] == expected for o in out)
    assert len({o.value["collectives"] for o in out}) == 1


def test_a_rank_that_proposes_late_delays_the_decision_without_error() -> None:
    """Rank 0 proposed and settled 3 decisions 4 steps before rank 1: nothing resolved meanwhile."""
    out = run_ranks(tp_workers.late_proposer, 2, timeout_s=WATCHDOG_S)
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value["resolved_before"] == [False, False, False]
    assert out[0].value["agreed"] == out[1].value["agreed"] == [5, 5, 5]


def test_a_rank_local_early_break_cannot_skip_a_collective() -> None:
    """SGLang #30760: one rank's batch fills first and its walk breaks early. Here the walk holds no
    collective, so both ranks run the same number of them and every decision resolves."""
    out = run_ranks(tp_workers.early_break, 2, (7,), timeout_s=WATCHDOG_S)
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value["agreed"] == out[1].value["agreed"] == [1] * 7
    assert out[0].value["collectives"] == out[1].value["collectives"]


def test_different_decisions_in_one_place_raise_on_every_rank() -> None:
    out = run_ranks(tp_workers.divergent_proposals, 2, timeout_s=WATCHDOG_S)
    assert [o.error_type for o in out] == ["RankDivergence", "RankDivergence"]
    assert "decision #0 differs between the ranks" in (out[0].error or "")


def test_a_rank_killed_mid_agreement_makes_the_others_raise() -> None:
    """Rank 1 exits abruptly; rank 0's step raises RankFailed, and its waiter fails with it (so the code
    awaiting the decision releases what it holds); nothing stays pending."""
    out = run_ranks(tp_workers.dies_mid_agreement, 2, (1,), timeout_s=WATCHDOG_S, group_timeout_s=10.0)
    assert out[1].exitcode == 17
    assert out[0].ok, out[0].error
    assert sorted(out[0].value["errors"]) == ["RankFailed", "RankFailed"]
    assert out[0].value["pending"] == 0


def test_a_silent_rank_makes_the_others_raise_within_the_timeout() -> None:
    """Rank 2 of 4 stops stepping without exiting: the others raise RankFailed naming the timeout."""
    out = run_ranks(tp_workers.goes_silent, 4, (2,), timeout_s=WATCHDOG_S, group_timeout_s=2.0)
    for o in out:
        assert o.ok, o.error
    for r in (0, 1, 3):
        errors = out[r].value["errors"]
        assert errors[0] == "RankFailed"
        assert "within 2 s" in errors[1]
        assert "failed: RankFailed" in out[r].value["decision"]


def test_a_decision_one_rank_never_proposes_raises_instead_of_stepping_forever() -> None:
    """Rank 0 proposes a decision rank 1 never proposes, while rank 1 keeps stepping: rank 0 raises
    RankDivergence naming the decision after the group timeout, and rank 1's next collective fails."""
    out = run_ranks(tp_workers.never_proposes, 2, (0,), timeout_s=WATCHDOG_S, group_timeout_s=1.0)
    for o in out:
        assert o.ok, o.error
    assert out[0].value["errors"][0] == "RankDivergence"
    assert "decision #0 (commit 'req-0')" in out[0].value["errors"][1]
    assert out[1].value["errors"][0] in ("RankFailed", "RankDivergence")


def test_a_decision_stuck_on_one_rank_that_holds_back_the_window_raises_on_every_rank() -> None:
    """Decision #0 never settles on rank 1 while both ranks propose more than a step carries: instead of
    stepping forever, every rank raises RankFailed naming the stuck decision within the group timeout."""
    out = run_ranks(tp_workers.stuck_settle, 2, (1,), timeout_s=WATCHDOG_S, group_timeout_s=1.0)
    for o in out:
        assert o.ok, o.error
        assert o.value["errors"][0] == "RankFailed", o.value
        assert o.value["first_failed"]
    assert any("decision #0 (store '1') has not settled on every rank" in o.value["errors"][1] for o in out)


def test_fingerprints_agree_and_a_difference_names_the_node() -> None:
    same = run_ranks(tp_workers.trees_compare, 2, (None, ""), timeout_s=WATCHDOG_S)
    assert all(o.ok for o in same)
    assert same[0].value == same[1].value
    differ = run_ranks(tp_workers.trees_compare, 2, (1, "lock"), timeout_s=WATCHDOG_S)
    for o in differ:
        assert o.value["error"] == "TreeDivergence"
        # The lock of the second prompt's leaf locks its path: the shared prefix differs first.
        assert "at node #0" in o.value["message"]
        assert (
            "rank 1 has node 2 tokens [0, 4) starting [1, 2, 3, 4] tiers=device device_lock=1"
            in (o.value["message"])
        )


async def test_a_single_rank_resolves_on_settle_without_any_collective() -> None:
    ag = Agreement(None)
    d = ag.propose("probe", "req")
    assert not d.resolved
    d.settle(3)
    assert d.resolved
    assert await d.wait() == 3
    result = await ag.step()
    assert not result.more
    assert ag.statistics().pending == 0


async def test_an_unsettled_decision_settles_its_default_after_its_timeout() -> None:
    """A rank-local timeout settles the safe default (the minimum then carries it to every rank); a value
    settled later is ignored."""
    ag = Agreement(None)
    d = ag.propose("commit", "req", default=0, timeout_s=0.0)
    assert not d.settled
    assert await ag.agree(d) == 0
    assert ag.statistics().timed_out == 1
    d.settle(5)
    assert d.result == 0


def test_a_slow_local_part_on_one_rank_does_not_time_the_group_out() -> None:
    """Rank 1's local part takes 3 s, the group timeout is 2 s: both ranks step while waiting, so no
    collective waits long; the minimum is agreed. A local part that raises settles its default (0) on
    every rank and re-raises on its own rank only."""
    out = run_ranks(tp_workers.slow_local_part, 2, (1, 3.0), timeout_s=WATCHDOG_S, group_timeout_s=2.0)
    assert all(o.ok for o in out), [o.error for o in out]
    assert out[0].value["agreed"] == out[1].value["agreed"] == 3
    assert out[0].value["commit"] == out[1].value["commit"] == 0
    assert out[0].value["error"] == ""
    assert out[1].value["error"] == "injected: local I/O failed"
    assert out[0].value["steps"] == out[1].value["steps"] > 1


@pytest.mark.parametrize("size", [0, -1, True])
def test_run_ranks_refuses_a_size_that_runs_no_rank(size: int) -> None:
    """An empty outcome list would let `all(o.ok for o in out)` pass with nothing run."""
    with pytest.raises(ValueError, match="size"):
        run_ranks(tp_workers.minimum_of_rank_values, size, (1, 0))


def test_an_on_resolve_callback_that_proposes_keeps_every_rank_stepping() -> None:
    """The first decision's callback proposes a second (settled later, at each rank's own pace): both
    callbacks run on both ranks, in order, with the minimum; `drive()` ends after the same step on
    both; a decision settled with `encode_max` agrees the maximum."""
    out = run_ranks(tp_workers.chained_on_resolve, 2, timeout_s=WATCHDOG_S)
    assert all(o.ok for o in out), [o.error for o in out]
    for o in out:
        assert o.value["seen"] == [("first", 3), ("second", 6)]
        assert o.value["max"] == 20
    assert out[0].value["steps"] == out[1].value["steps"]


async def test_on_resolve_runs_once_with_the_value_or_with_none_when_the_agreement_fails() -> None:
    ag = Agreement(None)
    seen: list[int | None] = []
    d = ag.propose("backup", "a", on_resolve=seen.append)
    d.settle(1)
    d.settle(0)  # ignored: the first value counts
    assert seen == [1]
    two = Agreement(None)
    two.local = False  # hold decisions pending as a group would, without one
    e = two.propose("backup", "b", on_resolve=seen.append)
    two.fail(RankFailed("rank 0: the cache was closed"))
    assert seen == [1, None]
    with pytest.raises(RankFailed):
        await e.wait()
    with pytest.raises(ValueError, match=r"^value: "):
        encode_max(-1)


async def test_one_rank_runs_the_local_part_in_the_callers_task_unless_it_settles_early() -> None:
    """On one rank a decision with no deadline resolves exactly when `local()` returns, so `agree_on`
    runs it in the caller's task (a task of its own cost the loop two iterations per probe and commit).
    A cancellation during it is one before the agreement: the decision stays unsettled, to agree again;
    an error settles the default and propagates. A local part that settles the decision itself before
    it ends (`settles_early`, a backup's copy) still runs in a task of its own, which a cancellation
    after the settling does not cut short."""
    ag = Agreement(None)
    caller = asyncio.current_task()
    where: list[asyncio.Task[object] | None] = []

    async def local() -> int:
        where.append(asyncio.current_task())
        return 5

    assert await ag.agree_on(ag.propose("probe", "a"), local) == 5
    assert where == [caller]

    parked = asyncio.Event()
    decision = ag.propose("probe", "b")

    async def parks() -> int:
        parked.set()
        await asyncio.Event().wait()
        return 1

    task = asyncio.get_running_loop().create_task(ag.agree_on(decision, parks))
    await parked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not decision.settled

    failing = ag.propose("probe", "c", default=3)

    async def fails() -> int:
        raise OSError("local: the probe failed")

    with pytest.raises(OSError, match="probe failed"):
        await ag.agree_on(failing, fails)
    assert failing.result == 3

    early = ag.propose("backup", "d")
    finished: list[bool] = []

    async def settles_then_works() -> int:
        early.settle(7)
        await asyncio.sleep(0.01)
        finished.append(True)
        return 7

    task = asyncio.get_running_loop().create_task(ag.agree_on(early, settles_then_works, settles_early=True))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [True]  # ran to its end after the settling, then the cancellation propagated
    assert early.result == 7

    undeclared = ag.propose("backup", "e")

    async def settles_itself() -> int:
        undeclared.settle(2)
        return 2

    with pytest.raises(AssertionError, match="settles_early"):  # the contract is checked, not trusted
        await ag.agree_on(undeclared, settles_itself)


class _DoneWork:
    """A collective that completed at once (what `RankGroup.min_reduce_on_loop` reads of gloo's work)."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: object = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[None]:
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done


class DivergentPeerGroup(RankGroup):
    """An in-process stand-in for a two-rank gloo group whose peer proposed the same decisions as this
    rank except at slot `diverges_at` (a different key there; None: nowhere), and settled what this rank
    settled; every collective completes at once.

    Bypasses `RankGroup.__init__` (no torch.distributed) and replaces only the start of a collective:
    the agreement's steps run the group's own `min_reduce_on_loop`.
    """

    def __init__(self, diverges_at: int | None, timeout_s: float = 30.0) -> None:
        self.tp_rank, self.tp_size, self.timeout_s = 0, 2, timeout_s
        self.backend, self._min_what = "gloo", "all_gather"
        self._lock, self._state_lock = threading.Lock(), threading.Lock()
        self._failed, self._slow_in_a_row = None, 0
        self.collectives = self.inline_completions = 0
        self.diverges_at = diverges_at

    def _start_min_reduce(self, tensor: torch.Tensor) -> tuple[Any, torch.Tensor]:
        peer = tensor.clone()
        if self.diverges_at is not None:
            row = 2 + self.diverges_at  # two header rows, then the slots
            peer[row, 3] -= 1  # the peer's key hash differs there: min(key) != -min(-key)
        return _DoneWork(), torch.cat([tensor.reshape(-1), peer.reshape(-1)])


class _BrokenWork(_DoneWork):
    """A collective whose state cannot be read: asking whether it completed, or for its future, raises."""

    def is_completed(self) -> bool:
        raise RuntimeError("is_completed: the work has no state")

    def get_future(self) -> torch.futures.Future[None]:
        raise RuntimeError("get_future: the work has no future")


def _unreadable_minimum(out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    raise RuntimeError("_min_of: the gathered buffer cannot be read")


@pytest.mark.parametrize("broken", ["minimum", "work"])
async def test_a_collective_that_breaks_on_the_loop_fails_the_group_and_lets_its_lock_go(broken: str) -> None:
    """Guards against `min_reduce_on_loop` keeping the group's collective lock when reading the completed
    work or its result raised on the loop: `on_done` never ran (the agreement's step waited for ever)
    and every later collective of the group waited for the lock. Now the group fails with that error,
    `on_done` gets it, and the lock is let go."""
    group = DivergentPeerGroup(diverges_at=None)
    if broken == "minimum":
        group._min_of = _unreadable_minimum  # type: ignore[method-assign]
    else:
        group._slow_in_a_row = 2  # ask the work whether it completed, then park it on its future
        group._start_min_reduce = lambda tensor: (_BrokenWork(), tensor)  # type: ignore[method-assign]
    seen: list[tuple[torch.Tensor | None, RankFailed | None]] = []
    await group.min_reduce_on_loop(torch.zeros(3, dtype=torch.int64), lambda m, e: seen.append((m, e)))
    assert len(seen) == 1
    minimum, error = seen[0]
    assert minimum is None
    assert isinstance(error, RankFailed)
    assert ("cannot be read" if broken == "minimum" else "no future") in str(error)
    assert not group._lock.locked()
    assert group._failed is error


async def test_a_divergence_at_a_later_slot_resolves_the_decisions_agreed_before_it() -> None:
    """Guards against a step that raised `RankDivergence` at slot 1 dropping slot 0's decision, ready on
    every rank: it had left `_pending`, so it was neither resolved nor failed, its `on_resolve` cleanup
    never ran and its `wait()` blocked for ever. Now it resolves with the agreed value; the divergent
    one fails with the error."""
    agreement = Agreement(DivergentPeerGroup(diverges_at=1))
    seen: list[tuple[str, int | None]] = []
    ready = agreement.propose("backup", "a", on_resolve=lambda v: seen.append(("a", v)))
    divergent = agreement.propose("backup", "b", on_resolve=lambda v: seen.append(("b", v)))
    ready.settle(7)
    divergent.settle(3)
    with pytest.raises(RankDivergence, match="decision #1 differs"):
        await agreement.step()
    assert seen == [("a", 7), ("b", None)]
    with anyio.fail_after(5):
        assert await ready.wait() == 7
        with pytest.raises(RankDivergence):
            await divergent.wait()
    assert agreement.statistics().pending == 0


async def test_a_held_back_window_failure_resolves_what_its_step_agreed() -> None:
    """Guards against the held-back guard's `RankFailed` dropping the decisions its own step had just
    agreed: decision #0 never settles and holds #3 out of a 3-slot window past the group's timeout
    (0 s), while #2, inside the window, is agreed in the very step that raises."""
    agreement = Agreement(DivergentPeerGroup(diverges_at=None, timeout_s=0.0), capacity=3)
    seen: list[tuple[str, int | None]] = []
    decisions = [
        agreement.propose("backup", name, on_resolve=lambda v, name=name: seen.append((name, v)))
        for name in ("stuck", "first", "second", "outside")
    ]
    decisions[1].settle(5)
    await agreement.step()  # agrees "first"; "outside" is held back from now on
    assert seen == [("first", 5)]
    decisions[2].settle(6)
    with pytest.raises(RankFailed, match="holds back"):
        await agreement.step()
    assert seen == [("first", 5), ("second", 6), ("stuck", None), ("outside", None)]
    with anyio.fail_after(5):
        assert await decisions[2].wait() == 6
    assert agreement.statistics().pending == 0


def test_drive_stops_after_the_step_that_resolves_the_last_decision() -> None:
    """Guards against `drive()` running one more collective after the step that resolved everything:
    the header said only whether a rank had something pending before the step, so every scheduling
    step's `tp_sync` ended with an empty step (12 of the TP demo's 138 steps). Now the header carries
    how many each rank holds, and the step knows none is left."""
    out = run_ranks(tp_workers.steps_for_settled, 2, timeout_s=WATCHDOG_S)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [{"steps": 1, "pending": 0}] * 2


def test_a_value_settled_late_on_one_rank_resolves_in_one_step() -> None:
    """Guards against idle steps: while rank 1's local part ran, both ranks stepped every `idle_s` (2 ms)
    and each step resolved nothing (54 of the TP demo's 138 steps). Now a rank waits (bounded) to
    settle its own value before it steps, and the other waits in the collective: one step."""
    out = run_ranks(tp_workers.steps_for_a_late_value, 2, (0.2,), timeout_s=WATCHDOG_S)
    assert all(o.ok for o in out), [o.error for o in out]
    assert [o.value for o in out] == [{"agreed": 5, "steps": 1}] * 2


async def test_steps_that_complete_at_once_still_let_the_loop_run_other_tasks() -> None:
    """Guards against a stepping loop starving the rest of the event loop when each collective completes
    within `min_reduce_then` (its short wait on the loop): awaiting a finished future does not yield, so
    a busy `drive()` on a fast group kept this rank's other tasks (its I/O, its settlements) from running
    until the peers stopped stepping. Each step gives the loop one turn."""
    agreement = Agreement(DivergentPeerGroup(diverges_at=None))
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.ensure_future(other_task())
    await asyncio.sleep(0)
    before = turns
    for _ in range(10):
        await agreement.step(busy=True)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert turns - before >= 10


async def test_a_cancellation_after_the_ranks_agreed_lets_the_local_part_end_then_propagates() -> None:
    """Guards against `agree_on` cutting this rank's local part short once the ranks had agreed: the local
    part settled the decision before it ended (as a backup's copy does; a decision's deadline does the
    same), the agreement returned, and a cancellation that came while `agree_on` waited for the local
    part to end cancelled it half-way (the task group's exit cancels its children) and left at once. Now
    the local part runs to its end, then the cancellation propagates; the agreed value is on the
    decision."""
    agreement = Agreement(DivergentPeerGroup(diverges_at=None))
    decision = agreement.propose("backup", "a")
    rest_of_the_work = asyncio.Event()
    ended: list[str] = []

    async def local() -> int:
        decision.settle(4)
        try:
            await rest_of_the_work.wait()
        except asyncio.CancelledError:
            ended.append("cut short")
            raise
        ended.append("whole")
        return 4

    caller = asyncio.ensure_future(agreement.agree_on(decision, local))
    await anyio.wait_all_tasks_blocked()
    assert decision.result == 4  # agreed: `agree_on` now only waits for the local part
    caller.cancel()
    await anyio.wait_all_tasks_blocked()
    assert ended == []
    assert not caller.done()
    rest_of_the_work.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert ended == ["whole"]
    assert agreement.statistics().pending == 0
