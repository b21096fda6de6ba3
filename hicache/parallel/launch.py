"""Run a function on N local gloo ranks, one spawned process each, under a watchdog (tests, the demo,
the benchmark). A serving engine has its own launcher and passes its TP group to `RankGroup`."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.errors import HiCacheError
from hicache.parallel.group import RankGroup

__all__ = ["RankOutcome", "RanksTimedOut", "run_ranks"]


class RanksTimedOut(HiCacheError, TimeoutError):
    """Raised by `run_ranks` when the ranks did not all finish within its watchdog timeout (they are
    killed first); the message lists the ranks still running."""


@dataclass(frozen=True, slots=True)
class RankOutcome:
    """How one rank's run ended.

    Attributes:
        rank: the rank.
        exitcode: the process's exit code (0 when the function returned or raised normally).
        value: what the function returned (None when it raised or the process died).
        error_type: the name of the exception the function raised, or None.
        error: the exception's message and traceback, or None.
    """

    rank: int
    exitcode: int | None
    value: Any
    error_type: str | None
    error: str | None

    @property
    def ok(self) -> bool:
        """The function returned and the process exited cleanly."""
        return self.exitcode == 0 and self.error_type is None


def _child(
    rank: int,
    size: int,
    rendezvous: str,
    group_timeout_s: float,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    out: str,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    group = RankGroup.init_local(rank, size, rendezvous, timeout_s=group_timeout_s)
    result: tuple[str, Any, str | None]
    try:
        if inspect.iscoroutinefunction(target):
            value = asyncio.run(target(group, *args))
        else:
            value = target(group, *args)
        result = ("ok", value, None)
    except BaseException as exc:
        result = ("error", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
    with contextlib.suppress(Exception):
        group.close()
    with open(out + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out + ".tmp", out)
    os._exit(0)  # skip interpreter teardown: gloo threads of a broken group may block it


def run_ranks(
    target: Callable[..., Any],
    size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    group_timeout_s: float = 30.0,
) -> list[RankOutcome]:
    """Run `target(group, *args)` in `size` spawned processes forming one gloo group on 127.0.0.1.

    `target` must be importable by name (a module-level function); a coroutine function runs under
    `asyncio.run`. Returns one `RankOutcome` per rank, in rank order; a rank that raised or died is reported,
    not re-raised.

    Raises:
        ValueError: naming `size` when it is not an int >= 1 (no rank would run: nothing to report).
        RanksTimedOut: some rank was still running after `timeout_s` (every rank is killed first).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size: expected an int >= 1, got {size!r}")
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hicache-tp-") as tmp:
        rendezvous = str(Path(tmp) / "rendezvous")
        outs = [str(Path(tmp) / f"rank-{r}.pkl") for r in range(size)]
        procs = [
            ctx.Process(
                target=_child,
                args=(r, size, rendezvous, group_timeout_s, target, tuple(args), outs[r]),
                name=f"hicache-tp-rank-{r}",
                daemon=True,
            )
            for r in range(size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        if stuck:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5.0)
            raise RanksTimedOut(f"ranks {stuck} of {size} still running after {timeout_s:g} s; killed")
        outcomes = []
        for r, p in enumerate(procs):
            value = error_type = error = None
            if os.path.exists(outs[r]):
                with open(outs[r], "rb") as f:
                    status, payload, text = pickle.load(f)
                if status == "ok":
                    value = payload
                else:
                    error_type, error = payload, text
            outcomes.append(RankOutcome(r, p.exitcode, value, error_type, error))
        return outcomes
