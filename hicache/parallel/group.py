"""A tensor-parallel rank group: one `torch.distributed` process group with this process's rank in it.

Every collective here is bounded by the group's `timeout_s`: a dead peer or one that stops responding makes
it raise `RankFailed` instead of hanging. They are synchronous but for `min_reduce_on_loop`, which an event
loop starts without a worker thread (the agreement's steps: the collective runs on the backend's own
thread and its completion wakes the loop, one thread hop fewer than a worker thread waiting on it).

On gloo, a MIN reduction runs as one `all_gather` of the fixed-shape tensor followed by a local minimum:
on a 2-core machine, gloo's `all_reduce(MIN)` of the agreement's small int64 tensor took 1.3x (2 ranks)
to 1.7x (4 ranks) as long as `all_gather_single` of it (`make bench-tp`, BENCHMARKS.md); on NCCL it is
one `all_reduce`. Either way it is exactly one collective per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hicache.parallel.errors import RankFailed

__all__ = ["RankGroup"]

_INLINE_WAIT_S = 0.001
_INLINE_WAIT = datetime.timedelta(seconds=_INLINE_WAIT_S)
"""How long `min_reduce_on_loop` waits on the loop for its collective before it parks (the least
`Work.wait` takes: its timeout is whole milliseconds, and 0 means no timeout)."""
_SLOW_IN_A_ROW = 2
"""After this many collectives in a row slower than `_INLINE_WAIT_S`, `min_reduce_on_loop` stops waiting on
the loop (until one completes within it again)."""


def _check_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a number of seconds, got {type(value).__name__} {value!r}")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}: must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class RankGroup:
    """This process's place in a tensor-parallel group: `tp_rank`, `tp_size` and the process group.

    Args:
        process_group: the `torch.distributed` process group of the TP ranks (gloo or NCCL); `None` uses
            the default (world) group, which must then be initialised.
        timeout_s: the most one collective may wait for the other ranks before `RankFailed` is raised.
        readiness_process_group: a second process group over the same ranks (gloo: it carries small
            host integers), for the per-layer readiness collectives that layer-wise load-back runs in the
            model's thread while the cache's agreement steps run on the event loop: two threads issuing
            collectives on one group could pair different collectives across the ranks. Needed only
            with `layerwise_load_back`; `init_local` makes one.

    Raises:
        ValueError: naming `process_group` when torch.distributed is not initialised, `timeout_s`
            when it is not a positive finite number, or `readiness_process_group` when it is the
            group itself or its ranks differ.
    """

    def __init__(
        self, process_group: Any = None, *, timeout_s: float = 30.0, readiness_process_group: Any = None
    ) -> None:
        self.timeout_s = _check_seconds("timeout_s", timeout_s)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group: torch.distributed is not initialised in this process")
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.tp_rank: int = dist.get_rank(self.process_group)
        self.tp_size: int = dist.get_world_size(self.process_group)
        self.backend: str = str(dist.get_backend(self.process_group))
        self._lock = threading.Lock()
        """Held for the whole of a collective (one at a time on the group), and by `close` to destroy it."""
        self._state_lock = threading.Lock()
        """Guards `_failed` and `_owned` only, never held while waiting: `close` marks the group failed at
        once, even while a collective holds `_lock`."""
        self._failed: RankFailed | None = None
        self._owned = False
        self.collectives = 0
        """Collectives this rank has run on the group (every rank runs the same number)."""
        self.inline_completions = 0
        """Collectives of `min_reduce_on_loop` that completed by the end of its short wait on the loop."""
        self._slow_in_a_row = 0
        """How many of `min_reduce_on_loop`'s last collectives in a row took longer than the short wait's
        bound (it waits while fewer than `_SLOW_IN_A_ROW` did)."""
        self._min_what = "all_gather" if self.backend == "gloo" else "all_reduce(MIN)"
        self._gathered: torch.Tensor | None = None
        """gloo: the buffer `_start_min_reduce`'s all-gather fills (one shape at a time, kept)."""
        self.readiness: RankGroup | None = None
        """The group of the per-layer readiness collectives (`readiness_process_group`), or None."""
        if readiness_process_group is not None:
            if readiness_process_group is self.process_group:
                raise ValueError(
                    "readiness_process_group: must be a second process group over the same ranks, not "
                    "the group itself (two threads' collectives on one group could pair up wrongly)"
                )
            readiness = RankGroup(readiness_process_group, timeout_s=timeout_s)
            if (readiness.tp_rank, readiness.tp_size) != (self.tp_rank, self.tp_size):
                raise ValueError(
                    f"readiness_process_group: rank {readiness.tp_rank} of {readiness.tp_size}, but the "
                    f"process group has this process as rank {self.tp_rank} of {self.tp_size}"
                )
            self.readiness = readiness

    @classmethod
    def init_local(
        cls,
        rank: int,
        size: int,
        rendezvous: str | Path,
        *,
        timeout_s: float = 30.0,
    ) -> RankGroup:
        """Initialise a gloo group on 127.0.0.1 through a rendezvous file shared by the ranks (tests,
        the demo and the benchmark; a serving engine passes its own TP group to the constructor).

        Args:
            rank: this process's rank, 0 <= rank < size.
            size: the number of ranks.
            rendezvous: a path every rank passes; it must not exist before the group is formed.
            timeout_s: the collective timeout of the group.
        """
        timeout_s = _check_seconds("timeout_s", timeout_s)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: expected an int >= 1, got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank: expected an int in [0, {size}), got {rank!r}")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(str(rendezvous), size)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # A second gloo group over the same ranks (every rank creates it here, at the same point).
        readiness = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        group = cls(timeout_s=timeout_s, readiness_process_group=readiness)
        group._owned = True
        return group

    @property
    def failed(self) -> RankFailed | None:
        """The error that broke the group, or None while it works."""
        return self._failed

    def _run(self, what: str, op: Any, timeout_s: float | None = None) -> None:
        wait_s = self._wait_s(timeout_s)
        with self._lock:
            if self._failed is not None:
                raise self._failed
            try:
                work = op()
                work.wait(timeout=datetime.timedelta(seconds=wait_s))
            except Exception as exc:
                raise self._broke(what, wait_s, exc) from exc
            finally:
                self.collectives += 1

    def _wait_s(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else max(0.001, min(timeout_s, self.timeout_s))

    def _broke(self, what: str, wait_s: float, exc: BaseException | None) -> RankFailed:
        """Mark the group failed by `what` (the first failure is kept) and return the error to raise."""
        failed = RankFailed(
            f"rank {self.tp_rank}/{self.tp_size}: {what} did not complete within "
            f"{wait_s:g} s (a peer rank died, closed its group or stopped responding)"
            + (f": {exc}" if exc is not None else "")
        )
        with self._state_lock:
            if self._failed is None:
                self._failed = failed
            return self._failed

    def _start_min_reduce(self, tensor: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Start the MIN collective of `tensor` (with `_lock` held): (its work, the buffer it fills). On
        gloo the buffer is the group's one gather buffer for that size, reused (the lock orders its
        users; a collective that timed out, and may still write into it, failed the group for good)."""
        if self.backend == "gloo":
            flat = tensor.contiguous().view(-1)
            out = self._gathered
            if out is None or out.numel() != self.tp_size * flat.numel() or out.dtype != flat.dtype:
                out = self._gathered = torch.empty(self.tp_size * flat.numel(), dtype=flat.dtype)
            work = dist.all_gather_single(out, flat, group=self.process_group, async_op=True)
            return work, out
        result = tensor.clone()
        work = dist.all_reduce(result, op=dist.ReduceOp.MIN, group=self.process_group, async_op=True)
        return work, result

    def _min_of(self, out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The minimum over the ranks from what `_start_min_reduce`'s collective filled (a new tensor)."""
        if self.backend != "gloo":
            return out
        return torch.from_numpy(out.numpy().reshape(self.tp_size, *shape).min(axis=0))

    def min_reduce(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> torch.Tensor:
        """The elementwise minimum of `tensor` over the ranks (an int64 CPU tensor of the same shape on
        every rank); one collective.

        Args:
            tensor: this rank's values.
            timeout_s: the most this collective may wait for the peers (at most the group's `timeout_s`,
                its default): a caller that already spent part of its own bound passes what is left.

        Raises:
            RankFailed: the collective did not complete within its timeout, now or earlier.
        """
        if self.tp_size == 1:
            return tensor.clone()
        started: list[torch.Tensor] = []

        def start() -> Any:
            work, out = self._start_min_reduce(tensor)
            started.append(out)
            return work

        self._run(self._min_what, start, timeout_s)
        return self._min_of(started[0], tensor.shape)

    async def min_reduce_on_loop(
        self, tensor: torch.Tensor, on_done: Callable[[torch.Tensor | None, RankFailed | None], None]
    ) -> None:
        """Start `min_reduce` of `tensor` from the running asyncio event loop, without a worker thread;
        `on_done(minimum, None)` or `on_done(None, error)` is called exactly once, on the loop, when the
        collective completes or `timeout_s` passes, whatever happens to the caller meanwhile.

        Returns after one turn of the loop, taken while the collective is in flight (the loop's other
        tasks run then, at no cost to the collective), and then: on gloo, after a collective that
        completed within 1 ms, once this one completed within a wait on the loop of at most 1 ms (the
        GIL released; `on_done` has run); otherwise, or when that wait runs out, at once, and the
        backend's completion wakes the loop later. A cancellation of the caller in its turn hands the
        collective to the backend's completion the same way, then propagates: nothing stops it half-way
        on this rank alone (the agreement's steps rely on that). `tensor` stays referenced until the
        backend lets go of it.
        """
        if self.tp_size == 1:
            on_done(tensor.clone(), None)
            return
        loop = asyncio.get_running_loop()
        reduction = _LoopReduction(self, tensor, on_done, loop)
        if not self._lock.acquire(blocking=False):
            # A thread's collective (a fingerprint check) holds the group: wait for it off the loop.
            loop.run_in_executor(None, self._lock.acquire).add_done_callback(lambda _: reduction.begin(True))
            return
        reduction.begin(False)
        try:
            await asyncio.sleep(0)
        except BaseException:
            reduction.park()
            raise
        reduction.wait_briefly()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` stacked by rank (same shape and dtype on every rank); one collective."""
        if self.tp_size == 1:
            return tensor.clone().unsqueeze(0)
        flat = tensor.contiguous().view(-1)
        out = torch.empty(self.tp_size * flat.numel(), dtype=flat.dtype)
        self._run(
            "all_gather", lambda: dist.all_gather_single(out, flat, group=self.process_group, async_op=True)
        )
        return out.view(self.tp_size, *tensor.shape)

    def gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload` by rank (any lengths): two collectives, the lengths then the padded bytes."""
        lengths = self.gather(torch.tensor([len(payload)], dtype=torch.int64)).view(-1).tolist()
        width = max(1, *lengths)
        buf = torch.zeros(width, dtype=torch.uint8)
        if payload:
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = self.gather(buf)
        return [bytes(rows[r, : lengths[r]].numpy().tobytes()) for r in range(self.tp_size)]

    def close(self) -> None:
        """Leave the group: later collectives raise `RankFailed` here, and peers waiting in one see the
        connection close. Destroys the process group only if `init_local` created it. Idempotent.

        The group is marked closed at once (a collective starting later raises at once, whatever is in
        flight); only the destruction of a group `init_local` made waits for a collective in flight to
        end (bounded by the timeout: a process group must not be destroyed under one). No lock is held
        while another is taken: the readiness group is closed after this group's state lock is let go,
        and this group's collective lock is taken last, alone.
        """
        with self._state_lock:
            if self._failed is None:
                self._failed = RankFailed(f"rank {self.tp_rank}/{self.tp_size}: the rank group was closed")
            owned, self._owned = self._owned, False
        if self.readiness is not None:
            self.readiness.close()
        if owned:
            with self._lock:
                if dist.is_initialized():
                    dist.destroy_process_group()

    def __repr__(self) -> str:
        state = "failed" if self._failed is not None else "ok"
        return (
            f"RankGroup(tp_rank={self.tp_rank}, tp_size={self.tp_size}, backend={self.backend}, "
            f"timeout_s={self.timeout_s:g}, collectives={self.collectives}, {state})"
        )


class _LoopReduction:
    """One collective of `RankGroup.min_reduce_on_loop`: begun with the group's lock held, ended exactly
    once (completed, failed or timed out), which lets the lock go and calls `on_done` on the loop."""

    __slots__ = ("_group", "_loop", "_on_done", "_out", "_parked", "_started", "_tensor", "_timer", "_work")

    def __init__(
        self,
        group: RankGroup,
        tensor: torch.Tensor,
        on_done: Callable[[torch.Tensor | None, RankFailed | None], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._group = group
        self._tensor = tensor
        self._on_done: Callable[[torch.Tensor | None, RankFailed | None], None] | None = on_done
        self._loop = loop
        self._work: Any = None
        self._out: torch.Tensor | None = None
        self._started = 0.0
        self._parked = False
        self._timer: asyncio.TimerHandle | None = None

    def begin(self, park: bool) -> None:
        """Start the collective (the group's lock is held); `park`: hand it to the backend's completion
        at once (begun from a callback, where no one waits on the loop)."""
        group = self._group
        if group._failed is not None:
            self._end(None, group._failed)
            return
        try:
            self._work, self._out = group._start_min_reduce(self._tensor)
        except Exception as exc:
            self._end(None, group._broke(group._min_what, group.timeout_s, exc))
            return
        self._started = time.perf_counter()
        if park:
            self.park()

    def wait_briefly(self) -> None:
        """After the caller's turn: end here if the collective completed; else, on gloo and after a
        collective of the last two that completed within `_INLINE_WAIT_S`, wait for it on the loop that
        long (the GIL
        released: the peers are usually in the same step, and one that completes within the bound costs
        one wake of this thread instead of the backend thread's callback, the loop's self-pipe and a
        second loop turn, ~125 us at TP 2 on 2 cores, BENCHMARKS.md; at TP 2 under load, most collectives
        right after a slow one completed within the bound: skipping after one slow one missed them, while
        at TP 4 on 2 cores slow ones come in runs); else park. (NCCL's `wait` does
        not wait for the host: the callback path only.)"""
        if self._on_done is None or self._work is None:
            return
        group = self._group
        work = self._work
        slow = group._slow_in_a_row >= _SLOW_IN_A_ROW
        try:
            if group.backend != "gloo" or (slow and not work.is_completed()):
                self.park()
                return
            work.wait(timeout=_INLINE_WAIT)
        except Exception:  # still running (or failed: its future says so, in `_completed`)
            self.park()  # counted slow when it completes (`_completed`)
            return
        group.inline_completions += 1
        group._slow_in_a_row = 0
        self._settle()

    def park(self) -> None:
        """Let the backend's completion wake the loop, within the group's timeout (once; not before the
        collective began, nor after it ended)."""
        if self._parked or self._on_done is None or self._work is None:
            return
        self._parked = True
        group = self._group
        self._timer = self._loop.call_later(group.timeout_s, self._timed_out)
        loop = self._loop
        try:
            self._work.get_future().add_done_callback(lambda fut: _call_soon(loop, self._completed, fut))
        except Exception as exc:  # no completion will come: end it here, the group failed
            self._end(None, group._broke(group._min_what, group.timeout_s, exc))

    def _timed_out(self) -> None:
        group = self._group
        self._end(None, group._broke(group._min_what, group.timeout_s, None))

    def _completed(self, fut: Any) -> None:
        """On the loop, from the backend's completion callback."""
        if self._on_done is None:
            return
        group = self._group
        fast = time.perf_counter() - self._started < _INLINE_WAIT_S
        group._slow_in_a_row = 0 if fast else group._slow_in_a_row + 1
        try:
            fut.value()
        except Exception as exc:
            self._end(None, group._broke(group._min_what, group.timeout_s, exc))
            return
        self._settle()

    def _settle(self) -> None:
        """The collective completed: hand its minimum to `on_done` (or, if reading it fails, the group's
        failure: the lock is let go and `on_done` called whatever happens)."""
        assert self._out is not None
        group = self._group
        try:
            minimum = group._min_of(self._out, self._tensor.shape)
        except Exception as exc:
            self._end(None, group._broke(group._min_what, group.timeout_s, exc))
            return
        self._end(minimum, None)

    def _end(self, result: torch.Tensor | None, error: RankFailed | None) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        group = self._group
        group.collectives += 1
        group._lock.release()
        on_done(result, error)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], arg: Any) -> None:
    """From the backend's thread: run `callback(arg)` on `loop` (unless it closed: nobody waits then)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, arg)
