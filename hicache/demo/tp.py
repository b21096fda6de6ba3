"""`hicache demo --tp N`: the tiny model served by N tensor-parallel ranks, one `HiCache` per rank.

Each rank is a spawned process in one gloo group on 127.0.0.1 (`hicache.parallel.launch.run_ranks`). The
model's weights are replicated (same seed); rank r owns KV heads `[r * H/N, (r+1) * H/N)` and its cache
holds only that slice: its pools are laid out for H/N heads, its namespace carries `tp_rank`/`tp_size`,
and all ranks share one storage directory. transformers' own tensor parallelism needs `torchrun` and a
`tp_plan` and does not run the demo's seeded Llama on CPU with gloo, so the runner does the TP part
itself: before a prefill, every rank reads its slice of the cached prefix from its own pools and the
slices are all-gathered into the full K/V the attention layers continue from; after it, each rank writes
only its slice of the new K/V into its cache. (The forward pass itself is computed on every rank; what
is sharded and checked here is the cache, which is what hicache is about.) Host hits load back layer by
layer, as in the single-rank demo (`TPDemoConfig.layerwise`): before reading the prefix, each rank's
forward waits for every layer in a worker thread, and under TP each of those waits is agreed by the ranks
(`hicache.parallel.layer_readiness`).

The ranks serve the same requests in the same order, one at a time (a TP engine's scheduler broadcasts
its batch), and check after each request that their cached prefix lengths and tree fingerprints agree.
Every request is checked as in the single-rank demo: the restored K/V bit for bit against the K/V the
model produced earlier (`KVOracle`, on the full gathered K/V), the logits bit for bit against the model
continuing from its own cache with the same split, and the reply against a full recompute.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hicache.config import HiCacheConfig
from hicache.controller import HiCache
from hicache.demo.model import DemoModel, ModelSpec, cache_from_kv
from hicache.demo.oracle import KVOracle
from hicache.demo.worker import ModelWorker
from hicache.demo.workload import Session, WorkloadSpec, make_workload
from hicache.keys import Namespace
from hicache.memory import KVLayout
from hicache.memory.layerwise import LayerReadiness
from hicache.parallel import RankGroup
from hicache.parallel.launch import run_ranks
from storage_backends.cancellation import run_in_thread

__all__ = ["TP_MODEL", "TPDemoConfig", "TPDemoResult", "run_tp_demo"]

TP_MODEL = ModelSpec(num_heads=4, num_kv_heads=4)
"""The demo model with four KV heads, so that 1, 2 and 4 ranks split them evenly (same weights seed)."""

RECOMPUTE_TOLERANCE = 1e-4


@dataclass(frozen=True, slots=True)
class TPDemoConfig:
    """A TP demo run.

    Attributes:
        tp: tensor-parallel ranks (divides the model's KV heads).
        users: simulated users, served round-robin by turn.
        turns: turns per user.
        seed: the workload seed.
        page_size: tokens per page.
        device_pages: pages in each rank's device pool (small, so history goes to host and storage).
        host_pages: pages in each rank's host pool.
        model: the model's shape and weight seed.
        timeout_s: the watchdog of the whole run; a collective waits at most `group_timeout_s`.
        group_timeout_s: the collective timeout of the rank group.
        layerwise: load host hits back layer by layer (as the single-rank demo does); each rank's
            forward waits for every layer of the prefix (`wait_layer`, agreed across the ranks) before
            reading it.
    """

    tp: int = 2
    users: int = 4
    turns: int = 3
    seed: int = 0
    page_size: int = 16
    device_pages: int = 24
    host_pages: int = 32
    model: ModelSpec = field(default_factory=lambda: TP_MODEL)
    timeout_s: float = 600.0
    group_timeout_s: float = 60.0
    layerwise: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp: expected an int >= 1, got {self.tp!r}")
        if self.model.num_kv_heads % self.tp:
            raise ValueError(f"tp: must divide the model's {self.model.num_kv_heads} KV heads, got {self.tp}")


@dataclass(frozen=True, slots=True)
class TPDemoResult:
    """What a TP demo run measured (rank 0's records; every rank checked the same).

    Attributes:
        tp: the ranks.
        requests: requests served.
        prompt_tokens: prompt tokens over all requests.
        saved_tokens: prompt tokens not prefilled thanks to the cache (the same on every rank).
        hits: cached tokens by the tier they came from (rank 0).
        all_identical: every request passed every check on every rank.
        failures: what failed, per rank and request.
        wall_s: the run's wall time.
        agreement_steps: agreement steps rank 0 ran (each one collective; 0 at TP 1), all requests.
    """

    tp: int
    requests: int
    prompt_tokens: int
    saved_tokens: int
    hits: dict[str, int]
    all_identical: bool
    failures: list[str]
    wall_s: float
    agreement_steps: int = 0

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-able dict."""
        return {**asdict(self), "wall_s": round(self.wall_s, 3)}


def _workload_spec(cfg: TPDemoConfig) -> WorkloadSpec:
    return WorkloadSpec(
        users=cfg.users,
        turns=cfg.turns,
        system_prompts=2,
        system_prompt_tokens=96,
        user_tokens=(24, 64),
        decode_tokens=4,
        vocab_size=cfg.model.vocab_size,
        seed=cfg.seed,
    )


def rank_config(cfg: TPDemoConfig, group: RankGroup, storage_url: str, run_id: str) -> HiCacheConfig:
    """Rank `group.tp_rank`'s cache: its share of the KV heads, its rank in the namespace."""
    spec = cfg.model
    heads = spec.num_kv_heads // group.tp_size
    return HiCacheConfig(
        layout=KVLayout(spec.num_layers, heads, spec.head_dim, torch.float32, cfg.page_size),
        device_pages=cfg.device_pages,
        host_pages=cfg.host_pages,
        storage_url=storage_url,
        namespace=Namespace(
            model_id=f"hicache-tp-demo-{spec.seed}",
            tp_rank=group.tp_rank,
            tp_size=group.tp_size,
            extra=run_id,
        ),
        prefetch_threshold=cfg.page_size,
        tp_group=group,
        layerwise_load_back=cfg.layerwise,
    )


def _gather_kv(group: RankGroup, mine: torch.Tensor) -> torch.Tensor:
    """Every rank's KV-head slice `(L, 2, n, H/N, D)` joined in rank order into `(L, 2, n, H, D)`."""
    if group.tp_size == 1:
        return mine
    stacked = group.gather(mine.contiguous())
    return torch.cat(list(stacked.unbind(0)), dim=3)


def _agree_equal(group: RankGroup, value: int, what: str) -> None:
    values = group.gather(torch.tensor([value], dtype=torch.int64)).view(-1).tolist()
    if any(v != values[0] for v in values):
        raise AssertionError(f"rank {group.tp_rank}: the ranks disagree on {what}: {values}")


async def _wait_layers(worker: ModelWorker, layers: LayerReadiness, num_layers: int) -> None:
    """The forward's waits, in the model's thread: every layer of the prefix landed on every rank (under
    TP each `wait_layer` may be a collective of the readiness group, the same on every rank)."""

    def wait_all() -> None:
        for layer in range(num_layers):
            layers.wait_layer(layer)

    await worker.call(wait_all)


async def serve_rank(group: RankGroup, cfg: TPDemoConfig, storage_url: str, run_id: str) -> dict[str, Any]:
    """One rank's run: serve every request through this rank's cache and check it (module level so the
    spawned ranks can import it)."""
    model = DemoModel(cfg.model)
    workload = make_workload(_workload_spec(cfg))
    sessions = [Session(workload, c) for c in workload.conversations]
    # Every forward pass (and the layer waits before it) runs in one model thread, as in the
    # single-rank demo: the cache's event loop (its agreement steps included) never waits for the model.
    worker = ModelWorker(torch_threads=None, max_calls=4)
    try:
        async with HiCache(rank_config(cfg, group, storage_url, run_id)) as cache:
            result = await _serve_all(cache, worker, group, cfg, model, sessions)
    finally:
        await run_in_thread(worker.close)  # waited for: the model thread must not wait for work forever
    return result


async def _serve_all(
    cache: HiCache,
    worker: ModelWorker,
    group: RankGroup,
    cfg: TPDemoConfig,
    model: DemoModel,
    sessions: list[Session],
) -> dict[str, Any]:
    """Serve every turn of every session on this rank, model calls in `worker` (see `serve_rank`)."""
    spec = cfg.model
    heads = spec.num_kv_heads // group.tp_size
    mine = slice(group.tp_rank * heads, (group.tp_rank + 1) * heads)
    page = cfg.page_size
    oracle = KVOracle(page)
    steps = _workload_spec(cfg).decode_tokens
    hits = {"device": 0, "host": 0, "storage": 0}
    failures: list[str] = []
    saved = prompt_tokens = requests = 0
    for turn in range(cfg.turns):
        for session in sessions:
            rid = f"u{session.conversation.user}t{turn}"
            prompt = session.next_prompt()
            lease = await cache.acquire(rid, prompt)
            new_indices: torch.Tensor | None = None
            try:
                cached = lease.cached_len
                _agree_equal(group, cached, f"the cached length of {rid}")
                reused = min(cached, (prompt.numel() - 1) // page * page)
                restored = None
                if reused:
                    await _wait_layers(worker, lease.layers, spec.num_layers)
                    local = cache.device_pool.read_tokens(lease.device_indices[:reused]).cpu()
                    restored = _gather_kv(group, local)
                    check = oracle.check(prompt, cache_from_kv(restored, model.model.config))
                    if not check.ok:
                        failures.append(f"{rid}: restored K/V differs on pages {check.mismatched_pages}")
                prefill = await worker.call(partial(model.prefill, prompt, restored))
                decoded = await worker.steps(model.decode_steps(prefill, steps))
                if restored is not None:
                    past = cache_from_kv(restored, model.model.config)
                    own = await worker.call(partial(model.continue_from, past, prompt))
                    if not torch.equal(own, decoded.logits[0]):
                        failures.append(f"{rid}: logits differ from the same split")
                recompute = await worker.call(partial(model.prefill, prompt, None))
                full = await worker.steps(model.decode_steps(recompute, steps))
                if (
                    full.tokens != decoded.tokens
                    or float((full.logits - decoded.logits).abs().max()) > RECOMPUTE_TOLERANCE
                ):
                    failures.append(f"{rid}: reply differs from a full recompute")
                seq = torch.cat([prompt, torch.tensor(decoded.tokens[:-1], dtype=torch.int64)])
                oracle.record(seq, prefill.cache, reused, seq.numel())
                kv_all = torch.cat([prefill.kv_new, decoded.kv], dim=2)[:, :, :, mine]
                padded = -(-seq.numel() // page) * page
                new_indices = await cache.alloc_device(padded - cached)
                _agree_equal(group, int(new_indices is not None), f"the allocation of {rid}")
                if new_indices is not None:
                    n_new = seq.numel() - cached
                    cache.device_pool.write_tokens(new_indices[:n_new], kv_all[:, :, cached - reused :])
                    indices = torch.cat([lease.device_indices[:cached], new_indices])
                    new_indices = None
                    await cache.insert(lease, seq, indices)
            finally:
                cache.release(lease, new_indices)
            for tier, n in lease.hit_tokens_by_tier.items():
                hits[tier] += n
            saved += reused
            prompt_tokens += prompt.numel()
            requests += 1
            session.record_reply(prompt, decoded.tokens)
            # The scheduling step's end: every rank steps until nothing is pending (backups and
            # storage writes agreed), then the trees are compared off the loop (identical).
            await cache.wait_idle()
            await cache.sanity_check_async(across_ranks=True)
    cache.sanity_check()
    agreement_steps = cache.agreement.statistics().steps
    return {
        "agreement_steps": agreement_steps,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "saved_tokens": saved,
        "hits": hits,
        "failures": [f"rank {group.tp_rank}: {f}" for f in failures],
    }


def run_tp_demo(cfg: TPDemoConfig, storage_dir: str | Path | None = None) -> TPDemoResult:
    """Run the demo on `cfg.tp` spawned ranks over a file storage tier in `storage_dir` (a temporary
    directory when None) and return rank 0's figures with every rank's failures."""
    started = time.perf_counter()
    run_id = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="hicache-tp-demo-") as tmp:
        root = Path(storage_dir) if storage_dir is not None else Path(tmp)
        outcomes = run_ranks(
            serve_rank,
            cfg.tp,
            (cfg, root.as_uri(), run_id),
            timeout_s=cfg.timeout_s,
            group_timeout_s=cfg.group_timeout_s,
        )
    failures: list[str] = []
    for o in outcomes:
        if not o.ok:
            failures.append(f"rank {o.rank}: {o.error_type or f'exit code {o.exitcode}'}: {o.error}")
        elif o.value is not None:
            failures.extend(o.value["failures"])
    first = outcomes[0].value or {"requests": 0, "prompt_tokens": 0, "saved_tokens": 0, "hits": {}}
    return TPDemoResult(
        tp=cfg.tp,
        requests=first["requests"],
        prompt_tokens=first["prompt_tokens"],
        saved_tokens=first["saved_tokens"],
        hits=dict(first["hits"]),
        all_identical=not failures,
        failures=failures,
        wall_s=time.perf_counter() - started,
        agreement_steps=first.get("agreement_steps", 0),
    )
