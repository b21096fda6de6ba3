"""What a demo run is configured with and what it produces: the config, per-request records, the result.

Shared by every demo runner (Llama, hybrid) and by the report; holds no serving logic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hicache.demo.model import ModelSpec
from hicache.demo.workload import WorkloadSpec
from hicache.policy import RefillPolicy, WritePolicy
from storage_backends.redact import redacted_repr

__all__ = [
    "RECOMPUTE_TOLERANCE",
    "DemoConfig",
    "DemoResult",
    "ProgressFn",
    "RequestRecord",
    "Served",
    "noop_progress",
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
        refill_policy: the cache's `refill_under_unbacked` (the Llama demo; staged hybrid components are
            never rescued).
        max_running: requests in flight at once (each holds device pages while it runs).
        model: the model's shape and weight seed.
        workload: workload knobs other than users, turns and seed (those come from above).
        metrics_port: serve Prometheus text on this loopback port while running (0 picks one).
        torch_threads: intra-op threads for the model's forward passes and for the cache's pool copies
            on the event loop thread (`None` leaves torch's setting). One by default: the event loop and
            storage I/O threads share the CPU, and an oversubscribed thread pool makes small forward
            passes up to ten times slower, and a small pool copy a hundred times slower, on a loaded
            two-core machine.
        lockstep: serve one request at a time (turn by turn, no pauses) and let the cache finish its
            backups and storage writes in between, with prefetches that wait for every page: the hits
            then depend on the workload only, not on timing (for tests and for comparing policies).
        scenario: `chat` (the users are served by this instance only) or `handoff` (the Llama demo only:
            users arrive from another instance sharing the storage, so storage hits hang below prefixes
            this instance computed itself and refills drop or are rescued; always in lockstep and under
            `write_through_selective`, see `hicache.demo.handoff`).
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
    refill_policy: RefillPolicy = RefillPolicy.DROP
    max_running: int = 2
    model: ModelSpec = field(default_factory=ModelSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    metrics_port: int | None = None
    torch_threads: int | None = 1
    lockstep: bool = False
    scenario: str = "chat"

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
        prefetch_rescued: the prefetch was committed only because its attach point was backed up first.
        inserted: whether the request's KV was inserted (device allocation may fail).
        arrival_s: when the request arrived, from the start of the run.
        ttft_s: time to first token with the cache.
        reply: the greedy reply with the cache.
        queue_s: time waiting for a running slot (`max_running`) with the cache.
        acquire_s: time in `HiCache.acquire` (match, storage prefetch and commit, load back).
        ttft_nocache_s: time to first token with full recompute and no cache.
        queue_nocache_s: time waiting for a running slot with full recompute and no cache.
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
    queue_nocache_s: float | None = None
    arrival_nocache_s: float | None = None
    kv_bitwise: bool = True
    same_split_bitwise: bool = True
    recompute_max_diff: float = float("nan")
    reply_equal: bool = False
    prefetch_rescued: bool = False

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
            "prefetch_rescued": self.prefetch_rescued,
            "inserted": self.inserted,
            "arrival_s": round(self.arrival_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "queue_s": round(self.queue_s, 6),
            "acquire_s": round(self.acquire_s, 6),
            "ttft_nocache_s": None if self.ttft_nocache_s is None else round(self.ttft_nocache_s, 6),
            "queue_nocache_s": None if self.queue_nocache_s is None else round(self.queue_nocache_s, 6),
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
