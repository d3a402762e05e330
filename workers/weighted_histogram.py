"""A Prometheus histogram that takes many equal observations at once.

The time between tokens is observed for every token of every running request, thousands a second at a
wide batch, and nearly all tokens of a step share one gap (each request's previous token came in the step
before). prometheus_client's Histogram.observe takes one value at a time (a lock and a walk of the buckets
each, ~1 µs); `observe(labels, value, count)` here counts a step's equal gaps in one call. It is exposed
exactly as a Histogram of the same name and buckets is (`_bucket{le=...}`, `_count`, `_sum`).
"""

from __future__ import annotations

import bisect
import threading
from itertools import accumulate

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class WeightedHistogram:
    """Buckets (upper bounds, +Inf added) per value of one label."""

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        buckets: tuple[float, ...],
        registry: CollectorRegistry | None = REGISTRY,
    ):
        self.name, self.documentation, self.label = name, documentation, label
        self._bounds = [*sorted(buckets), float("inf")]
        self._les = [floatToGoString(b) for b in self._bounds]
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        self._lock = threading.Lock()
        if registry is not None:
            registry.register(self)

    def observe(self, label_value: str, value: float, count: int = 1) -> None:
        """`count` observations of `value`."""
        bucket = bisect.bisect_left(self._bounds, value)  # the first bound >= value: Prometheus's `le`
        with self._lock:
            counts = self._counts.get(label_value)
            if counts is None:
                counts = self._counts[label_value] = [0] * len(self._bounds)
                self._sums[label_value] = 0.0
            counts[bucket] += count
            self._sums[label_value] += value * count

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        with self._lock:
            snapshot = [(value, list(counts), self._sums[value]) for value, counts in self._counts.items()]
        for value, counts, total in snapshot:
            family.add_metric([value], list(zip(self._les, accumulate(counts), strict=True)), total)
        yield family

    def describe(self):
        yield HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
