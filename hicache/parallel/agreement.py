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
next collective then times out with `RankFailed`), so no loop steps forever. With no group, or a group of one rank, a settled decision is
resolved at once and no step is needed: a single rank pays nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import torch

from hicache.parallel.decision import NONE, Decision, decode_max, encode_max
from hicache.parallel.errors import RankDivergence, RankFailed, RankGroupError
from hicache.parallel.group import RankGroup

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
_HEADER = 2  # row 0: busy flag and step number; row 1: base


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
        idle_s: how long `drive()` waits for a local change after a step that resolved nothing.

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
        self._failed: RankGroupError | None = None
        self._changed: anyio.Event | None = None
        # (base, since) while decisions wait outside the window
        self._held_back: tuple[int, float] | None = None

    @classmethod
    def for_group(cls, group: RankGroup | None) -> Agreement | None:
        """An agreement over `group`, or None when there is nothing to agree (no group, or one rank)."""
        return cls(group) if group is not None and group.tp_size > 1 else None

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
        absent = [0, 0, NONE, NONE, NONE]
        rows = [[1, 0 if (busy or self._pending) else 1, step, step, -step], [1, 1, base, base, -base]]
        rows.extend([absent] * self.capacity)
        for seq, d in self._pending.items():
            i = seq - base
            if i >= self.capacity:
                continue
            if d._local is None and now >= d.deadline:
                logger.warning("agreement: %r timed out locally; settling %d", d, d.default)
                self._timed_out += 1
                d._local = d.default
            local = d._local
            rows[_HEADER + i] = [
                1,
                int(local is not None),
                NONE if local is None else local,
                d.key_hash,
                -d.key_hash,
            ]
        return torch.tensor(rows, dtype=torch.int64), base

    async def step(self, *, busy: bool = False) -> StepResult:
        """Run one agreement step: one collective over every pending decision, resolving each one that
        every rank has proposed and settled. Every rank must call it the same number of times.

        Args:
            busy: this rank wants more steps (its workload is not done); see `StepResult.more`.

        Raises:
            RankFailed: a peer died or stopped responding (every pending decision fails with it).
            RankDivergence: the ranks proposed different decisions in one place, or are at different steps.
        """
        if self._failed is not None:
            raise self._failed
        if self._stepping:
            raise RuntimeError("step: another step of this agreement is running (steps must not overlap)")
        self._stepping = True
        try:
            # Shielded: a step cancelled half-way would leave this rank's resolved set behind its peers'
            # (they resolved what the collective agreed); the collective is bounded by the group timeout.
            with anyio.CancelScope(shield=True):
                result = await self._step(busy)
            return result
        except RankGroupError as exc:
            self._fail(exc)
            raise
        finally:
            self._stepping = False

    async def _step(self, busy: bool) -> StepResult:
        step = self._steps
        self._steps += 1
        if self.local:
            self._resolved = self._next_seq  # proposed less pending, and nothing is held pending here
            return StepResult(step=step, resolved=0, more=busy or bool(self._pending))
        group = self.group
        assert group is not None
        tensor, base = self._build(busy, time.monotonic())
        started = time.perf_counter()
        # The thread is waited for even when this task is cancelled: the tensor stays alive under it.
        reduced = await anyio.to_thread.run_sync(group.min_reduce, tensor)
        self._last_step_us = (time.perf_counter() - started) * 1e6
        agreed: list[list[int]] = reduced.tolist()
        (_, idle, _, step_lo, step_neg), (_, _, _, base_lo, base_neg) = agreed[0], agreed[1]
        if step_lo != -step_neg or base_lo != -base_neg:
            raise RankDivergence(
                f"rank {group.tp_rank}: ranks are at different agreement steps or bases (this rank: step "
                f"{step}, base {base}; seen: steps {step_lo}..{-step_neg}, bases {base_lo}..{-base_neg}); "
                f"every rank must call step() alike"
            )
        # Slots before an error are agreed all the same (every rank saw this reduced tensor): they are
        # resolved before the error is raised, and the rest fail with it, so no decision is lost.
        done: list[tuple[Decision, int]] = []
        failure: RankGroupError | None = None
        now = time.monotonic()
        for i, (present, ready, value, key_lo, key_neg) in enumerate(agreed[_HEADER:]):
            if present != 1:
                # Some rank has not proposed it yet: a late rank is fine for a while, but a peer that
                # keeps stepping without ever proposing it would make every loop step forever.
                failure = self._unmatched(self._pending.get(base + i), now, group)
                if failure is not None:
                    break
                continue
            d = self._pending[base + i]
            if key_lo != -key_neg:
                failure = RankDivergence(
                    f"rank {group.tp_rank}: decision #{d.seq} differs between the ranks (this rank "
                    f"proposed {d.kind} {d.key!r}): every rank must propose the same decisions in the "
                    f"same order"
                )
                break
            if ready == 1:
                done.append((d, value))
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
        return StepResult(step=step, resolved=resolved, more=idle == 0 or self._next_seq != proposed)

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
        """End the agreement with `error` (the cache is closing): pending decisions fail with it."""
        if self._failed is None:
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
                with anyio.move_on_after(max(0.0, decision.deadline - time.monotonic())):
                    await decision.wait()
                if not decision.resolved:
                    self._timed_out += 1
                    decision.settle(decision.default)
            return await decision.wait()
        while not decision.resolved:
            result = await self.step(busy=True)
            if not decision.resolved and not result.resolved and self.idle_s:
                await self._wait_change()
        return await decision.wait()

    async def agree_value(self, kind: str, value: int, key: str = "") -> int:
        """Propose, settle with `value` and agree at once (a blocking agreement; see `agree`)."""
        decision = self.propose(kind, key)
        decision.settle(value)
        return await self.agree(decision)

    async def agree_max(self, kind: str, value: int, key: str = "") -> int:
        """As `agree_value`, for the maximum of the ranks' values (see `encode_max`)."""
        return decode_max(await self.agree_value(kind, encode_max(value), key))

    async def agree_on(self, decision: Decision, local: Callable[[], Awaitable[int]]) -> int:
        """Run `local()` (this rank's part: a storage probe, a prefetch's I/O) and agree its result.

        While `local()` runs, this rank keeps stepping, so a peer waiting for the agreement never waits in
        a collective for this rank's I/O (only for its next step). `local()`'s result settles the
        decision; if it raises, the decision settles to its default and, once agreed, the error is
        re-raised. If the caller is cancelled, the decision settles to its default (peers resolve it at
        this rank's next step) and the cancellation propagates.

        Raises:
            RankFailed, RankDivergence: as `step()`; whatever `local()` raised.
        """
        failure: list[BaseException] = []

        async def run_local() -> None:
            try:
                decision.settle(await local())
            except Exception as exc:
                failure.append(exc)
                decision.settle(decision.default)

        try:
            if self.local:
                await run_local()
                agreed = await decision.wait()
            else:
                error: Exception | None = None
                agreed = decision.default
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run_local)
                    try:
                        agreed = await self.agree(decision)
                    except Exception as exc:  # kept out of the group: raised as itself, not in a group
                        error = exc
                        tg.cancel_scope.cancel()
                if error is not None:
                    raise error
        except BaseException:
            decision.settle(decision.default)  # no-op if already settled
            raise
        if failure:
            raise failure[0]
        return agreed

    async def _wait_change(self) -> None:
        self._changed = anyio.Event()
        with anyio.move_on_after(self.idle_s):
            await self._changed.wait()

    async def drive(self, busy: Callable[[], bool]) -> int:
        """Step until no rank is busy and no decision is pending anywhere; return the steps run.

        After a step that resolved nothing, waits up to `idle_s` for a local proposal (peers meanwhile
        wait in the collective). Every rank leaves after the same step.
        """
        steps = 0
        while True:
            result = await self.step(busy=busy())
            steps += 1
            if not result.more:
                return steps
            if not result.resolved and self.idle_s:
                await self._wait_change()

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
