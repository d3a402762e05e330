"""workers/weighted_histogram.py: counted in groups, exposed exactly as prometheus_client's Histogram fed the
same values one at a time."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from workers.weighted_histogram import WeightedHistogram

BUCKETS = (0.001, 0.005, 0.01, 0.1, 1.0)


def exposed(registry: CollectorRegistry) -> dict[str, float]:
    """The exposition's samples by name and labels, `_created` (which only Histogram has) left out."""
    lines = generate_latest(registry).decode().splitlines()
    samples = (line.rpartition(" ") for line in lines if not line.startswith("#") and "_created" not in line)
    return {name: float(value) for name, _, value in samples}


def test_groups_are_exposed_as_a_histogram_of_each_value():
    weighted_registry, plain_registry = CollectorRegistry(), CollectorRegistry()
    weighted = WeightedHistogram("gaps_seconds", "gaps", "priority", BUCKETS, registry=weighted_registry)
    plain = Histogram("gaps_seconds", "gaps", ["priority"], buckets=BUCKETS, registry=plain_registry)
    rng = random.Random(7)
    # values on the bounds too: a value equal to a bound is in that bound's bucket (le)
    values = [
        *BUCKETS,
        0.0,
        2.5,
        *(rng.choice([rng.uniform(0, 1.5), rng.choice(BUCKETS)]) for _ in range(200)),
    ]
    for value in values:
        priority, count = str(rng.randint(0, 2)), rng.randint(1, 4)
        weighted.observe(priority, value, count)
        for _ in range(count):
            plain.labels(priority).observe(value)
    weighted_samples, plain_samples = exposed(weighted_registry), exposed(plain_registry)
    assert weighted_samples == pytest.approx(plain_samples, rel=1e-12)  # sums added in another order
    assert weighted_samples.keys() == plain_samples.keys()
    assert len([name for name in weighted_samples if "_bucket" in name]) == 3 * (len(BUCKETS) + 1)


def test_an_unobserved_label_is_not_exposed():
    registry = CollectorRegistry()
    histogram = WeightedHistogram("gaps_seconds", "gaps", "priority", BUCKETS, registry=registry)
    assert exposed(registry) == {}
    histogram.observe("5", 0.02, 3)
    samples = exposed(registry)
    assert samples['gaps_seconds_count{priority="5"}'] == 3
    assert samples['gaps_seconds_bucket{le="0.01",priority="5"}'] == 0
    assert samples['gaps_seconds_bucket{le="0.1",priority="5"}'] == 3
    assert samples['gaps_seconds_sum{priority="5"}'] == pytest.approx(0.06)
