"""`hicache demo --plot`: the chart is a real PNG of the expected size with both runs drawn on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

from matplotlib.image import imread

from hicache.demo.plot import plot_series, save_plot
from hicache.demo.records import DemoConfig, DemoResult, RequestRecord

CACHE_RGB = (0x1F / 255, 0x77 / 255, 0xB4 / 255)
NOCACHE_RGB = (0xD6 / 255, 0x27 / 255, 0x28 / 255)


def record(i: int, hits: dict[str, int], ttft_s: float, ttft_nocache_s: float) -> RequestRecord:
    """A served request of 100 prompt tokens arriving at `i` * 0.1 s in both runs."""
    return RequestRecord(
        request_id=f"u{i}t0",
        user=i,
        turn=0,
        prompt=torch.zeros(100, dtype=torch.int64),
        cached_len=sum(hits.values()),
        reused_len=sum(hits.values()),
        hits={"device": 0, "host": 0, "storage": 0, **hits},
        prefetch=None,
        inserted=True,
        arrival_s=0.1 * i,
        ttft_s=ttft_s,
        reply=[1],
        logits=torch.zeros(1, 4),
        ttft_nocache_s=ttft_nocache_s,
        arrival_nocache_s=0.1 * i,
        reply_equal=True,
    )


def result_of(records: list[RequestRecord]) -> DemoResult:
    return DemoResult(
        config=DemoConfig(users=4, turns=3),
        backend_url="memory://plot-test",
        records=records,
        metrics={},
        prometheus="",
        pools={},
        tree={},
        top_prefixes=[],
        wall_s={},
        token_nbytes=1,
    )


def fraction_near(image: np.ndarray, rgb: tuple[float, float, float], tol: float = 0.03) -> float:
    """The fraction of the image's pixels within `tol` of colour `rgb` in every channel."""
    return float((np.abs(image[:, :, :3] - np.asarray(rgb)).max(axis=2) < tol).mean())


@pytest.fixture
def result() -> DemoResult:
    records = [
        record(i, {"device": 16 * i, "host": 8 if i % 3 == 1 else 0, "storage": 24 if i % 4 == 2 else 0},
               ttft_s=0.01 + 0.002 * (i % 5), ttft_nocache_s=0.05 + 0.01 * (i % 3))
        for i in range(12)
    ]  # fmt: skip
    return result_of(records)


def test_plot_series_accumulates_hits_by_tier(result: DemoResult) -> None:
    """The hit-rate series are cumulative per tier over the prompt tokens served so far."""
    series = plot_series(result)
    assert len(series["ttft_cache"]) == len(series["ttft_no_cache"]) == 12
    last_device = series["hit_device"][-1][1]
    assert last_device == pytest.approx(100 * sum(16 * i for i in range(12)) / 1200)
    assert series["hit_host"][-1][1] == pytest.approx(100 * 8 * 4 / 1200)
    assert series["hit_storage"][-1][1] == pytest.approx(100 * 24 * 3 / 1200)
    assert series["ttft_cache"][0] == (pytest.approx(0.01), pytest.approx(10.0))


def test_plot_is_a_png_of_the_chart_size_with_both_runs_drawn(result: DemoResult, tmp_path: Path) -> None:
    """The PNG opens as a 1200 x 800 image that is not blank, and both TTFT lines are on it."""
    path = tmp_path / "demo.png"
    save_plot(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.shape[:2] == (800, 1200)
    assert float(image[:, :, :3].var()) > 0.01  # a blank (single-colour) image has variance 0
    assert fraction_near(image, CACHE_RGB) > 0.0005
    assert fraction_near(image, NOCACHE_RGB) > 0.0005


def test_plot_of_a_run_with_no_records_is_still_an_image(tmp_path: Path) -> None:
    """A run with no requests (nothing to draw) still writes a labelled chart rather than failing."""
    path = tmp_path / "empty.png"
    save_plot(result_of([]), path, title="nothing served")
    image = imread(path)
    assert image.shape[:2] == (800, 1200)
    assert float(image[:, :, :3].var()) > 0.0
