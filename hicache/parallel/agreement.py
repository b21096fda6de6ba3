"""The batched agreement step: every divergent decision of the ranks, agreed in one collective per step.

A decision is anything a rank decides from rank-local facts (how many pages its storage holds, how many a
prefetch verified, whether a load-back or a backup finished). Each rank *proposes* the decision at the
same point of its program (an engine call, which every rank makes in the same order), *settles* it with
its local value when that is known, and every rank gets the same result: the minimum over the ranks.

Why it cannot deadlock (SGLang #30760, #22607: a loop broke early on one rank and skipped a collective):

- `step()` runs exactly one collective, of one fixed shape (`capacity` slots plus two header rows),
  whatever this rank has pending. Nothing rank-local decides whether, or how many times, it is called.
- Decision number `seq` (the order of proposals, the same on every rank) sits in slot `seq - base`,
  where `base` is the first decision not yet resolved. Resolution happens only in a step, only when every
  rank has proposed and settled the decision, so the resolved set, and with it `base`, is the same on
  every rank: a rank that is late proposing leaves its slot empty and the decision simply waits a step.
- Loops end by agreement: `step(busy=...)` returns `more`, true while any rank is busy or holds an
  unresolved decision, the same value on every rank, so `drive()` stops after the same step everywhere.
- A peer that dies or stops stepping makes the collective raise `RankFailed` within the group's timeout;
  every pending decision then fails with it and its waiters release what they hold. So does a decision
  whose local part is stuck on some rank once it has held later decisions out of the window (`capacity`
  slots past the oldest pending one) for longer than the timeout: no step could carry them.

Two ranks that propose different decisions under one `seq` (a caller bug) get `RankDivergence` on every
rank at the first step that sees both; a decision one rank proposed and a peer, still stepping, has not
proposed for longer than the group's timeout raises `RankDivergence` on the proposing rank (the peer's
next collective then times out with `RankFailed`), so no loop steps forever.

What a step costs beyond its collective: filling the fixed-shape tensor (numpy, over the pending
decisions only, in one buffer the steps reuse) and reading the reduced one, and no thread hop: the
collective runs on the backend's thread; the loop takes one turn while it runs, then waits for it at most
1 ms (`RankGroup.min_reduce_on_loop`) before its completion wakes the event loop, where the step
completes even if its caller was cancelled meanwhile (so no shield). How many steps a loop runs: before stepping, a rank waits (at most a quarter of the group
timeout, 1 s at most) to settle its own decisions, while a peer that has settled waits in the collective,
so a value settled late resolves in one step, not after idle ones; the header carries how many decisions
the neediest rank holds, so the step that resolves the last one is the last step. With no group, or a group of one rank, a settled decision is
resolved at once and no step is needed: a single rank pays nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from hicache.parallel.decision import NONE, Decision, decode_max, encode_max
from hicache.parallel.errors import RankDivergence, RankFailed, RankGroupError
from hicache.parallel.group import RankGroup
from storage_backends.cancellation import StopScope, uncancellable

__all__ = [
    "AGREEMENT_CAPACITY",
    "Agreement",
    "AgreementStatistics",
    "Decision",
    "StepResult",
    "decode_max",
    "encode_max",
]

logger = logging.getLogger(
    "hicache.cache"
)  # a logger carrying the redacting filter (storage_backends.redact)

AGREEMENT_CAPACITY = 64
"""Decisions one step can carry; later ones wait for a later step (the tensor's shape never changes)."""

_FIELDS = 5  # per slot: present, ready, value, key, -key
_HEADER = 2  # row 0: what is left and the step number; row 1: base
_BUSY = 1 << 40
"""Added to a busy rank's count of pending decisions in the header (more than any window holds)."""
_ABSENT = (0, 0, NONE, NONE, NONE)
_MAX_HOLD_S = 1.0
"""The most a rank waits to settle its own decisions before it steps all the same (see `_hold_s`)."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one agreement step did.

    Attributes:
        step: the step's number (the same on every rank).
        resolved: decisions resolved by this step.
        more: whether any rank is busy or holds an unresolved decision (the same on every rank): loops
            that step until nothing is left stop on this, never on a local condition.
    """

    step: int
    resolved: int
    more: bool


@dataclass(frozen=True, slots=True)
class AgreementStatistics:
    """Counters of an `Agreement` (frozen snapshot).

    Attributes:
        steps: steps run (each one collective when the group has more than one rank).
        proposed: decisions proposed.
        resolved: decisions resolved.
        pending: decisions proposed and not yet resolved.
        timed_out: decisions settled with their default because their local timeout passed.
        last_step_us: the wall time of the last step's collective, in microseconds.
    """

    steps: int
    proposed: int
    resolved: int
    pending: int
    timed_out: int
    last_step_us: float


class Agreement:
    """Proposes, settles and agrees the ranks' divergent decisions, one collective per `step()`.

    Args:
        group: the rank group; `None` (or a group of one rank) resolves each decision as it is settled.
        capacity: decisions one step carries (the tensor's fixed number of slots).
        idle_s: how long `drive()` and `agree()` wait for a local proposal after a step that resolved
            nothing because some rank had not proposed a decision yet.

    Raises:
        TypeError, ValueError: naming the argument.
    """

    def __init__(
        self, group: RankGroup | None = None, *, capacity: int = AGREEMENT_CAPACITY, idle_s: float = 0.002
    ) -> None:
        if group is not None and not isinstance(group, RankGroup):
            raise TypeError(f"group: expected a RankGroup or None, got {type(group).__name__}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: expected an int >= 1, got {capacity!r}")
        if isinstance(idle_s, bool) or not isinstance(idle_s, int | float) or not 0 <= idle_s < math.inf:
            raise ValueError(f"idle_s: expected a finite number of seconds >= 0, got {idle_s!r}")
        self.group = group
        self.capacity = capacity
        self.idle_s = float(idle_s)
        self.local = group is None or group.tp_size == 1
        self._pending: dict[int, Decision] = {}
        self._next_seq = 0
        self._steps = 0
        self._resolved = 0
        self._timed_out = 0
        self._last_step_us = 0.0
        self._stepping = False
        self._stepped: asyncio.Event | None = None
        self._failed: RankGroupError | None = None
        self._changed: asyncio.Event | None = None
        # (base, since) while decisions wait outside the window
        self._held_back: tuple[int, float] | None = None
        self._template = np.array([_ABSENT] * (_HEADER + capacity), dtype=np.int64)
        self._template[:, 0] = 0
        self._template[:_HEADER, 0] = 1
        self._template[:_HEADER, 1] = 1
        rows = self._template.copy()
        self._tensor = torch.from_numpy(rows)
        """What every step's collective carries: one buffer, refilled by each step (`_cells`)."""
        self._cells = rows.data.cast("B").cast("q")
        self._template_cells = self._template.data.cast("B").cast("q")
        self._absent_on_peer = False
        """Whether the last step saw a decision of the window that some rank has not proposed yet."""

    @property
    def tp_rank(self) -> int:
        """This rank (0 without a group)."""
        return 0 if self.group is None else self.group.tp_rank

    @property
    def tp_size(self) -> int:
        """The number of ranks (1 without a group)."""
        return 1 if self.group is None else self.group.tp_size

    @property
    def failed(self) -> RankGroupError | None:
        """The error that ended the agreement (a failed or diverged group), or None."""
        return self._failed

    def propose(
        self,
        kind: str,
        key: str,
        *,
        default: int = 0,
        timeout_s: float | None = None,
        on_resolve: Callable[[int | None], None] | None = None,
    ) -> Decision:
        """Register a decision; every rank must propose the same decisions in the same order.

        Call it synchronously where every rank is at the same point of its program (an engine call, or
        an `on_resolve` callback of an earlier decision), never after an await whose duration is
        rank-local. Settle it with `Decision.settle`.

        Args:
            kind: what is decided.
            key: what it is about.
            default: the value settled when `timeout_s` passes without a local value.
            timeout_s: seconds after which an unsettled decision settles to `default` at the next step
                (a local fact: the minimum with `default` is what every rank then gets).
            on_resolve: called synchronously, once, inside the step that resolves the decision (so at
                the same point of every rank's program, in the order of proposals) with the agreed
                value, or with None when the agreement fails. Where the tree changes on an agreed
                outcome that no engine call waits for (a backup's commit). It must not raise or await.

        Raises:
            RankFailed, RankDivergence: the agreement already failed.
        """
        if self._failed is not None:
            raise self._failed
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        decision = Decision(
            kind,
            key,
            self._next_seq,
            default=default,
            deadline=deadline,
            immediate=self.local,
            notify=self._notify,
            on_resolve=on_resolve,
        )
        self._next_seq += 1
        if not self.local:
            self._pending[decision.seq] = decision
        self._notify()
        return decision

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _base(self) -> int:
        return min(self._pending) if self._pending else self._next_seq

    def _build(self, busy: bool, now: float) -> tuple[torch.Tensor, int]:
        base = self._base()
        step = self._steps
        # Written through a flat int64 view of the one buffer the steps reuse (the previous step's
        # collective has ended: steps run one at a time): an item costs no numpy conversion.
        cells = self._cells
        cells[:] = self._template_cells
        # Row 0: NONE - (this rank's pending decisions, plus `_BUSY` when busy): the minimum says how
        # many the neediest rank holds, so every rank knows alike whether any is left after the step.
        cells[1] = NONE - len(self._pending) - (_BUSY if busy else 0)
        cells[2] = cells[3] = step
        cells[4] = -step
        cells[_FIELDS + 2] = cells[_FIELDS + 3] = base  # row 1
        cells[_FIELDS + 4] = -base
        for seq, d in self._pending.items():  # in the order of proposals: the window is a prefix
            i = seq - base
            if i >= self.capacity:
                break
            if d._local is None and now >= d.deadline:
                logger.warning("agreement: %r timed out locally; settling %d", d, d.default)
                self._timed_out += 1
                d._local = d.default
            local = d._local
            key = d.key_hash
            j = (_HEADER + i) * _FIELDS
            cells[j] = 1
            if local is not None:
                cells[j + 1] = 1
                cells[j + 2] = local
            cells[j + 3] = key
            cells[j + 4] = -key
        return self._tensor, base

    async def step(self, *, busy: bool = False) -> StepResult:
        """Run one agreement step: one collective over every pending decision, resolving each one that
        every rank has proposed and settled. Every rank must call it the same number of times.

        Args:
            busy: this rank wants more steps (its workload is not done); see `StepResult.more`.

        Raises:
            RankFailed: a peer died or stopped responding (every pending decision fails with it).
            RankDivergence: the ranks proposed different decisions in one place, or are at different steps.
        """
        while self._stepping:  # a step whose caller was cancelled is still completing: after it
            if self._stepped is None:
                self._stepped = asyncio.Event()
            await self._stepped.wait()
        if self._failed is not None:
            raise self._failed
        step = self._steps
        self._steps += 1
        if self.local:
            self._resolved = self._next_seq  # proposed less pending, and nothing is held pending here
            return StepResult(step=step, resolved=0, more=busy or bool(self._pending))
        group = self.group
        assert group is not None
        tensor, base = self._build(busy, time.monotonic())
        waiter: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        started = time.perf_counter()

        def finished(reduced: torch.Tensor | None, error: RankFailed | None) -> None:
            # On the loop, once the collective ended: the step completes here even when its caller
            # was cancelled meanwhile (a step cut short would leave this rank's resolved set behind
            # its peers', who resolved what the collective agreed), so no shield is needed.
            self._stepping = False
            if self._stepped is not None:
                self._stepped.set()
                self._stepped = None
            self._last_step_us = (time.perf_counter() - started) * 1e6
            outcome: StepResult | Exception
            try:
                if error is not None:
                    raise error
                assert reduced is not None
                outcome = self._apply(reduced, step, base, group)
            except RankGroupError as exc:
                self._fail(exc)  # every decision still pending fails with it
                outcome = exc
            except Exception as exc:  # an `on_resolve` callback's bug, after every decision resolved
                outcome = exc
            if waiter.done():  # its caller was cancelled
                return
            if isinstance(outcome, Exception):
                waiter.set_exception(outcome)
            else:
                waiter.set_result(outcome)

        self._stepping = True
        try:
            # One turn of the loop while the collective runs, so a loop that steps (`drive`) never keeps
            # the rest of the loop (this rank's I/O, its settlements) out, even when each collective
            # completes within the group's short wait (then `waiter` is done on return: no second turn).
            await group.min_reduce_on_loop(tensor, finished)
        except BaseException:
            waiter.cancel()  # nobody waits for the step's outcome any more: `finished` drops it
            raise
        return await waiter

    def _apply(self, reduced: torch.Tensor, step: int, base: int, group: RankGroup) -> StepResult:
        """Resolve what the reduced tensor of step `step` agreed (on the loop, in the collective's
        completion)."""
        agreed = reduced.contiguous().numpy().data.cast("B").cast("q")  # flat, item by item
        left, step_lo, step_neg = agreed[1], agreed[3], agreed[4]
        base_lo, base_neg = agreed[_FIELDS + 3], agreed[_FIELDS + 4]
        if step_lo != -step_neg or base_lo != -base_neg:
            raise RankDivergence(
                f"rank {group.tp_rank}: ranks are at different agreement steps or bases (this rank: step "
                f"{step}, base {base}; seen: steps {step_lo}..{-step_neg}, bases {base_lo}..{-base_neg}); "
                f"every rank must call step() alike"
            )
        # Slots before an error are agreed all the same (every rank saw this reduced tensor): they are
        # resolved before the error is raised, and the rest fail with it, so no decision is lost. Only
        # this rank's pending decisions are read: a slot every rank proposed is pending here too.
        done: list[tuple[Decision, int]] = []
        failure: RankGroupError | None = None
        now = time.monotonic()
        absent = False
        for seq, d in self._pending.items():
            i = seq - base
            if i >= self.capacity:
                break
            j = (_HEADER + i) * _FIELDS
            present, ready, value, key_lo, key_neg = agreed[j : j + _FIELDS].tolist()
            if present != 1:
                # Some rank has not proposed it yet: a late rank is fine for a while, but a peer that
                # keeps stepping without ever proposing it would make every loop step forever.
                absent = True
                failure = self._unmatched(d, now, group)
                if failure is not None:
                    break
                continue
            if key_lo != -key_neg:
                failure = RankDivergence(
                    f"rank {group.tp_rank}: decision #{d.seq} differs between the ranks (this rank "
                    f"proposed {d.kind} {d.key!r}): every rank must propose the same decisions in the "
                    f"same order"
                )
                break
            if ready == 1:
                done.append((d, value))
        self._absent_on_peer = absent
        for d, _ in done:
            del self._pending[d.seq]
        resolved = len(done)
        self._resolved += resolved
        if failure is None:
            failure = self._held_back_failure(now, group)
        # Resolved in the order of proposals, after the loop: an `on_resolve` callback may propose a new
        # decision (on every rank alike), which then keeps `drive()` stepping.
        proposed = self._next_seq
        error: BaseException | None = None
        for d, value in done:
            try:
                d._resolve(value)
            except Exception as exc:  # a callback's bug: resolve the rest, then raise the first
                error = error or exc
        if failure is not None:
            raise failure  # `step()` fails every decision still pending with it
        if error is not None:
            raise error
        # Left after this step: the neediest rank's pending less what resolved (every resolved decision
        # was pending on every rank), or a busy rank, or a proposal of an `on_resolve` callback.
        neediest = NONE - left
        return StepResult(
            step=step, resolved=resolved, more=neediest > resolved or self._next_seq != proposed
        )

    @staticmethod
    def _unmatched(decision: Decision | None, now: float, group: RankGroup) -> RankDivergence | None:
        """`RankDivergence` once `decision`, proposed here, has been missing on a peer that keeps
        stepping for longer than the group timeout (the bound a dead peer gets from the collective)."""
        if decision is None:
            return None
        if decision._unmatched_since is None:
            decision._unmatched_since = now
        elif now - decision._unmatched_since > group.timeout_s:
            return RankDivergence(
                f"rank {group.tp_rank}: decision #{decision.seq} ({decision.kind} {decision.key!r}) was "
                f"not proposed by every rank within {group.timeout_s:g} s while all kept stepping: every "
                f"rank must propose the same decisions in the same order"
            )
        return None

    def _held_back_failure(self, now: float, group: RankGroup) -> RankFailed | None:
        """`RankFailed` once the oldest pending decision has kept later ones out of the window (beyond
        `capacity`, so no step carries them) for longer than the group timeout: its local part is stuck on
        some rank (a storage write whose thread never returned, say), and without this bound every rank
        would step forever with no error."""
        base = self._base()
        if self._next_seq - base <= self.capacity:
            self._held_back = None
            return None
        if self._held_back is None or self._held_back[0] != base:
            self._held_back = (base, now)
        elif now - self._held_back[1] > group.timeout_s:
            stuck = self._pending[base]
            return RankFailed(
                f"rank {group.tp_rank}: decision #{base} ({stuck.kind} {stuck.key!r}) has not settled on "
                f"every rank within {group.timeout_s:g} s and holds back {self._next_seq - base - 1} later "
                f"decisions (a step carries {self.capacity}): a rank's local part of it is stuck"
            )
        return None

    def _fail(self, error: RankGroupError) -> None:
        self._failed = error
        pending = list(self._pending.values())
        self._pending.clear()
        for d in pending:
            d._fail(error)
        self._notify()

    def fail(self, error: RankGroupError) -> None:
        """End the agreement with `error` (the cache is closing): pending decisions fail with it. One
        rank holds none pending and has no peer to fall out with: nothing ends there."""
        if self._failed is None and not self.local:
            self._fail(error)

    async def agree(self, decision: Decision) -> int:
        """Step until `decision` resolves and return the agreed value (a blocking agreement).

        Every rank calls it for the same decision at the same point of its program (an engine call that
        every rank makes in the same order); the loop ends on `decision.resolved`, which is agreed, so
        every rank runs the same steps. Other pending decisions resolve in the same steps.

        Raises:
            RankFailed, RankDivergence: as `step()`.
        """
        if self.local:
            if not decision.settled and decision.deadline < math.inf:
                async with StopScope(max(0.0, decision.deadline - time.monotonic())):
                    await decision.wait()
                if not decision.resolved:
                    self._timed_out += 1
                    decision.settle(decision.default)
            return await decision.wait()
        while not decision.resolved:
            if decision._local is None:
                await self._wait_settled(decision)
            result = await self.step(busy=True)
            if not decision.resolved and not result.resolved:
                await self._after_idle_step()
        return await decision.wait()

    async def agree_value(self, kind: str, value: int, key: str = "") -> int:
        """Propose, settle with `value` and agree at once (a blocking agreement; see `agree`)."""
        decision = self.propose(kind, key)
        decision.settle(value)
        return await self.agree(decision)

    async def agree_max(self, kind: str, value: int, key: str = "") -> int:
        """As `agree_value`, for the maximum of the ranks' values (see `encode_max`)."""
        return decode_max(await self.agree_value(kind, encode_max(value), key))

    async def agree_on(
        self, decision: Decision, local: Callable[[], Awaitable[int]], *, settles_early: bool = False
    ) -> int:
        """Run `local()` (this rank's part: a storage probe, a prefetch's I/O) and agree its result.

        While `local()` runs, this rank keeps stepping, so a peer waiting for the agreement never waits in
        a collective for this rank's I/O (only for its next step). `local()`'s result settles the
        decision; if it raises, the decision settles to its default and, once agreed, the error is
        re-raised. `agree_on` returns or raises only once `local()` has ended. Cancellation, two cases:

        - before the ranks agreed: the decision settles to its default (peers resolve it at this rank's
          next step; one rank leaves it unsettled, to agree again), `local()` is cancelled and the
          cancellation propagates;
        - after (the decision was settled before `local()` ended: by `local()` itself, as a backup's copy
          does, or by its deadline): the ranks' decision is taken, so `local()` runs to its end all the
          same, then the cancellation propagates; the agreed value is `decision.result`.

        `settles_early`: `local()` may settle the decision itself before it ends (a backup's copy does).
        Otherwise, on one rank and with no deadline, `local()` runs in the caller's task: the decision
        resolves exactly when it returns, so there is no "after" while it runs, and a task of its own
        would only cost two loop iterations.

        Raises:
            RankFailed, RankDivergence: as `step()`; whatever `local()` raised.
        """
        if self.local and not settles_early and decision.deadline == math.inf:
            try:
                value = await local()
            except Exception:
                decision.settle(decision.default)
                raise
            if decision.settled:  # a cancellation could have cut it short after that: the contract broke
                raise AssertionError(
                    f"agree_on: local() settled {decision!r} itself; pass settles_early=True"
                )
            decision.settle(value)
            return await decision.wait()
        failure: list[Exception] = []

        async def run_local() -> None:
            try:
                decision.settle(await local())
            except Exception as exc:
                failure.append(exc)
                decision.settle(decision.default)

        local_run = asyncio.ensure_future(run_local())
        try:
            try:
                agreed = await self.agree(decision)
            finally:
                if decision.result is None:  # failed or cancelled before the ranks agreed
                    local_run.cancel()
                if not local_run.done():  # agreed: this rank's part ends whole, whatever comes meanwhile
                    await uncancellable(asyncio.wait((local_run,)))
        except BaseException:
            if not self.local:  # one rank leaves it unsettled, to agree again
                decision.settle(decision.default)  # no-op if already settled
            raise
        if failure:
            raise failure[0]
        return agreed

    def _hold_s(self, decisions: Iterable[Decision]) -> float:
        """How long to wait for this rank to settle `decisions` before its next step: until the first
        unsettled one's deadline, at most a quarter of the group timeout (then step all the same, so no
        peer waits in a collective for long); 0 when all are settled."""
        assert self.group is not None
        hold = min(0.25 * self.group.timeout_s, _MAX_HOLD_S)
        unsettled = [d.deadline for d in decisions if d._local is None]
        if not unsettled:
            return 0.0
        return max(0.0, min(hold, min(unsettled) - time.monotonic()))

    async def _wait_settled(self, decision: Decision | None) -> None:
        """Before a step: while this rank has not settled `decision` (None: any decision of the window),
        wait for it to (bounded, `_hold_s`). A step then carries this rank's value, so the peers,
        waiting in the collective meanwhile, resolve it in that one step instead of stepping idly."""
        if decision is not None:
            window: Iterable[Decision] = (decision,)
        else:
            base = self._base()
            window = (d for seq, d in self._pending.items() if seq - base < self.capacity)
        hold = self._hold_s(window)
        if hold > 0:
            await self._wait_change(hold)

    async def _after_idle_step(self) -> None:
        """After a step that resolved nothing: if a peer has not proposed a decision yet, give it
        `idle_s` (a local proposal ends the wait); if only peers' values were missing, step at once (the
        collective waits for them: no idle step)."""
        if self._absent_on_peer and self.idle_s:
            await self._wait_change(self.idle_s)

    async def _wait_change(self, timeout_s: float) -> None:
        self._changed = asyncio.Event()
        async with StopScope(timeout_s):
            await self._changed.wait()

    async def drive(self, busy: Callable[[], bool]) -> int:
        """Step until no rank is busy and no decision is pending anywhere; return the steps run (0 for
        one rank: nothing waits for a step there).

        Before each step this rank waits (bounded) until it has settled what it holds; after a step that
        resolved nothing because a peer had not proposed yet, it waits up to `idle_s` for a local
        proposal. Every rank leaves after the same step.
        """
        if self.local:
            return 0
        steps = 0
        while True:
            wants = busy()
            await self._wait_settled(None)
            result = await self.step(busy=wants)
            steps += 1
            if not result.more:
                return steps
            if not result.resolved:
                await self._after_idle_step()

    def statistics(self) -> AgreementStatistics:
        """A snapshot of the counters."""
        return AgreementStatistics(
            steps=self._steps,
            proposed=self._next_seq,  # every proposal takes the next number
            resolved=self._resolved,
            pending=len(self._pending),
            timed_out=self._timed_out,
            last_step_us=self._last_step_us,
        )

    def __repr__(self) -> str:
        state = f"failed: {type(self._failed).__name__}" if self._failed is not None else "ok"
        return (
            f"Agreement(tp_rank={self.tp_rank}, tp_size={self.tp_size}, capacity={self.capacity}, "
            f"steps={self._steps}, pending={len(self._pending)}, {state})"
        )
