"""Per-rank functions of the rank-group tests (module level: spawned ranks import them)."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hicache.parallel import RankFailed, RankGroup


def _wait_until(predicate: Any, what: str) -> None:
    """Poll another thread's progress (no event to wait on: it sits inside a gloo collective)."""
    for _ in range(20_000):
        if predicate():
            return
        time.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def close_behind_a_readiness_collective(group: RankGroup, root: str) -> dict[str, Any]:
    """Rank 0: a thread sits in a readiness collective rank 1 never joins; another thread closes the
    group meanwhile. A collective on the main group must then raise `RankFailed` at once, not wait for
    the readiness collective to time out behind `close` (which held the main group's lock while it
    waited for the readiness group's). Rank 1 takes part in nothing until rank 0 says it is done."""
    flag = Path(root) / "rank0-done"
    if group.tp_rank == 1:
        while not flag.exists():
            time.sleep(0.01)
        return {}
    readiness = group.readiness
    assert readiness is not None
    stuck = threading.Thread(target=_swallow, args=(readiness,), daemon=True)
    stuck.start()
    _wait_until(readiness._lock.locked, "the readiness collective to start")
    closer = threading.Thread(target=group.close, daemon=True)
    closer.start()
    _wait_until(lambda: group.failed is not None, "close to mark the group failed")
    error = ""
    try:
        group.gather(torch.zeros(1, dtype=torch.int64))
    except RankFailed as exc:
        error = str(exc)
    still_stuck = stuck.is_alive()
    flag.write_text("done")
    stuck.join()
    closer.join()
    return {"error": error, "readiness_still_in_flight": still_stuck, "closer_done": not closer.is_alive()}


def _swallow(group: RankGroup) -> None:
    with contextlib.suppress(RankFailed):  # rank 1 never joins: it fails at close or the timeout
        group.gather(torch.zeros(1, dtype=torch.int64))


async def tp_demo_model_threads(group: RankGroup, root: str) -> dict[str, Any]:
    """One rank of the TP demo with `DemoModel`'s forward passes recording the thread they run in: the
    names of those threads, and whether any ran in the thread of the event loop."""
    from hicache.demo import tp
    from hicache.demo.model import DemoModel

    loop_thread = threading.current_thread()
    seen: set[str] = set()
    on_loop = [0]
    real_prefill = DemoModel.prefill

    def prefill(self: DemoModel, *args: Any, **kwargs: Any) -> Any:
        here = threading.current_thread()
        seen.add(here.name)
        on_loop[0] += here is loop_thread
        return real_prefill(self, *args, **kwargs)

    DemoModel.prefill = prefill  # type: ignore[method-assign]
    cfg = tp.TPDemoConfig(tp=group.tp_size, users=2, turns=2)
    result = await tp.serve_rank(group, cfg, Path(root).as_uri(), "threads")
    return {"threads": sorted(seen), "on_loop": on_loop[0], "failures": result["failures"]}
