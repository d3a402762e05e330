"""Settings come from the environment, one object per component, with clear errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract.cpus import available_cpus, cgroup_quota
from contract.settings import ApiSettings, Settings, StoreSettings, WorkerSettings


def test_each_variable_is_read_by_its_upper_case_name(monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgresql://db.example/genq")
    monkeypatch.setenv("MAX_NUM_SEQS", "256")
    monkeypatch.setenv("LEASE_SECONDS", "12.5")
    monkeypatch.setenv("RATE_LIMIT", "5/second")
    worker = WorkerSettings.from_env()
    assert (worker.database_url, worker.max_num_seqs, worker.lease_seconds) == (
        "postgresql://db.example/genq",
        256,
        12.5,
    )
    assert ApiSettings.from_env().rate_limit == "5/second"


def test_an_empty_variable_means_the_default(monkeypatch):
    monkeypatch.setenv("MAX_NUM_SEQS", "")
    monkeypatch.setenv("MODEL", "")
    worker = WorkerSettings.from_env()
    assert worker.max_num_seqs is None and worker.model == "tiny-llama"


def test_a_bad_value_names_its_variable(monkeypatch):
    monkeypatch.setenv("MAX_NUM_SEQS", "lots")
    with pytest.raises(ValueError, match=r"MAX_NUM_SEQS='lots': Input should be a valid integer"):
        WorkerSettings.from_env()


def test_each_component_holds_only_its_own_settings():
    api, worker, store = (
        set(ApiSettings.model_fields),
        set(WorkerSettings.model_fields),
        set(StoreSettings.model_fields),
    )
    assert {"database_url", "redis_url", "model", "max_model_len"} <= store
    assert store <= api and store <= worker
    assert "max_num_seqs" not in api and "rate_limit" not in worker
    assert set(Settings.model_fields) == api | worker


def test_replace_validates_and_typos_are_refused():
    settings = Settings(lease_seconds=5.0)
    assert settings.replace(max_num_seqs="8").max_num_seqs == 8
    with pytest.raises(ValueError, match="lease_secs"):
        settings.replace(lease_secs=1)
    with pytest.raises(ValueError):
        settings.replace(max_num_seqs="many")


def test_cpu_quota_of_a_container(tmp_path: Path):
    """cgroup v2 `cpu.max` (and v1's quota/period files) cap the CPUs that processes are sized by."""
    v2, v1 = tmp_path / "cpu.max", (tmp_path / "quota", tmp_path / "period")
    v2.write_text("250000 100000\n")
    assert cgroup_quota(v2, v1) == 2.5
    v2.write_text("max 100000\n")
    assert cgroup_quota(v2, v1) is None
    v2.unlink()
    v1[0].write_text("-1\n")
    v1[1].write_text("100000\n")
    assert cgroup_quota(v2, v1) is None
    v1[0].write_text("50000\n")
    assert cgroup_quota(v2, v1) == 0.5
    assert 1 <= available_cpus()
