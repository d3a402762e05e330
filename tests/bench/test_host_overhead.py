"""bench/host_overhead.py measures what it says: the forward is timed inside each step (so host work is
what is left), every sequence decodes through the real engine, and gpu_check's report carries the table."""

from __future__ import annotations

from bench import host_overhead
from bench.gpu_check import markdown


def test_host_work_is_the_step_less_its_forward():
    report = host_overhead.measure_widths([1, 4], steps=4, device="cpu", sections=True)
    assert [r["width"] for r in report["results"]] == [1, 4]
    for r in report["results"]:
        assert 0 < r["forward_us"] < r["step_us"]
        assert abs(r["step_us"] - r["forward_us"] - r["host_us_per_step"]) < 0.2
        assert abs(r["host_us_per_seq"] * r["width"] - r["host_us_per_step"]) < 0.1 * r["width"] + 0.1
        assert r["host_cpu_us_per_step"] > 0
        assert r["target_us"] == (100 if r["width"] == 1 else 100 + r["width"])
        parts = r[
            "sections_cpu_us"
        ]  # --sections: the step's parts, each timed (a part never run is left out)
        assert {"schedule", "sample", "stops and text", "report (step_deltas)", "stats"} <= parts.keys()
        assert all(us > 0 for us in parts.values())
    assert report["gaps"] == []  # the device's idle time is measured on CUDA only
    text = "\n".join(host_overhead.table(report))
    assert (
        "| 4 |" in text and "async scheduling off" in text and "width 4, thread CPU us a step by part" in text
    )
    assert "## host work per step" in markdown("CPU", None, [], report)
