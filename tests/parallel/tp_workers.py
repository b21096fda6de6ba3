"""Functions the multi-process tests run on each rank (module level: spawned processes import them)."""

from __future__ import annotations

import os
import random
import threading

import anyio
from tree_helpers import build_tree

from hicache.parallel import Agreement, Decision, RankGroup, check_same_tree
from hicache.parallel.agreement import decode_max, encode_max
from hicache.tree import RadixTree


async def minimum_of_rank_values(group: RankGroup, n: int, seed: int) -> dict[str, object]:
    """Propose `n` decisions, settle them with rank-dependent values at rank-dependent moments (each rank
    settles in its own random order, a few per step), drive until done; return the agreed values."""
    ag = Agreement(group, capacity=8)
    rng = random.Random(seed * 31 + group.tp_rank)
    decisions = [ag.propose("probe", f"req-{i}") for i in range(n)]
    values = [rng.randrange(0, 100) for _ in range(n)]
    order = list(range(n))
    rng.shuffle(order)

    def busy() -> bool:
        for _ in range(rng.randrange(0, 3)):  # a few settle before each step, a rank-local pace
            if order:
                i = order.pop()
                decisions[i].settle(values[i])
        return bool(order)

    steps = await ag.drive(busy)
    return {
        "agreed": [d.result for d in decisions],
        "local": values,
        "steps": steps,
        "collectives": group.collectives,
    }


async def late_proposer(group: RankGroup) -> dict[str, object]:
    """Rank 1 proposes its decisions only after rank 0 has stepped a few times: they wait, no error."""
    ag = Agreement(group)
    decisions = []
    if group.tp_rank == 0:
        decisions = [ag.propose("commit", f"req-{i}") for i in range(3)]
        for d in decisions:
            d.settle(7)
    for _ in range(4):  # every rank steps four times whatever it holds
        await ag.step(busy=True)
    resolved_before = [d.resolved for d in decisions]
    if group.tp_rank == 1:
        decisions = [ag.propose("commit", f"req-{i}") for i in range(3)]
        for d in decisions:
            d.settle(5)
    await ag.drive(lambda: False)
    return {"resolved_before": resolved_before, "agreed": [d.result for d in decisions]}


async def early_break(group: RankGroup, queue: int) -> dict[str, object]:
    """SGLang #30760's loop: rank 0's batch is full after 2 requests, rank 1's after 5. Each rank only
    settles decisions while walking its queue; the steps run outside the walk, so the walk's rank-local
    trip count cannot change the collectives."""
    ag = Agreement(group)
    pending = [ag.propose("prefetch_done", f"req-{i}") for i in range(queue)]
    batch_limit = 2 if group.tp_rank == 0 else 5
    walked = 0
    rounds = 0
    while any(not d.resolved for d in pending) or rounds == 0:
        rounds += 1
        for d in pending:  # the scheduler's walk of its waiting queue
            if walked >= batch_limit:
                break  # rank-local: no collective is skipped, there is none in here
            if not d.settled:
                d.settle(1)
                walked += 1
        walked = 0
        await ag.step(busy=any(not d.resolved for d in pending))
    await ag.drive(lambda: False)
    return {"agreed": [d.result for d in pending], "collectives": group.collectives}


async def divergent_proposals(group: RankGroup) -> None:
    """Rank 0 proposes a probe for request a, rank 1 for request b, in the same place: every rank raises."""
    ag = Agreement(group)
    d = ag.propose("probe", "a" if group.tp_rank == 0 else "b")
    d.settle(1)
    await ag.drive(lambda: True)


async def dies_mid_agreement(group: RankGroup, victim: int) -> dict[str, object]:
    """`victim` exits abruptly after proposing; the others' step raises and their waiter fails too."""
    ag = Agreement(group)
    d = ag.propose("commit", "req-0")
    await ag.step(busy=True)
    if group.tp_rank == victim:
        os._exit(17)
    errors: list[str] = []

    async def waiter() -> None:
        try:
            await d.wait()
        except Exception as exc:
            errors.append(type(exc).__name__)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        try:
            await ag.drive(lambda: True)
        except Exception as exc:
            errors.append(type(exc).__name__)
    return {"errors": errors, "pending": ag.statistics().pending, "failed": repr(ag.failed)}


async def never_proposes(group: RankGroup, lone: int) -> dict[str, object]:
    """Only rank `lone` proposes a decision; every rank keeps stepping (a caller bug, not a dead rank)."""
    ag = Agreement(group)
    errors: list[str] = []
    try:
        if group.tp_rank == lone:
            d = ag.propose("commit", "req-0")
            d.settle(1)
            await ag.agree(d)
        else:
            await ag.drive(lambda: False)
    except Exception as exc:
        errors += [type(exc).__name__, str(exc)]
    return {"errors": errors}


async def goes_silent(group: RankGroup, victim: int) -> dict[str, object]:
    """`victim` stops stepping (its thread blocks, the process lives on) for two group timeouts."""
    ag = Agreement(group)
    d = ag.propose("commit", "req-0")
    d.settle(1)
    if group.tp_rank == victim:
        threading.Event().wait(group.timeout_s * 2)  # a hung rank: no step, no exit
        return {"errors": []}
    errors = []
    try:
        await ag.drive(lambda: True)
    except Exception as exc:
        errors.append(type(exc).__name__)
        errors.append(str(exc))
    return {"errors": errors, "decision": repr(d)}


def trees_compare(group: RankGroup, differ_on: int | None, what: str) -> dict[str, object]:
    """Each rank builds the same tree (rank `differ_on` with one difference) and compares fingerprints."""
    tree: RadixTree = build_tree(group.tp_rank == differ_on and what)
    try:
        digest = check_same_tree(group, tree)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"digest": digest}


async def slow_local_part(group: RankGroup, slow_rank: int, gap_s: float) -> dict[str, object]:
    """`slow_rank`'s local part takes `gap_s` (longer than the group timeout); the other's is instant.
    Both keep stepping meanwhile, so no collective waits long and the agreement completes."""
    ag = Agreement(group)
    d = ag.propose("probe", "req-0")

    async def local() -> int:
        if group.tp_rank == slow_rank:
            await anyio.sleep(gap_s)  # slow storage on this rank (the fault under test, not an ordering)
            return 3
        return 9

    agreed = await ag.agree_on(d, local)
    failing = ag.propose("commit", "req-0")

    async def broken() -> int:
        if group.tp_rank == slow_rank:
            raise OSError("injected: local I/O failed")
        return 4

    error = ""
    try:
        await ag.agree_on(failing, broken)
    except OSError as exc:
        error = str(exc)
    return {"agreed": agreed, "commit": failing.result, "error": error, "steps": ag.statistics().steps}


async def chained_on_resolve(group: RankGroup) -> dict[str, object]:
    """A decision whose `on_resolve` proposes the next one (as a backup's commit proposes its write-through
    release): `drive()` keeps stepping until the chain ends, on every rank alike, and the callbacks run
    in the order of proposals with the agreed minimum (rank-dependent values, settled at rank-local
    moments: the second is settled only on this rank's next `busy()` call)."""
    ag = Agreement(group)
    seen: list[tuple[str, int | None]] = []
    later: list[Decision] = []

    def first_resolved(value: int | None) -> None:
        seen.append(("first", value))
        later.append(ag.propose("second", "x", on_resolve=lambda v: seen.append(("second", v))))

    first = ag.propose("first", "x", on_resolve=first_resolved)
    first.settle(3 + group.tp_rank)
    biggest = ag.propose("max", "x")
    biggest.settle(encode_max(10 * (group.tp_rank + 1)))

    def busy() -> bool:
        for d in later:
            d.settle(7 - group.tp_rank)
        return False

    steps = await ag.drive(busy)
    return {"seen": seen, "steps": steps, "max": decode_max(biggest.result or 0)}


async def stuck_settle(group: RankGroup, stuck_rank: int) -> dict[str, object]:
    """Decision #0's local part never finishes on `stuck_rank` (a write thread that never returned) while
    both ranks propose and settle more decisions than one step carries (capacity 4)."""
    ag = Agreement(group, capacity=4)
    first = ag.propose("store", "1")
    if group.tp_rank != stuck_rank:
        first.settle(1)
    later = [ag.propose("alloc_device", str(i)) for i in range(6)]
    for d in later:
        d.settle(1)
    errors: list[str] = []
    try:
        await ag.agree(later[-1])
    except Exception as exc:
        errors += [type(exc).__name__, str(exc)]
    return {"errors": errors, "first_failed": first.resolved and ag.failed is not None}


async def steps_for_settled(group: RankGroup) -> dict[str, object]:
    """Both ranks settle three decisions, then `drive()`: the steps it runs."""
    ag = Agreement(group)
    for i in range(3):
        ag.propose("commit", f"req-{i}").settle(1 + group.tp_rank)
    return {"steps": await ag.drive(lambda: False), "pending": ag.statistics().pending}


async def steps_for_a_late_value(group: RankGroup, late_s: float) -> dict[str, object]:
    """Rank 1 settles its value `late_s` after rank 0 (its local part is slow; `late_s` is well under
    the hold bound): the steps `agree_on` runs on each rank until the decision resolves."""
    ag = Agreement(group)
    d = ag.propose("probe", "req-0")

    async def local() -> int:
        if group.tp_rank == 1:
            await anyio.sleep(late_s)  # a slow storage probe on this rank (the fault under test)
        return 5 + group.tp_rank

    agreed = await ag.agree_on(d, local)
    return {"agreed": agreed, "steps": ag.statistics().steps}
