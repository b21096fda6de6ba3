"""Turn a `DemoResult` into a summary: a dict for `--json`, a rich table and a snapshot file (the chart: `plot`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hicache.demo.records import RECOMPUTE_TOLERANCE, DemoResult, RequestRecord
from hicache.demo.snapshot import sum_metric
from storage_backends.redact import redact_url

__all__ = ["percentile", "render_summary", "save_snapshot", "summarize"]

TIERS = ("device", "host", "storage")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q`-th percentile (0 < q <= 100) of `values`; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(result: DemoResult) -> dict[str, Any]:
    """The run's summary as plain JSON-serialisable data (the `--json` output)."""
    records = result.records
    m = result.metrics
    nbytes = result.token_nbytes
    prompt_tokens = sum(int(r.prompt.numel()) for r in records)
    hits = {tier: sum(r.hits.get(tier, 0) for r in records) for tier in TIERS}
    prefetch_status = [r.prefetch for r in records if r.prefetch is not None]
    skipped: dict[str, int] = {}
    for name, metric in m.items():
        if name.endswith("prefetch_skipped_total"):
            for sample in metric.get("samples", []):
                reason = sample.get("labels", {}).get("reason", "")
                skipped[reason] = skipped.get(reason, 0) + int(sample["value"])
    config = result.config
    return {
        "requests": len(records),
        "users": config.users,
        "turns": config.turns,
        "seed": config.seed,
        "scenario": config.scenario,
        "refill_policy": config.refill_policy.value,
        "backend": redact_url(result.backend_url),
        "identical": sum(r.identical for r in records),
        "checks": {
            "kv_bitwise": sum(r.kv_bitwise for r in records),
            "same_split_logits_bitwise": sum(r.same_split_bitwise for r in records),
            "replies_equal": sum(r.reply_equal for r in records),
            "max_recompute_logit_diff": max((r.recompute_max_diff for r in records), default=0.0),
            "tolerance": RECOMPUTE_TOLERANCE,
        },
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hits,
        "requests_with_hits": {tier: sum(1 for r in records if r.hits.get(tier, 0)) for tier in TIERS},
        "prefill_tokens_saved": sum(r.reused_len for r in records),
        "prefetch": {
            "committed": prefetch_status.count("committed"),
            "dropped": prefetch_status.count("dropped"),
            "rescued": sum(1 for r in records if r.prefetch_rescued),
            "cancelled": prefetch_status.count("cancelled"),
            "skipped": skipped,
            "loaded_tokens": int(sum_metric(m, "prefetch_loaded_tokens_total")),
        },
        "bytes_moved": {
            "device_to_host": int(sum_metric(m, "backup_tokens_total")) * nbytes,
            "host_to_device": int(sum_metric(m, "load_back_tokens_total")) * nbytes,
            "storage_read": int(sum_metric(m, "storage_read_bytes_total")),
            "storage_written": int(sum_metric(m, "storage_written_bytes_total")),
        },
        "ttft_ms": _ttft_ms(records),
        "not_inserted": sum(1 for r in records if not r.inserted),
        "pools": result.pools,
        "tree": result.tree,
        "wall_s": {k: round(v, 3) for k, v in result.wall_s.items()},
        "metrics_url": result.metrics_url,
        **({"hybrid": result.details} if result.details else {}),
        **({"handoff": _returning(result)} if config.scenario == "handoff" else {}),
    }


def _returning(result: DemoResult) -> dict[str, Any]:
    """The handoff scenario's last phase alone: the users' last turns, back on this instance."""
    last = result.config.turns - 1
    records = [r for r in result.records if r.user >= 0 and r.turn == last]
    return {
        "returning_requests": len(records),
        "dropped": sum(1 for r in records if r.prefetch == "dropped"),
        "rescued": sum(1 for r in records if r.prefetch_rescued),
        "prefill_tokens_saved": sum(r.reused_len for r in records),
        "prompt_tokens": sum(int(r.prompt.numel()) for r in records),
        "ttft_ms": _ttft_ms(records),
    }


def _ttft_ms(records: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """The records' time to first token in ms, p50 and p99, with the cache and without it."""
    ttft = [r.ttft_s for r in records]
    ttft_nocache = [r.ttft_nocache_s for r in records if r.ttft_nocache_s is not None]
    return {
        "cache": {"p50": 1e3 * percentile(ttft, 50), "p99": 1e3 * percentile(ttft, 99)},
        "no_cache": {"p50": 1e3 * percentile(ttft_nocache, 50), "p99": 1e3 * percentile(ttft_nocache, 99)},
    }


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop always returns


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The summary as (label, value) rows, in the order they are shown."""
    s = summary
    hits = s["hit_tokens"]
    total = max(1, s["prompt_tokens"])
    pf = s["prefetch"]
    moved = s["bytes_moved"]
    ttft = s["ttft_ms"]
    checks = s["checks"]
    skipped = ", ".join(f"{k} {v}" for k, v in sorted(pf["skipped"].items()) if v) or "none"
    return [
        ("requests", f"{s['requests']} ({s['users']} users x {s['turns']} turns), backend {s['backend']}"),
        ("prompt tokens", f"{s['prompt_tokens']:,}"),
        (
            "hit tokens by tier",
            " / ".join(f"{t} {hits[t]:,} ({100 * hits[t] / total:.0f}%)" for t in TIERS),
        ),
        (
            "requests hitting each tier",
            " / ".join(f"{t} {s['requests_with_hits'][t]}" for t in TIERS),
        ),
        (
            "prefill tokens saved",
            f"{s['prefill_tokens_saved']:,} ({100 * s['prefill_tokens_saved'] / total:.0f}%)",
        ),
        (
            "prefetches",
            f"committed {pf['committed']} / dropped {pf['dropped']} "
            f"({pf['loaded_tokens']:,} tokens loaded; skipped: {skipped})",
        ),
        (
            "bytes moved",
            f"device->host {_bytes(moved['device_to_host'])}, "
            f"host->device {_bytes(moved['host_to_device'])}, "
            f"storage read {_bytes(moved['storage_read'])}, written {_bytes(moved['storage_written'])}",
        ),
        (
            "TTFT p50 / p99",
            f"cache {ttft['cache']['p50']:.1f} / {ttft['cache']['p99']:.1f} ms, "
            f"no cache {ttft['no_cache']['p50']:.1f} / {ttft['no_cache']['p99']:.1f} ms",
        ),
        (
            "checks",
            f"K/V bitwise {checks['kv_bitwise']}/{s['requests']}, same-split logits bitwise "
            f"{checks['same_split_logits_bitwise']}/{s['requests']}, max |logit diff| vs recompute "
            f"{checks['max_recompute_logit_diff']:.1e} (tolerance {checks['tolerance']:.0e})",
        ),
        *_hybrid_rows(s),
        ("outputs identical to recompute", f"{s['identical']}/{s['requests']}"),
    ]


def _hybrid_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows of the hybrid run's components (none for the Llama run)."""
    h = summary.get("hybrid")
    if not h:
        return []
    restored = h["restored"]
    occupancy = ", ".join(
        f"{name} device {t['device_slots']:,} / host {t['host_slots']:,} slots"
        for name, t in h["component_tree"].items()
    )
    return [
        ("model", f"{h['model']}: {', '.join(h['layer_types'])}"),
        (
            "components restored",
            f"{restored['requests']} requests: {restored['window_tokens']:,} sliding-window tokens "
            f"(window {h['window_tokens']}), {restored['states']} states of {_bytes(h['state_nbytes'])}",
        ),
        ("components cached at the end", occupancy),
    ]


def render_summary(summary: dict[str, Any]) -> Any:
    """A rich `Table` of the summary."""
    from rich.table import Table

    ok = summary["identical"] == summary["requests"]
    title = "hicache demo (hybrid)" if summary.get("hybrid") else "hicache demo"
    table = Table(title=title, show_header=False, title_style="bold")
    table.add_column("what", style="bold")
    table.add_column("value")
    for label, value in summary_rows(summary):
        style = ("green" if ok else "bold red") if label == "outputs identical to recompute" else None
        table.add_row(label, value, style=style)
    return table


def save_snapshot(result: DemoResult, summary: dict[str, Any], path: str | Path) -> None:
    """Write a JSON snapshot for `hicache inspect`: summary, pools, tree, top prefixes, requests, metrics."""
    data = {
        "summary": summary,
        "pools": result.pools,
        "tree": result.tree,
        "top_prefixes": result.top_prefixes,
        "requests": [r.to_json() for r in result.records],
        "metrics": result.metrics,
    }
    Path(path).write_text(json.dumps(data, indent=2, default=str))
