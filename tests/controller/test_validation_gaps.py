"""Regression tests for issue 9 finding 7: inputs that were accepted, or refused without naming the argument.

- NaN and infinite prefetch timeouts were accepted by `HiCacheConfig`, and then every timed prefetch
  failed silently; they are refused, naming the field.
- Token ids outside int64 raised a bare `OverflowError`; they raise `ValueError` naming `tokens`.
- `HiCache.acquire` checked `request_id` only when a storage tier existed; it checks it always.
"""

from __future__ import annotations

import math
from array import array

import pytest
import torch
from controller_helpers import make_config, tokens

from hicache import HiCache, HiCacheConfig
from hicache.components import SlidingWindow
from hicache.keys import Namespace, as_key_bytes
from hicache.layout import KVLayout
from hicache.parallel import RankGroup
from hicache.policy import RefillPolicy

TIMEOUT_FIELDS = ("prefetch_timeout_base", "prefetch_timeout_per_1k_tokens", "prefetch_timeout_max")


@pytest.mark.parametrize("field", TIMEOUT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_timeouts_are_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: must be a finite number"):
        make_config(**{field: value})


@pytest.mark.parametrize("field", TIMEOUT_FIELDS)
def test_finite_timeouts_are_still_accepted(field: str) -> None:
    config = make_config(**{field: 0.0})
    assert getattr(config, field) == 0.0
    assert math.isfinite(config.prefetch_timeout(1 << 20))


@pytest.mark.parametrize(
    "key",
    [
        [1, 2, 1 << 63],
        [-(1 << 63) - 1],
        (5, 1 << 64),
        array("Q", [1 << 63]),
        torch.tensor([1, 1 << 63], dtype=torch.uint64),
    ],
    ids=["list-2**63", "list-below-int64", "tuple-2**64", "array-Q", "uint64-tensor"],
)
def test_token_ids_outside_int64_raise_value_error_naming_tokens(key: object) -> None:
    with pytest.raises(ValueError, match=r"^tokens: token ids must fit in int64"):
        as_key_bytes(key, name="tokens")  # type: ignore[arg-type]


def test_token_ids_at_the_int64_bounds_are_accepted() -> None:
    low, high = -(1 << 63), (1 << 63) - 1
    assert as_key_bytes([low, high]) == array("q", [low, high]).tobytes()
    assert as_key_bytes(torch.tensor([7], dtype=torch.uint64)) == array("q", [7]).tobytes()


async def test_acquire_names_tokens_for_an_id_outside_int64() -> None:
    async with HiCache(make_config()) as cache:
        with pytest.raises(ValueError, match=r"^tokens: "):
            await cache.acquire("r", [*tokens(0, 8), 1 << 63])
        cache.sanity_check()
        assert cache.statistics().tree.num_nodes == 0  # nothing was inserted


@pytest.mark.parametrize(
    ("request_id", "error"),
    [("", ValueError), (None, TypeError), (7, TypeError), (b"r", TypeError)],
)
async def test_acquire_checks_request_id_without_a_storage_tier(request_id: object, error: type) -> None:
    async with HiCache(make_config()) as cache:
        assert cache.storage is None
        with pytest.raises(error, match=r"^request_id: expected a non-empty str"):
            await cache.acquire(request_id, tokens(0, 8))  # type: ignore[arg-type]
        cache.sanity_check()
        lease = await cache.acquire("ok", tokens(0, 8))  # the cache is unharmed
        assert lease.cached_len == 0
        cache.release(lease)


async def test_acquire_checks_request_id_with_a_storage_tier() -> None:
    async with HiCache(make_config(storage_url="memory://")) as cache:
        assert cache.storage is not None
        with pytest.raises(ValueError, match=r"^request_id: "):
            await cache.acquire("", tokens(0, 8))
        with pytest.raises(TypeError, match=r"^request_id: "):
            await cache.acquire(3, tokens(0, 8))  # type: ignore[arg-type]


def _rank_view(tp_rank: int, tp_size: int) -> RankGroup:
    """A `RankGroup` as one rank of a `tp_size` group sees itself, without forming the group: the config
    reads only `tp_rank` and `tp_size` (forming a real group of more than one rank needs more processes)."""
    group = RankGroup.__new__(RankGroup)
    group.tp_rank, group.tp_size = tp_rank, tp_size
    group.readiness = None
    return group


def _tp_config(tp_rank: int, tp_size: int, **overrides: object) -> HiCacheConfig:
    namespace = Namespace(model_id="controller-tests", tp_rank=tp_rank, tp_size=tp_size)
    return make_config(namespace=namespace, tp_group=_rank_view(tp_rank, tp_size), **overrides)


def test_hybrid_components_are_accepted_under_tp_with_a_namespace_per_rank() -> None:
    """Hybrid components under TP (their slots' evictions, backups, loads and staged reads are agreed:
    tests/parallel/test_tp_hybrid.py): the config accepts them, and each rank's namespace, hence its
    component storage keys, stays its own."""
    overrides = {"components": (SlidingWindow(8, KVLayout.flat(8, 4), device_pages=8, host_pages=8),)}
    configs = [_tp_config(rank, 2, **overrides) for rank in range(2)]
    assert [c.tp_group.tp_size for c in configs if c.tp_group is not None] == [2, 2]
    assert configs[0].namespace.digest != configs[1].namespace.digest


def test_layerwise_load_back_under_tp_needs_a_readiness_group() -> None:
    """Under TP `wait_layer` is a collective of the model's thread, beside the agreement's steps on the
    event loop: without a second process group for it the config refuses, naming `tp_group`; with one
    it is accepted (tests/parallel/test_tp_layerwise.py)."""
    with pytest.raises(ValueError, match=r"^tp_group: layerwise_load_back under tensor parallelism needs"):
        _tp_config(1, 2, layerwise_load_back=True)
    group = _rank_view(1, 2)
    group.readiness = _rank_view(1, 2)
    namespace = Namespace(model_id="controller-tests", tp_rank=1, tp_size=2)
    config = make_config(namespace=namespace, tp_group=group, layerwise_load_back=True)
    assert config.layerwise_load_back


def test_refill_rescue_is_accepted_under_tp() -> None:
    """The rescue's backup is agreed across the ranks (tests/parallel/test_tp_cache.py), so the config
    no longer refuses `backup_then_attach` with more than one rank."""
    config = _tp_config(1, 2, refill_under_unbacked="backup_then_attach")
    assert config.refill_under_unbacked is RefillPolicy.BACKUP_THEN_ATTACH


def test_tp_group_must_match_the_namespace_rank_and_size() -> None:
    with pytest.raises(ValueError, match=r"^tp_group: rank 1 of 2, but the namespace says tp_rank=0"):
        make_config(namespace=Namespace(model_id="m", tp_rank=0, tp_size=2), tp_group=_rank_view(1, 2))
    with pytest.raises(TypeError, match=r"^tp_group: expected a RankGroup, got object"):
        make_config(tp_group=object())


async def test_release_and_insert_name_a_lease_that_is_not_one() -> None:
    """A lease that is not a `Lease` was read field by field (an AttributeError, or worse, a duck-typed
    object unlocking a node); it is refused naming `lease`, and nothing changes."""
    async with HiCache(make_config()) as cache:
        seq = tokens(0, 8)
        lease = await cache.acquire("r", seq)
        indices = await cache.alloc_device(8)
        assert indices is not None
        with pytest.raises(TypeError, match=r"^lease: expected a Lease from acquire, got dict"):
            cache.release({"node": lease.node})  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^lease: expected a Lease from acquire, got dict"):
            await cache.insert({"node": lease.node}, seq, indices)  # type: ignore[arg-type]
        assert lease.active
        await cache.insert(lease, seq, indices)
        cache.sanity_check()
