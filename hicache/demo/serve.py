"""The demo's asyncio serving loop: simulated users over one model, with a `HiCache` and without one.

One run serves the seeded workload through a `HiCache` (match, storage prefetch and commit, load back,
prefill the suffix, decode a few tokens, insert); a second run serves the very same prompts with full
recompute and no cache, for the time-to-first-token comparison and the recompute check. Every request is
then verified:

1. the K/V restored from the cache (whatever tier it came from) equal bit for bit the K/V the model
   produced for those tokens earlier (`KVOracle`);
2. the logits equal bit for bit those of the model continuing from its own in-memory cache with the same
   split (prefix length);
3. the logits and the greedy reply agree with the no-cache full recompute within `RECOMPUTE_TOLERANCE`.

Forward passes run in a worker thread under one lock (one model), so the event loop keeps serving cache
I/O while the model computes.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import torch

from hicache.components.base import Component
from hicache.config import HiCacheConfig
from hicache.controller import HiCache, Lease
from hicache.demo.model import DecodeResult, DemoModel, ModelSpec, PrefillResult, cache_from_kv
from hicache.demo.oracle import KVOracle
from hicache.demo.workload import Session, Workload, WorkloadSpec, make_workload
from hicache.keys import Namespace
from hicache.memory import KVLayout
from hicache.metrics import render as render_metrics
from hicache.metrics import snapshot as metrics_snapshot
from hicache.policy import WritePolicy
from hicache.tree import TreeNode
from storage_backends.redact import redact_url, redacted_repr

__all__ = [
    "RECOMPUTE_TOLERANCE",
    "DemoConfig",
    "DemoResult",
    "ProgressFn",
    "RequestRecord",
    "Served",
    "ServingLoop",
    "demo_cache_config",
    "noop_progress",
    "pool_json",
    "run_demo",
    "run_serving",
    "storage_url",
    "sum_metric",
    "top_prefixes",
]

RECOMPUTE_TOLERANCE = 1e-4
"""Largest absolute logit difference accepted between a cached run and a full recompute."""

ProgressFn = Callable[[str, int, int], None]
"""Called as `progress(phase, done, total)`; phases are `cache`, `recompute` and `verify`."""


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Everything a demo run needs.

    Attributes:
        users: concurrent simulated users.
        turns: turns per user.
        seed: seeds the workload (the model's weights have their own seed in `model`).
        backend_url: the storage tier (`file:///path`, `memory://name`, `s3://bucket/prefix`); `None`
            uses the file backend in a temporary directory that is removed afterwards.
        storage_options: keyword options for the backend factory.
        page_size: tokens per page.
        device_pages: pages in the device pool; small, so that eviction happens.
        host_pages: pages in the host pool; small, so that host eviction and storage prefetch happen.
        prefetch_threshold: smallest storage remainder (tokens) worth a prefetch.
        write_policy: the cache's write policy.
        max_running: requests in flight at once (each holds device pages while it runs).
        model: the model's shape and weight seed.
        workload: workload knobs other than users, turns and seed (those come from above).
        metrics_port: serve Prometheus text on this loopback port while running (0 picks one).
        torch_threads: intra-op threads for the model's forward passes (`None` leaves torch's setting).
            One by default: the event loop and storage I/O threads share the CPU, and an oversubscribed
            thread pool makes small forward passes up to ten times slower on a loaded two-core machine.
    """

    users: int = 8
    turns: int = 6
    seed: int = 0
    backend_url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    page_size: int = 16
    device_pages: int = 160
    host_pages: int = 224
    prefetch_threshold: int = 64
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    max_running: int = 2
    model: ModelSpec = field(default_factory=ModelSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    metrics_port: int | None = None
    torch_threads: int | None = 1

    def __repr__(self) -> str:
        """The fields, with secrets in `backend_url` and `storage_options` replaced by `***`."""
        return redacted_repr(self)

    def workload_spec(self) -> WorkloadSpec:
        """The workload with this config's users, turns, seed and the model's vocabulary."""
        w = self.workload
        return WorkloadSpec(
            users=self.users,
            turns=self.turns,
            system_prompts=w.system_prompts,
            system_prompt_tokens=w.system_prompt_tokens,
            user_tokens=w.user_tokens,
            decode_tokens=w.decode_tokens,
            arrival_gap_s=w.arrival_gap_s,
            think_time_s=w.think_time_s,
            vocab_size=self.model.vocab_size,
            seed=self.seed,
        )


@dataclass(slots=True)
class RequestRecord:
    """One request of the cached run, what the no-cache run saw for it, and the verdicts.

    Attributes:
        request_id: `u{user}t{turn}`.
        user: the user.
        turn: the turn.
        prompt: the prompt tokens.
        cached_len: tokens the cache had on device after `acquire`.
        reused_len: cached tokens actually used (one token is always left to prefill).
        hits: cached tokens by tier they came from: `device`, `host`, `storage`.
        prefetch: the storage prefetch's status (`committed`, `dropped`, ...) or `None`.
        inserted: whether the request's KV was inserted (device allocation may fail).
        arrival_s: when the request arrived, from the start of the run.
        ttft_s: time to first token with the cache.
        reply: the greedy reply with the cache.
        queue_s: time waiting for a running slot (`max_running`) with the cache.
        acquire_s: time in `HiCache.acquire` (match, storage prefetch and commit, load back).
        ttft_nocache_s: time to first token with full recompute and no cache.
        arrival_nocache_s: when the request arrived in the no-cache run, from its start.
        kv_bitwise: restored K/V equal the model's earlier K/V bit for bit (check 1).
        same_split_bitwise: logits equal the in-memory same-split continuation bit for bit (check 2).
        recompute_max_diff: largest logit difference from the no-cache recompute (check 3).
        reply_equal: the no-cache run produced the same reply.
    """

    request_id: str
    user: int
    turn: int
    prompt: torch.Tensor
    cached_len: int
    reused_len: int
    hits: dict[str, int]
    prefetch: str | None
    inserted: bool
    arrival_s: float
    ttft_s: float
    reply: list[int]
    logits: torch.Tensor = field(repr=False)
    restored_kv: torch.Tensor | None = field(repr=False, default=None)
    queue_s: float = 0.0
    acquire_s: float = 0.0
    ttft_nocache_s: float | None = None
    arrival_nocache_s: float | None = None
    kv_bitwise: bool = True
    same_split_bitwise: bool = True
    recompute_max_diff: float = float("nan")
    reply_equal: bool = False

    @property
    def identical(self) -> bool:
        """All three checks passed."""
        return (
            self.kv_bitwise
            and self.same_split_bitwise
            and self.reply_equal
            and self.recompute_max_diff <= RECOMPUTE_TOLERANCE
        )

    def to_json(self) -> dict[str, Any]:
        """The record without tensors, for the `--json` output and snapshots."""
        return {
            "request_id": self.request_id,
            "user": self.user,
            "turn": self.turn,
            "prompt_tokens": int(self.prompt.numel()),
            "cached_tokens": self.cached_len,
            "reused_tokens": self.reused_len,
            "hits": dict(self.hits),
            "prefetch": self.prefetch,
            "inserted": self.inserted,
            "arrival_s": round(self.arrival_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "queue_s": round(self.queue_s, 6),
            "acquire_s": round(self.acquire_s, 6),
            "ttft_nocache_s": None if self.ttft_nocache_s is None else round(self.ttft_nocache_s, 6),
            "arrival_nocache_s": None if self.arrival_nocache_s is None else round(self.arrival_nocache_s, 6),
            "kv_bitwise": self.kv_bitwise,
            "same_split_bitwise": self.same_split_bitwise,
            "recompute_max_diff": self.recompute_max_diff,
            "reply_equal": self.reply_equal,
            "identical": self.identical,
        }


@dataclass(slots=True)
class DemoResult:
    """What a demo run produced: per-request records and snapshots of the cache and its metrics.

    Attributes:
        config: the run's configuration.
        backend_url: the storage URL actually used, with credentials replaced by `***` (it is shown).
        records: one per request, in completion order of the cached run.
        metrics: the cache's metrics registry snapshot at the end of the cached run.
        prometheus: the same metrics in Prometheus text.
        pools: per-tier occupancy at the end of the cached run.
        tree: tree statistics at the end of the cached run.
        top_prefixes: the tree's top-level prefixes, most hit first.
        wall_s: seconds per phase (`model`, `cache`, `recompute`, `verify`).
        token_nbytes: bytes of K/V per token in the pools.
        metrics_url: where metrics were served, if they were.
        details: model-specific extras for the summary (the hybrid run's components); empty for Llama.
    """

    config: DemoConfig
    backend_url: str
    records: list[RequestRecord]
    metrics: dict[str, dict[str, Any]]
    prometheus: str
    pools: dict[str, dict[str, Any]]
    tree: dict[str, Any]
    top_prefixes: list[dict[str, Any]]
    wall_s: dict[str, float]
    token_nbytes: int
    metrics_url: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def all_identical(self) -> bool:
        """Whether every request passed every check."""
        return all(r.identical for r in self.records)


def noop_progress(phase: str, done: int, total: int) -> None:
    """A `ProgressFn` that reports nothing."""
    del phase, done, total


@dataclass(frozen=True, slots=True)
class Served:
    """What serving one request under its lease produced, for its `RequestRecord`.

    Attributes:
        reused: cached tokens actually used.
        inserted: whether the request's KV was inserted.
        ttft: time to first token.
        reply: the greedy reply.
        logits: the logits each reply token was chosen from.
        restored_kv: the K/V restored from the cache, kept for verification, or `None`.
    """

    reused: int
    inserted: bool
    ttft: float
    reply: list[int]
    logits: torch.Tensor
    restored_kv: torch.Tensor | None = None


ModelT = TypeVar("ModelT")


class ServingLoop(Generic[ModelT]):
    """State and user loops shared by the demo runners: one model, a running-slot limit, the records.

    A runner subclasses this and implements `_run` (one request through the cache under its lease, which
    it releases); the user loops with the cache, the no-cache recompute run and the model worker thread
    are here. The model must offer `prefill(prompt, None)` and `decode(prefill, steps)` returning objects
    with `tokens` and `logits`.

    Args:
        model: the model the requests run on.
        workload: the seeded workload.
        max_running: requests in flight at once.
        torch_threads: intra-op threads for the model's forward passes (`None` leaves torch's setting).
        progress: called as requests complete, per phase.
    """

    def __init__(
        self,
        model: ModelT,
        workload: Workload,
        max_running: int,
        torch_threads: int | None,
        progress: ProgressFn,
    ) -> None:
        self.model = model
        self.workload = workload
        self.progress = progress
        self.torch_threads = torch_threads
        self.model_lock = anyio.Lock()
        self.running = anyio.CapacityLimiter(max_running)
        self.records: list[RequestRecord] = []
        self.t0 = 0.0

    async def compute(self, fn: Callable[[], Any]) -> Any:
        """Run one model call in a worker thread, one at a time (waiting for it even if cancelled)."""
        threads = self.torch_threads

        def call() -> Any:
            # The thread count is per OS thread under OpenMP, so it is set in the worker itself.
            if threads is not None and torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            return fn()

        async with self.model_lock:
            return await anyio.to_thread.run_sync(call)

    # ------------------------------------------------------------------ with the cache

    async def serve_cached(self, cache: HiCache) -> None:
        """Serve every user's conversation through `cache`, recording each request."""
        async with anyio.create_task_group() as tg:
            for conversation in self.workload.conversations:
                tg.start_soon(self._user_cached, cache, Session(self.workload, conversation))

    async def _user_cached(self, cache: HiCache, session: Session) -> None:
        conv = session.conversation
        await anyio.sleep(conv.start_delay_s)
        while not session.done:
            prompt = session.next_prompt()
            turn = session.turn
            arrival = time.perf_counter()
            async with self.running:
                record = await self._serve_one(
                    cache, f"u{conv.user}t{turn}", conv.user, turn, prompt, arrival
                )
            self.records.append(record)
            self.progress("cache", len(self.records), self.workload.num_requests)
            session.record_reply(prompt, record.reply)
            await anyio.sleep(conv.think_times_s[turn])

    async def _serve_one(
        self, cache: HiCache, request_id: str, user: int, turn: int, prompt: torch.Tensor, arrival: float
    ) -> RequestRecord:
        t_acquire = time.perf_counter()
        lease: Lease = await cache.acquire(request_id, prompt)
        acquire_s = time.perf_counter() - t_acquire
        served = await self._run(cache, lease, request_id, prompt, arrival)
        return RequestRecord(
            request_id=request_id,
            user=user,
            turn=turn,
            prompt=prompt,
            cached_len=lease.cached_len,
            reused_len=served.reused,
            hits=dict(lease.hit_tokens_by_tier),
            prefetch=lease.prefetch.status if lease.prefetch is not None else None,
            inserted=served.inserted,
            arrival_s=arrival - self.t0,
            ttft_s=served.ttft,
            reply=served.reply,
            logits=served.logits,
            restored_kv=served.restored_kv,
            acquire_s=acquire_s,
        )

    async def _run(
        self, cache: HiCache, lease: Lease, request_id: str, prompt: torch.Tensor, arrival: float
    ) -> Served:
        """Serve one request under `lease` (which this releases) and insert what it computed."""
        raise NotImplementedError

    # ------------------------------------------------------------------ without a cache

    async def serve_recompute(self) -> None:
        """Serve the recorded prompts again with full recompute and no cache, comparing the replies."""
        by_user: dict[int, list[RequestRecord]] = {}
        for record in sorted(self.records, key=lambda r: (r.user, r.turn)):
            by_user.setdefault(record.user, []).append(record)
        done = [0]
        async with anyio.create_task_group() as tg:
            for conv in self.workload.conversations:
                tg.start_soon(
                    self._user_recompute, conv.start_delay_s, conv.think_times_s, by_user[conv.user], done
                )

    async def _user_recompute(
        self, delay: float, think: tuple[float, ...], records: list[RequestRecord], done: list[int]
    ) -> None:
        await anyio.sleep(delay)
        steps = self.workload.spec.decode_tokens
        model: Any = self.model
        for record in records:
            arrival = time.perf_counter()
            record.arrival_nocache_s = arrival - self.t0
            async with self.running:
                prefill = await self.compute(partial(model.prefill, record.prompt, None))
                record.ttft_nocache_s = time.perf_counter() - arrival
                decoded = await self.compute(partial(model.decode, prefill, steps))
            record.reply_equal = decoded.tokens == record.reply
            record.recompute_max_diff = float((decoded.logits - record.logits).abs().max())
            done[0] += 1
            self.progress("recompute", done[0], len(self.records))
            await anyio.sleep(think[record.turn])

    # ------------------------------------------------------------------ checks 1 and 2

    def verify(self) -> None:
        """Run checks 1 and 2 on every record (in the worker thread)."""
        raise NotImplementedError


class _Runner(ServingLoop[DemoModel]):
    """State shared by the users of one demo run."""

    def __init__(
        self, config: DemoConfig, model: DemoModel, workload: Workload, progress: ProgressFn
    ) -> None:
        super().__init__(model, workload, config.max_running, config.torch_threads, progress)
        self.config = config
        self.oracle = KVOracle(config.page_size)

    # ------------------------------------------------------------------ with the cache

    def _decode_and_record(self, prefill: PrefillResult, prompt: torch.Tensor, reused: int) -> DecodeResult:
        """Decode, then record the K/V the model computed itself in the oracle (in the worker thread)."""
        decoded = self.model.decode(prefill, self.workload.spec.decode_tokens)
        seq = torch.cat([prompt, torch.tensor(decoded.tokens[:-1], dtype=torch.int64)])
        self.oracle.record(seq, prefill.cache, reused, seq.numel())
        return decoded

    async def _run(
        self, cache: HiCache, lease: Lease, request_id: str, prompt: torch.Tensor, arrival: float
    ) -> Served:
        page = self.config.page_size
        new_indices: torch.Tensor | None = None
        try:
            cached = lease.cached_len
            # A fully cached prompt still needs one token run through the model for its logits.
            reused = min(cached, (prompt.numel() - 1) // page * page)
            restored = cache.device_pool.read_tokens(lease.device_indices[:reused]).cpu() if reused else None
            prefill: PrefillResult = await self.compute(partial(self.model.prefill, prompt, restored))
            ttft = time.perf_counter() - arrival
            decode = partial(self._decode_and_record, prefill, prompt, reused)
            decoded: DecodeResult = await self.compute(decode)
            reply = decoded.tokens
            seq = torch.cat([prompt, torch.tensor(reply[:-1], dtype=torch.int64)])
            kv_all = torch.cat([prefill.kv_new, decoded.kv], dim=2)  # K/V of seq[reused:]
            padded = -(-seq.numel() // page) * page
            new_indices = await cache.alloc_device(padded - cached)
            inserted = new_indices is not None
            if new_indices is not None:
                n_new = seq.numel() - cached
                cache.device_pool.write_tokens(new_indices[:n_new], kv_all[:, :, cached - reused :])
                indices = torch.cat([lease.device_indices[:cached], new_indices])
                new_indices = None  # owned by the tree from here on
                await cache.insert(lease, seq, indices)
        finally:
            cache.release(lease, new_indices)  # and the pages it allocated but did not insert, if any
        return Served(reused, inserted, ttft, reply, decoded.logits, restored_kv=restored)

    # ------------------------------------------------------------------ checks 1 and 2

    def verify(self) -> None:
        config = self.model.model.config
        for i, record in enumerate(self.records):
            if record.restored_kv is not None:
                restored = cache_from_kv(record.restored_kv, config=config)
                check = self.oracle.check(record.prompt, restored, config=config)
                record.kv_bitwise = check.ok
                logits = self.model.continue_from(check.reference_cache, record.prompt)
                record.same_split_bitwise = torch.equal(logits, record.logits[0])
                record.restored_kv = None
            self.progress("verify", i + 1, len(self.records))


def sum_metric(snapshot: dict[str, dict[str, Any]], name: str) -> float:
    """The sum over label sets of the counter `name` (with or without a prefix such as `hicache_`).

    Returns 0 when no such metric was registered.
    """
    for full, metric in snapshot.items():
        if full == name or full.endswith("_" + name):
            return float(sum(s["value"] for s in metric.get("samples", []) if "value" in s))
    return 0.0


def _subtree(node: TreeNode) -> Iterator[TreeNode]:
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(current.children.values())


def top_prefixes(cache: HiCache, limit: int = 8) -> list[dict[str, Any]]:
    """The tree's top-level branches (one per distinct first page, e.g. per system prompt), most hit first."""
    rows: list[dict[str, Any]] = []
    for child in cache.tree.root.children.values():
        nodes = list(_subtree(child))
        rows.append(
            {
                "first_tokens": [
                    int(t) for t in torch.frombuffer(bytearray(child.key[:64]), dtype=torch.int64)
                ],
                "edge_tokens": child.num_tokens,
                "hits": child.hit_count,
                "nodes": len(nodes),
                "device_tokens": sum(n.num_tokens for n in nodes if n.device_value is not None),
                "host_tokens": sum(n.num_tokens for n in nodes if n.host_value is not None),
            }
        )
    rows.sort(key=lambda r: (-int(r["hits"]), -int(r["nodes"])))
    return rows[:limit]


@contextlib.asynccontextmanager
async def _storage_url(url: str | None) -> AsyncIterator[str]:
    if url is not None:
        yield url
        return
    with tempfile.TemporaryDirectory(prefix="hicache-demo-") as tmp:
        yield Path(tmp).as_uri()


async def run_demo(
    config: DemoConfig, progress: ProgressFn = noop_progress, announce: Callable[[str], None] | None = None
) -> DemoResult:
    """Serve the workload with a `HiCache`, then without, verify every request, and return the records.

    Args:
        config: the run's configuration.
        progress: called as requests complete, per phase.
        announce: called with the metrics URL once it is being served.
    """
    wall: dict[str, float] = {}
    t = time.perf_counter()
    model = await anyio.to_thread.run_sync(DemoModel, config.model)
    wall["model"] = time.perf_counter() - t
    workload = make_workload(config.workload_spec())
    runner = _Runner(config, model, workload, progress)
    spec = config.model
    layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32, config.page_size)

    def cache_config(url: str) -> HiCacheConfig:
        return demo_cache_config(config, layout, url, f"hicache-demo-{spec.seed}")

    return await run_serving(runner, config, cache_config, wall, announce)


def demo_cache_config(
    config: DemoConfig,
    layout: KVLayout,
    url: str,
    model_name: str,
    components: tuple[Component, ...] = (),
) -> HiCacheConfig:
    """The cache's configuration for a demo run: `config`'s pools and policies over `url`.

    Args:
        config: the run's configuration.
        layout: the base pool's (full-attention) K/V layout.
        url: the storage URL actually used.
        model_name: the namespace's model name.
        components: the hybrid model's components, if any.
    """
    return HiCacheConfig(
        layout=layout,
        device_pages=config.device_pages,
        host_pages=config.host_pages,
        write_policy=config.write_policy,
        storage_url=url,
        storage_options=config.storage_options,
        # A fresh namespace per run: pages a previous run left in a shared store are not this run's
        # model output as far as the oracle knows, so they must never match.
        namespace=Namespace(model_id=model_name, extra=uuid.uuid4().hex),
        prefetch_threshold=config.prefetch_threshold,
        components=components,
    )


async def run_serving(
    runner: ServingLoop[Any],
    config: DemoConfig,
    cache_config: Callable[[str], HiCacheConfig],
    wall: dict[str, float],
    announce: Callable[[str], None] | None = None,
    inspect: Callable[[HiCache], dict[str, Any]] | None = None,
) -> DemoResult:
    """The phases of a demo run after the model is built: cached run, no-cache run, verification.

    Args:
        runner: the run's serving loop.
        config: the run's configuration (storage tier, metrics port).
        cache_config: the cache's configuration, given the storage URL actually used.
        wall: seconds per phase so far; the `cache`, `recompute` and `verify` phases are added.
        announce: called with the metrics URL once it is being served.
        inspect: called with the cache at the end of the cached run; what it returns becomes the result's
            `details`.
    """
    metrics_url: str | None = None
    details: dict[str, Any] = {}
    async with _storage_url(config.backend_url) as url:
        hicache_config = cache_config(url)
        async with HiCache(hicache_config) as cache, anyio.create_task_group() as tg:
            if config.metrics_port is not None:
                from hicache.metrics import serve_metrics

                port = await tg.start(serve_metrics, cache.registry, "127.0.0.1", config.metrics_port)
                metrics_url = f"http://127.0.0.1:{port}/metrics"
                if announce is not None:
                    announce(metrics_url)
            t = runner.t0 = time.perf_counter()
            await runner.serve_cached(cache)
            await cache.wait_idle()
            wall["cache"] = time.perf_counter() - t
            cache.sanity_check()
            snapshot = metrics_snapshot(cache.registry)
            prometheus = render_metrics(cache.registry)
            stats = cache.statistics()
            pools = {
                "device": _pool_json(stats.device_pool),
                "host": _pool_json(stats.host_pool),
                "storage": {
                    "url": redact_url(url),
                    "bytes_written": sum_metric(snapshot, "storage_written_bytes_total"),
                },
            }
            tree = {
                "nodes": stats.tree.num_nodes,
                "device_tokens": stats.tree.device_tokens,
                "host_tokens": stats.tree.host_tokens,
                "evictable_device_tokens": stats.tree.evictable_device_tokens,
                "evictable_host_tokens": stats.tree.evictable_host_tokens,
            }
            if inspect is not None:
                details = inspect(cache)
            prefixes = top_prefixes(cache)
            tg.cancel_scope.cancel()
    t = runner.t0 = time.perf_counter()
    await runner.serve_recompute()
    wall["recompute"] = time.perf_counter() - t
    t = time.perf_counter()
    await runner.compute(runner.verify)
    wall["verify"] = time.perf_counter() - t
    return DemoResult(
        config=config,
        backend_url=redact_url(url),
        records=runner.records,
        metrics=snapshot,
        prometheus=prometheus,
        pools=pools,
        tree=tree,
        top_prefixes=prefixes,
        wall_s=wall,
        token_nbytes=hicache_config.layout.token_nbytes,
        metrics_url=metrics_url,
        details=details,
    )


def _pool_json(stats: Any) -> dict[str, Any]:
    return {
        "device": stats.device,
        "capacity_pages": stats.capacity_pages,
        "used_pages": stats.used_pages,
        "free_pages": stats.free_pages,
        "page_size": stats.page_size,
        "page_nbytes": stats.page_nbytes,
    }


storage_url = _storage_url
"""`async with storage_url(url) as url:` the URL itself, or a temporary file-backend directory when `None`."""

pool_json = _pool_json
"""A pool's `PoolStatistics` as JSON-serialisable data."""
