"""The controller's metric set, registered as prometheus_client collectors in the caller's registry."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import prometheus_client as prom

from hicache.metrics.handles import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from hicache.keys import Namespace

__all__ = ["DEFAULT_PREFIX", "LATENCY_BUCKETS", "CacheMetrics", "default_cache_metrics", "rank_labels"]

DEFAULT_PREFIX = "hicache_"
"""Prepended to every metric name: the application prefix Prometheus naming asks for, which also keeps
hicache's series apart from an embedding server's own on its ``/metrics``."""

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds for prefetch latencies in seconds (``+Inf`` is added by prometheus_client)."""


@dataclass(frozen=True)
class CacheMetrics:
    """The metrics the cache controller updates. Names below are without the prefix (``hicache_``).

    Counters are named after their field plus ``_total``, except ``storage_bytes_read`` and
    ``storage_bytes_written`` (``storage_read_bytes_total``, ``storage_written_bytes_total``: the unit
    ends the name); ``prefetch_latency`` is the histogram ``prefetch_latency_seconds``.
    """

    registry: prom.CollectorRegistry
    """Where the collectors are registered."""
    prefetch_requested: Counter
    prefetch_skipped: Counter
    """Labelled by ``reason``."""
    prefetch_hit_tokens: Counter
    prefetch_loaded_tokens: Counter
    prefetch_dropped_tokens: Counter
    """Labelled by ``reason``."""
    prefetch_committed: Counter
    prefetch_cancelled: Counter
    storage_bytes_read: Counter
    storage_bytes_written: Counter
    storage_page_failures: Counter
    """Labelled by ``reason``: ``exists`` (a lookup failed), ``write``, ``timeout``, and for reads the
    failed page's `PageStatus` value: ``miss``, ``corrupt``, ``foreign_page`` (another namespace's or
    another key's page under this key), ``old_format``, ``error``."""
    backup_tokens: Counter
    backup_skipped: Counter
    evict_dropped_tokens: Counter
    """Device tokens evicted without a host copy: un-backed nodes deleted (write-through) or dropped
    because their un-backed chain did not fit in the host (write-back)."""
    load_back_tokens: Counter
    prefetch_latency: Histogram
    storage_errors: Counter
    """Labelled by ``op`` (exists, get, put) and ``kind`` (unavailable, timeout, auth, other): storage calls
    that failed with an error, never a miss."""
    writes_shed: Counter
    """Labelled by ``tier`` (host, storage) and ``reason``: backups and storage writes dropped instead of
    done (``queue_full``: the queue was at its limit; ``storage_unavailable``: the breaker was open). A
    queued storage write holds its host pages until written: only admission sheds."""
    storage_breaker_state: Gauge
    """Labelled by ``tier``: 0 closed, 1 open, 2 half-open (see `hicache.controller.storage.guarded`)."""


# (field, kind, name without prefix, help, labelnames)
_SPEC: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("prefetch_requested", "counter", "prefetch_requested_total", "Storage prefetches requested.", ()),
    (
        "prefetch_skipped",
        "counter",
        "prefetch_skipped_total",
        "Storage prefetches not started, by reason.",
        ("reason",),
    ),
    (
        "prefetch_hit_tokens",
        "counter",
        "prefetch_hit_tokens_total",
        "Tokens found in storage by prefetch lookups.",
        (),
    ),
    (
        "prefetch_loaded_tokens",
        "counter",
        "prefetch_loaded_tokens_total",
        "Tokens read from storage into host memory.",
        (),
    ),
    (
        "prefetch_dropped_tokens",
        "counter",
        "prefetch_dropped_tokens_total",
        "Prefetched tokens dropped instead of committed, by reason.",
        ("reason",),
    ),
    ("prefetch_committed", "counter", "prefetch_committed_total", "Prefetches committed into the tree.", ()),
    ("prefetch_cancelled", "counter", "prefetch_cancelled_total", "Prefetches cancelled.", ()),
    ("storage_bytes_read", "counter", "storage_read_bytes_total", "Bytes read from storage.", ()),
    ("storage_bytes_written", "counter", "storage_written_bytes_total", "Bytes written to storage.", ()),
    (
        "storage_page_failures",
        "counter",
        "storage_page_failures_total",
        "Storage page operations that failed, by reason.",
        ("reason",),
    ),
    (
        "backup_tokens",
        "counter",
        "backup_tokens_total",
        "Tokens backed up from device to host or storage.",
        (),
    ),
    (
        "backup_skipped",
        "counter",
        "backup_skipped_total",
        "Backups not started (no host or storage room).",
        (),
    ),
    (
        "evict_dropped_tokens",
        "counter",
        "evict_dropped_tokens_total",
        "Device tokens evicted without a host copy (un-backed nodes deleted).",
        (),
    ),
    (
        "load_back_tokens",
        "counter",
        "load_back_tokens_total",
        "Tokens loaded back from host to device.",
        (),
    ),
    (
        "prefetch_latency",
        "histogram",
        "prefetch_latency_seconds",
        "Seconds from prefetch start to commit.",
        (),
    ),
    (
        "storage_errors",
        "counter",
        "storage_errors_total",
        "Storage calls that failed with an error (not a miss), by op and kind.",
        ("op", "kind"),
    ),
    (
        "writes_shed",
        "counter",
        "writes_shed_total",
        "Backups and storage writes dropped instead of queued, by tier and reason.",
        ("tier", "reason"),
    ),
    (
        "storage_breaker_state",
        "gauge",
        "storage_breaker_state",
        "Storage circuit breaker: 0 closed, 1 open, 2 half-open.",
        ("tier",),
    ),
)

_FamilyKey = tuple[str, tuple[str, ...]]
_families: weakref.WeakKeyDictionary[prom.CollectorRegistry, dict[_FamilyKey, dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)
_families_lock = threading.Lock()


def _register(registry: prom.CollectorRegistry, prefix: str, const_names: tuple[str, ...]) -> dict[str, Any]:
    """Create every collector of `_SPEC` in `registry`: field name -> (name, collector, labelnames)."""
    made: dict[str, Any] = {}
    for field, kind, name, help, labelnames in _SPEC:
        full = prefix + name
        names = (*labelnames, *const_names)
        try:
            collector: prom.Counter | prom.Gauge | prom.Histogram
            if kind == "counter":
                collector = prom.Counter(full, help, names, registry=registry)
            elif kind == "gauge":
                # One series per label set across processes in multiprocess mode: the latest value set
                # by a live process (a rank's breaker state, with its `tp_rank` label).
                collector = prom.Gauge(
                    full, help, names, registry=registry, multiprocess_mode="livemostrecent"
                )
            else:
                collector = prom.Histogram(full, help, names, registry=registry, buckets=LATENCY_BUCKETS)
        except ValueError as exc:
            raise ValueError(f"registry: cannot register {full!r}: {exc}") from exc
        made[field] = (full, collector, labelnames)
    return made


def default_cache_metrics(
    registry: prom.CollectorRegistry,
    *,
    prefix: str = DEFAULT_PREFIX,
    const_labels: Mapping[str, str] | None = None,
) -> CacheMetrics:
    """Register (or, for a registry that has them, fetch) the controller's metrics in `registry`.

    Caches sharing one registry share its collectors: a second call with the same prefix and constant
    label names reuses them (a series is told apart only by its constant label values).

    Args:
        registry: the prometheus_client registry to register in (an embedding server passes its own, so
            its ``/metrics`` shows hicache's series).
        prefix: prepended to every metric name.
        const_labels: labels added to every series, e.g. `rank_labels(namespace)`.

    Raises:
        TypeError: when `registry` is not a `prometheus_client.CollectorRegistry`.
        ValueError: when `prefix` makes invalid names, a constant label name is invalid or taken, or
            `registry` already holds one of the names from someone else.
    """
    if not isinstance(registry, prom.CollectorRegistry):
        raise TypeError(
            f"registry: expected a prometheus_client CollectorRegistry, got {type(registry).__name__}"
        )
    const = dict(const_labels or {})
    for name, value in const.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"const_labels: names and values must be str, got {name!r}: {value!r}")
        if any(name in labelnames for *_, labelnames in _SPEC):
            raise ValueError(f"const_labels: {name!r} is one of the metrics' own label names")
    key: _FamilyKey = (prefix, tuple(sorted(const)))
    with _families_lock:
        per_registry = _families.setdefault(registry, {})
        made = per_registry.get(key)
        if made is None:
            made = per_registry[key] = _register(registry, prefix, key[1])
    kinds = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
    handles: dict[str, Any] = {
        field: kinds[kind](made[field][0], made[field][1], made[field][2], const) for field, kind, *_ in _SPEC
    }
    return CacheMetrics(registry=registry, **handles)


def rank_labels(namespace: Namespace) -> dict[str, str]:
    """The constant labels of a cache in `namespace`: ``tp_rank`` when it is one rank of several, else none.

    Each tensor-parallel rank is one process with its own cache; the label keeps their series apart when
    one ``/metrics`` shows every rank (prometheus_client's multiprocess mode), and single-process caches
    keep the plain label sets.
    """
    return {"tp_rank": str(namespace.tp_rank)} if namespace.tp_size > 1 else {}
