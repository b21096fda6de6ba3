"""Metrics: exact Prometheus exposition, cumulative histogram buckets, escaping, threads, /metrics."""

from __future__ import annotations

import json
import threading

import anyio
import pytest

from hicache.metrics import (
    Counter,
    Histogram,
    MetricsRegistry,
    default_cache_metrics,
    format_value,
    serve_metrics,
)


def small_registry() -> MetricsRegistry:
    registry = MetricsRegistry()
    requests = registry.counter("requests_total", "Requests seen.")
    requests.inc()
    requests.inc(2)
    skipped = registry.counter("skipped_total", "Skipped, by reason.", ["reason"])
    skipped.inc(reason="miss")
    skipped.labels(reason="full").inc(3)
    registry.gauge("inflight", "Requests in flight.").set(4)
    latency = registry.histogram("latency_seconds", "Latency.", buckets=[0.1, 1.0])
    for value in (0.05, 0.5, 0.5, 3.0):
        latency.observe(value)
    return registry


def test_exposition_text_is_exact() -> None:
    assert small_registry().render_prometheus().splitlines() == [
        "# HELP requests_total Requests seen.",
        "# TYPE requests_total counter",
        "requests_total 3.0",
        "# HELP skipped_total Skipped, by reason.",
        "# TYPE skipped_total counter",
        'skipped_total{reason="miss"} 1.0',
        'skipped_total{reason="full"} 3.0',
        "# HELP inflight Requests in flight.",
        "# TYPE inflight gauge",
        "inflight 4.0",
        "# HELP latency_seconds Latency.",
        "# TYPE latency_seconds histogram",
        'latency_seconds_bucket{le="0.1"} 1',
        'latency_seconds_bucket{le="1.0"} 3',
        'latency_seconds_bucket{le="+Inf"} 4',
        "latency_seconds_sum 4.05",
        "latency_seconds_count 4",
    ]


def test_exposition_ends_with_newline_and_untouched_metrics_show_zero() -> None:
    registry = MetricsRegistry()
    registry.counter("a_total", "A.")
    registry.counter("b_total", "B.", ["kind"])  # labelled: no series until first update
    text = registry.render_prometheus()
    assert text.endswith("\n")
    assert text.splitlines() == [
        "# HELP a_total A.",
        "# TYPE a_total counter",
        "a_total 0.0",
        "# HELP b_total B.",
        "# TYPE b_total counter",
    ]


def test_histogram_buckets_are_cumulative_per_label_set() -> None:
    h = Histogram("op_seconds", "Op.", ["op"], buckets=[1, 2, 5])
    for v in (0.5, 1.0, 1.5, 2.0, 4.0, 6.0):
        h.observe(v, op="read")
    h.labels(op="write").observe(10)
    assert h.bucket_counts(op="read") == [(1.0, 2), (2.0, 4), (5.0, 5), (float("inf"), 6)]
    assert h.bucket_counts(op="write") == [(1.0, 0), (2.0, 0), (5.0, 0), (float("inf"), 1)]
    assert h.count(op="read") == 6
    assert h.sum(op="read") == pytest.approx(15.0)
    lines = h.render()
    assert 'op_seconds_bucket{op="read",le="2.0"} 4' in lines
    assert 'op_seconds_sum{op="write"} 10.0' in lines
    assert 'op_seconds_count{op="write"} 1' in lines


def test_label_values_and_help_are_escaped() -> None:
    registry = MetricsRegistry()
    c = registry.counter("odd_total", 'Help with \\ and\nnewline and "quotes".', ["path"])
    c.inc(path='C:\\dir\n"x"')
    assert registry.render_prometheus().splitlines() == [
        '# HELP odd_total Help with \\\\ and\\nnewline and "quotes".',
        "# TYPE odd_total counter",
        'odd_total{path="C:\\\\dir\\n\\"x\\""} 1.0',
    ]


def test_format_value_special_floats() -> None:
    assert [format_value(v) for v in (float("inf"), float("-inf"), float("nan"), 2, 0.25)] == [
        "+Inf",
        "-Inf",
        "NaN",
        "2.0",
        "0.25",
    ]


def test_concurrent_increments_from_threads_sum_correctly() -> None:
    registry = MetricsRegistry()
    counter = registry.counter("hits_total", "Hits.", ["worker"])
    hist = registry.histogram("sizes", "Sizes.", buckets=[10])
    threads_n, per_thread = 8, 2000
    barrier = threading.Barrier(threads_n)

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(per_thread):
            counter.inc(worker=str(i % 2))
            hist.observe(1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.value(worker="0") + counter.value(worker="1") == threads_n * per_thread
    assert counter.value(worker="0") == threads_n // 2 * per_thread
    assert hist.count() == threads_n * per_thread
    assert hist.bucket_counts()[0] == (10.0, threads_n * per_thread)


def test_misuse_raises_naming_the_argument() -> None:
    registry = MetricsRegistry()
    c = registry.counter("x_total", "X.", ["reason"])
    with pytest.raises(ValueError, match="labels"):
        c.inc()
    with pytest.raises(ValueError, match="labels"):
        c.inc(reason="a", other="b")
    with pytest.raises(ValueError, match="amount"):
        c.inc(-1, reason="a")
    with pytest.raises(ValueError, match="name"):
        registry.counter("bad name", "Bad.")
    with pytest.raises(ValueError, match="labelnames"):
        registry.histogram("h", "H.", ["le"])
    with pytest.raises(ValueError, match="buckets"):
        registry.histogram("h2", "H.", buckets=[2, 1])
    with pytest.raises(ValueError, match="already registered"):
        registry.gauge("x_total", "X.")
    assert registry.counter("x_total", "X.", ["reason"]) is c


def test_snapshot_is_plain_json() -> None:
    snap = small_registry().snapshot()
    assert json.loads(json.dumps(snap)) == snap
    assert snap["skipped_total"]["samples"] == [
        {"labels": {"reason": "miss"}, "value": 1.0},
        {"labels": {"reason": "full"}, "value": 3.0},
    ]
    latency = snap["latency_seconds"]["samples"][0]
    assert latency["buckets"] == {"0.1": 1, "1.0": 3, "+Inf": 4}
    assert latency["count"] == 4


def test_default_cache_metrics_registers_the_controller_names() -> None:
    registry = MetricsRegistry()
    m = default_cache_metrics(registry)
    m.prefetch_skipped.labels(reason="no_host_room").inc()
    m.storage_page_failures.labels(reason="read").inc(2)
    m.prefetch_latency.observe(0.002)
    assert isinstance(m.prefetch_requested, Counter)
    for name in (
        "prefetch_requested_total",
        "prefetch_skipped_total",
        "prefetch_hit_tokens_total",
        "prefetch_loaded_tokens_total",
        "prefetch_dropped_tokens_total",
        "prefetch_committed_total",
        "prefetch_cancelled_total",
        "storage_bytes_read_total",
        "storage_bytes_written_total",
        "storage_page_failures_total",
        "backup_tokens_total",
        "evict_dropped_tokens_total",
        "load_back_tokens_total",
        "prefetch_latency_seconds",
    ):
        assert name in registry
    assert default_cache_metrics(registry).prefetch_skipped is m.prefetch_skipped
    assert 'prefetch_skipped_total{reason="no_host_room"} 1.0' in registry.render_prometheus()
    assert (
        "hicache_backup_tokens_total"
        in default_cache_metrics(MetricsRegistry(), prefix="hicache_").backup_tokens.name
    )


async def http_get(port: int, path: str, method: str = "GET") -> bytes:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
        chunks = []
        while True:
            try:
                chunks.append(await stream.receive())
            except anyio.EndOfStream:
                break
        return b"".join(chunks)


async def test_serve_metrics_answers_over_loopback() -> None:
    registry = small_registry()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve_metrics, registry)
        response = await http_get(port, "/metrics")
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"Content-Type: text/plain; version=0.0.4; charset=utf-8" in head
        assert body.decode() == registry.render_prometheus()
        assert (await http_get(port, "/nope")).startswith(b"HTTP/1.1 404 ")
        assert (await http_get(port, "/metrics", method="POST")).startswith(b"HTTP/1.1 405 ")
        tg.cancel_scope.cancel()
