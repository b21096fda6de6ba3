"""Names that explain themselves (tiers, skip and drop reasons, outcome status), the public API of
`hicache`, and the controller's structure: collaborators that never reach back into the facade."""

from __future__ import annotations

import ast
import importlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from controller_helpers import PAGE, make_config, store_sequence, tokens

import hicache
from hicache import (
    DropReason,
    HiCache,
    KVPool,
    PrefetchStatus,
    ShedReason,
    SkipReason,
    Tier,
)
from hicache.keys import Namespace
from storage_backends.memory import MemoryBackend

CONTROLLER = Path(hicache.__file__).parent / "controller"


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    async with MemoryBackend(namespace_digest=Namespace(model_id="controller-tests").digest) as b:
        yield b


# ---------------------------------------------------------------------------------------------- names


def test_names_are_string_enums_that_read_as_their_metric_labels() -> None:
    """Tiers and reasons compare and hash as the plain strings metric labels and older call sites use,
    so a tier keyed dict, a label or a JSON dump reads the same whichever a caller passes."""
    assert [t.value for t in Tier] == ["device", "host", "storage"]
    assert Tier.HOST == "host"
    assert {"device": 1}[Tier.DEVICE] == 1
    assert f"{SkipReason.BELOW_THRESHOLD}" == "below_threshold"
    assert {r.value for r in PrefetchStatus} == {"committed", "dropped", "cancelled"}
    assert {r.value for r in DropReason} == {"anchor_not_backed_up", "component_incomplete"}
    assert {r.value for r in SkipReason} == {
        "no_storage",
        "below_threshold",
        "capacity",
        "storage_unavailable",
        "storage_error",
        "storage_miss",
        "host_full",
        "component_miss",
        "component_host_full",
    }
    assert {r.value for r in ShedReason} == {"queue_full", "storage_unavailable"}
    for enum in (Tier, SkipReason, DropReason, PrefetchStatus, ShedReason):
        for member in enum:
            assert member.__doc__, f"{enum.__name__} needs a docstring"


async def test_a_lease_says_why_its_prefetch_was_skipped(backend: MemoryBackend) -> None:
    """Every acquire with a storage tier either runs a prefetch (its outcome on the lease) or records the
    skip reason on the lease, the same reason the `prefetch_skipped_total` counter is labelled with."""
    async with HiCache(make_config(), storage=backend) as cache:
        short = await cache.acquire("short", tokens(0, 4))  # one page: below the 8-token threshold
        assert (short.prefetch, short.prefetch_skipped) == (None, SkipReason.BELOW_THRESHOLD)
        cache.release(short)

        missing = await cache.acquire("missing", tokens(100, 16))  # nothing stored
        assert (missing.prefetch, missing.prefetch_skipped) == (None, SkipReason.STORAGE_MISS)
        cache.release(missing)

        seq = tokens(200, 16)
        await store_sequence(backend, cache, seq)
        hit = await cache.acquire("hit", seq)
        assert hit.prefetch_skipped is None
        assert hit.prefetch is not None
        assert hit.prefetch.committed
        assert hit.prefetch.status is PrefetchStatus.COMMITTED
        assert hit.hit_tokens_by_tier == {"device": 0, "host": 0, "storage": 16}
        cache.release(hit)
        skipped = {
            reason: cache.metrics.prefetch_skipped.value(reason=reason)
            for reason in (SkipReason.BELOW_THRESHOLD, SkipReason.STORAGE_MISS)
        }
        assert skipped == {SkipReason.BELOW_THRESHOLD: 1.0, SkipReason.STORAGE_MISS: 1.0}
        cache.sanity_check()


async def test_a_lease_without_a_storage_tier_has_no_skip_reason() -> None:
    """Without storage nothing is prefetched and nothing is skipped: `prefetch_skipped` stays None."""
    async with HiCache(make_config()) as cache:
        lease = await cache.acquire("r", tokens(0, 4 * PAGE))
        assert (lease.prefetch, lease.prefetch_skipped) == (None, None)
        cache.release(lease)


# ----------------------------------------------------------------------------------------- public API


def test_hicache_exports_the_documented_api_and_nothing_dead() -> None:
    """`hicache.__all__` is the public API: every name in it is documented, the result, statistics and
    storage protocol types are there, and names never used (the tree class, prefetch errors nobody
    raises) are not."""
    exported = set(hicache.__all__)
    for name in (
        "HiCache",
        "HiCacheConfig",
        "Lease",
        "PrefetchOutcome",
        "InsertResult",
        "MatchResult",
        "CacheStatistics",
        "TreeStatistics",
        "PoolStatistics",
        "StorageBackend",
        "PageStatus",
        "ForeignPage",
        "OldPageFormat",
        "Tier",
        "SkipReason",
        "DropReason",
        "PrefetchStatus",
        "RefillPolicy",  # like every policy enum a config field takes
        "LayerReadiness",  # what `Lease.layers` is: the model calls its `wait_layer`
        "LoadBackFailed",  # what `wait_layer` raises
        "LeaseReleased",  # what `wait_layer` raises once its lease was released
    ):
        assert name in exported, name
    for name in ("RadixTree", "PrefetchError", "PrefetchFailed", "FULL", "FullAttention"):
        assert name not in exported, name
        assert not hasattr(importlib.import_module("hicache.errors"), name), name
    for name in hicache.__all__:
        obj = getattr(hicache, name)
        assert (obj.__doc__ or "").strip(), f"hicache.{name} has no docstring"


async def test_the_cache_hands_out_no_tree_pools_or_release_queue() -> None:
    """Only the device pool (where the model reads and writes KV) and a component's device pool are
    public; the tree, the host pool, the component pools and the release queue take an underscore."""
    async with HiCache(make_config()) as cache:
        for name in ("tree", "host_pool", "component_pools", "release_queue"):
            assert not hasattr(cache, name), name
        assert isinstance(cache.device_pool, KVPool)
        with pytest.raises(AttributeError):
            cache.device_pool = cache.device_pool  # type: ignore[misc]
        with pytest.raises(ValueError, match="name: unknown component 'swa'"):
            cache.component_pool("swa")
        stats = cache.statistics()
        assert (stats.component_pools, stats.components) == ({}, {})


# ------------------------------------------------------------------------------------------ structure


def _controller_imports() -> dict[str, set[str]]:
    """Module name -> the hicache.controller modules it imports (at any level, TYPE_CHECKING included)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(CONTROLLER.glob("*.py")):
        name = f"hicache.controller.{path.stem}"
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("hicache.controller")
            ):
                if node.module == "hicache.controller":
                    found.update(f"hicache.controller.{alias.name}" for alias in node.names)
                else:
                    found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("hicache.controller."))
        graph[name] = found
    return graph


def test_no_collaborator_reaches_back_into_the_facade() -> None:
    """The collaborators (allocation, tier mover, admission, prefetches, leases, accounting, workers, the
    storage writer, ...) are handed what they need; none imports the facade (`cache.py`), which was the
    storage writer's import cycle."""
    graph = _controller_imports()
    assert "hicache.controller.cache" in graph
    importers = {m for m, deps in graph.items() if "hicache.controller.cache" in deps}
    assert importers == {"hicache.controller.__init__"}


def test_the_controller_package_has_no_import_cycles() -> None:
    """A depth-first walk of the controller's import graph finds no module on its own import path."""
    graph = _controller_imports()
    graph.pop("hicache.controller.__init__")
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            assert state.get(dep) != "open", " -> ".join([*path, module, dep])
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_names_module_is_a_leaf() -> None:
    """`hicache.tiers` imports nothing of hicache, so the tree, the controller and the metrics can use it."""
    tree = ast.parse((CONTROLLER.parent / "tiers.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported == {"__future__", "enum"}
