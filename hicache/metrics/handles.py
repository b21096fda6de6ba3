"""hicache's handles on prometheus_client metrics: the controller's call style over the library's collectors.

A handle wraps one prometheus_client collector and adds three things the controller relies on: updates
that take their labels as keywords (``shed.inc(3, tier="host", reason="queue_full")``), constant labels
bound once (a tensor-parallel rank's ``tp_rank``) so call sites never repeat them, and label values
(constant ones too) shown redacted (a storage URL in a label never shows its credentials). ``value`` reads
a series back through the collector's public ``collect()``, for tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, TypeVar

import prometheus_client as prom

from storage_backends.redact import redact_value

__all__ = ["Counter", "Gauge", "Histogram"]

_C = TypeVar("_C", prom.Counter, prom.Gauge, prom.Histogram)


class _Handle(Generic[_C]):
    """A collector, the label names each update gives, and the constant labels bound to every series."""

    _value_suffix = ""

    def __init__(
        self, name: str, collector: _C, labelnames: tuple[str, ...], const_labels: Mapping[str, str]
    ) -> None:
        self.name = name
        """The metric's name as exposed (a counter's ends in ``_total``)."""
        self.collector: _C = collector
        """The prometheus_client collector (registered in the cache's registry)."""
        self.labelnames = labelnames
        """The label names every update must give (the constant labels excluded)."""
        self.const_labels: dict[str, str] = {
            label: str(redact_value(label, value)) for label, value in const_labels.items()
        }
        """The constant labels as every series shows them: redacted like any other label value."""
        # A metric without per-update labels shows its series (at 0) from the start, as a bare one would.
        self._bare: _C | None = None
        if not labelnames:
            self._bare = collector.labels(**self.const_labels) if self.const_labels else collector
        # Children by label values in `labelnames` order: the values are a small fixed set (reasons,
        # tiers, ops), and a hit skips the checks, the redaction and prometheus_client's own lookup.
        self._children: dict[tuple[object, ...], _C] = {}

    def _shown(self, labels: Mapping[str, object]) -> dict[str, str]:
        if labels.keys() != set(self.labelnames):
            missing = sorted(set(self.labelnames) - labels.keys())
            extra = sorted(labels.keys() - set(self.labelnames))
            raise ValueError(
                f"labels: metric {self.name!r} takes labels {list(self.labelnames)}; "
                f"missing {missing}, unexpected {extra}"
            )
        shown = {}
        for name, value in labels.items():
            if not isinstance(value, str):
                raise TypeError(f"labels: value of {name!r} must be a str, got {type(value).__name__}")
            shown[name] = str(redact_value(name, str(value)))
        return shown

    def _child(self, labels: Mapping[str, object]) -> _C:
        if self._bare is not None and not labels:
            return self._bare
        key = tuple(labels.get(name) for name in self.labelnames)
        child = self._children.get(key) if len(labels) == len(key) else None
        if child is None:
            child = self.collector.labels(**self.const_labels, **self._shown(labels))
            self._children[key] = child
        return child

    def labels(self, **labels: str) -> _C:
        """The prometheus_client child for one label set (constant labels added): ``.labels(reason=r).inc()``.

        Raises:
            ValueError: when `labels` are not exactly this metric's label names.
            TypeError: when a label value is not a str.
        """
        return self._child(labels)

    def value(self, **labels: str) -> float:
        """The current value of the series named by `labels` (0.0 for one never updated).

        For tests and benchmarks: it walks the collector's samples.
        """
        want = {**self.const_labels, **self._shown(labels)}
        for family in self.collector.collect():
            for sample in family.samples:
                if sample.name == self.name + self._value_suffix and sample.labels == want:
                    return float(sample.value)
        return 0.0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} labels={list(self.labelnames)}>"


class Counter(_Handle[prom.Counter]):
    """A prometheus_client `Counter` with the controller's call style (see the module docstring)."""

    def inc(self, amount: float = 1.0, /, **labels: str) -> None:
        """Add `amount` (at least 0) to the series named by `labels`.

        Raises:
            ValueError: when `amount` is negative or `labels` do not match the label names.
        """
        if not amount >= 0:
            raise ValueError(f"amount: a counter only goes up, got {amount!r}")
        self._child(labels).inc(amount)


class Gauge(_Handle[prom.Gauge]):
    """A prometheus_client `Gauge` with the controller's call style."""

    def set(self, value: float, /, **labels: str) -> None:
        """Set the series named by `labels` to `value`."""
        self._child(labels).set(value)

    def inc(self, amount: float = 1.0, /, **labels: str) -> None:
        """Add `amount` to the series named by `labels`."""
        self._child(labels).inc(amount)

    def dec(self, amount: float = 1.0, /, **labels: str) -> None:
        """Subtract `amount` from the series named by `labels`."""
        self._child(labels).dec(amount)


class Histogram(_Handle[prom.Histogram]):
    """A prometheus_client `Histogram` with the controller's call style."""

    _value_suffix = "_count"

    def observe(self, value: float, /, **labels: str) -> None:
        """Record one observation of `value` in the series named by `labels`."""
        self._child(labels).observe(value)

    def value(self, **labels: str) -> float:
        """The number of observations in the series named by `labels` (its ``_count``)."""
        return super().value(**labels)
