"""The controller state machine with layer-wise load-back on: every rule (acquire with host and storage
hits, serve, evict, cancel, storage faults, close) runs while loads land layer by layer in tasks of their
own, and copies fail (at a drawn layer, for the next few copies) or are cancelled (the loop shutting
down) at drawn points. Before each step's checks the machine waits for the loads in flight; a lease
whose load failed must then raise `LoadBackFailed` from `wait_layer` (never block, never hand out its
pages), and its holder releases it and would recompute. Then the same exact accounting and content
checks hold (no page leaks; every device page of the tree holds its oracle KV), for both refill
policies."""

from __future__ import annotations

import dataclasses
import threading

import anyio
import anyio.lowlevel
import pytest
import torch
from cache_internals import layered_loader_of
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule
from kv_oracle import chain_payload
from test_controller_state_machine import (
    ControllerMachine,
    Held,
    make_tokens,
    picks,
    sequences,
    short_sequences,
)

from hicache import HiCacheConfig, KVLayout, Lease, LoadBackFailed
from hicache.keys import TOKEN_BYTES, as_key_bytes
from hicache.memory.layerwise import LayerReadiness, LayerwiseCopy, read_layer_tokens
from hicache.policy import StopPolicy, WritePolicy


class FailCopies:
    """A `before_layer` hook: the next `count` copies that reach layer `layer` fail there (in the copying
    thread, as a device error would)."""

    def __init__(self, layer: int, count: int) -> None:
        self.layer = layer
        self.left = count
        self._lock = threading.Lock()

    def __call__(self, layer: int) -> None:
        if layer != self.layer:
            return
        with self._lock:
            if self.left <= 0:
                return
            self.left -= 1
        raise RuntimeError(f"injected copy failure at layer {layer}")


def wait_every_layer(layers: LayerReadiness, num_layers: int) -> None:
    """What a model reading every layer does (raises `LoadBackFailed` for a failed load)."""
    for layer in range(num_layers):
        layers.wait_layer(layer)


class LayerwiseControllerMachine(ControllerMachine):
    """`ControllerMachine` over a cache that loads host hits back layer by layer, with copy failures and
    cancellations injected."""

    def cache_config(self, layout: KVLayout, write: WritePolicy, stop: StopPolicy) -> HiCacheConfig:
        return dataclasses.replace(super().cache_config(layout, write, stop), layerwise_load_back=True)

    async def check(self) -> None:
        loader = layered_loader_of(self.c)
        if loader.in_flight:
            event("a layer-wise load in flight at the end of a step")
        with anyio.fail_after(30):
            while loader.in_flight or loader._tasks:  # noqa: ASYNC110 - the copy runs in a worker thread
                await anyio.sleep(0.001)
        self.drop_failed_leases()
        await super().check()

    def drop_failed_leases(self) -> None:
        """Every lease whose load failed tells its reader so at once (no block, no stale read); its holder
        gives it back, with what it computed, to recompute."""
        num_layers = self.c.config.layout.num_layers
        for request_id, held in list(self.leases.items()):
            layers = held.lease.layers
            if not layers.done or layers.is_ready(num_layers - 1):
                continue
            with pytest.raises(LoadBackFailed):
                wait_every_layer(layers, num_layers)
            event("a lease's load-back failed")
            del self.leases[request_id]
            self.free_held(self.c, held)
            self.c.release(held.lease)

    @rule(layer=st.integers(0, 1), count=st.integers(1, 3))
    def fail_copies(self, layer: int, count: int) -> None:
        """The next `count` layer-wise copies fail before `layer`."""
        layered_loader_of(self.c).before_layer = FailCopies(layer, count)

    @rule(seq=sequences, stored=st.none() | picks, turns=st.integers(0, 6))
    def acquire_then_cancel_loads(self, seq: tuple[list[int], int], stored: int | None, turns: int) -> None:
        """Acquire, then after `turns` scheduler turns cancel every layer-wise load's task (what a loop
        shutting down does): the lease's readiness then fails, whatever had landed."""
        tokens = self.pick_tokens(seq, stored)
        self.remember(tokens)
        request_id = self.next_id("x")
        opened = self.gate_for_blocking_wait()

        async def go() -> None:
            lease = await self.c.acquire(request_id, tokens)
            if opened:
                self.backend.gated = True
            self.leases[request_id] = Held(lease, tokens)
            for _ in range(turns):
                await anyio.lowlevel.checkpoint()
            for task in list(layered_loader_of(self.c)._tasks):
                if task.cancel():
                    event("a layer-wise load cancelled")

        self.run(go)

    @rule(seq=sequences, stored=st.none() | picks, layer=st.integers(0, 1), reach=st.booleans())
    def acquire_then_end_loads_with_their_copy_running(
        self, seq: tuple[list[int], int], stored: int | None, layer: int, reach: bool
    ) -> None:
        """Acquire with the copy held before `layer` (reached by its thread first, with `reach`), then end
        every layer-wise load's task with an exception other than a cancellation while it waits for its
        copy (`_run` absorbs cancellations; this is what is left): the load fails at once, its pages stay
        the copy's (no match reaches them: the tree never knew them) until it settled, then are freed."""
        tokens = self.pick_tokens(seq, stored)
        self.remember(tokens)
        request_id = self.next_id("i")
        opened = self.gate_for_blocking_wait()

        async def go() -> None:
            cache = self.c
            loader = layered_loader_of(cache)
            hold = HoldThenFail(layer, fail=False)
            loader.before_layer = hold
            try:
                lease = await cache.acquire(request_id, tokens)
                if opened:
                    self.backend.gated = True
                self.leases[request_id] = Held(lease, tokens)
                loads = list(loader._landing.values())
                if not loads:
                    return
                if reach:
                    await anyio.to_thread.run_sync(hold.reached.wait)
                for load in loads:
                    end_its_task_while_it_waits(load.copy)
                for task in list(loader._tasks):
                    task.cancel()
                with anyio.fail_after(30):
                    while not all(load.ended.is_set() for load in loads):
                        await anyio.lowlevel.checkpoint()
                for load in loads:
                    if not load.copy.settled:
                        event("a load ended with its copy running, its pages the copy's until it settled")
                        match = cache.match(load.key)
                        assert not bool(torch.isin(match.device_indices, load.device_indices).any())
            finally:
                hold.release()
                loader.before_layer = None

        self.run(go)

    @rule(
        seq=sequences,
        stored=st.none() | picks,
        pages=st.integers(1, 4),
        longer=st.booleans(),
        fail=st.booleans(),
    )
    def acquire_while_a_load_lands(
        self, seq: tuple[list[int], int], stored: int | None, pages: int, longer: bool, fail: bool
    ) -> None:
        """A host hit loads back held before layer 1 (to fail there, with `fail`); meanwhile a second
        request acquires its first `pages` pages (it shares the landing load: its pages, its outcome) or,
        with `longer`, the first request took only those and the second takes all (it waits for the load
        to end, then loads what is left itself)."""
        tokens = self.pick_tokens(seq, stored)
        short = tokens[: pages * self.page_size]
        first_tokens, other = (short, tokens) if longer else (tokens, short)
        self.remember(tokens)
        first_id, second_id = self.next_id("a"), self.next_id("b")
        opened = self.gate_for_blocking_wait()

        async def go() -> None:
            cache = self.c
            loader = layered_loader_of(cache)
            hold = HoldThenFail(1, fail=fail)
            loader.before_layer = hold
            try:
                first = await cache.acquire(first_id, first_tokens)
                if opened:
                    self.backend.gated = True
                self.leases[first_id] = Held(first, first_tokens)
                if not loader.in_flight:
                    return
                await anyio.to_thread.run_sync(hold.reached.wait)
                loader.before_layer = None
                got: list[Lease] = []
                async with anyio.create_task_group() as tg:

                    async def second() -> None:
                        got.append(await cache.acquire(second_id, other, prefetch=False))

                    tg.start_soon(second)
                    await anyio.wait_all_tasks_blocked()
                    event(f"a second acquire {'shares' if got else 'waits for'} a landing load")
                    hold.release()
                self.leases[second_id] = Held(got[0], other)
            finally:
                hold.release()
                loader.before_layer = None

        self.run(go)

    @rule(seq=short_sequences)
    def serve(self, seq: tuple[list[int], int]) -> None:
        """A whole request whose model reads the prefix layer by layer as it lands: each layer is read only
        once `wait_layer` returned, and holds the oracle KV then; a failed load raises `LoadBackFailed`
        instead and the request releases everything (it would recompute)."""
        tokens = make_tokens(*seq, self.page_size)
        self.remember(tokens)
        request_id = self.next_id("s")
        opened = self.gate_for_blocking_wait()

        async def go() -> None:
            cache = self.c
            lease = await cache.acquire(request_id, tokens)
            if opened:
                self.backend.gated = True
            expected = chain_payload(
                lease.key[: lease.cached_len * TOKEN_BYTES], cache.config.layout, self.namespace
            )
            try:
                for layer in range(cache.config.layout.num_layers):
                    await lease.layers.wait_layer_async(layer)
                    got = read_layer_tokens(cache.device_pool, lease.device_indices, layer)
                    assert torch.equal(got, expected[layer]), f"layer {layer} read before it held its KV"
            except LoadBackFailed:
                event("serve: the prefix's load-back failed")
                cache.release(lease)
                return
            padded = -(-len(tokens) // self.page_size) * self.page_size
            new = await cache.alloc_device(padded - lease.cached_len)
            if new is None:
                cache.release(lease)
                return
            aligned = len(tokens) // self.page_size * self.page_size
            if aligned > lease.cached_len:
                kv = chain_payload(lease.key[: aligned * TOKEN_BYTES], cache.config.layout, self.namespace)
                cache.device_pool.write_tokens(
                    new[: aligned - lease.cached_len], kv[:, :, lease.cached_len :]
                )
            try:
                await cache.insert(lease, tokens, torch.cat([lease.device_indices, new]))
            except LoadBackFailed:  # a load above ours failed after we read: ours was revoked with it
                event("serve: insert refused, the prefix's load-back failed")
                cache.release(lease, new)

        self.run(go)


class HoldThenFail:
    """A `before_layer` hook: the first copy to reach `layer` waits there until `release()`, then fails
    (unless `fail` is false)."""

    def __init__(self, layer: int, *, fail: bool = True) -> None:
        self.layer = layer
        self.fail = fail
        self.reached = threading.Event()
        self._go = threading.Event()
        self._used = False

    def __call__(self, layer: int) -> None:
        if layer != self.layer or self._used:
            return
        self._used = True
        self.reached.set()
        assert self._go.wait(30), "the test never released the held copy"
        if self.fail:
            raise RuntimeError(f"injected copy failure at layer {layer}")

    def release(self) -> None:
        self._go.set()


class Interrupted(BaseException):
    """Ends a load's task while it waits for its copy (neither an `Exception` nor a cancellation)."""


def end_its_task_while_it_waits(copy: LayerwiseCopy) -> None:
    """The next `wait_settled` of `copy` (its task's, once cancelled) raises `Interrupted` at once."""
    real = copy.wait_settled
    used = False

    async def interrupted() -> None:
        nonlocal used
        if not used:
            used = True
            raise Interrupted
        await real()

    copy.wait_settled = interrupted  # type: ignore[method-assign]


class KeptPathMachine(LayerwiseControllerMachine):
    """The layer-wise machine plus a rule that fails a load while another request inserts its prefix and
    a child below it, and a third holds a lease on both (before, the failed pages stayed on the device
    under the locked child, poisoned, and were copied again; now the failure touches nothing)."""

    @rule(seq=sequences, stored=st.none() | picks, extra=st.integers(1, 2), fail_again=st.booleans())
    def fail_a_load_under_a_held_child(
        self, seq: tuple[list[int], int], stored: int | None, extra: int, fail_again: bool
    ) -> None:
        """A host hit loads back layer-wise and is held before its last layer; meanwhile a request that
        computed the prefix and `extra` pages more itself inserts them (a device-only child below the
        loading pages) and another request acquires all of it (locking the child); then the load fails
        (and, with `fail_again`, so does the next copy)."""
        tokens = self.pick_tokens(seq, stored)
        aligned = len(tokens) // self.page_size * self.page_size
        tokens = tokens[:aligned]
        longer = tokens + [7000 + j for j in range(extra * self.page_size)]
        self.remember(longer)
        opened = self.gate_for_blocking_wait()

        async def go() -> None:
            cache = self.c
            loader = layered_loader_of(cache)
            hold = HoldThenFail(cache.config.layout.num_layers - 1)
            loader.before_layer = hold
            early = await cache.acquire(self.next_id("e"), [6000 + j for j in range(self.page_size)])
            loading_id = self.next_id("l")
            loading = await cache.acquire(loading_id, tokens)
            if opened:
                self.backend.gated = True
            self.leases[loading_id] = Held(loading, tokens)
            if not loader.in_flight:  # no host hit to load back: nothing to fail
                loader.before_layer = None
                cache.release(early)
                return
            event("a load held under a child")
            await anyio.to_thread.run_sync(hold.reached.wait)
            loader.before_layer = FailCopies(0, 1) if fail_again else None
            try:
                new = await cache.alloc_device(len(longer))
                if new is None:
                    cache.release(early)
                    return
                kv = chain_payload(as_key_bytes(longer), cache.config.layout, self.namespace)
                cache.device_pool.write_tokens(new, kv)
                await cache.insert(early, longer, new)
                holder_id = self.next_id("h")
                self.leases[holder_id] = Held(await cache.acquire(holder_id, longer), longer)
            finally:
                hold.release()
            while not loading.layers.done:
                await anyio.lowlevel.checkpoint()

        self.run(go)


class LayerwiseRescueControllerMachine(LayerwiseControllerMachine):
    """The layer-wise machine with `refill_under_unbacked="backup_then_attach"`."""

    refill_policy = "backup_then_attach"


_settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
LayerwiseControllerMachine.TestCase.settings = _settings
LayerwiseRescueControllerMachine.TestCase.settings = _settings
KeptPathMachine.TestCase.settings = _settings
test_controller_machine_layerwise = LayerwiseControllerMachine.TestCase
test_controller_machine_layerwise_rescue = LayerwiseRescueControllerMachine.TestCase
test_controller_machine_layerwise_kept_path = KeptPathMachine.TestCase
