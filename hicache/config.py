"""One validated configuration dataclass for a `HiCache`."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hicache.components.base import Component
from hicache.keys import Namespace
from hicache.layout import KVLayout
from hicache.policy import EvictionPolicy, RefillPolicy, StopPolicy, WritePolicy, parse_policy
from storage_backends.names import check_url_names
from storage_backends.redact import redact_text, redacted_repr, remember_secrets, secret_values

if TYPE_CHECKING:
    from hicache.parallel.group import RankGroup

__all__ = ["STORAGE_BATCH_BYTES", "HiCacheConfig", "layout_signature"]

STORAGE_BATCH_BYTES = 64 << 20
"""Target payload bytes per storage `get` call of a prefetch when `storage_batch_pages` is not set.
Each call costs the event loop CPU whatever its size (the stream's read, the backend's checks, the wake-up),
taken from the read threads on a small machine; the backend still spreads a call over its threads, so a
larger call loses no parallelism (a prefetch's progress moves in steps of a call). Measured with
`bench/bench_io.py` (2 cores, 16 concurrent prefetches of 1 GiB in all, hot file backend): at 64 KiB pages,
1 MiB calls reached ~2.1 GB/s, 4 MiB calls ~3.1 GB/s; at 1 MiB pages, 4 MiB calls cost the loop ~31 ms of
CPU per GiB, 16 MiB calls ~19 ms. Once a call's groups woke the loop once (read sets), 64 MiB calls cost
~15-16 ms against 17-22 ms for 16 MiB, and cold passes ran 1.17-1.34 of raw against 1.05-1.13 (issue 12,
BENCHMARKS.md). A call must finish within `storage_read_timeout_s` (default 5 s: 13 MB/s for 64 MiB, a tier
far too slow to beat recomputing that much KV); set `storage_batch_pages` lower for a slower one."""


def layout_signature(layout: KVLayout, components: Sequence[Component] = ()) -> str:
    """The canonical description of a cache's page bytes, the `layout` field of its `Namespace`.

    Canonical JSON of the KV layout's `signature()` (layers, planes, page size, KV heads, head dim, dtype,
    page-first layout version) and, per component in order, its name, kind and pool layout. A component's
    other settings (a sliding window's length) decide which pages exist, not their bytes, and stay out.
    """
    described = {
        "kv": layout.signature(),
        "components": [
            {"name": c.name, "kind": type(c).__name__, "pool": c.pool_layout(layout.page_size).signature()}
            for c in components
        ],
    }
    return json.dumps(described, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _positive_int(name: str, value: object, *, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")


def _non_negative_float(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number of seconds, got {value}")
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")


def _positive_seconds(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a number of seconds, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a finite number of seconds > 0, got {value!r}")


@dataclass(frozen=True)
class HiCacheConfig:
    """Everything a `HiCache` needs to know, validated on construction.

    Attributes:
        layout: the KV layout of one page (layers, heads, head dim, dtype, page size).
        device_pages: pages in the device pool (GPU when available, CPU otherwise).
        host_pages: pages in the host pool (pinned when an accelerator exists).
        write_policy: when device pages are backed up to host.
        eviction_policy: which evictable leaf goes first.
        write_through_threshold: hits before a backup under `write_through_selective`.
        storage_url: `file:///path`, `memory://name`, `s3://bucket/prefix`, or None for no storage tier.
            An `s3://` bucket must follow the S3 naming rules and the prefix and a `file://` root may
            hold no `.` or `..` segment, even percent-encoded (`storage_backends.names`).
        storage_options: keyword options passed to the backend factory. Secrets in it and in the URL
            (credentials, tokens) are shown as `***` by `repr`/`str`.
        namespace: who this cache's pages belong to (`model_id`, tensor-parallel rank and size, `extra`).
            The configuration derives the effective namespace from it: its `layout` field is always
            replaced by `layout_signature(layout, components)`, so caches whose pages differ in bytes never
            share pages, whatever is passed. Two caches share pages exactly when their effective
            namespaces are equal (see docs/storage.md, "Namespaces and sharing").
        backup_to_storage: write host backups through to storage in the background.
        prefetch_threshold: minimum page-aligned storage remainder (tokens) worth a prefetch.
        prefetch_stop_policy: when a prefetch stops streaming (see `StopPolicy`).
        prefetch_timeout_base: seconds, for the `timeout` policy (every timeout is finite and >= 0).
        prefetch_timeout_per_1k_tokens: seconds per 1,024 tokens, for the `timeout` policy.
        prefetch_timeout_max: upper bound in seconds, for the `timeout` policy.
        prefetch_capacity_tokens: most tokens in flight across prefetches (default: half the host pool).
        storage_batch_pages: pages per storage `get` call while streaming a prefetch (default: as many as
            fill `STORAGE_BATCH_BYTES`, at least one: fewer, larger calls cost the event loop fewer
            thread hops or requests).
        storage_concurrency: `get` batches in flight at once per prefetch.
        release_batch_pages: pages the release queue returns to the host pool per step.
        storage_read_timeout_s: the most one storage read (an `exists` lookup or a `get` batch) may take;
            a read that takes longer fails its pages (counted as `storage_page_failures{reason="timeout"}`)
            and its worker threads are abandoned, their buffers quarantined until they return.
        storage_write_timeout_s: the most one storage write (a `put` batch) of write-through may take; a
            write that takes longer fails its pages (`reason="write_timeout"`), and the host pages it
            reads stay locked until its threads return.
        close_timeout_s: the most `aclose()` waits for background work, stuck I/O and copies; what is left
            then is logged and finishes in the background (pools a stuck thread may touch stay open
            until it returns).
        storage_breaker_threshold: consecutive storage errors (unreachable, timed out, 5xx, refused
            credentials) that open the storage tier's circuit breaker; while open, prefetch and
            write-through skip storage without I/O.
        storage_breaker_backoff_s: seconds after opening before one call probes storage again.
        storage_breaker_backoff_max_s: cap of the probe backoff, which doubles after each failed probe.
        backup_queue_limit: most device->host backup targets begun and not yet committed or aborted
            (queued or copying); more are shed and counted in `writes_shed_total{tier="host"}`.
        storage_write_queue_limit: most write-through targets host-locked at once (queued or being
            written); more are shed and counted in `writes_shed_total{tier="storage"}`.
        components: hybrid-model components kept beside full-attention KV (`SlidingWindow`,
            `MambaState`), each with its own device and host pools; empty for a full-attention model.
        layerwise_load_back: `acquire` loads host hits back layer by layer and returns at once; the
            lease's `layers.wait_layer(i)` says when layer i may be read (see `layered_load`).
            Ignored with `components` (loaded whole). Under tensor parallelism `tp_group` needs a
            readiness group (`RankGroup(readiness_process_group=...)`): `wait_layer` is then agreed.
        refill_under_unbacked: what a prefetch commit does with a refill whose attach point is not
            backed up: `drop` it (the default), or `backup_then_attach` (see `RefillPolicy`).
        tp_group: the tensor-parallel rank group (`hicache.parallel.RankGroup`), or None for one rank.
            With more than one rank, every decision that depends on rank-local facts (the storage probe,
            the pages a prefetch completed) is agreed across the group before the tree changes
            (docs/tensor-parallel.md). Its rank and size must equal `namespace.tp_rank` and `tp_size`.
    """

    layout: KVLayout
    device_pages: int
    host_pages: int
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    eviction_policy: EvictionPolicy = EvictionPolicy.LRU
    write_through_threshold: int = 2
    storage_url: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    namespace: Namespace = field(default_factory=Namespace)
    backup_to_storage: bool = True
    prefetch_threshold: int = 256
    prefetch_stop_policy: StopPolicy = StopPolicy.TIMEOUT
    prefetch_timeout_base: float = 2.0
    prefetch_timeout_per_1k_tokens: float = 0.1
    prefetch_timeout_max: float = 30.0
    prefetch_capacity_tokens: int | None = None
    storage_batch_pages: int | None = None
    storage_concurrency: int = 4
    release_batch_pages: int = 256
    storage_read_timeout_s: float = 5.0
    storage_write_timeout_s: float = 30.0
    close_timeout_s: float = 5.0
    storage_breaker_threshold: int = 5
    storage_breaker_backoff_s: float = 1.0
    storage_breaker_backoff_max_s: float = 30.0
    backup_queue_limit: int = 1024
    storage_write_queue_limit: int = 1024
    components: tuple[Component, ...] = ()
    layerwise_load_back: bool = False
    refill_under_unbacked: RefillPolicy = RefillPolicy.DROP
    tp_group: RankGroup | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise TypeError(f"layout: expected a KVLayout, got {type(self.layout).__name__}")
        if not isinstance(self.layerwise_load_back, bool):
            raise TypeError(f"layerwise_load_back: expected a bool, got {self.layerwise_load_back!r}")
        _positive_int("device_pages", self.device_pages)
        _positive_int("host_pages", self.host_pages)
        _positive_int("write_through_threshold", self.write_through_threshold)
        _positive_int("prefetch_threshold", self.prefetch_threshold, minimum=0)
        if self.storage_batch_pages is not None:
            _positive_int("storage_batch_pages", self.storage_batch_pages)
        _positive_int("storage_concurrency", self.storage_concurrency)
        _positive_int("release_batch_pages", self.release_batch_pages)
        _positive_int("storage_breaker_threshold", self.storage_breaker_threshold)
        _positive_int("backup_queue_limit", self.backup_queue_limit)
        _positive_int("storage_write_queue_limit", self.storage_write_queue_limit)
        _non_negative_float("storage_breaker_backoff_s", self.storage_breaker_backoff_s)
        if not self.storage_breaker_backoff_s > 0:
            raise ValueError(f"storage_breaker_backoff_s: must be > 0, got {self.storage_breaker_backoff_s}")
        _non_negative_float("storage_breaker_backoff_max_s", self.storage_breaker_backoff_max_s)
        if self.storage_breaker_backoff_max_s < self.storage_breaker_backoff_s:
            raise ValueError(
                f"storage_breaker_backoff_max_s: must be >= storage_breaker_backoff_s "
                f"({self.storage_breaker_backoff_s}), got {self.storage_breaker_backoff_max_s}"
            )
        if self.prefetch_capacity_tokens is not None:
            _positive_int("prefetch_capacity_tokens", self.prefetch_capacity_tokens, minimum=0)
        for name in ("prefetch_timeout_base", "prefetch_timeout_per_1k_tokens", "prefetch_timeout_max"):
            _non_negative_float(name, getattr(self, name))
        for name in ("storage_read_timeout_s", "storage_write_timeout_s", "close_timeout_s"):
            _positive_seconds(name, getattr(self, name))
        object.__setattr__(self, "write_policy", parse_policy(WritePolicy, self.write_policy, "write_policy"))
        object.__setattr__(
            self,
            "refill_under_unbacked",
            parse_policy(RefillPolicy, self.refill_under_unbacked, "refill_under_unbacked"),
        )
        object.__setattr__(
            self, "eviction_policy", parse_policy(EvictionPolicy, self.eviction_policy, "eviction_policy")
        )
        object.__setattr__(
            self,
            "prefetch_stop_policy",
            parse_policy(StopPolicy, self.prefetch_stop_policy, "prefetch_stop_policy"),
        )
        if self.storage_url is not None:
            if not isinstance(self.storage_url, str) or "://" not in self.storage_url:
                raise ValueError(
                    f"storage_url: expected a URL such as 'file:///path', got {redact_text(str(self.storage_url))!r}"
                )
            try:
                check_url_names(self.storage_url)
            except ValueError as exc:
                raise ValueError(f"storage_url: {exc}") from None
        if not isinstance(self.storage_options, Mapping):
            raise TypeError(f"storage_options: expected a mapping, got {type(self.storage_options).__name__}")
        remember_secrets(secret_values(self.storage_url, self.storage_options))
        if not isinstance(self.namespace, Namespace):
            raise TypeError(f"namespace: expected a Namespace, got {type(self.namespace).__name__}")
        components = tuple(self.components)
        names = set()
        for comp in components:
            if not isinstance(comp, Component):
                raise TypeError(f"components: expected Component objects, got {type(comp).__name__}")
            if comp.name in names or comp.name == "full":
                raise ValueError(f"components: the name {comp.name!r} is taken")
            names.add(comp.name)
            comp.pool_layout(self.page_size)  # raises on a page size mismatch
        object.__setattr__(self, "components", components)
        if self.tp_group is not None:
            # Not imported here (it pulls in `hicache.parallel`): a RankGroup exists only once its module is.
            group = sys.modules.get("hicache.parallel.group")
            if group is None or not isinstance(self.tp_group, group.RankGroup):
                raise TypeError(f"tp_group: expected a RankGroup, got {type(self.tp_group).__name__}")
            if self.tp_group.tp_size > 1 and self.layerwise_load_back and self.tp_group.readiness is None:
                # `wait_layer` is a collective in the model's thread, beside the agreement's steps.
                raise ValueError(
                    "tp_group: layerwise_load_back under tensor parallelism needs a readiness group "
                    "(RankGroup(..., readiness_process_group=dist.new_group(ranks, backend='gloo')))"
                )
            ns = self.namespace
            if (ns.tp_rank, ns.tp_size) != (self.tp_group.tp_rank, self.tp_group.tp_size):
                raise ValueError(
                    f"tp_group: rank {self.tp_group.tp_rank} of {self.tp_group.tp_size}, but the namespace "
                    f"says tp_rank={ns.tp_rank}, tp_size={ns.tp_size}"
                )
        signature = layout_signature(self.layout, components)
        if self.namespace.layout != signature:
            object.__setattr__(self, "namespace", dataclasses.replace(self.namespace, layout=signature))

    def __repr__(self) -> str:
        """The fields, with secrets in `storage_url` and `storage_options` replaced by `***`."""
        return redacted_repr(self)

    @property
    def page_size(self) -> int:
        """Tokens per page (from the layout)."""
        return self.layout.page_size

    @property
    def capacity_tokens(self) -> int:
        """The prefetch in-flight limit in tokens."""
        if self.prefetch_capacity_tokens is not None:
            return self.prefetch_capacity_tokens
        return self.host_pages * self.page_size // 2

    @property
    def batch_pages(self) -> int:
        """Pages per storage `get` call while streaming: `storage_batch_pages`, or its default."""
        if self.storage_batch_pages is not None:
            return self.storage_batch_pages
        return max(1, STORAGE_BATCH_BYTES // self.layout.page_nbytes)

    def prefetch_timeout(self, num_tokens: int) -> float:
        """Seconds a `timeout` prefetch of `num_tokens` may stream: min(max, base + per_1k * tokens / 1024)."""
        return min(
            self.prefetch_timeout_max,
            self.prefetch_timeout_base + self.prefetch_timeout_per_1k_tokens * num_tokens / 1024,
        )
