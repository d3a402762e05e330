"""bench/harness.py: the one percentile every bench reports, and what a run writes."""

import json
import random

import numpy as np
import pytest

from bench.harness import markdown_table, pct, run_info, write_result


@pytest.mark.parametrize("n", [1, 2, 7, 40, 1000])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_pct_is_numpys_linear_percentile(n, q):
    values = [random.Random(n).random() for _ in range(n)]
    assert pct(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_pct_of_nothing_is_none():
    assert pct([], 99) is None


def test_write_result_keeps_the_run_beside_the_figures(tmp_path, capsys):
    run = run_info()
    table = markdown_table(["measure", "figure"], [["tok/s", "**12.5**"]])
    path = write_result("demo", {"tok_s": 12.5}, table, tmp_path / "demo.json", run=run)
    written = json.loads(path.read_text())
    assert written["tok_s"] == 12.5
    assert set(written["run"]) == {"date", "machine", "command", "code", "load_avg"}
    md = (tmp_path / "demo.md").read_text()
    assert md.startswith(f"`{run['command']}`, {run['date']}, {run['machine']}, code ")
    assert md.endswith("| measure | figure |\n| --- | --- |\n| tok/s | **12.5** |\n")
    assert "| tok/s | **12.5** |" in capsys.readouterr().out
