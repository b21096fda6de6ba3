"""The serving loop's run modes: lockstep runs are reproducible, and the demo pins torch's intra-op threads."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

pytest.importorskip("transformers")

from hicache.demo.llama_serve import run_demo
from hicache.demo.loop import ServingLoop
from hicache.demo.model import ModelSpec
from hicache.demo.records import DemoConfig, DemoResult, noop_progress
from hicache.demo.run import intra_op_threads
from hicache.demo.worker import ModelWorker
from hicache.demo.workload import WorkloadSpec, make_workload

SMALL = DemoConfig(
    users=2,
    turns=3,
    page_size=16,
    device_pages=24,
    host_pages=24,
    prefetch_threshold=16,
    lockstep=True,
    model=ModelSpec(
        num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16
    ),
    workload=WorkloadSpec(system_prompts=1, system_prompt_tokens=96, user_tokens=(16, 48), decode_tokens=4),
)


def hits_by_request(result: DemoResult) -> dict[str, tuple[int, dict[str, int], str | None]]:
    return {r.request_id: (r.reused_len, r.hits, r.prefetch) for r in result.records}


def test_lockstep_runs_hit_the_same_tiers_every_time() -> None:
    """In lockstep, requests run one at a time in turn order and the cache settles in between: two runs
    give every request the same hits from the same tiers (and every output matches recompute)."""
    first = anyio.run(run_demo, SMALL)
    second = anyio.run(run_demo, SMALL)
    assert first.all_identical
    assert second.all_identical
    assert [r.request_id for r in first.records] == ["u0t0", "u1t0", "u0t1", "u1t1", "u0t2", "u1t2"]
    assert hits_by_request(first) == hits_by_request(second)
    assert sum(r.reused_len for r in first.records) > 0
    # Both runs record their wait for a running slot the same way (the no-cache one since issue 13).
    assert all(
        r.queue_s >= 0 and r.queue_nocache_s is not None and r.queue_nocache_s >= 0 for r in first.records
    )


def test_intra_op_threads_sets_and_restores_the_calling_threads_setting() -> None:
    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before


async def test_a_call_waiting_for_the_model_runs_between_two_decode_steps() -> None:
    """The model thread runs a decode one step per turn, in arrival order: a prefill that queues while a
    step runs goes next, rather than waiting for the whole decode (its time to first token)."""
    loop = ServingLoop(None, make_workload(WorkloadSpec(users=1, turns=1)), 2, None, noop_progress)
    order: list[str] = []
    gate = threading.Event()

    running = threading.Event()

    def steps() -> Generator[None, None, str]:
        order.append("step 1")
        running.set()
        assert gate.wait(30)  # holds the model thread until the prefill has queued for it
        yield
        order.append("step 2")
        yield
        order.append("step 3")
        return "decoded"

    results: list[str] = []

    async def decode() -> None:
        results.append(await loop.compute_steps(steps()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(decode)
        await anyio.to_thread.run_sync(running.wait)  # the model thread runs step 1
        tg.start_soon(loop.compute, lambda: order.append("prefill"))
        await anyio.wait_all_tasks_blocked()
        assert loop.worker.waiting == 1
        gate.set()
    loop.worker.close()
    assert order == ["step 1", "prefill", "step 2", "step 3"]
    assert results == ["decoded"]


def test_a_password_in_the_backend_url_reaches_no_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The storage URL's user info is shown as `***` everywhere the demo shows it: the summary (`--json`),
    the table, the snapshot file, the Prometheus text and the chart's title."""
    from matplotlib.figure import Figure
    from rich.console import Console

    from hicache.demo.plot import save_plot
    from hicache.demo.report import render_summary, save_snapshot, summarize

    secret = "hunter2secret"
    config = dataclasses.replace(SMALL, turns=1, backend_url=f"memory://alice:{secret}@redaction-test")
    result = anyio.run(run_demo, config)
    assert result.all_identical
    summary = summarize(result)
    assert summary["backend"] == "memory://***@redaction-test"
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render_summary(summary))
    save_snapshot(result, summary, tmp_path / "snap.json")
    shown = {
        "json": json.dumps(summary),
        "table": console.export_text(),
        "snapshot": (tmp_path / "snap.json").read_text(),
        "prometheus": result.prometheus,
        "repr": repr(result.config),
    }
    for where, text in shown.items():
        assert secret not in text, where
    assert "***@redaction-test" in shown["table"]
    titles: list[str] = []
    suptitle = Figure.suptitle

    def recording_suptitle(fig: Figure, t: str, **kwargs: Any) -> Any:
        titles.append(t)
        return suptitle(fig, t, **kwargs)

    monkeypatch.setattr(Figure, "suptitle", recording_suptitle)
    save_plot(result, tmp_path / "plot.png")
    assert len(titles) == 1
    assert "***@redaction-test" in titles[0]
    assert secret not in titles[0]


async def test_the_model_thread_hands_errors_back_and_never_abandons_a_call() -> None:
    """A model call that raises raises in its caller (the thread serves the next call); a caller cancelled
    while its call runs waits until the call returned, so nothing it frees on the way out is still in use
    by the model."""
    worker = ModelWorker(None)
    gate = threading.Event()
    finished: list[str] = []

    def boom() -> None:
        raise RuntimeError("model failure")

    with pytest.raises(RuntimeError, match="model failure"):
        await worker.call(boom)
    assert await worker.call(lambda: "next") == "next"
    entered = threading.Event()

    def held() -> None:
        entered.set()
        assert gate.wait(30)
        finished.append("held")

    # Cancelled with asyncio's own `Task.cancel`: the cache's one cancellation vocabulary. (Under an anyio
    # scope the wait is the same, but anyio re-sends the cancellation every loop turn, so its
    # `wait_all_tasks_blocked` never sees the caller blocked.)
    caller = asyncio.ensure_future(worker.call(held))
    assert await asyncio.to_thread(entered.wait, 30)  # the model thread runs the call
    caller.cancel()
    for _ in range(20):  # turns of the loop in which an abandoning caller would have returned
        await asyncio.sleep(0)
    assert not caller.done()  # still waiting for the model
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert finished == ["held"]
    worker.close()
    worker.close()  # idempotent


async def test_a_cancelled_run_still_stops_the_model_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_serving` stops the model thread on its way out even when the run is cancelled (Ctrl-C, a
    deadline): an unshielded `close` raised at its first checkpoint and left the thread waiting forever."""
    import hicache.demo.run as demo_run

    loop = ServingLoop(None, make_workload(WorkloadSpec(users=1, turns=1)), 2, None, noop_progress)
    with anyio.CancelScope() as scope:

        async def phases(runner: ServingLoop[Any], *args: object) -> None:
            await runner.compute(lambda: None)  # the model thread is started
            scope.cancel()
            await anyio.sleep_forever()

        monkeypatch.setattr(demo_run, "_serve_phases", phases)
        config = dataclasses.replace(SMALL, torch_threads=None)
        await demo_run.run_serving(loop, config, lambda url: None, {})  # type: ignore[arg-type]
    assert scope.cancelled_caught
    assert loop.worker._thread is not None
    assert not loop.worker._thread.is_alive()
