"""Metrics: hicache's collectors in a real prometheus_client registry, scraped through the text format
(`generate_latest`, parsed back with prometheus_client's parser) and over HTTP on 127.0.0.1."""

from __future__ import annotations

import enum
import json
import re
import threading
import urllib.error
from pathlib import Path

import anyio
import prometheus_client as prom
import pytest
import torch
from metrics_helpers import http_get, scraped

from hicache import HiCache, HiCacheConfig, KVLayout, Namespace
from hicache.metrics import (
    CacheMetrics,
    CollectorRegistry,
    default_cache_metrics,
    rank_labels,
    render,
    serve_metrics,
    snapshot,
)

METRICS_DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def updated_metrics(registry: CollectorRegistry) -> CacheMetrics:
    """The controller's metric set in `registry`, with a few updates through its call style."""
    m = default_cache_metrics(registry)
    m.prefetch_requested.inc()
    m.prefetch_requested.inc(2)
    m.prefetch_skipped.inc(reason="below_threshold")
    m.prefetch_skipped.labels(reason="capacity").inc(3)
    m.writes_shed.inc(4, tier="host", reason="queue_full")
    m.storage_bytes_written.inc(4096)
    m.storage_breaker_state.set(1, tier="storage")
    for seconds in (0.0004, 0.02, 0.02, 30.0):
        m.prefetch_latency.observe(seconds)
    return m


def test_the_metric_set_scrapes_through_the_text_format() -> None:
    """What the controller records is what a Prometheus scrape of the registry reads back."""
    registry = CollectorRegistry()
    m = updated_metrics(registry)
    samples = scraped(prom.generate_latest(registry).decode())
    assert samples[("hicache_prefetch_requested_total", ())] == 3.0
    assert samples[("hicache_prefetch_skipped_total", (("reason", "below_threshold"),))] == 1.0
    assert samples[("hicache_prefetch_skipped_total", (("reason", "capacity"),))] == 3.0
    assert samples[("hicache_writes_shed_total", (("reason", "queue_full"), ("tier", "host")))] == 4.0
    assert samples[("hicache_storage_written_bytes_total", ())] == 4096.0
    assert samples[("hicache_storage_breaker_state", (("tier", "storage"),))] == 1.0
    assert samples[("hicache_backup_tokens_total", ())] == 0.0  # untouched, unlabelled: shown at 0
    assert not any(name == "hicache_prefetch_dropped_tokens_total" for name, _ in samples)  # no label set yet
    buckets = {dict(labels)["le"]: v for (name, labels), v in samples.items() if name.endswith("_bucket")}
    assert buckets["0.0005"] == 1.0
    assert buckets["0.025"] == 3.0
    assert buckets["10.0"] == 3.0
    assert buckets["+Inf"] == 4.0
    assert samples[("hicache_prefetch_latency_seconds_count", ())] == 4.0
    assert samples[("hicache_prefetch_latency_seconds_sum", ())] == pytest.approx(30.0404)
    assert render(registry) == prom.generate_latest(registry).decode()
    assert m.prefetch_skipped.value(reason="capacity") == 3.0
    assert m.prefetch_latency.value() == 4.0


def test_names_follow_prometheus_conventions_and_match_the_docs_table() -> None:
    """Counters end in `_total`, units end the name, every name has the `hicache_` prefix; the
    metrics table of docs/metrics.md lists exactly the registered names, with their types and labels."""
    registry = CollectorRegistry()
    default_cache_metrics(registry)
    registered = {}
    for family in registry.collect():
        registered[family.name + ("_total" if family.type == "counter" else "")] = family.type
    for name, kind in registered.items():
        assert name.startswith("hicache_"), name
        assert name.endswith("_total") == (kind == "counter"), name
        assert "bytes" not in name or name.endswith(("_bytes", "_bytes_total")), name
    assert registered["hicache_prefetch_latency_seconds"] == "histogram"
    table = re.findall(r"^\| `(hicache_\w+)` \| (\w+) \| ([^|]*)\|", METRICS_DOC.read_text(), re.M)
    assert {name: kind for name, kind, _ in table} == registered
    labels = {name: set(re.findall(r"`(\w+)`", cell)) for name, _, cell in table}
    assert labels["hicache_writes_shed_total"] == {"tier", "reason"}
    assert labels["hicache_storage_errors_total"] == {"op", "kind"}
    assert labels["hicache_prefetch_requested_total"] == set()


LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, page_size=4)


def layout_config(**overrides: object) -> HiCacheConfig:
    return HiCacheConfig(layout=LAYOUT, device_pages=8, host_pages=8, **overrides)  # type: ignore[arg-type]


async def test_a_cache_registers_in_the_registry_its_caller_passes() -> None:
    """An embedding server's registry shows its own metrics and the cache's; two caches share one registry
    (their series add up); a name the server already took is refused naming the argument."""
    server = CollectorRegistry()
    requests = prom.Counter("server_requests_total", "The server's own requests.", registry=server)
    requests.inc()
    async with (
        HiCache(layout_config(), metrics=server) as first,
        HiCache(layout_config(), metrics=server) as second,
    ):
        assert first.registry is server
        first.metrics.backup_tokens.inc(8)
        second.metrics.backup_tokens.inc(4)
        samples = scraped(render(server))
        assert samples[("server_requests_total", ())] == 1.0
        assert samples[("hicache_backup_tokens_total", ())] == 12.0
        assert samples[("hicache_storage_breaker_state", (("tier", "storage"),))] == 0.0
        assert first.metrics.backup_tokens.collector is second.metrics.backup_tokens.collector
    taken = CollectorRegistry()
    prom.Gauge("hicache_backup_tokens_total", "Someone else's.", registry=taken)
    with pytest.raises(ValueError, match="registry: cannot register 'hicache_backup_tokens_total'"):
        default_cache_metrics(taken)
    with pytest.raises(TypeError, match="registry"):
        default_cache_metrics(object())  # type: ignore[arg-type]


async def test_a_cache_of_several_tensor_parallel_ranks_labels_its_series_with_its_rank() -> None:
    """`tp_rank` is added to every series when the namespace has more than one rank, and only then."""
    assert rank_labels(Namespace(tp_rank=1, tp_size=2)) == {"tp_rank": "1"}
    assert rank_labels(Namespace()) == {}
    registry = CollectorRegistry()
    async with HiCache(
        layout_config(namespace=Namespace(model_id="m", tp_rank=1, tp_size=2)), metrics=registry
    ) as c:
        c.metrics.prefetch_skipped.inc(reason="capacity")
        samples = scraped(render(registry))
    assert samples[("hicache_prefetch_skipped_total", (("reason", "capacity"), ("tp_rank", "1")))] == 1.0
    assert samples[("hicache_backup_tokens_total", (("tp_rank", "1"),))] == 0.0
    with pytest.raises(ValueError, match="const_labels"):
        default_cache_metrics(CollectorRegistry(), const_labels={"reason": "x"})


def test_label_values_are_shown_redacted() -> None:
    """A label value holding a URL never shows its credentials, in the text or the snapshot."""
    registry = CollectorRegistry()
    m = default_cache_metrics(registry)
    for _ in range(2):
        m.prefetch_skipped.inc(reason="s3://AKIAEXAMPLE:wJalrXUtnFEMI@host/bucket")
    text, snap = render(registry), json.dumps(snapshot(registry))
    for shown in (text, snap):
        assert "wJalrXUtnFEMI" not in shown
        assert "AKIAEXAMPLE" not in shown
    assert 'hicache_prefetch_skipped_total{reason="s3://***@host/bucket"} 2.0' in text


def test_constant_label_values_are_shown_redacted() -> None:
    """Guards against constant labels bypassing redaction: a storage URL with user info and a signed query,
    or a secret-named label, given once as a constant label never shows its credentials in any series."""
    registry = CollectorRegistry()
    url = "s3://AKIAEXAMPLE:wJalrXUtnFEMI@host/bucket?X-Amz-Signature=deadbeefcafe&region=eu"
    m = default_cache_metrics(registry, const_labels={"storage": url, "api_token": "tok-0123456789"})
    m.prefetch_requested.inc()
    m.prefetch_skipped.inc(reason="capacity")
    text, snap = render(registry), json.dumps(snapshot(registry))
    for shown in (text, snap):
        for secret in ("wJalrXUtnFEMI", "AKIAEXAMPLE", "deadbeefcafe", "tok-0123456789"):
            assert secret not in shown
    series = scraped(text)
    labels = (("api_token", "***"), ("storage", "s3://***@host/bucket?X-Amz-Signature=***&region=eu"))
    assert series[("hicache_prefetch_requested_total", labels)] == 1.0
    assert m.prefetch_skipped.value(reason="capacity") == 1.0


def test_str_enum_label_values_show_their_value() -> None:
    """Reasons and tiers given as `StrEnum` members land in the same series as their plain strings."""

    class Reason(enum.StrEnum):
        CAPACITY = "capacity"

    registry = CollectorRegistry()
    m = default_cache_metrics(registry)
    m.prefetch_skipped.inc(reason=Reason.CAPACITY)
    m.prefetch_skipped.labels(reason="capacity").inc()
    m.prefetch_skipped.inc(reason="capacity")
    assert scraped(render(registry))[("hicache_prefetch_skipped_total", (("reason", "capacity"),))] == 3.0


def test_misuse_raises_naming_the_argument() -> None:
    """Bad labels are refused on the first update and after a good one (the handle caches children)."""
    m = default_cache_metrics(CollectorRegistry())
    m.prefetch_skipped.inc(reason="a")
    with pytest.raises(ValueError, match="labels"):
        m.prefetch_skipped.inc()
    with pytest.raises(ValueError, match="labels"):
        m.prefetch_skipped.inc(reason="a", other="b")
    with pytest.raises(ValueError, match="amount"):
        m.prefetch_skipped.inc(-1, reason="a")
    with pytest.raises(TypeError, match="labels"):
        m.prefetch_skipped.inc(reason=3)  # type: ignore[arg-type]


def test_concurrent_increments_from_threads_sum_correctly() -> None:
    registry = CollectorRegistry()
    m = default_cache_metrics(registry)
    threads_n, per_thread = 8, 2000
    barrier = threading.Barrier(threads_n)

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(per_thread):
            m.prefetch_skipped.inc(reason=str(i % 2))
            m.prefetch_latency.observe(0.001)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    samples = scraped(render(registry))
    assert samples[("hicache_prefetch_skipped_total", (("reason", "0"),))] == threads_n // 2 * per_thread
    assert samples[("hicache_prefetch_skipped_total", (("reason", "1"),))] == threads_n // 2 * per_thread
    assert samples[("hicache_prefetch_latency_seconds_count", ())] == threads_n * per_thread


def test_snapshot_is_plain_json_keyed_by_exposed_name() -> None:
    registry = CollectorRegistry()
    updated_metrics(registry)
    snap = snapshot(registry)
    assert json.loads(json.dumps(snap)) == snap
    assert snap["hicache_prefetch_skipped_total"]["type"] == "counter"
    assert snap["hicache_prefetch_skipped_total"]["samples"] == [
        {"labels": {"reason": "below_threshold"}, "value": 1.0},
        {"labels": {"reason": "capacity"}, "value": 3.0},
    ]
    latency = snap["hicache_prefetch_latency_seconds"]["samples"]
    assert len(latency) == 1
    assert latency[0]["buckets"]["0.0005"] == 1
    assert latency[0]["buckets"]["+Inf"] == 4
    assert latency[0]["count"] == 4
    assert not any(name.endswith("_created") for name in snap)


async def test_serve_metrics_answers_a_real_scrape_over_loopback() -> None:
    """prometheus_client's HTTP server, started and stopped by the `serve_metrics` task, answers a scrape."""
    registry = CollectorRegistry()
    m = updated_metrics(registry)
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_metrics, registry)
        status, content_type, body = await anyio.to_thread.run_sync(
            http_get, f"http://127.0.0.1:{port}/metrics"
        )
        assert status == 200
        assert content_type == "text/plain; version=0.0.4; charset=utf-8"  # the text format, no Accept header
        assert scraped(body) == scraped(render(registry))
        m.prefetch_requested.inc()
        _, _, body = await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{port}/metrics")
        assert scraped(body)[("hicache_prefetch_requested_total", ())] == 4.0
        tg.cancel_scope.cancel()
    with pytest.raises(urllib.error.URLError, match="refused"):  # the server is gone once the task stopped
        await anyio.to_thread.run_sync(http_get, f"http://127.0.0.1:{port}/metrics")
