"""bench/harness.py: the one percentile every bench reports, its CPU accounting, and what a run writes."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from bench.harness import (
    markdown_table,
    own_seconds,
    pct,
    proc_stat,
    run_info,
    session_cpu,
    tree_cpu_seconds,
    write_result,
)


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


# burns 0.3 s of CPU, then idles; given its own source as an argument, it starts a child that does the
# same first, then prints the child's pid
BURNER = """
import subprocess, sys, time
t = time.process_time()
while time.process_time() - t < 0.3:
    pass
if len(sys.argv) > 1:
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "idle\\n"
    print(child.pid)
print("idle", flush=True)
time.sleep(60)
"""


def test_cpu_accounting_of_a_session_and_of_a_process_tree():
    """A stack's processes share a session (start_new_session): session_cpu counts each of them, and
    nothing outside the session; tree_cpu_seconds adds up a process and its descendants."""
    with subprocess.Popen(
        [sys.executable, "-c", BURNER, BURNER], stdout=subprocess.PIPE, text=True, start_new_session=True
    ) as leader:
        try:
            assert leader.stdout is not None
            child_pid = int(leader.stdout.readline())
            assert leader.stdout.readline() == "idle\n"
            stats = {pid: proc_stat(pid) for pid in (leader.pid, child_pid)}
            for stat in stats.values():
                assert stat is not None and stat.session == leader.pid and 0.25 <= stat.cpu_s < 1.5, stat
            assert stats[child_pid].ppid == leader.pid and stats[leader.pid].ppid == os.getpid()
            in_session = session_cpu(leader.pid)
            assert set(in_session) == {leader.pid, child_pid}
            for pid, (comm, cpu_s) in in_session.items():
                assert comm == stats[pid].comm and cpu_s == pytest.approx(stats[pid].cpu_s, abs=0.02)
            both = stats[leader.pid].cpu_s + stats[child_pid].cpu_s
            assert tree_cpu_seconds(leader.pid) == pytest.approx(both, abs=0.04)
            assert tree_cpu_seconds(child_pid) == pytest.approx(stats[child_pid].cpu_s, abs=0.02)
            assert tree_cpu_seconds(os.getpid()) >= both  # an ancestor counts them too
        finally:
            os.killpg(leader.pid, signal.SIGKILL)
    assert proc_stat(leader.pid) is None and tree_cpu_seconds(leader.pid) is None


def test_own_seconds_counts_this_processs_cpu_not_its_waits():
    t0 = own_seconds()
    time.sleep(0.2)
    slept = own_seconds() - t0
    t1 = time.process_time()
    while time.process_time() - t1 < 0.2:
        pass
    burned = own_seconds() - t0 - slept
    assert slept < 0.05 and 0.19 <= burned < 0.3
