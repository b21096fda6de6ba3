"""`hicache demo --plot PATH`: a PNG of the run's hit rate by tier and its time to first token over time.

Drawn with matplotlib's Agg canvas on a `Figure` of its own (no `pyplot`, so no global state and no GUI
backend is ever chosen). Two panels share the time axis (seconds since each run's start):

* the share of the prompt tokens served so far that came from each tier (device, host, storage), stacked;
* each request's time to first token with the cache and without one (full recompute), with a rolling
  median over the last few requests of each run, on a log scale, and the p50 of both runs in the legend.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.demo.records import DemoResult

__all__ = ["plot_series", "save_plot"]

TIERS = ("device", "host", "storage")
_TIER_COLOURS = {"device": "#2ca02c", "host": "#ff7f0e", "storage": "#9467bd"}
_CACHE_COLOUR = "#1f77b4"
_NOCACHE_COLOUR = "#d62728"
_ROLLING = 7


def plot_series(result: DemoResult) -> dict[str, list[tuple[float, float]]]:
    """The chart's data: `(seconds since start, value)` points per series.

    Keys: `hit_device`, `hit_host`, `hit_storage` (cumulative % of prompt tokens from that tier, by first
    token time), `ttft_cache` and `ttft_no_cache` (ms, by first token time).
    """
    records = sorted(result.records, key=lambda r: r.arrival_s + r.ttft_s)
    series: dict[str, list[tuple[float, float]]] = {f"hit_{t}": [] for t in TIERS}
    hits = dict.fromkeys(TIERS, 0)
    total = 0
    for r in records:
        total += int(r.prompt.numel())
        at = r.arrival_s + r.ttft_s
        for tier in TIERS:
            hits[tier] += r.hits.get(tier, 0)
            series[f"hit_{tier}"].append((at, 100.0 * hits[tier] / max(1, total)))
    series["ttft_cache"] = [(r.arrival_s + r.ttft_s, 1e3 * r.ttft_s) for r in records]
    series["ttft_no_cache"] = sorted(
        (r.arrival_nocache_s + r.ttft_nocache_s, 1e3 * r.ttft_nocache_s)
        for r in result.records
        if r.arrival_nocache_s is not None and r.ttft_nocache_s is not None
    )
    return series


def _rolling_median(values: list[float], width: int) -> list[float]:
    out = []
    for i in range(len(values)):
        window = sorted(values[max(0, i - width + 1) : i + 1])
        mid = len(window) // 2
        out.append(window[mid] if len(window) % 2 else (window[mid - 1] + window[mid]) / 2)
    return out


def _p50(points: list[tuple[float, float]]) -> float:
    values = sorted(v for _, v in points)
    return values[max(0, (len(values) + 1) // 2 - 1)] if values else float("nan")


def save_plot(result: DemoResult, path: str | Path, *, title: str | None = None) -> None:
    """Write the run's chart as a PNG (1200 x 800 pixels).

    Args:
        result: the demo run.
        path: where to write the PNG.
        title: the figure's title; by default it names the model, users, turns and backend.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = plot_series(result)
    config = result.config
    if title is None:
        model = "hybrid (LaraMini)" if result.details else "Llama"
        title = (
            f"hicache demo, {model}: {config.users} users x {config.turns} turns, "
            f"backend {result.backend_url}"
        )
    fig = Figure(figsize=(12, 8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    hit_ax, ttft_ax = fig.subplots(2, 1, sharex=True, height_ratios=(2, 3))
    fig.suptitle(title, fontsize=13)

    xs = [x for x, _ in series["hit_device"]]
    if xs:
        stacked = [[y for _, y in series[f"hit_{t}"]] for t in TIERS]
        hit_ax.stackplot(
            xs,
            *stacked,
            labels=[f"{t} ({stacked[i][-1]:.0f}%)" for i, t in enumerate(TIERS)],
            colors=[_TIER_COLOURS[t] for t in TIERS],
            alpha=0.8,
            step="post",
        )
        hit_ax.legend(loc="upper left", title="tier (final)")
    hit_ax.set_ylim(0, 100)
    hit_ax.set_ylabel("prompt tokens from cache (%)")
    hit_ax.set_title("cumulative hit rate by tier (share of prompt tokens served so far)", fontsize=11)
    hit_ax.grid(True, alpha=0.3)

    for key, label, colour in (
        ("ttft_no_cache", "no cache (full recompute)", _NOCACHE_COLOUR),
        ("ttft_cache", "with hicache", _CACHE_COLOUR),
    ):
        points = series[key]
        if not points:
            continue
        px = [x for x, _ in points]
        py = [y for _, y in points]
        ttft_ax.scatter(px, py, s=14, color=colour, alpha=0.45, label=f"{label}: p50 {_p50(points):.1f} ms")
        ttft_ax.plot(px, _rolling_median(py, _ROLLING), color=colour, linewidth=2)
    ttft_ax.set_yscale("log")
    ttft_ax.set_ylabel("time to first token (ms, log scale)")
    ttft_ax.set_xlabel("seconds since the run's start")
    ttft_ax.set_title(
        f"time to first token per request (dots) and rolling median of {_ROLLING} (lines)", fontsize=11
    )
    if series["ttft_cache"] or series["ttft_no_cache"]:
        ttft_ax.legend(loc="upper left")
    ttft_ax.grid(True, which="both", alpha=0.3)
    fig.savefig(Path(path), format="png")
