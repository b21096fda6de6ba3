"""Leases: matching a request's prefix (loading it from storage and host), holding it, and inserting the
finished request's KV."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hicache.controller.movement.layered_load import LayeredLoader
from hicache.controller.movement.tier_mover import TierMover
from hicache.controller.pages.allocation import Allocator, ComponentPools
from hicache.controller.prefetch.admission import Admission
from hicache.controller.prefetch.job import Prefetches, PrefetchOutcome
from hicache.controller.results import Lease
from hicache.controller.state import OpenState
from hicache.errors import LeaseReleased, LoadBackFailed
from hicache.keys import TOKEN_BYTES, KeyLike, as_key_bytes
from hicache.memory import KVPool, Owner, check_token_indices
from hicache.memory.layerwise import HeldReadiness
from hicache.tiers import SkipReason, Tier
from hicache.tree import InsertResult, RadixTree

_NO_PAGES = torch.empty(0, dtype=torch.int64)

__all__ = ["Leases"]

# The tiers' names as plain strings, read once: an enum member's `.value` is a Python-level descriptor
# call, three per `acquire`.
_DEVICE, _HOST, _STORAGE = Tier.DEVICE.value, Tier.HOST.value, Tier.STORAGE.value


class Leases:
    """Carries out `HiCache.acquire`, `release` and `insert` once the facade has checked the cache is open.

    Args:
        tree: the radix tree (a lease's prefix is device-locked there).
        device_pool, component_pools: the device pools a request's KV is in.
        allocator: checks the caller's pages and frees what the tree lets go of.
        mover: loads host hits back, and backs inserted KV up.
        prefetches: the prefetches in flight (a lease's own is committed there).
        admission: starts a lease's prefetch of its storage hit.
        state: whether the cache is still open after an await.
        loader: loads host hits back layer by layer (a lease shares the load it reads until released).
        layerwise: whether `acquire` loads layer by layer.
    """

    def __init__(
        self,
        tree: RadixTree,
        device_pool: KVPool,
        component_pools: Mapping[str, ComponentPools],
        allocator: Allocator,
        mover: TierMover,
        prefetches: Prefetches,
        admission: Admission,
        state: OpenState,
        loader: LayeredLoader,
        layerwise: bool,
    ) -> None:
        self._tree = tree
        self._device_pool = device_pool
        self._component_pools = component_pools
        self._allocator = allocator
        self._mover = mover
        self._prefetches = prefetches
        self._admission = admission
        self._state = state
        self._loader = loader
        self._layerwise = layerwise
        self._page_size = device_pool.page_size

    async def acquire(self, request_id: str, key: bytes, *, prefetch: bool = True) -> Lease:
        """Match `key`, prefetch its storage hit and commit it (unless `prefetch` is False), load host hits
        back, lock the prefix.

        One match: the prefetch is admitted on a `peek` (which changes nothing), and the tree is matched
        once, after any await, for the load-back and the lease.
        """
        outcome: PrefetchOutcome | None = None
        skipped: SkipReason | None = None
        anchor_end = 0
        if prefetch and self._prefetches.storage is not None:
            started = await self._admission.start(request_id, key, None, ())  # it peeks
            if isinstance(started, SkipReason):
                skipped = started
            else:
                anchor_end = self._tree.depth(started.anchor)  # where the prefetch's tokens start
                try:
                    outcome = await self._prefetches.commit(request_id)
                except BaseException:
                    # Cancelled (or failed) while waiting: stop the reads and give every page back.
                    if self._prefetches.is_in_flight(started):
                        await self._prefetches.stop_and_cancel(started)
                    raise
            self._state.check_open("acquire")
        # Matched after any await: eviction may have changed the tree meanwhile.
        match = self._tree.match_prefix(key)
        # Storage hits are only the tokens this request's prefetch loaded: [start, end) below. Tokens
        # that other requests inserted or loaded meanwhile count by where this match finds them.
        loaded_end = loaded_start = 0
        if outcome is not None and outcome.committed:
            loaded_end = anchor_end + outcome.completed_tokens
            loaded_start = loaded_end - outcome.loaded_tokens
        found_on_device = match.device_len
        self._state.check_open("load_back")
        if self._layerwise:
            loaded = await self._loader.load_back(match)
            match, landing, layers = loaded.match, loaded.landing, loaded.layers
        else:
            match = await self._mover.load_back(match)
            landing, layers = _NO_PAGES, self._loader.ready()
        node = match.last_device_node
        self._tree.lock_device(node)
        indices = self._tree.device_indices(node)  # the tree keeps the join on the node for later hits
        if landing.numel():  # pages still landing: this lease's (and their load's other readers') only
            indices = torch.cat([indices, landing])
        cached = match.device_len + int(landing.numel())
        storage_hit = max(0, min(loaded_end, cached) - loaded_start)
        on_device = min(found_on_device, cached)
        device_hit = on_device - max(0, min(loaded_end, on_device) - loaded_start)
        host_hit = cached - device_hit - storage_hit
        return Lease(
            request_id=request_id,
            key=key,
            node=node,
            device_indices=indices,
            cached_len=cached,
            hit_tokens_by_tier={
                _DEVICE: device_hit,
                _HOST: host_hit,
                _STORAGE: storage_hit,
            },
            prefetch=outcome,
            component_indices=self._tree.component_window(node) if self._tree.components else {},
            prefetch_skipped=skipped,
            layers=layers,
        )

    def release(
        self,
        lease: Lease,
        device_indices: torch.Tensor | None,
        components: Mapping[str, torch.Tensor] | None,
    ) -> None:
        """Give up `lease`, freeing the caller's `device_indices` and `components` (checked first)."""
        claims = self._allocator.caller_claims(device_indices, components)
        if lease.active:
            lease.active = False
            self._tree.unlock_device(lease.node)
            if isinstance(lease.layers, HeldReadiness):
                lease.layers.release(f"the lease of request {lease.request_id!r}")
        for pool, indices in claims:
            pool.free(indices)

    async def insert(
        self,
        lease: Lease,
        tokens: KeyLike,
        device_indices: torch.Tensor,
        components: Mapping[str, torch.Tensor] | None,
    ) -> InsertResult:
        """Check and insert a finished request's KV, then release its lease (see `HiCache.insert`)."""
        await self._mover.give_workers_a_turn()
        self._state.check_open("insert")
        if not lease.active:
            raise LeaseReleased(f"lease: the lease of request {lease.request_id!r} was already released")
        landed = await self._loader.landed(lease.layers)  # a load still landing ends first
        self._state.check_open("insert")
        if not lease.active:
            raise LeaseReleased(f"lease: the lease of request {lease.request_id!r} was released meanwhile")
        if not landed:
            raise LoadBackFailed(
                f"lease: the cached prefix of request {lease.request_id!r} failed to load back; "
                "release the lease and recompute"
            )
        key = as_key_bytes(tokens, name="tokens")
        n = len(key) // TOKEN_BYTES
        page = self._page_size
        padded = -(-n // page) * page
        if not isinstance(device_indices, torch.Tensor) or device_indices.dtype != torch.int64:
            raise TypeError(f"device_indices: expected an int64 tensor, got {device_indices!r:.80}")
        if device_indices.dim() != 1 or device_indices.numel() != padded:
            raise ValueError(
                f"device_indices: expected {padded} indices ({n} tokens padded to pages of {page}), "
                f"got shape {tuple(device_indices.shape)}"
            )
        if (
            n < lease.cached_len
            or key[: lease.cached_len * TOKEN_BYTES] != lease.key[: lease.cached_len * TOKEN_BYTES]
        ):
            raise ValueError("tokens: must start with the lease's cached prefix")
        cached = lease.cached_len
        # One numpy view for the checks below: each costs a microsecond or two there.
        index_array = check_token_indices(device_indices, name="device_indices").numpy()
        # The rest must be pages the caller got from `alloc_device` (and components' slots from
        # `alloc_component`) and still holds: anything else would let two owners share a page.
        self._allocator.caller_claims(index_array[cached:], components)
        if not (index_array[:cached] == lease.device_indices.numpy()).all():
            raise ValueError(
                f"device_indices: the first {cached} must be the lease's own prefix (lease.device_indices)"
            )
        aligned = n // page * page
        if components:
            result = self._tree.insert(key, device_indices[:n], components)
        else:
            result = self._tree.insert(key[: aligned * TOKEN_BYTES], device_indices[:aligned])
        # The tree owns what it took; the rest is freed below (duplicates, the partial tail, components
        # it did not keep).
        self._device_pool.set_owner(index_array[cached:], Owner.TREE)
        for name, indices in (components or {}).items():
            self._component_pools[name].device.set_owner(indices, Owner.TREE)
        if result.prefix_len > lease.cached_len:
            self._device_pool.free(device_indices[lease.cached_len : result.prefix_len], owner=Owner.TREE)
        if padded > aligned:
            self._device_pool.free(device_indices[aligned:], owner=Owner.TREE)
        self.release(lease, None, None)
        self._allocator.free_components(result.component_frees)
        await self._mover.start_backups(result.backups)
        return result
