"""Stateful property test of the controller: random request traffic over an async, gated, faulty backend.

Rules mix acquires (with storage prefetch, load-back and cancellation at a random suspension point),
KV computation and inserts, releases, explicit prefetches that commit or cancel while their reads are
held at a gate, injected storage faults, eviction pressure from tiny pools, and waits for idle, over every
write policy and page sizes 1 and 4. After every step the cache must pass `sanity_check()`, every used
device and host page must have exactly one owner, and every page in the tree (device and host) and under
every lease must hold the oracle KV of its own prefix (`kv_oracle.chain_payload`), so a page attached
under the wrong parent, a stale buffer or a torn read is caught. At the end everything is released,
evicted and closed, and both pools must be completely free.

Every example runs in its own event loop (`asyncio.Runner`): one task owns the `HiCache` (enters and
exits its task group), each rule runs as a short task in the same loop, and between rules the loop is
stopped, so background work only advances while a rule runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import torch
from cache_internals import component_pools_of, host_pool_of, release_queue_of, tree_of
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kv_oracle import (
    FaultyBackend,
    chain_payload,
    check_leased_kv,
    check_pools_exact,
    check_tree_kv,
    layout_for,
    page_bytes,
    page_keys,
    store_chain,
    v1_page,
)

from hicache import HiCache, HiCacheConfig, KVLayout, Lease, Prefetch, UnknownRequest
from hicache.keys import TOKEN_BYTES, Namespace, as_key_bytes, key_to_tensor
from hicache.memory import Owner
from hicache.policy import StopPolicy, WritePolicy
from hicache.tree import ComponentFree
from storage_backends.memory import MemoryBackend
from storage_backends.page_format import encode_header
from storage_backends.protocol import PageStatus

T = TypeVar("T")

DEVICE_PAGES = 12
HOST_PAGES = 16

sequences = st.tuples(st.lists(st.integers(0, 2), min_size=0, max_size=8), st.integers(0, 3))
"""Pages drawn from three patterns (so prefixes are shared), and a partial tail."""
short_sequences = st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=3), st.integers(0, 3))
"""Short prefixes of the same patterns: served requests that longer stored sequences extend."""
cancel_points = st.none() | st.integers(0, 12)
"""None: let the operation finish; k: cancel it after k scheduler turns."""
picks = st.integers(0, 1 << 16)


def make_tokens(pages: list[int], tail: int, page_size: int) -> list[int]:
    out = [c * 100 + j for c in pages for j in range(page_size)]
    out.extend(90 + j for j in range(tail % page_size))
    return out


@dataclass
class Held:
    """A lease of the test's and the device pages it computed beyond the cached prefix."""

    lease: Lease
    tokens: list[int]
    computed: torch.Tensor | None = None
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    """Component device slots the test filled for the request (hybrid machines), not yet inserted."""


def unsettled(cache: HiCache) -> bool:
    """A cancelled stream still stopping, or pages a returning worker thread still holds in quarantine."""
    return bool(
        cache.statistics().detached_prefetches or release_queue_of(cache).statistics().quarantined_calls
    )


class ControllerMachine(RuleBasedStateMachine):
    """Random serving traffic against one `HiCache` with storage, checked after every step.

    Hybrid-model machines (`test_controller_components_machine.py`) subclass it through the hooks
    `cache_config`, `store_prefill`, `stage_components` and `check`; here they do nothing beyond the
    full-attention model.
    """

    refill_policy = "drop"
    """`refill_under_unbacked`: the machine runs with each policy (`RescueControllerMachine`)."""

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner()
        self.cache: HiCache | None = None
        self.backend: FaultyBackend
        self.inner: MemoryBackend
        self.page_size = 1
        self.stop_policy = StopPolicy.WAIT_COMPLETE
        self.namespace = Namespace(model_id="state-machine")
        self.leases: dict[str, Held] = {}
        self.prefetches: dict[str, Prefetch] = {}
        self.expected_pages: dict[str, bytes] = {}
        self.corrupted: set[str] = set()
        self.known_keys: list[bytes] = []
        self.prefilled: list[list[int]] = []
        self.serial = 0
        self._owner: asyncio.Task[None] | None = None
        self._closing: anyio.Event | None = None

    # ------------------------------------------------------------------ plumbing

    def run(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run one rule's coroutine in this example's loop, then check everything."""

        async def step() -> T:
            result = await func(*args)
            await self.check()
            return result

        return self.runner.run(step())

    @property
    def c(self) -> HiCache:
        assert self.cache is not None
        return self.cache

    def next_id(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}{self.serial}"

    def key_of(self, tokens: list[int]) -> bytes:
        return as_key_bytes(tokens)

    def remember(self, tokens: list[int]) -> None:
        """Record the expected stored bytes of every page of `tokens`."""
        key = self.key_of(tokens)
        aligned = len(tokens) // self.page_size * self.page_size
        if aligned == 0:
            return
        key = key[: aligned * TOKEN_BYTES]
        layout = layout_for(self.page_size)
        for k, data in zip(
            page_keys(key, layout, self.namespace), page_bytes(key, layout, self.namespace), strict=True
        ):
            self.expected_pages[k] = data
        self.known_keys.append(key)

    async def cancellable(self, point: int | None, func: Callable[..., Awaitable[T]], *args: Any) -> list[T]:
        """Run `func(*args)`; with `point`, cancel it after that many scheduler turns. [] if cancelled."""
        out: list[T] = []

        async def target() -> None:
            out.append(await func(*args))

        if point is None:
            await target()
            return out
        async with anyio.create_task_group() as tg:
            tg.start_soon(target)
            for _ in range(point):
                await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        if not out:
            event("operation cancelled")
        return out

    async def allow_and_settle(self, pages: int) -> None:
        """Let `pages` gated reads proceed and turn the loop until they are used or nobody reads.

        The memory backend reads in worker threads: the loop turns until every gated read that started has
        returned (`reads_started == reads_done`) or no prefetch still streams.
        """
        if not self.backend.gated or pages == 0:
            return
        self.backend.allow(pages)
        for _ in range(500):
            streaming = any(not p.done for p in self.prefetches.values())
            if (self.backend.credits == 0 or not streaming) and (
                self.backend.reads_started == self.backend.reads_done
            ):
                break
            await anyio.lowlevel.checkpoint()

    def gate_for_blocking_wait(self) -> bool:
        """Open the gate while a wait_complete commit waits (else it would wait forever); True if opened."""
        if self.stop_policy is StopPolicy.WAIT_COMPLETE and self.backend.gated:
            self.backend.open_gate()
            return True
        return False

    # ------------------------------------------------------------------ setup and teardown

    @initialize(
        page_size=st.sampled_from([1, 4]),
        write=st.sampled_from(list(WritePolicy)),
        stop=st.sampled_from([StopPolicy.BEST_EFFORT, StopPolicy.WAIT_COMPLETE]),
        gated=st.booleans(),
        prefill=st.lists(sequences, min_size=1, max_size=3),
    )
    def setup(
        self,
        page_size: int,
        write: WritePolicy,
        stop: StopPolicy,
        gated: bool,
        prefill: list[tuple[list[int], int]],
    ) -> None:
        self.page_size = page_size
        self.stop_policy = stop
        event(f"page_size={page_size} {write.value} {stop.value} gated={gated}")
        self.runner.run(self.open(write, stop, gated, prefill))

    async def open(
        self, write: WritePolicy, stop: StopPolicy, gated: bool, prefill: list[tuple[list[int], int]]
    ) -> None:
        layout = layout_for(self.page_size)
        # The cache's effective namespace (its config adds the page layout): keys and oracle bytes use it.
        self.namespace = self.cache_config(layout, write, stop).namespace
        self.inner = MemoryBackend(namespace_digest=self.namespace.digest)
        self.backend = FaultyBackend(self.inner, gated=gated)
        # Another instance served these before: their pages are in storage.
        for i, (pages, tail) in enumerate(prefill):
            tokens = make_tokens(pages, tail, self.page_size)
            self.remember(tokens)
            self.prefilled.append(tokens)
            aligned = len(tokens) // self.page_size * self.page_size
            if aligned:
                await self.store_prefill(self.key_of(tokens[:aligned]), i)
        config = self.cache_config(layout, write, stop)
        started = anyio.Event()
        self._closing = anyio.Event()
        closing = self._closing

        async def own() -> None:
            try:
                async with HiCache(config, storage=self.backend) as cache:
                    self.cache = cache
                    started.set()
                    await closing.wait()
                    await self.release_everything(cache)
            finally:
                await self.backend.aclose()  # the cache does not own a backend it was given
            # After aclose: nothing in flight, nothing pending, every pool (components' too) free.
            s = cache.statistics()
            assert s.closed
            assert s.prefetches_in_flight == 0
            assert s.release_queue.pending_calls == 0
            pools = [cache.device_pool, host_pool_of(cache)]
            for device_pool, host_pool in component_pools_of(cache).values():
                pools.extend((device_pool, host_pool))
            for pool in pools:
                assert pool.statistics().used_pages == 0, pool

        self._owner = asyncio.get_running_loop().create_task(own())
        await started.wait()

    def cache_config(self, layout: KVLayout, write: WritePolicy, stop: StopPolicy) -> HiCacheConfig:
        """The configuration of the cache under test: tiny pools, so eviction is constant."""
        return HiCacheConfig(
            layout=layout,
            device_pages=DEVICE_PAGES,
            host_pages=HOST_PAGES,
            write_policy=write,
            write_through_threshold=2,
            namespace=self.namespace,
            prefetch_threshold=self.page_size,
            prefetch_stop_policy=stop,
            storage_batch_pages=2,
            release_batch_pages=2,
            # Gated reads are this machine's stuck reads; the test releases them, never a timeout.
            storage_read_timeout_s=3600.0,
            storage_write_timeout_s=3600.0,
            refill_under_unbacked=self.refill_policy,
        )

    async def store_prefill(self, key: bytes, index: int) -> None:
        """Put the pages of the page-aligned `key` (the `index`-th prefilled sequence) into storage."""
        await store_chain(self.inner, key, layout_for(self.page_size), self.namespace)

    def stage_components(self, lease: Lease, tokens: list[int]) -> dict[str, torch.Tensor]:
        """Component device slots holding the request's values, to insert with it (none here)."""
        return {}

    def free_held(self, cache: HiCache, held: Held) -> None:
        """Give back what the test allocated for a request it will not insert."""
        if held.computed is not None:
            cache.device_pool.free(held.computed)
        for name, slots in held.components.items():
            cache.component_pool(name).free(slots)
        held.computed = None
        held.components = {}

    def held_component_slots(self) -> dict[str, list[torch.Tensor]]:
        """Per component, the device slots the test holds outside the tree."""
        out: dict[str, list[torch.Tensor]] = {name: [] for name in component_pools_of(self.c)}
        for h in self.leases.values():
            for name, slots in h.components.items():
                out[name].append(slots)
        return out

    async def release_everything(self, cache: HiCache) -> None:
        """Release every lease and prefetch, wait idle, evict everything: both pools must end up free."""
        for held in self.leases.values():
            self.free_held(cache, held)
            cache.release(held.lease)
        self.leases.clear()
        for request_id in list(self.prefetches):
            outcome = await cache.cancel_prefetch(request_id)
            assert outcome.status == "cancelled"
        self.prefetches.clear()
        await cache.wait_idle()
        await self.check()
        assert self.backend.reads_started == self.backend.reads_done
        await self.check_storage()
        # No host room offered: under write-back, un-backed leaves are dropped rather than backed up.
        frees: list[ComponentFree] = []
        while True:
            evicted = tree_of(cache).evict_device(DEVICE_PAGES * self.page_size, host_free_tokens=0)
            assert not evicted.backup_first
            cache.device_pool.free(evicted.freed_device, Owner.TREE)
            host_pool_of(cache).free(evicted.freed_host, Owner.TREE)
            frees.extend(evicted.component_frees)  # component values evicted with their nodes
            if evicted.evicted_tokens == 0:
                break
        while True:
            host = tree_of(cache).evict_host(HOST_PAGES * self.page_size)
            host_pool_of(cache).free(host.freed_host, Owner.TREE)
            frees.extend(host.component_frees)
            if host.evicted_tokens == 0:
                break
        for free in frees:
            device_pool, host_pool = component_pools_of(cache)[free.component]
            (device_pool if free.tier == "device" else host_pool).free(free.indices, Owner.TREE)
        cache.sanity_check()
        assert tree_of(cache).statistics().num_nodes == 0

    def teardown(self) -> None:
        try:
            if self._owner is not None and self._closing is not None:
                closing, owner = self._closing, self._owner

                async def close() -> None:
                    closing.set()
                    await owner

                self.runner.run(close())
        finally:
            self.runner.close()

    # ------------------------------------------------------------------ checks

    async def check(self) -> None:
        cache = self.c
        held = [h.computed for h in self.leases.values() if h.computed is not None]
        # Pages pending release are owned too: the partition holds before the queue drains as well.
        cache.sanity_check(held_device=held, held_components=self.held_component_slots())
        await release_queue_of(cache).drain()
        # A read cancelled while its (healthy) worker thread ran leaves its pages quarantined until the
        # thread returns, a moment later; a cancelled stream gives its pages back once it stopped.
        with anyio.fail_after(30):
            while unsettled(cache):  # noqa: ASYNC110 - a worker thread cannot wake the loop
                await anyio.sleep(0.005)
        await release_queue_of(cache).drain()
        # Every page of every pool has exactly one owner, checked page by page: the test's own
        # allocations are the only caller-held pages.
        cache.sanity_check(held_device=held, held_components=self.held_component_slots())
        assert cache.statistics().prefetches_in_flight == len(self.prefetches)
        check_pools_exact(
            cache, held_device=held, prefetch_host=[p.host_indices for p in self.prefetches.values()]
        )
        check_tree_kv(cache)
        refused = self.inner.statistics()
        if refused.foreign_pages or refused.old_format_pages:
            event("a planted page was read and refused")
        for h in self.leases.values():
            node = h.lease.node
            assert node == tree_of(cache).root or tree_of(cache).node_info(node).device_lock > 0
            check_leased_kv(cache, h.lease.key, h.lease.device_indices)

    async def check_storage(self) -> None:
        """Every page in storage (that the test did not corrupt) holds the oracle bytes of its key."""
        for key, data in self.expected_pages.items():
            if key in self.corrupted or await self.inner.exists([key]) == 0:
                continue
            buf = bytearray(len(data))
            ok = await self.inner.get([key], [memoryview(buf)])
            assert ok == [PageStatus.HIT], key
            assert bytes(buf) == data, f"stored page {key} holds the wrong bytes"

    # ------------------------------------------------------------------ rules

    @rule(seq=sequences, stored=st.none() | picks, point=cancel_points)
    def acquire(self, seq: tuple[list[int], int], stored: int | None, point: int | None) -> None:
        self.acquire_tokens(self.pick_tokens(seq, stored), point)

    def acquire_tokens(self, tokens: list[int], point: int | None) -> None:
        """The `acquire` rule's body, for any tokens."""
        self.remember(tokens)
        request_id = self.next_id("r")
        opened = self.gate_for_blocking_wait()

        async def go() -> None:
            got = await self.cancellable(point, self.c.acquire, request_id, tokens)
            if opened:
                self.backend.gated = True
            if got:
                lease = got[0]
                self.leases[request_id] = Held(lease, tokens)
                assert lease.cached_len == int(lease.device_indices.numel())
                assert lease.cached_len <= len(tokens) // self.page_size * self.page_size
                hits = lease.hit_tokens_by_tier
                assert sum(hits.values()) == lease.cached_len
                # A storage hit is a token this request's own prefetch loaded, never one that another
                # request put in the tree meanwhile.
                own = lease.prefetch.loaded_tokens if lease.prefetch is not None else 0
                assert hits["storage"] <= own, (hits, lease.prefetch)
                if hits["storage"]:
                    event("acquire hit storage")
                if lease.prefetch is not None:
                    event(f"acquire prefetch {lease.prefetch.status}")

        self.run(go)

    @rule(seq=short_sequences)
    def serve(self, seq: tuple[list[int], int]) -> None:
        """A whole request at once: acquire, compute the KV beyond the hit, insert (a device-only chain
        under write-through-selective, or one whose backup is still queued)."""
        self.serve_tokens(make_tokens(*seq, self.page_size))

    def serve_tokens(self, tokens: list[int]) -> None:
        """The `serve` rule's body, for any tokens."""
        self.remember(tokens)
        request_id = self.next_id("s")
        opened = self.gate_for_blocking_wait()

        async def go() -> None:
            cache = self.c
            lease = await cache.acquire(request_id, tokens)
            if opened:
                self.backend.gated = True
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
            components = self.stage_components(lease, tokens)
            await cache.insert(lease, tokens, torch.cat([lease.device_indices, new]), components or None)

        self.run(go)

    @rule(pick=picks)
    def compute(self, pick: int) -> None:
        """Allocate device pages beyond the cached prefix and write the request's KV into them."""
        if not self.leases:
            return
        held = list(self.leases.values())[pick % len(self.leases)]
        if held.computed is not None:
            return

        async def go() -> None:
            cache = self.c
            n = len(held.tokens)
            padded = -(-n // self.page_size) * self.page_size
            cached = held.lease.cached_len
            new = await cache.alloc_device(padded - cached)
            if new is None:
                event("alloc_device returned None")
                return
            aligned = n // self.page_size * self.page_size
            if aligned > cached:
                kv = chain_payload(
                    held.lease.key[: aligned * TOKEN_BYTES], cache.config.layout, self.namespace
                )
                cache.device_pool.write_tokens(new[: aligned - cached], kv[:, :, cached:])
            held.computed = new
            held.components = self.stage_components(held.lease, held.tokens)

        self.run(go)

    @rule(pick=picks)
    def insert(self, pick: int) -> None:
        ready = [rid for rid, h in self.leases.items() if h.computed is not None]
        if not ready:
            return
        request_id = ready[pick % len(ready)]
        held = self.leases.pop(request_id)
        assert held.computed is not None

        async def go() -> None:
            indices = torch.cat([held.lease.device_indices, held.computed])
            await self.c.insert(held.lease, held.tokens, indices, held.components or None)

        self.run(go)

    @rule(pick=picks)
    def release(self, pick: int) -> None:
        if not self.leases:
            return
        request_id = list(self.leases)[pick % len(self.leases)]
        held = self.leases.pop(request_id)

        async def go() -> None:
            # The request gives back what it computed with its lease; a second release is a no-op.
            self.c.release(held.lease, held.computed, held.components or None)
            held.computed, held.components = None, {}
            self.c.release(held.lease)  # idempotent

        self.run(go)

    @rule(
        ops=st.lists(
            st.tuples(st.sampled_from(["acquire", "pressure", "prefetch_commit"]), sequences, cancel_points),
            min_size=2,
            max_size=4,
        )
    )
    def burst(self, ops: list[tuple[str, tuple[list[int], int], int | None]]) -> None:
        """Several requests at once: acquires, device pressure and prefetch-then-commit, interleaved."""
        opened = self.gate_for_blocking_wait()

        async def one(kind: str, seq: tuple[list[int], int], point: int | None) -> None:
            cache = self.c
            tokens = make_tokens(*seq, self.page_size)
            self.remember(tokens)
            if kind == "acquire":
                request_id = self.next_id("b")
                got = await self.cancellable(point, cache.acquire, request_id, tokens)
                if got:
                    self.leases[request_id] = Held(got[0], tokens)
            elif kind == "pressure":
                pages = (len(tokens) // self.page_size) % DEVICE_PAGES + 1
                indices = await cache.alloc_device(pages * self.page_size)
                if indices is not None:
                    cache.device_pool.free(indices)
            else:
                request_id = self.next_id("q")

                async def prefetch_commit() -> None:
                    prefetch = await cache.prefetch(request_id, tokens)
                    if prefetch is None:
                        return
                    try:
                        outcome = await cache.commit_prefetch(request_id)
                    except BaseException:
                        with anyio.CancelScope(shield=True), contextlib.suppress(UnknownRequest):
                            await cache.cancel_prefetch(request_id)
                        raise
                    event(f"burst commit {outcome.status}{' (rescued)' if outcome.rescued else ''}")

                await self.cancellable(point, prefetch_commit)

        async def go() -> None:
            async with anyio.create_task_group() as tg:
                for kind, seq, point in ops:
                    tg.start_soon(one, kind, seq, point)
            if opened:
                self.backend.gated = True

        self.run(go)

    def pick_tokens(self, seq: tuple[list[int], int], stored: int | None) -> list[int]:
        """A drawn sequence, or (when `stored` is drawn) one another instance stored."""
        if stored is not None and self.prefilled:
            return self.prefilled[stored % len(self.prefilled)]
        return make_tokens(*seq, self.page_size)

    @rule(seq=sequences, stored=st.none() | picks, point=cancel_points)
    def prefetch(self, seq: tuple[list[int], int], stored: int | None, point: int | None) -> None:
        tokens = self.pick_tokens(seq, stored)
        self.remember(tokens)
        request_id = self.next_id("p")

        async def go() -> None:
            got = await self.cancellable(point, self.c.prefetch, request_id, tokens)
            if got and got[0] is not None:
                self.prefetches[request_id] = got[0]
                event("prefetch started")

        self.run(go)

    @rule(pages=st.integers(1, 4))
    def allow_reads(self, pages: int) -> None:
        if not self.backend.gated:
            return

        async def go() -> None:
            await self.allow_and_settle(pages)

        self.run(go)

    @rule(pick=picks, point=cancel_points, reads=st.integers(0, 6))
    def commit(self, pick: int, point: int | None, reads: int) -> None:
        """Let `reads` more gated pages arrive, then commit one prefetch (cancelled at `point`)."""
        if not self.prefetches:
            return
        request_id = list(self.prefetches)[pick % len(self.prefetches)]
        prefetch = self.prefetches[request_id]

        async def go() -> None:
            await self.allow_and_settle(reads)
            opened = self.gate_for_blocking_wait()
            got = await self.cancellable(point, self.c.commit_prefetch, request_id)
            if opened:
                self.backend.gated = True
            if not got:
                # Cancelled before the ranks' decision was taken: the prefetch stays in flight, asked to
                # stop. Cancelled after it: the commit was carried out whole, the prefetch is resolved.
                try:
                    self.c.get_prefetch(request_id)
                except UnknownRequest:
                    del self.prefetches[request_id]
                    event("commit cancelled after the agreement: carried out")
                return
            outcome = got[0]
            del self.prefetches[request_id]
            assert outcome.status in ("committed", "dropped")
            assert outcome.completed_tokens == prefetch.completed_tokens <= prefetch.num_tokens
            assert outcome.completed_tokens % self.page_size == 0
            if outcome.status == "dropped":
                assert outcome.loaded_tokens == 0
                assert outcome.released_tokens == prefetch.num_tokens
            else:
                assert 0 <= outcome.loaded_tokens <= outcome.completed_tokens
            if self.stop_policy is StopPolicy.WAIT_COMPLETE and not prefetch.failed_pages:
                assert outcome.completed_tokens == prefetch.num_tokens
            event(f"commit {outcome.status}{' (rescued)' if outcome.rescued else ''}")
            if outcome.rescued:
                assert self.refill_policy == "backup_then_attach"
                assert outcome.status == "committed"

        self.run(go)

    @rule(pick=picks)
    def cancel(self, pick: int) -> None:
        if not self.prefetches:
            return
        request_id = list(self.prefetches)[pick % len(self.prefetches)]

        async def go() -> None:
            outcome = await self.c.cancel_prefetch(request_id)
            del self.prefetches[request_id]
            assert outcome.status == "cancelled"
            assert outcome.loaded_tokens == 0
            assert self.backend.reads_started == self.backend.reads_done or self.prefetches

        self.run(go)

    @rule(pick=picks, page=st.integers(0, 7), mode=st.sampled_from(["false", "error", "corrupt", "heal"]))
    def inject_fault(self, pick: int, page: int, mode: str) -> None:
        """Make one page of a known sequence fail: unread, a raising batch, or flipped bytes in storage."""
        if not self.known_keys:
            return
        key = self.known_keys[pick % len(self.known_keys)]
        layout = layout_for(self.page_size)
        keys = page_keys(key, layout, self.namespace)
        target = keys[page % len(keys)]

        async def go() -> None:
            if mode == "heal":
                self.backend.faults.clear()
            elif mode == "corrupt":
                if await self.inner.exists([target]):
                    self.inner.corrupt(target, offset=-3)
                    self.corrupted.add(target)
            else:
                self.backend.faults[target] = mode

        self.run(go)

    @rule(
        pick=picks,
        page=st.integers(0, 7),
        source=picks,
        mode=st.sampled_from(["copy", "namespace", "old_format"]),
        then_acquire=st.booleans(),
    )
    def foreign_writer(self, pick: int, page: int, source: int, mode: str, then_acquire: bool) -> None:
        """Another writer plants a valid page that is not this key's own under a known key, stored or not:
        another key's page copied over it, another namespace's page (of wrong bytes) written under it, or a
        version 1 page; with `then_acquire`, a request for that key follows at once. The content checks
        after every step must never see one of its bytes loaded."""
        if not self.known_keys:
            return
        layout = layout_for(self.page_size)
        known = self.known_keys[pick % len(self.known_keys)]
        keys = page_keys(known, layout, self.namespace)
        target = keys[page % len(keys)]
        own = self.expected_pages[target]
        # A donor page of different bytes: loading it under `target` would show in the content checks.
        donors = sorted(k for k, data in self.expected_pages.items() if data != own)
        donor = donors[source % len(donors)] if donors else None
        wrong = self.expected_pages[donor] if donor is not None else bytes(b ^ 0xFF for b in own)
        digest = self.namespace.digest
        if mode == "copy":
            stored = self.inner._pages.get(donor) if donor is not None else None
            # A stored donor page copied as is, else a valid page of another key made for the purpose.
            body = stored or encode_header(memoryview(wrong), digest, donor or "ffff") + wrong
        elif mode == "namespace":
            foreign = Namespace(model_id="another-model", layout=self.namespace.layout).digest
            body = encode_header(memoryview(wrong), foreign, target) + wrong
        else:
            body = v1_page(wrong, digest)
        self.inner._pages[target] = body
        self.corrupted.add(target)
        event(f"foreign writer: {mode}")
        if then_acquire:
            self.acquire_tokens(key_to_tensor(known).tolist(), None)

    @rule(pages=st.integers(1, DEVICE_PAGES))
    def device_pressure(self, pages: int) -> None:
        """Ask for device pages (evicting, and under write-back backing up first), then give them back."""

        async def go() -> None:
            got = await self.c.alloc_device(pages * self.page_size)
            if got is None:
                event("device pressure: could not evict enough")
            else:
                self.c.device_pool.free(got)

        self.run(go)

    @rule()
    def wait_idle(self) -> None:
        async def go() -> None:
            await self.c.wait_idle()
            s = self.c.statistics()
            assert s.backups_queued == 0
            assert s.storage_writes_queued == 0
            assert s.tree.pending_backup_tokens == 0
            for name, comp in tree_of(self.c).component_statistics().items():
                assert comp.pending_backup_slots == 0, name
            await self.check_storage()

        self.run(go)

    @invariant()
    def repr_is_informative(self) -> None:
        if self.cache is not None:
            assert "HiCache open" in repr(self.cache)


TestControllerMachine = ControllerMachine.TestCase
TestControllerMachine.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class RescueControllerMachine(ControllerMachine):
    """The same machine with refills under an un-backed attach point backed up and attached."""

    refill_policy = "backup_then_attach"


TestRescueControllerMachine = RescueControllerMachine.TestCase
TestRescueControllerMachine.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
