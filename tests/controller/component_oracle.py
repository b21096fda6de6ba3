"""A content oracle and exact accounting for hybrid components (sliding window, Mamba state) in controller
tests, in the spirit of `kv_oracle` (whose base-KV oracle it complements).

Every component byte depends on the whole prefix, through the chained page hash:
  * a sliding-window token holds the first 12 bytes of its page's chained hash and its offset in the page;
  * a Mamba state at the end of page `i` holds page `i`'s chained hash, reversed.
So a window page or a state attached to the wrong node, loaded from a stale slot or read from the wrong
storage key never matches, even where the tokens agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from cache_internals import component_pools_of, release_queue_of, tree_of
from kv_oracle import _assert_owned_once, path_key

from hicache import HiCache, Lease
from hicache.components import MambaState, SlidingWindow, component_storage_key
from hicache.controller.pages.release import ComponentTransfer
from hicache.keys import ROOT_HASH, TOKEN_BYTES, Namespace, chained_page_hashes
from hicache.memory import KVLayout
from storage_backends.protocol import StorageBackend

__all__ = [
    "STATE_NBYTES",
    "SWA_TOKEN_BYTES",
    "UNALIGNED_STATE",
    "check_component_kv",
    "check_component_pools_exact",
    "check_leased_components",
    "component_page_bytes",
    "make_components",
    "stage_components",
    "state_payload",
    "store_components",
    "swa_payload",
    "swa_span",
]

SWA_TOKEN_BYTES = 16
"""Bytes of window KV per token (a flat layout)."""
STATE_NBYTES = 16
"""Bytes of one Mamba state."""
UNALIGNED_STATE = torch.full((1, 1, 1, 1, STATE_NBYTES), 0xEE, dtype=torch.uint8)
"""What a test writes as the state of a key with a partial last page: the tree must never keep it."""


def make_components(
    names: Sequence[str], page_size: int, *, window: int, swa_pages: int, state_slots: int
) -> tuple[SlidingWindow | MambaState, ...]:
    """The components `names` (a subset of "swa", "mamba", in that order) with small pools."""
    out: list[SlidingWindow | MambaState] = []
    for name in names:
        if name == "swa":
            layout = KVLayout.flat(SWA_TOKEN_BYTES, page_size)
            out.append(SlidingWindow(window, layout, device_pages=swa_pages, host_pages=swa_pages))
        elif name == "mamba":
            out.append(MambaState(STATE_NBYTES, device_slots=state_slots, host_slots=state_slots))
        else:
            raise ValueError(f"names: unknown component {name!r}")
    return tuple(out)


def swa_span(window: int, page_size: int, aligned: int) -> int:
    """Tokens of window KV a key of `aligned` page-aligned tokens needs at its end (whole pages)."""
    return min(aligned, -(-window // page_size) * page_size)


def _hashes(key: bytes, page_size: int, namespace: Namespace) -> list[bytes]:
    n = len(key) // TOKEN_BYTES
    assert n % page_size == 0, f"key of {n} tokens is not page-aligned (page size {page_size})"
    return chained_page_hashes(key, page_size, namespace, ROOT_HASH)


def swa_payload(key: bytes, page_size: int, namespace: Namespace) -> torch.Tensor:
    """Window KV of every token of the page-aligned `key`, shaped `(1, 1, n, 1, SWA_TOKEN_BYTES)`."""
    rows: list[bytes] = []
    for h in _hashes(key, page_size, namespace):
        rows.extend(h[:12] + offset.to_bytes(4, "little") for offset in range(page_size))
    data = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8)
    return data.view(1, 1, len(rows), 1, SWA_TOKEN_BYTES).clone()


def state_payload(key: bytes, page_size: int, namespace: Namespace) -> torch.Tensor:
    """The state at the end of the page-aligned, non-empty `key`, shaped `(1, 1, 1, 1, STATE_NBYTES)`."""
    last = _hashes(key, page_size, namespace)[-1]
    return torch.frombuffer(bytearray(last[::-1]), dtype=torch.uint8).view(1, 1, 1, 1, STATE_NBYTES).clone()


def component_page_bytes(key: bytes, page_size: int, namespace: Namespace) -> dict[str, bytes]:
    """Storage key -> stored payload of the window page of every page of `key` and the state at every
    page end (any of them may be written through: nodes may end at any page boundary)."""
    out: dict[str, bytes] = {}
    swa = swa_payload(key, page_size, namespace).view(-1, page_size * SWA_TOKEN_BYTES)
    for i, h in enumerate(_hashes(key, page_size, namespace)):
        out[component_storage_key(h, "swa")] = swa[i].numpy().tobytes()
        out[component_storage_key(h, "mamba")] = h[::-1]
    return out


async def store_components(
    backend: StorageBackend,
    key: bytes,
    page_size: int,
    namespace: Namespace,
    *,
    window: int,
    names: Sequence[str],
    every_page: bool,
) -> list[str]:
    """Put component pages of the page-aligned `key` as another instance would; returns their keys.

    `every_page`: a window page for every page and a state at every page end (an instance whose tree
    split the sequence at every page); otherwise only the window at the end and the end state.
    """
    n_pages = len(key) // TOKEN_BYTES // page_size
    if n_pages == 0:
        return []
    hashes = _hashes(key, page_size, namespace)
    data = component_page_bytes(key, page_size, namespace)
    window_pages = swa_span(window, page_size, n_pages * page_size) // page_size
    keys: list[str] = []
    for i, h in enumerate(hashes):
        if "swa" in names and (every_page or i >= n_pages - window_pages):
            keys.append(component_storage_key(h, "swa"))
        if "mamba" in names and (every_page or i == n_pages - 1):
            keys.append(component_storage_key(h, "mamba"))
    ok = await backend.put(keys, [memoryview(bytearray(data[k])) for k in keys])
    assert all(ok), ok
    return keys


def _expected(name: str, key: bytes, start: int, stop: int, page_size: int, ns: Namespace) -> torch.Tensor:
    """The payload of component `name` for tokens [start, stop) of the prefix `key[:stop]`."""
    prefix = key[: stop * TOKEN_BYTES]
    if name == "swa":
        return swa_payload(prefix, page_size, ns)[:, :, start:]
    return state_payload(prefix, page_size, ns)


def check_component_kv(cache: HiCache) -> int:
    """Every component value in the tree (device, host, and host slots of committed backups) holds the
    oracle payload of its node's path; returns the values checked."""
    ns, page = cache.config.namespace, cache.page_size
    checked = 0
    tree = tree_of(cache)
    for node in tree.iter_nodes():
        values = [
            (name, tier, pool, value)
            for name, (device_pool, host_pool) in component_pools_of(cache).items()
            for tier, pool in (("device", device_pool), ("host", host_pool))
            if (value := tree.component_value(node, name, tier)) is not None
        ]
        if not values:
            continue
        full = path_key(tree, node)
        end = len(full) // TOKEN_BYTES
        for name, tier, pool, value in values:
            start = end - int(value.numel()) if name == "swa" else end
            expected = _expected(name, full, start, end, page, ns)
            got = pool.read_tokens(value)
            assert torch.equal(got, expected), f"{tier} {name} of {node!r} differs from its path's payload"
            checked += 1
    return checked


def check_leased_components(cache: HiCache, lease: Lease) -> None:
    """A lease's component indices hold its prefix's window KV and end state, and every component the
    cache keeps is there whenever the lease caches anything (a match ends only where all are valid)."""
    n = lease.cached_len
    if n == 0 or not cache.components:
        assert not lease.component_indices, lease.component_indices
        return
    assert set(lease.component_indices) == set(component_pools_of(cache)), (
        f"lease of {n} tokens lacks components: has {sorted(lease.component_indices)}"
    )
    ns, page = cache.config.namespace, cache.page_size
    for name, indices in lease.component_indices.items():
        comp = next(c for c in cache.components if c.name == name)
        pool = cache.component_pool(name)
        if isinstance(comp, SlidingWindow):
            assert int(indices.numel()) >= min(comp.window, n), f"window of {indices.numel()} tokens"
            start = n - int(indices.numel())
        else:
            assert int(indices.numel()) == 1
            start = n
        expected = _expected(name, lease.key, start, n, page, ns)
        assert torch.equal(pool.read_tokens(indices), expected), (
            f"leased {name} of {lease.request_id} is wrong"
        )


def check_component_pools_exact(
    cache: HiCache,
    *,
    held: Mapping[str, Sequence[torch.Tensor]],
    staged: Sequence[ComponentTransfer],
) -> None:
    """Index-level accounting of every component pool (call with the release queue drained).

    Device owners: the tree (queued frees included) and `held` (slots the test allocated and has not
    inserted). Host owners: the tree (backups in flight and queued frees included) and `staged` (buffers
    of prefetches in flight).
    """
    assert release_queue_of(cache).statistics().pending_calls == 0, "drain the release queue first"
    for name, (device_pool, host_pool) in component_pools_of(cache).items():
        _assert_owned_once(
            f"{name} device pool",
            [tree_of(cache).component_indices_owned(name, "device"), *held.get(name, ())],
            device_pool.statistics().used_pages,
            device_pool.page_size,
            device_pool.allocator.is_free,
        )
        _assert_owned_once(
            f"{name} host pool",
            [
                tree_of(cache).component_indices_owned(name, "host"),
                *(t.indices for t in staged if t.pool is host_pool),
            ],
            host_pool.statistics().used_pages,
            host_pool.page_size,
            host_pool.allocator.is_free,
        )


def stage_components(
    cache: HiCache,
    names: Sequence[str],
    key: bytes,
    cached_len: int,
    *,
    window: int,
    whole_window: bool = True,
) -> dict[str, torch.Tensor]:
    """Fresh device slots of `names` holding a request's window KV and end state, as a serving loop
    hands them to `insert` (what a component's pool cannot give is left out: a tombstone).

    `key` is the request's whole key; the window ends at its last page boundary (`whole_window=False`:
    only the part beyond `cached_len`, which the lease already holds), and the state is taken after its
    last token: a key with a partial last page gets `UNALIGNED_STATE`, which the tree must drop.
    """
    page = cache.page_size
    n = len(key) // TOKEN_BYTES
    aligned = n // page * page
    if aligned == 0:
        return {}
    prefix = key[: aligned * TOKEN_BYTES]
    ns = cache.config.namespace
    out: dict[str, torch.Tensor] = {}
    for name in names:
        payload: torch.Tensor
        if name == "swa":
            start = aligned - swa_span(window, page, aligned)
            if not whole_window:
                start = max(start, cached_len)
            if start >= aligned:
                continue
            slots = cache.alloc_component("swa", aligned - start)
            payload = swa_payload(prefix, page, ns)[:, :, start:]
        else:
            slots = cache.alloc_component(name, 1)
            payload = state_payload(prefix, page, ns) if aligned == n else UNALIGNED_STATE
        if slots is None:
            continue
        cache.component_pool(name).write_tokens(slots, payload)
        out[name] = slots
    return out
