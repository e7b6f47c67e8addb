"""Counters, gauges and histograms for the request path, written by the event loop alone.

prometheus_client's metrics take a lock on every update and build a label tuple on every
`.labels()`: some 6-15 us a call each, several per request (a profile of the router at
c=32 found them at about a seventh of its CPU). These keep plain numbers per label set
(one writer: the event loop's thread; no lock) and hand them to Prometheus when it scrapes
(`collect`, from the metrics server's thread: it copies each dict before reading it, a
single step under the GIL). Exposed exactly as the prometheus_client types are: a counter's
`_total`, a histogram's cumulative `_bucket{le=...}`, `_count` and `_sum`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry


class Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # le: the first bound >= amount
        self.sum += amount


class _Family(Collector):
    kind = ""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if registry is not None:
            registry.register(self)

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError


class LoopCounter(_Family):
    def labels(self, *values: str) -> Value:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = Value()
        return child  # type: ignore[return-value]

    def remove(self, *values: str) -> None:
        self._children.pop(values, None)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)  # type: ignore[attr-defined]
        yield family


class LoopGauge(LoopCounter):
    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(list(values), child.value)  # type: ignore[attr-defined]
        yield family


class LoopHistogram(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self.bounds = tuple(sorted(float(b) for b in buckets))
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> Buckets:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = Buckets(self.bounds)
        return child  # type: ignore[return-value]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            assert isinstance(child, Buckets)
            counts, total = list(child.counts), child.sum
            cumulative, buckets = 0, []
            for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
                cumulative += n
                buckets.append((_le(bound), cumulative))
            family.add_metric(list(values), buckets, total)
        yield family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
