"""`HiCacheConnector`: hicache as vLLM's host and storage tiers, through vLLM's KV connector API (v1).

Load it the standard way::

    KVTransferConfig(kv_connector="HiCacheConnector", kv_connector_module_path="hicache.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"host_bytes": 8 << 30,
                     "storage_url": "file:///var/cache/hicache"})

vLLM's block pool stays the device tier (its own prefix cache on); hicache keeps what vLLM evicts in its
pinned host pool and storage below, with its radix tree, its commit-or-drop prefetch and its
integrity-checked, namespaced pages.

Which process owns what (vLLM runs the scheduler in EngineCore and the model in a Worker process, even at
one rank on the CPU backend):

- The Worker owns the `HiCache` (tree, host pool, storage) on an event loop thread of its own, because
  the bytes are there: every copy between vLLM's paged KV tensors and hicache's pages is a local memcpy.
  It also serves lookups on a ZeroMQ socket (`ipc://`, one per engine id), answered on that loop.
- The scheduler side (EngineCore) only does bookkeeping: one lookup round trip per waiting request (the
  answer is `None`, "ask again", while a storage probe runs, so the scheduler never waits on storage),
  then it ships load and save jobs to the worker in the step's connector metadata.

A host hit is loaded synchronously in `start_load_kv`; a hit that needs storage is an async load (the
request waits in `WAITING_FOR_REMOTE_KVS` while hicache's prefetch streams, and the commit decides how much
is loaded). Both are one path, `HiCache.acquire`: a host hit is a load with no storage stage. Blocks hicache
could not deliver are reported through `get_block_ids_with_load_errors`, so vLLM recomputes them. A
finished request's blocks are copied into hicache (`request_finished` keeps them until the copy landed,
then `insert` backs them up to host and storage in the background).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Coroutine, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import prometheus_client
import torch
import zmq
import zmq.asyncio as zmq_asyncio
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace
from hicache.keys import as_key_bytes
from storage_backends.cancellation import run_in_thread

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "HiCacheConnector",
    "HiCacheConnectorMetadata",
    "LoadJob",
    "SaveJob",
    "build_hicache_config",
    "lookup_endpoint",
    "query_worker",
]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")
_TOKEN = 8  # bytes of one int64 token id
_REFUSED_PAGE_COUNTERS = ("checksum_failures", "foreign_pages", "old_format_pages")
"""The storage backend's counters of pages read and refused (damaged, another's, of an old format)."""

EXTRA_CONFIG_KEYS: Mapping[str, str] = {
    "host_pages": "pages of hicache's host pool (a page is one vLLM block)",
    "host_bytes": "bytes of hicache's host pool, instead of host_pages (default 2 GiB)",
    "staging_pages": "pages of hicache's own device pool, the staging area of copies (default: 2 x max_model_len)",
    "storage_url": "file:///dir, s3://bucket/prefix?endpoint=..., memory://name, or None (no storage tier)",
    "storage_options": "keyword options of the storage backend (credentials)",
    "write_policy": "write_through, write_through_selective or write_back",
    "eviction_policy": "lru, lfu or priority",
    "backup_to_storage": "write host pages through to storage (default true)",
    "prefetch_threshold": "least storage remainder in tokens worth a prefetch (default: one block)",
    "prefetch_stop_policy": "best_effort, wait_complete or timeout",
    "prefetch_timeout_base": "seconds, for the timeout stop policy",
    "prefetch_timeout_per_1k_tokens": "seconds per 1,024 tokens, for the timeout stop policy",
    "prefetch_timeout_max": "upper bound in seconds, for the timeout stop policy",
    "storage_read_timeout_s": "the most one storage read may take",
    "storage_write_timeout_s": "the most one storage write may take",
    "model_id": "the namespace's model id (default: derived from vLLM's model config)",
    "namespace_extra": "a further namespace discriminator",
    "lookup_timeout_s": "the most the scheduler waits for the worker's lookup answer (default 1 s)",
}
"""Every key `kv_connector_extra_config` accepts, with what it sets. Any other key is refused."""

_HICACHE_FIELDS = (
    "storage_url",
    "storage_options",
    "write_policy",
    "eviction_policy",
    "backup_to_storage",
    "prefetch_stop_policy",
    "prefetch_timeout_base",
    "prefetch_timeout_per_1k_tokens",
    "prefetch_timeout_max",
    "storage_read_timeout_s",
    "storage_write_timeout_s",
)


# ---------------------------------------------------------------------------------------- configuration


def _layout_of(vllm_config: Any) -> KVLayout:
    """hicache's page layout for vLLM's KV: one page is one vLLM block of every layer."""
    model, parallel, cache = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if getattr(model, "use_mla", False):
        raise ValueError("HiCacheConnector: MLA models (a latent KV per layer) are not supported yet")
    if parallel.world_size != 1:
        raise ValueError(
            "HiCacheConnector: tensor and pipeline parallelism are not supported yet "
            f"(world_size {parallel.world_size}): each rank would need its own cache and an agreement"
        )
    if cache.cache_dtype != "auto":
        raise ValueError(
            f"HiCacheConnector: kv cache dtype {cache.cache_dtype!r} is not supported (only 'auto')"
        )
    return KVLayout(
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        dtype=model.dtype,
        page_size=cache.block_size,
    )


def _model_id(vllm_config: Any) -> str:
    """The model's identity: its name, revision and load format, and a digest of its HF config."""
    model = vllm_config.model_config
    digest = hashlib.blake2b(
        model.hf_config.to_json_string(use_diff=False).encode(), digest_size=8
    ).hexdigest()
    load_format = getattr(vllm_config.load_config, "load_format", "")
    return f"{model.model}@{model.revision or ''}#{digest}/{load_format}"


def build_hicache_config(vllm_config: Any) -> tuple[HiCacheConfig, float]:
    """The `HiCacheConfig` (and the lookup timeout) for `vllm_config`'s model and extra config.

    Raises:
        ValueError: naming the `kv_connector_extra_config` key that is unknown or invalid, or the vLLM
            feature that is not supported (MLA, parallelism, a quantized KV cache dtype).
        TypeError: naming the key whose value has the wrong type.
    """
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    for key in extra:
        if key not in EXTRA_CONFIG_KEYS:
            raise ValueError(
                f"kv_connector_extra_config: unknown key {key!r}; expected one of {', '.join(EXTRA_CONFIG_KEYS)}"
            )
    layout = _layout_of(vllm_config)
    if "host_pages" in extra and "host_bytes" in extra:
        raise ValueError("kv_connector_extra_config: give host_pages or host_bytes, not both")
    host_bytes = extra.get("host_bytes", 2 << 30)
    if not isinstance(host_bytes, int) or isinstance(host_bytes, bool):
        raise TypeError(f"kv_connector_extra_config: host_bytes: expected an int, got {host_bytes!r}")
    host_pages = extra.get("host_pages", host_bytes // layout.page_nbytes)
    max_len = int(vllm_config.model_config.max_model_len)
    staging = extra.get("staging_pages", 2 * -(-max_len // layout.page_size) + 2)
    timeout = extra.get("lookup_timeout_s", 1.0)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(
            f"kv_connector_extra_config: lookup_timeout_s: expected seconds > 0, got {timeout!r}"
        )
    for key in ("model_id", "namespace_extra"):
        if key in extra and not isinstance(extra[key], str):
            raise TypeError(f"kv_connector_extra_config: {key}: expected a str, got {extra[key]!r}")
    namespace = Namespace(
        model_id=extra.get("model_id") or _model_id(vllm_config), extra=extra.get("namespace_extra", "")
    )
    fields = {name: extra[name] for name in _HICACHE_FIELDS if name in extra}
    try:
        config = HiCacheConfig(
            layout=layout,
            device_pages=staging,
            host_pages=host_pages,
            namespace=namespace,
            prefetch_threshold=extra.get("prefetch_threshold", layout.page_size),
            **fields,
        )
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"kv_connector_extra_config: {exc}") from exc
    return config, float(timeout)


def lookup_endpoint(engine_id: str) -> str:
    """The ZeroMQ endpoint of the worker's lookup server for vLLM engine `engine_id`."""
    digest = hashlib.blake2b(engine_id.encode(), digest_size=8).hexdigest()
    return f"ipc://{tempfile.gettempdir()}/hicache-vllm-{digest}.sock"


# ---------------------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class LoadJob:
    """Load `tokens[start:end]` of request `request_id` from hicache into vLLM blocks `block_ids`."""

    request_id: str
    key: bytes
    start: int
    end: int
    block_ids: tuple[int, ...]
    is_async: bool


@dataclass(frozen=True)
class SaveJob:
    """Copy the KV of `key` (whole blocks) from vLLM blocks `block_ids` into hicache."""

    request_id: str
    key: bytes
    block_ids: tuple[int, ...]


@dataclass
class HiCacheConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side hands the worker side for one step."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    forgets: list[str] = field(default_factory=list)
    """Requests whose lookup the worker may drop (finished or aborted before any load)."""


@dataclass
class _Plan:
    start: int
    host_end: int
    end: int
    is_async: bool


# ---------------------------------------------------------------------------------------- the connector


class HiCacheConnector(KVConnectorBase_V1):
    """vLLM KV connector with hicache's host and storage tiers below vLLM's block pool.

    One instance per role: the scheduler's (bookkeeping, in EngineCore) and the worker's (the `HiCache`
    and every copy, in the Worker process); see the module docstring.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._hicache_config, timeout = build_hicache_config(vllm_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) > 1:
            raise ValueError(
                "HiCacheConnector: hybrid models (more than one KV cache group) are not supported yet"
            )
        self._page = self._hicache_config.page_size
        endpoint = lookup_endpoint(vllm_config.kv_transfer_config.engine_id)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # hicache is a cache: a block it could not load is recomputed, never a failed request. vLLM's
            # scheduler reads this policy right after building its connector (its default is "fail").
            transfer = vllm_config.kv_transfer_config
            if transfer.kv_load_failure_policy != "recompute":
                logger.info("HiCacheConnector: kv_load_failure_policy set to 'recompute'")
                object.__setattr__(transfer, "kv_load_failure_policy", "recompute")
            self._scheduler = _SchedulerSide(self._page, endpoint, timeout)
        else:
            self._worker = _WorkerSide(self._hicache_config, endpoint)

    # -- scheduler side

    def _sched(self) -> _SchedulerSide:
        assert self._scheduler is not None, "scheduler-side method called on the worker's connector"
        return self._scheduler

    def _work(self) -> _WorkerSide:
        assert self._worker is not None, "worker-side method called on the scheduler's connector"
        return self._worker

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens hicache can load beyond `num_computed_tokens`, and whether the load is async."""
        return self._sched().lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load into the blocks vLLM allocated."""
        self._sched().allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HiCacheConnectorMetadata:
        """This step's loads, saves and forgotten lookups."""
        return self._sched().take_metadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Save the finished request's whole blocks (kept until the copy landed); report its hits."""
        return self._sched().finished(request, block_ids)

    # -- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Start the worker's `HiCache` over vLLM's per-layer KV tensors."""
        self._work().register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads and saves; host hits land before this returns."""
        self._work().start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: synchronous loads landed in `start_load_kv`."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Nothing per layer: finished requests' blocks are copied whole (`request_finished` keeps them)."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: saves are asynchronous and reported by `get_finished`."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose save copy landed, and requests whose async load finished (or failed)."""
        return self._work().finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks promised to vLLM that hicache could not load (vLLM recomputes them)."""
        return self._work().take_load_errors()

    def shutdown(self) -> None:
        """Close the worker's cache (waits for its background work within `close_timeout_s`)."""
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()


# ---------------------------------------------------------------------------------------- scheduler side


class _SchedulerSide:
    """Bookkeeping in EngineCore: one lookup round trip per waiting request, then jobs for the worker."""

    def __init__(self, page: int, endpoint: str, timeout_s: float) -> None:
        self._page = page
        self._client = _LookupClient(endpoint, timeout_s)
        self._plans: dict[str, _Plan] = {}
        self._hits: dict[str, dict[str, int]] = {}
        self._meta = HiCacheConnectorMetadata()
        self._asked: set[str] = set()

    def lookup(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        rid = request.request_id
        tokens = request.all_token_ids
        # vLLM computes at least the last token itself: only whole blocks before it can load.
        n_max = (request.num_tokens - 1) // self._page * self._page
        if n_max <= num_computed:
            return 0, False
        key = _key_bytes(tokens, n_max)
        reply = self._client.ask({"op": "lookup", "rid": rid}, key)
        self._asked.add(rid)
        if reply is None:  # the worker did not answer in time: a miss, never a stall
            return 0, False
        if reply["state"] == "pending":
            return None, False
        host_end, end = int(reply["host_end"]), int(reply["end"])
        if end <= num_computed:  # vLLM's own prefix cache reaches as far: drop the lookup (and its prefetch)
            self._plans.pop(rid, None)
            self._asked.discard(rid)
            self._meta.forgets.append(rid)
            return 0, False
        is_async = end > max(host_end, num_computed)
        self._plans[rid] = _Plan(num_computed, host_end, end, is_async)
        return end - num_computed, is_async

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, None)
        if plan is None or num_external_tokens == 0:
            return
        end = plan.start + num_external_tokens
        block_ids = blocks.get_block_ids()[0]
        page = self._page
        self._meta.loads.append(
            LoadJob(
                request_id=request.request_id,
                key=_key_bytes(request.all_token_ids, end),
                start=plan.start,
                end=end,
                block_ids=tuple(block_ids[plan.start // page : end // page]),
                is_async=plan.is_async,
            )
        )
        host = max(0, min(plan.host_end, end) - plan.start)
        self._hits[request.request_id] = {"host": host, "storage": num_external_tokens - host}

    def take_metadata(self) -> HiCacheConnectorMetadata:
        meta, self._meta = self._meta, HiCacheConnectorMetadata()
        return meta

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._plans.pop(rid, None)
        if rid in self._asked:
            self._asked.discard(rid)
            self._meta.forgets.append(rid)
        params = {"hicache_hit_tokens": self._hits.pop(rid, {"host": 0, "storage": 0})}
        if request.status.name == "WAITING_FOR_REMOTE_KVS":
            return False, params  # vLLM itself keeps the blocks until the load reports back
        n = min(request.num_computed_tokens, request.num_tokens) // self._page * self._page
        if n == 0 or len(block_ids) < n // self._page:
            return False, params
        key = _key_bytes(request.all_token_ids, n)
        self._meta.saves.append(SaveJob(rid, key, tuple(block_ids[: n // self._page])))
        return True, params

    def close(self) -> None:
        self._client.close()


def _key_bytes(tokens: Any, n: int) -> bytes:
    """The first `n` token ids as hicache's key bytes (int64, little-endian)."""
    return as_key_bytes(list(tokens[:n]), name="tokens")


class _LookupClient:
    """The scheduler's end of the lookup socket: one request, one answer, bounded by a timeout."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._endpoint = endpoint
        self._timeout_ms = int(timeout_s * 1000)
        self._socket: zmq.Socket[bytes] | None = None
        self._seq = 0

    def ask(self, header: dict[str, Any], payload: bytes = b"") -> dict[str, Any] | None:
        if self._socket is None:
            self._socket = self._context.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.connect(self._endpoint)
        self._seq += 1
        header = {**header, "seq": self._seq}
        self._socket.send_multipart([json.dumps(header).encode(), payload])
        deadline = time.monotonic() + self._timeout_ms / 1000
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0 or not self._socket.poll(left):
                logger.warning(
                    "hicache lookup got no answer within %d ms: counted as a miss", self._timeout_ms
                )
                return None
            reply: dict[str, Any] = json.loads(self._socket.recv())
            if reply.get("seq") == self._seq:  # an older, timed-out answer is dropped
                return reply

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def query_worker(engine_id: str, op: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Ask the worker of vLLM engine `engine_id` for `op`: `"statistics"` (hicache's statistics and the
    connector's counters) or `"sanity_check"` (runs `HiCache.sanity_check`; `ok` and any `error`).

    Raises:
        ValueError: naming `op` when it is neither.
        TimeoutError: when the worker does not answer within `timeout_s`.
    """
    if op not in ("statistics", "sanity_check"):
        raise ValueError(f"op: expected 'statistics' or 'sanity_check', got {op!r}")
    client = _LookupClient(lookup_endpoint(engine_id), timeout_s)
    try:
        reply = client.ask({"op": op})
    finally:
        client.close()
    if reply is None:
        raise TimeoutError(f"the hicache worker of engine {engine_id!r} did not answer {op!r}")
    return reply


# ---------------------------------------------------------------------------------------- worker side


def _block_views(kv_caches: Mapping[str, torch.Tensor], layout: KVLayout) -> list[torch.Tensor]:
    """Per layer, a view of vLLM's paged KV as ``(num_blocks, 2, block_size, num_kv_heads, head_dim)``.

    Two layouts are known: the CPU backend's ``(blocks, heads, block_size, 2 * head_dim)`` (K then V in
    each head's ``2 * block_size`` rows) and the flash layout ``(2, blocks, block_size, heads, head_dim)``.
    """
    n, h, d = layout.page_size, layout.num_kv_heads, layout.head_dim
    views = []
    if len(kv_caches) != layout.num_layers:
        raise ValueError(f"kv_caches: expected {layout.num_layers} layers, got {len(kv_caches)}")
    for name, kv in kv_caches.items():
        if kv.dtype != layout.dtype:
            raise ValueError(f"kv_caches[{name!r}]: dtype {kv.dtype}, expected {layout.dtype}")
        shape = tuple(kv.shape)
        if len(shape) == 4 and shape[1:] == (h, n, 2 * d):
            views.append(kv.view(shape[0], h, 2, n, d).permute(0, 2, 3, 1, 4))
        elif len(shape) == 5 and shape[0] == 2 and shape[2:] == (n, h, d):
            views.append(kv.permute(1, 0, 2, 3, 4))
        else:
            raise ValueError(f"kv_caches[{name!r}]: unsupported KV cache shape {shape}")
    return views


class _WorkerSide:
    """The Worker process's half: the `HiCache` runtime and the futures of this rank's transfers."""

    def __init__(self, config: HiCacheConfig, endpoint: str) -> None:
        self._config = config
        self._endpoint = endpoint
        self._runtime: _Runtime | None = None
        self._async_loads: dict[str, Future[set[int]]] = {}
        self._saves: dict[str, Future[None]] = {}
        self._finished_seen: set[str] = set()
        self._load_errors: set[int] = set()

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        views = _block_views(kv_caches, self._config.layout)
        self._runtime = _Runtime(self._config, views, self._endpoint)
        self._runtime.start()

    def _rt(self) -> _Runtime:
        assert self._runtime is not None, "register_kv_caches was not called"
        return self._runtime

    def start(self, meta: HiCacheConnectorMetadata) -> None:
        runtime = self._rt()
        for rid in meta.forgets:
            runtime.submit(runtime.forget(rid))
        sync: list[Future[set[int]]] = []
        for job in meta.loads:
            future = runtime.submit(runtime.load(job))
            if job.is_async:
                self._async_loads[job.request_id] = future
            else:
                sync.append(future)
        for save in meta.saves:
            self._saves[save.request_id] = runtime.submit(runtime.save(save))
        for future in sync:  # host hits land before the forward pass reads them
            self._load_errors |= future.result()

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finished_seen |= finished_req_ids
        sending = {rid for rid, f in self._saves.items() if f.done() and rid in self._finished_seen}
        for rid in sending:
            del self._saves[rid]
            self._finished_seen.discard(rid)
        recving = {rid for rid, f in self._async_loads.items() if f.done()}
        for rid in recving:
            self._load_errors |= self._async_loads.pop(rid).result()
        self._finished_seen -= {rid for rid in self._finished_seen if rid not in self._saves}
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None


@dataclass
class _Lookup:
    key: bytes
    host_end: int
    end: int
    pending: bool = False
    prefetching: bool = False


@dataclass
class _Counters:
    lookups: int = 0
    loads: int = 0
    loaded_tokens: int = 0
    failed_tokens: int = 0
    saves: int = 0
    saved_tokens: int = 0


class _Metrics:
    """The connector's series, in the cache's registry (and, under `PROMETHEUS_MULTIPROC_DIR`, in the
    directory vLLM's `/metrics` reads)."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        def counter(name: str, doc: str) -> prometheus_client.Counter:
            return prometheus_client.Counter(f"hicache_vllm_{name}", doc, registry=registry)

        self.loaded = counter("loaded_tokens", "Tokens hicache loaded into vLLM blocks.")
        self.failed = counter("failed_tokens", "Tokens promised to vLLM that hicache could not load.")
        self.saved = counter("saved_tokens", "Tokens of finished requests copied into hicache.")
        self.lookups = counter("lookups", "Scheduler lookups answered.")


class _Runtime:
    """The worker's `HiCache`, its event loop thread and the lookup server on that loop."""

    def __init__(self, config: HiCacheConfig, views: list[torch.Tensor], endpoint: str) -> None:
        self._config = config
        self._views = views
        self._endpoint = endpoint
        self._page = config.page_size
        self._thread = threading.Thread(target=self._run, name="hicache-vllm", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._cache: HiCache | None = None
        self._lookups: dict[str, _Lookup] = {}
        self._inflight: set[asyncio.Task[Any]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.counters = _Counters()
        self.registry = prometheus_client.CollectorRegistry()
        self.metrics = _Metrics(self.registry)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"hicache failed to start: {self._error}") from self._error

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                logger.exception("hicache's event loop ended with an error")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        context, sock, path = _bind(self._endpoint)
        try:
            async with HiCache(self._config, metrics=self.registry) as cache, asyncio.TaskGroup() as tg:
                self._cache = cache
                serving = tg.create_task(self._serve(sock))
                self._ready.set()
                await self._stop.wait()
                serving.cancel()
        finally:
            sock.close()
            context.term()
            _unlink(path)

    def submit(self, coro: Coroutine[Any, Any, _T]) -> Future[_T]:
        """Run `coro` on the cache's loop (from vLLM's thread); `sanity_check` waits for it."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(self._tracked(coro), self._loop)

    async def _tracked(self, coro: Coroutine[Any, Any, _T]) -> _T:
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            return await coro
        finally:
            self._inflight.discard(task)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=self._config.close_timeout_s + 5)

    @property
    def cache(self) -> HiCache:
        assert self._cache is not None
        return self._cache

    # -- the lookup server

    async def _serve(self, sock: zmq_asyncio.Socket) -> None:
        while True:
            ident, header_bytes, payload = await sock.recv_multipart()
            header = json.loads(header_bytes)
            if header.get("op") == "sanity_check":  # waits for work in flight: answered from a task
                asyncio.get_running_loop().create_task(self._reply_later(sock, ident, header))
                continue
            try:
                reply = self._answer(header, payload)
            except Exception as exc:  # a bad request must not end the server
                logger.exception("hicache lookup failed")
                reply = {"state": "error", "error": repr(exc)}
            reply["seq"] = header.get("seq")
            await sock.send_multipart([ident, json.dumps(reply).encode()])

    async def _reply_later(self, sock: zmq_asyncio.Socket, ident: bytes, header: dict[str, Any]) -> None:
        reply = await self._sanity_check()
        reply["seq"] = header.get("seq")
        await sock.send_multipart([ident, json.dumps(reply).encode()])

    async def _sanity_check(self) -> dict[str, Any]:
        """Once every load and save in flight has finished and the cache is idle, `sanity_check()`."""
        while self._inflight:
            await asyncio.wait(set(self._inflight))
        await self.cache.wait_idle()
        try:
            self.cache.sanity_check()
        except Exception as exc:
            return {"ok": False, "error": str(exc)}
        return {"ok": True}

    def _answer(self, header: dict[str, Any], payload: bytes) -> dict[str, Any]:
        op = header["op"]
        if op == "lookup":
            return self._lookup(header["rid"], payload)
        if op == "statistics":
            stats = self.cache.statistics()
            read = getattr(self.cache.storage, "statistics", None)  # a backend's own counters, if it has them
            backend = read() if callable(read) else None
            refused = sum(getattr(backend, name, 0) for name in _REFUSED_PAGE_COUNTERS)
            return {
                "storage_refused_pages": refused,
                "connector": vars(self.counters),
                "host_pool_used_pages": stats.host_pool.used_pages,
                "device_pool_used_pages": stats.device_pool.used_pages,
                "tree_nodes": stats.tree.num_nodes,
                "prefetches_in_flight": stats.prefetches_in_flight,
                "lookups_held": len(self._lookups),
                # The fields, as `Namespace(**...)` takes them back (the encoding's "v" aside).
                "namespace": {
                    k: v for k, v in json.loads(self._config.namespace.encoding).items() if k != "v"
                },
            }
        raise ValueError(f"op: unknown {op!r}")

    def _lookup(self, rid: str, key: bytes) -> dict[str, Any]:
        self.counters.lookups += 1
        self.metrics.lookups.inc()
        state = self._lookups.get(rid)
        if state is None:
            match = self.cache.match(key)
            hit = match.device_len + match.host_len
            state = _Lookup(key, hit, hit)
            threshold = max(self._page, self._config.prefetch_threshold)
            if self.cache.storage is not None and len(key) // _TOKEN - hit >= threshold:
                state.pending = True
                task = asyncio.get_running_loop().create_task(self._probe(rid, state))
                self._tasks.add(task)  # held until done: the loop keeps only a weak reference
                task.add_done_callback(self._tasks.discard)
            self._lookups[rid] = state
        if state.pending:
            return {"state": "pending"}
        return {"state": "ready", "host_end": state.host_end, "end": state.end}

    async def _probe(self, rid: str, state: _Lookup) -> None:
        """Start the request's storage prefetch; its plan says how far the hit reaches."""
        try:
            prefetch = await self.cache.prefetch(rid, state.key)
            if prefetch is not None:
                state.prefetching = True
                start = _start_of(state.key, prefetch.key, state.host_end, self._page)
                state.end = max(state.end, start + prefetch.num_tokens)
        except Exception:
            logger.exception("hicache storage probe for %s failed: loading host hits only", rid)
        finally:
            state.pending = False

    async def forget(self, rid: str) -> None:
        state = self._lookups.pop(rid, None)
        if state is not None and state.prefetching:
            await self.cache.cancel_prefetch(rid)

    # -- loads and saves

    async def load(self, job: LoadJob) -> set[int]:
        """Load `job` into vLLM's blocks; returns the blocks that could not be loaded."""
        cache, page = self.cache, self._page
        self.counters.loads += 1
        state = self._lookups.pop(job.request_id, None)
        loaded = job.start
        try:
            if state is not None and state.prefetching:
                await cache.commit_prefetch(job.request_id)
            # Storage was read by the committed prefetch, if any: this acquire never waits on storage, so
            # a synchronous host-hit load whose pages were evicted since the lookup is recomputed instead.
            lease = await cache.acquire(f"{job.request_id}/load", job.key, prefetch=False)
            try:
                loaded = min(lease.cached_len, job.end) // page * page
                if loaded > job.start:
                    pages = lease.device_indices[job.start : loaded : page] // page
                    blocks = list(job.block_ids[: (loaded - job.start) // page])
                    await run_in_thread(self._copy_in, pages, blocks)
            finally:
                cache.release(lease)
        except Exception:
            logger.exception("hicache load for %s failed: vLLM recomputes it", job.request_id)
            loaded = job.start
        done = max(0, (loaded - job.start) // page)
        self.counters.loaded_tokens += done * page
        self.counters.failed_tokens += job.end - job.start - done * page
        self.metrics.loaded.inc(done * page)
        self.metrics.failed.inc(job.end - job.start - done * page)
        return set(job.block_ids[done:])

    def _copy_in(self, pages: torch.Tensor, blocks: list[int]) -> None:
        buffer = self.cache.device_pool.buffer  # (pages, layers, 2, page, heads, dim)
        index = torch.tensor(blocks, dtype=torch.int64)
        for layer, view in enumerate(self._views):
            view[index] = buffer[pages, layer]

    def _copy_out(self, blocks: list[int], pages: torch.Tensor) -> None:
        buffer = self.cache.device_pool.buffer
        index = torch.tensor(blocks, dtype=torch.int64)
        for layer, view in enumerate(self._views):
            buffer[pages, layer] = view[index]

    async def save(self, job: SaveJob) -> None:
        """Copy the blocks of `job` hicache lacks into staging pages and insert them (then vLLM frees the
        blocks); write-through backs them up to host and storage in the background."""
        cache, page = self.cache, self._page
        try:
            lease = await cache.acquire(f"{job.request_id}/save", job.key, prefetch=False)
        except Exception:
            logger.exception("hicache save for %s failed", job.request_id)
            return
        new: torch.Tensor | None = None
        try:
            cached = lease.cached_len
            n = len(job.key) // _TOKEN - cached
            if n <= 0:
                return
            new = await cache.alloc_device(n)
            if new is None:
                return  # no staging room: skipped (a later request recomputes)
            await run_in_thread(self._copy_out, list(job.block_ids[cached // page :]), new[::page] // page)
            await cache.insert(lease, job.key, torch.cat([lease.device_indices, new]))
            new = None
            self.counters.saves += 1
            self.counters.saved_tokens += n
            self.metrics.saved.inc(n)
        except Exception:
            logger.exception("hicache save for %s failed", job.request_id)
        finally:
            cache.release(lease, new)


def _bind(endpoint: str) -> tuple[zmq_asyncio.Context, zmq_asyncio.Socket, str]:
    """The lookup server's ROUTER socket, bound at `endpoint` (a stale socket file is replaced)."""
    path = endpoint.removeprefix("ipc://")
    _unlink(path)
    context = zmq_asyncio.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return context, sock, path


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _start_of(key: bytes, prefetched: bytes, hit: int, page: int) -> int:
    """Where a prefetch's key starts in `key`: its anchor's depth, a page boundary at or below `hit`."""
    width = len(prefetched)
    for start in range(hit, -1, -page):
        if key[start * _TOKEN : start * _TOKEN + width] == prefetched:
            return start
    return hit
