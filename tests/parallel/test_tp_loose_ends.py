"""Loose ends of the rank group and the agreed paths: admission's capacity under TP, the bound of an
agreed `wait_layer`, and `RankGroup.close` beside a collective in flight."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import loose_end_workers
import pytest
import torch

from hicache import HiCache, Namespace
from hicache.components import MambaState, component_storage_key
from hicache.errors import LoadBackFailed
from hicache.memory.layerwise import CpuLayerReadiness
from hicache.parallel import AgreedLayerReadiness
from hicache.parallel.launch import run_ranks
from storage_backends.memory import MemoryBackend
from tests.controller.controller_helpers import (
    PassThroughBackend,
    make_config,
    prefetch_together,
    store_sequence,
    tokens,
)


class SettlingProbe(PassThroughBackend):
    """`exists` answers only once every other task is blocked: a second admission started meanwhile has
    then made its own capacity check (and, if admitted, is waiting in its probe too)."""

    async def exists(self, keys: Sequence[str]) -> int:
        await anyio.wait_all_tasks_blocked()
        return await self.inner.exists(keys)


async def test_agreed_admissions_started_together_never_exceed_the_capacity_between_them() -> None:
    """Guards against the agreed plan checking the capacity on the in-flight value passed in: two
    32-token prefetches admitted together under a 40-token capacity both passed (neither was in flight
    while the other awaited its probe). Now a plan counts from its check until it returns, as on one
    rank. One rank runs the same plan as N (its decisions resolve at once)."""
    config = make_config(host_pages=64, prefetch_threshold=8, prefetch_capacity_tokens=40)
    digest = Namespace(model_id="controller-tests").digest
    async with (
        MemoryBackend(namespace_digest=digest) as inner,
        HiCache(config, storage=SettlingProbe(inner)) as cache,
    ):
        seqs = [tokens(0, 32), tokens(1000, 32)]
        for seq in seqs:
            await store_sequence(inner, cache, seq)
        admitted = await prefetch_together(cache, seqs)
        assert len(admitted) == 1
        assert cache.statistics().prefetch_tokens_in_flight == 32
        assert cache._admission._admitting_tokens == 0
        await cache.cancel_prefetch(admitted[0])
        cache.sanity_check()


class GatedComponentProbe(PassThroughBackend):
    """`exists` of component pages waits for `gate`; every other call passes through."""

    def __init__(self, inner: MemoryBackend) -> None:
        super().__init__(inner)
        self.gate = anyio.Event()

    async def exists(self, keys: Sequence[str]) -> int:
        if keys and keys[0].endswith(b"mamba".hex()):
            await self.gate.wait()
        return await self.inner.exists(keys)


async def test_an_agreed_admission_staging_its_components_still_counts_toward_the_capacity() -> None:
    """Guards against the agreed plan ending its capacity count before it staged the components (one
    more agreed step, a storage lookup): a second 32-token prefetch started while the first waited in
    that lookup saw neither in flight and both were admitted under a 40-token capacity. One rank runs
    the same plan as N (its decisions resolve at once)."""
    config = make_config(
        host_pages=64,
        prefetch_threshold=8,
        prefetch_capacity_tokens=40,
        components=(MambaState(16, device_slots=4, host_slots=4),),
    )
    digest = Namespace(model_id="controller-tests").digest
    async with MemoryBackend(namespace_digest=digest) as inner:
        backend = GatedComponentProbe(inner)
        async with HiCache(config, storage=backend) as cache:
            seqs = [tokens(0, 32), tokens(1000, 32)]
            for seq in seqs:
                keys = await store_sequence(inner, cache, seq)
                state = component_storage_key(bytes.fromhex(keys[-1]), "mamba")
                assert all(await inner.put([state], [memoryview(bytearray(16))]))
            admitted: list[str] = []

            async def start(i: int) -> None:
                if await cache.prefetch(f"r{i}", seqs[i]) is not None:
                    admitted.append(f"r{i}")

            async with anyio.create_task_group() as tg:
                tg.start_soon(start, 0)
                await anyio.wait_all_tasks_blocked()  # r0 staged its pages, looks its state up
                tg.start_soon(start, 1)
                await anyio.wait_all_tasks_blocked()
                backend.gate.set()
            assert admitted == ["r0"]
            assert cache._admission._admitting_tokens == 0
            await cache.cancel_prefetch("r0")
            cache.sanity_check()


class RecordingGroup:
    """A readiness group stand-in: records when each collective starts and the bound it was given."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.calls: list[tuple[float, float | None]] = []

    def min_reduce(self, tensor: torch.Tensor, *, timeout_s: float | None = None) -> torch.Tensor:
        self.calls.append((time.monotonic(), timeout_s))
        return tensor.clone()


def test_an_agreed_wait_layer_is_bounded_by_the_group_timeout_not_one_and_a_half_of_it() -> None:
    """Guards against `wait_layer` waiting half the group timeout for its own copy and then up to a
    whole timeout more in the collective (1.5x, while its docstring said within the timeout): the
    collective now gets only what is left of the timeout since the call."""
    group = RecordingGroup(timeout_s=0.2)
    readiness = AgreedLayerReadiness(CpuLayerReadiness(2), group, 2)  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(LoadBackFailed):
        readiness.wait_layer(0)  # its copy never lands: half the timeout here, then the collective
    [(at, bound)] = group.calls
    assert bound is not None
    assert at + bound <= started + group.timeout_s + 1e-3


def test_close_marks_the_group_failed_without_waiting_behind_a_readiness_collective(tmp_path: Path) -> None:
    """Guards against `RankGroup.close` holding the group's lock while it waited for the readiness
    group's (held by a collective in flight for up to the timeout): every collective of the group
    queued behind it for that long. Now close takes one lock at a time and marks the group failed
    first, so a collective raises `RankFailed` at once while the readiness collective is still in flight."""
    out = run_ranks(
        loose_end_workers.close_behind_a_readiness_collective,
        2,
        (str(tmp_path),),
        timeout_s=120,
        group_timeout_s=30.0,
    )
    assert all(o.ok for o in out), [(o.rank, o.error) for o in out]
    value = out[0].value
    assert "the rank group was closed" in value["error"]
    assert value["readiness_still_in_flight"] is True
    assert value["closer_done"] is True


def test_the_tp_demo_runs_its_forward_passes_in_the_model_thread_not_on_the_loop(tmp_path: Path) -> None:
    """Guards against the TP demo calling the model inline on the event loop (the cache's agreement
    steps, backups and storage writes then waited for every forward pass): every prefill runs in
    `ModelWorker`'s thread, as in the single-rank demo."""
    out = run_ranks(loose_end_workers.tp_demo_model_threads, 2, (str(tmp_path),), timeout_s=300)
    assert all(o.ok for o in out), [(o.rank, o.error) for o in out]
    for o in out:
        assert o.value == {"threads": ["hicache-demo-model"], "on_loop": 0, "failures": []}
