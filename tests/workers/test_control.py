"""`celery -A workers inspect engine_stats`, typed as the README gives it, against a real worker."""

from __future__ import annotations

import json
import subprocess

from tests.conftest import BIN, ROOT, settings_env


def test_inspect_engine_stats_command_answers_from_the_worker(wide):
    done = subprocess.run(
        [BIN / "celery", "-A", "workers", "inspect", "engine_stats", "--json", "-d", wide.node, "-t", "10"],
        cwd=ROOT,
        env=settings_env(wide.settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    replies = json.loads(done.stdout.strip().splitlines()[-1])
    stats = replies[wide.node]
    assert stats["device"] == "cpu" and stats["dtype"] == "float32", stats
    assert stats["engine_pid"] > 0 and stats["engine_restarts"] == 0
    assert stats["device_blocks"] > 0 and stats["attention"] == "cpu_kernel" and not stats["cuda_graphs"]
    # what it holds follows the policy: 8 + 2 under predicted, 3 x 8 under preemptive
    assert stats["worker_capacity"] == wide.settings.worker_capacity(8) and "num_running" in stats


def test_worker_log_names_model_device_dtype_kv_blocks_and_attention_path(wide):
    """The first lines an operator reads say what the worker runs (logged once Celery's log works)."""
    runs = [line for line in wide.log.read_text().splitlines() if " runs tiny-llama on cpu/float32 " in line]
    assert len(runs) == 1, wide.log_text()
    assert "device + " in runs[0] and "host KV blocks" in runs[0] and "attention: cpu_kernel" in runs[0]
    assert f"holds up to {wide.settings.worker_capacity(8)} jobs" in runs[0]
