"""Counters, gauges and histograms with Prometheus text exposition, and no dependencies.

Metrics are created through a `MetricsRegistry` and updated from the event loop or from worker threads
(each metric has a lock). `MetricsRegistry.snapshot()` gives a plain dict for JSON;
`MetricsRegistry.render_prometheus()` gives text exposition format 0.0.4; `serve_metrics` answers
``GET /metrics`` on a loopback port.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
import anyio.abc

from storage_backends.redact import redact_value

__all__ = [
    "DEFAULT_BUCKETS",
    "LATENCY_BUCKETS",
    "BoundCounter",
    "BoundGauge",
    "BoundHistogram",
    "CacheMetrics",
    "Counter",
    "Gauge",
    "Histogram",
    "Metric",
    "MetricsRegistry",
    "default_cache_metrics",
    "format_value",
    "serve_metrics",
]

DEFAULT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Histogram upper bounds used when none are given (Prometheus client defaults, without +Inf)."""

LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Upper bounds for prefetch latencies in seconds."""

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

LabelKey = tuple[str, ...]


def format_value(value: float) -> str:
    """Format a sample value as Prometheus (and Go) expect: ``+Inf``, ``-Inf``, ``NaN`` or a float repr."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _shown_label(name: str, value: str) -> str:
    """A label value as rendered: never a credential (a URL's secrets or a secret-named label's value)."""
    return str(redact_value(name, value))


def _format_labels(pairs: Iterable[tuple[str, str]]) -> str:
    body = ",".join(f'{k}="{_escape_label_value(_shown_label(k, v))}"' for k, v in pairs)
    return f"{{{body}}}" if body else ""


class Metric:
    """Base class of the metric kinds: a name, help text, label names and one series per label set.

    Args:
        name: the metric name (``[a-zA-Z_:][a-zA-Z0-9_:]*``).
        help: one line saying what is measured.
        labelnames: the label names every update must give, in order.

    Raises:
        ValueError: for an invalid or reserved name or label name, or a repeated label name.
    """

    kind: ClassVar[str] = "untyped"
    _reserved_labels: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        if not isinstance(name, str) or not _METRIC_NAME.match(name):
            raise ValueError(f"name: invalid metric name {name!r}")
        labelnames = tuple(labelnames)
        for label in labelnames:
            if not isinstance(label, str) or not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"labelnames: invalid label name {label!r} for metric {name!r}")
            if label in self._reserved_labels:
                raise ValueError(f"labelnames: label {label!r} is reserved in a {self.kind}")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"labelnames: repeated label name in {labelnames!r}")
        self.name = name
        self.help = help
        self.labelnames: tuple[str, ...] = labelnames
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelKey:
        if labels.keys() != set(self.labelnames):
            missing = sorted(set(self.labelnames) - labels.keys())
            extra = sorted(labels.keys() - set(self.labelnames))
            raise ValueError(
                f"labels: metric {self.name!r} takes labels {list(self.labelnames)}; "
                f"missing {missing}, unexpected {extra}"
            )
        key = tuple(labels[n] for n in self.labelnames)
        for n, v in zip(self.labelnames, key, strict=True):
            if not isinstance(v, str):
                raise TypeError(f"labels: value of {n!r} must be a str, got {type(v).__name__}")
        return key

    def _label_dict(self, key: LabelKey) -> dict[str, str]:
        return {n: _shown_label(n, v) for n, v in zip(self.labelnames, key, strict=True)}

    def _header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        """The exposition lines of this metric (HELP, TYPE and samples)."""
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        """A plain dict of this metric: type, help, label names and samples."""
        raise NotImplementedError


class _ScalarMetric(Metric):
    """A counter or gauge: one float per label set."""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[LabelKey, float] = {}
        if not self.labelnames:
            self._values[()] = 0.0

    def value(self, **labels: str) -> float:
        """The current value for `labels` (0.0 for a label set never updated)."""
        key = self._key(labels)
        with self._lock:
            return self._values.get(key, 0.0)

    def _add(self, amount: float, labels: dict[str, str]) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def _samples(self) -> list[tuple[LabelKey, float]]:
        with self._lock:
            return list(self._values.items())

    def render(self) -> list[str]:
        lines = self._header()
        for key, value in self._samples():
            pairs = zip(self.labelnames, key, strict=True)
            lines.append(f"{self.name}{_format_labels(pairs)} {format_value(value)}")
        return lines

    def snapshot(self) -> dict[str, Any]:
        return {
            "type": self.kind,
            "help": self.help,
            "labelnames": list(self.labelnames),
            "samples": [{"labels": self._label_dict(k), "value": v} for k, v in self._samples()],
        }


class Counter(_ScalarMetric):
    """A value that only goes up (by convention its name ends in ``_total``)."""

    kind: ClassVar[str] = "counter"

    def inc(self, amount: float = 1.0, /, **labels: str) -> None:
        """Add `amount` (at least 0) to the series named by `labels`.

        Raises:
            ValueError: when `amount` is negative or `labels` do not match the label names.
        """
        if not amount >= 0:
            raise ValueError(f"amount: a counter only goes up, got {amount!r}")
        self._add(float(amount), labels)

    def labels(self, **labels: str) -> BoundCounter:
        """This counter bound to one label set: ``c.labels(reason="miss").inc(3)``."""
        self._key(labels)
        return BoundCounter(self, labels)


class Gauge(_ScalarMetric):
    """A value that goes up and down."""

    kind: ClassVar[str] = "gauge"

    def set(self, value: float, /, **labels: str) -> None:
        """Set the series named by `labels` to `value`."""
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)

    def inc(self, amount: float = 1.0, /, **labels: str) -> None:
        """Add `amount` to the series named by `labels`."""
        self._add(float(amount), labels)

    def dec(self, amount: float = 1.0, /, **labels: str) -> None:
        """Subtract `amount` from the series named by `labels`."""
        self._add(-float(amount), labels)

    def labels(self, **labels: str) -> BoundGauge:
        """This gauge bound to one label set."""
        self._key(labels)
        return BoundGauge(self, labels)


@dataclass
class _HistogramSeries:
    counts: list[int]
    sum: float = 0.0
    count: int = 0


class Histogram(Metric):
    """Observations counted in fixed buckets, with their sum and count.

    Args:
        name: the metric name.
        help: one line saying what is measured.
        labelnames: the label names every observation must give (``le`` is reserved).
        buckets: strictly increasing finite upper bounds; ``+Inf`` is always added.

    Raises:
        ValueError: for invalid names or buckets.
    """

    kind: ClassVar[str] = "histogram"
    _reserved_labels: ClassVar[frozenset[str]] = frozenset({"le"})

    def __init__(
        self, name: str, help: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = DEFAULT_BUCKETS
    ) -> None:
        super().__init__(name, help, labelnames)
        bounds = [float(b) for b in buckets]
        if bounds and math.isinf(bounds[-1]) and bounds[-1] > 0:
            bounds.pop()
        if any(math.isnan(b) or math.isinf(b) for b in bounds):
            raise ValueError(f"buckets: bounds must be finite (+Inf is implied), got {list(buckets)}")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"buckets: bounds must be strictly increasing, got {list(buckets)}")
        self.buckets: tuple[float, ...] = (*bounds, math.inf)
        self._series: dict[LabelKey, _HistogramSeries] = {}
        if not self.labelnames:
            self._series[()] = self._new_series()

    def _new_series(self) -> _HistogramSeries:
        return _HistogramSeries(counts=[0] * len(self.buckets))

    def observe(self, value: float, /, **labels: str) -> None:
        """Record one observation of `value` in the series named by `labels`."""
        key = self._key(labels)
        value = float(value)
        # Non-cumulative per-bucket counts; the first bucket whose bound is >= value (+Inf catches NaN too).
        index = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets) - 1)
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = self._new_series()
            series.counts[index] += 1
            series.sum += value
            series.count += 1

    def labels(self, **labels: str) -> BoundHistogram:
        """This histogram bound to one label set."""
        self._key(labels)
        return BoundHistogram(self, labels)

    def _copy(self, key: LabelKey) -> _HistogramSeries:
        with self._lock:
            s = self._series.get(key)
            return self._new_series() if s is None else _HistogramSeries(list(s.counts), s.sum, s.count)

    def bucket_counts(self, **labels: str) -> list[tuple[float, int]]:
        """Cumulative ``(upper_bound, count)`` pairs, ending with ``(inf, count)``."""
        series = self._copy(self._key(labels))
        out, total = [], 0
        for bound, n in zip(self.buckets, series.counts, strict=True):
            total += n
            out.append((bound, total))
        return out

    def sum(self, **labels: str) -> float:
        """The sum of observed values."""
        return self._copy(self._key(labels)).sum

    def count(self, **labels: str) -> int:
        """The number of observations."""
        return self._copy(self._key(labels)).count

    def _all(self) -> list[tuple[LabelKey, _HistogramSeries]]:
        with self._lock:
            return [(k, _HistogramSeries(list(s.counts), s.sum, s.count)) for k, s in self._series.items()]

    def render(self) -> list[str]:
        lines = self._header()
        for key, series in self._all():
            pairs = list(zip(self.labelnames, key, strict=True))
            total = 0
            for bound, n in zip(self.buckets, series.counts, strict=True):
                total += n
                labels = _format_labels([*pairs, ("le", format_value(bound))])
                lines.append(f"{self.name}_bucket{labels} {total}")
            lines.append(f"{self.name}_sum{_format_labels(pairs)} {format_value(series.sum)}")
            lines.append(f"{self.name}_count{_format_labels(pairs)} {series.count}")
        return lines

    def snapshot(self) -> dict[str, Any]:
        samples = []
        for key, series in self._all():
            cumulative, total = {}, 0
            for bound, n in zip(self.buckets, series.counts, strict=True):
                total += n
                cumulative[format_value(bound)] = total
            samples.append(
                {
                    "labels": self._label_dict(key),
                    "buckets": cumulative,
                    "sum": series.sum,
                    "count": series.count,
                }
            )
        return {"type": self.kind, "help": self.help, "labelnames": list(self.labelnames), "samples": samples}


class BoundCounter:
    """A `Counter` bound to one label set (from `Counter.labels`)."""

    def __init__(self, metric: Counter, labels: dict[str, str]) -> None:
        self._metric, self._labels = metric, dict(labels)

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount` (at least 0)."""
        self._metric.inc(amount, **self._labels)

    def value(self) -> float:
        """The current value."""
        return self._metric.value(**self._labels)


class BoundGauge:
    """A `Gauge` bound to one label set (from `Gauge.labels`)."""

    def __init__(self, metric: Gauge, labels: dict[str, str]) -> None:
        self._metric, self._labels = metric, dict(labels)

    def set(self, value: float) -> None:
        """Set the value."""
        self._metric.set(value, **self._labels)

    def inc(self, amount: float = 1.0) -> None:
        """Add `amount`."""
        self._metric.inc(amount, **self._labels)

    def dec(self, amount: float = 1.0) -> None:
        """Subtract `amount`."""
        self._metric.dec(amount, **self._labels)

    def value(self) -> float:
        """The current value."""
        return self._metric.value(**self._labels)


class BoundHistogram:
    """A `Histogram` bound to one label set (from `Histogram.labels`)."""

    def __init__(self, metric: Histogram, labels: dict[str, str]) -> None:
        self._metric, self._labels = metric, dict(labels)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self._metric.observe(value, **self._labels)


class MetricsRegistry:
    """Creates metrics by name and renders them all.

    Asking again for an existing name returns the same metric when kind and label names match.
    """

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}
        self._lock = threading.Lock()

    def _get_or_create(self, kind: type[Metric], name: str, labelnames: Sequence[str], make: Any) -> Any:
        with self._lock:
            existing = self._metrics.get(name)
            if existing is None:
                metric = make()
                self._metrics[name] = metric
                return metric
        if type(existing) is not kind or existing.labelnames != tuple(labelnames):
            raise ValueError(
                f"name: {name!r} is already registered as a {existing.kind} with labels "
                f"{list(existing.labelnames)}"
            )
        return existing

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        """The counter `name`, created on first use."""
        metric: Counter = self._get_or_create(
            Counter, name, labelnames, lambda: Counter(name, help, labelnames)
        )
        return metric

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        """The gauge `name`, created on first use."""
        metric: Gauge = self._get_or_create(Gauge, name, labelnames, lambda: Gauge(name, help, labelnames))
        return metric

    def histogram(
        self, name: str, help: str, labelnames: Sequence[str] = (), buckets: Sequence[float] = DEFAULT_BUCKETS
    ) -> Histogram:
        """The histogram `name`, created on first use."""
        metric: Histogram = self._get_or_create(
            Histogram, name, labelnames, lambda: Histogram(name, help, labelnames, buckets)
        )
        return metric

    def get(self, name: str) -> Metric | None:
        """The metric registered as `name`, if any."""
        with self._lock:
            return self._metrics.get(name)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._metrics

    def _all(self) -> list[Metric]:
        with self._lock:
            return list(self._metrics.values())

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every metric as plain, JSON-serialisable data, keyed by name."""
        return {m.name: m.snapshot() for m in self._all()}

    def render_prometheus(self) -> str:
        """Every metric in Prometheus text exposition format 0.0.4, in registration order."""
        lines: list[str] = []
        for metric in self._all():
            lines.extend(metric.render())
        return "".join(line + "\n" for line in lines)

    def __repr__(self) -> str:
        return f"<MetricsRegistry metrics={len(self._all())}>"


@dataclass(frozen=True)
class CacheMetrics:
    """The metrics the cache controller updates; each field's metric name is the field name plus ``_total``
    for counters (``prefetch_latency`` is the histogram ``prefetch_latency_seconds``)."""

    prefetch_requested: Counter
    prefetch_skipped: Counter
    """Labelled by ``reason``."""
    prefetch_hit_tokens: Counter
    prefetch_loaded_tokens: Counter
    prefetch_dropped_tokens: Counter
    """Labelled by ``reason``."""
    prefetch_committed: Counter
    prefetch_cancelled: Counter
    storage_bytes_read: Counter
    storage_bytes_written: Counter
    storage_page_failures: Counter
    """Labelled by ``reason``: ``exists`` (a lookup failed), ``write``, ``timeout``, and for reads the
    failed page's `PageStatus` value: ``miss``, ``corrupt``, ``foreign_page`` (another namespace's or
    another key's page under this key), ``old_format``, ``error``."""
    backup_tokens: Counter
    backup_skipped: Counter
    evict_dropped_tokens: Counter
    """Device tokens evicted without a host copy: un-backed nodes deleted (write-through) or dropped
    because their un-backed chain did not fit in the host (write-back)."""
    load_back_tokens: Counter
    prefetch_latency: Histogram
    storage_errors: Counter
    """Labelled by ``op`` (exists, get, put) and ``kind`` (unavailable, timeout, auth, other): storage calls
    that failed with an error, never a miss."""
    writes_shed: Counter
    """Labelled by ``tier`` (host, storage) and ``reason``: backups and storage writes dropped instead of
    done (``queue_full``: the queue was at its limit; ``storage_unavailable``: the breaker was open;
    ``evicted``: the node left host memory while its storage write was still queued)."""
    storage_breaker_state: Gauge
    """Labelled by ``tier``: 0 closed, 1 open, 2 half-open (see `hicache.controller.breaker`)."""


def default_cache_metrics(registry: MetricsRegistry, *, prefix: str = "") -> CacheMetrics:
    """Register (or fetch) the controller's metrics in `registry`.

    Args:
        registry: where the metrics live.
        prefix: prepended to every metric name (e.g. ``"hicache_"``).
    """

    def counter(name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return registry.counter(f"{prefix}{name}_total", help, labelnames)

    return CacheMetrics(
        prefetch_requested=counter("prefetch_requested", "Storage prefetches requested."),
        prefetch_skipped=counter(
            "prefetch_skipped", "Storage prefetches not started, by reason.", ["reason"]
        ),
        prefetch_hit_tokens=counter("prefetch_hit_tokens", "Tokens found in storage by prefetch lookups."),
        prefetch_loaded_tokens=counter(
            "prefetch_loaded_tokens", "Tokens read from storage into host memory."
        ),
        prefetch_dropped_tokens=counter(
            "prefetch_dropped_tokens",
            "Prefetched tokens dropped instead of committed, by reason.",
            ["reason"],
        ),
        prefetch_committed=counter("prefetch_committed", "Prefetches committed into the tree."),
        prefetch_cancelled=counter("prefetch_cancelled", "Prefetches cancelled."),
        storage_bytes_read=counter("storage_bytes_read", "Bytes read from storage."),
        storage_bytes_written=counter("storage_bytes_written", "Bytes written to storage."),
        storage_page_failures=counter(
            "storage_page_failures", "Storage page operations that failed, by reason.", ["reason"]
        ),
        backup_tokens=counter("backup_tokens", "Tokens backed up from device to host or storage."),
        backup_skipped=counter("backup_skipped", "Backups not started (no host or storage room)."),
        evict_dropped_tokens=counter(
            "evict_dropped_tokens", "Device tokens evicted without a host copy (un-backed nodes deleted)."
        ),
        load_back_tokens=counter("load_back_tokens", "Tokens loaded back from host to device."),
        prefetch_latency=registry.histogram(
            f"{prefix}prefetch_latency_seconds",
            "Seconds from prefetch start to commit.",
            buckets=LATENCY_BUCKETS,
        ),
        storage_errors=counter(
            "storage_errors",
            "Storage calls that failed with an error (not a miss), by op and kind.",
            ["op", "kind"],
        ),
        writes_shed=counter(
            "writes_shed",
            "Backups and storage writes dropped instead of queued, by tier and reason.",
            ["tier", "reason"],
        ),
        storage_breaker_state=registry.gauge(
            f"{prefix}storage_breaker_state",
            "Storage circuit breaker: 0 closed, 1 open, 2 half-open.",
            ["tier"],
        ),
    )


_MAX_REQUEST_BYTES = 8192
_REQUEST_TIMEOUT_S = 10.0


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


async def _handle(registry: MetricsRegistry, stream: anyio.abc.SocketStream) -> None:
    async with stream:
        request = b""
        with anyio.move_on_after(_REQUEST_TIMEOUT_S):
            while b"\r\n\r\n" not in request and len(request) < _MAX_REQUEST_BYTES:
                try:
                    request += await stream.receive(4096)
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
        parts = request.split(b"\r\n", 1)[0].split()
        if len(parts) != 3:
            reply = _response("400 Bad Request", b"bad request\n")
        elif parts[0] not in (b"GET", b"HEAD"):
            reply = _response("405 Method Not Allowed", b"method not allowed\n")
        elif parts[1].split(b"?", 1)[0] != b"/metrics":
            reply = _response("404 Not Found", b"not found\n")
        else:
            body = registry.render_prometheus().encode("utf-8")
            reply = _response("200 OK", body, "text/plain; version=0.0.4; charset=utf-8")
            if parts[0] == b"HEAD":
                reply = reply[: len(reply) - len(body)]
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await stream.send(reply)


async def serve_metrics(
    registry: MetricsRegistry,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ``GET /metrics`` with `registry`'s exposition text until cancelled.

    Start it with ``port = await task_group.start(serve_metrics, registry)`` to learn the bound port.

    Args:
        registry: the metrics to serve.
        host: the address to bind; loopback by default.
        port: the port to bind; 0 picks a free one.
        task_status: receives the bound port once listening.
    """
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    async with listener:
        bound = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        task_status.started(bound)

        async def handler(stream: anyio.abc.SocketStream) -> None:
            await _handle(registry, stream)

        await listener.serve(handler)
