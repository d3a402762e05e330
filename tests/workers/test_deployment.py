"""docker-compose.yml, the Procfile and .env.example agree with each other and with the contract commands.

No Docker engine runs here, so the compose file is checked by reading it."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from jobstore.settings import Settings
from tests.conftest import ROOT

CONTRACT = {  # the contract commands (README, Procfile): each service's command starts like this
    "api": ["gunicorn"],
    "worker": ["celery", "-A", "workers", "worker", "--pool", "threads", "--concurrency"],
    "beat": ["celery", "-A", "workers", "beat"],
    "flower": ["celery", "-A", "workers", "flower"],
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def procfile() -> dict[str, str]:
    lines = (ROOT / "Procfile").read_text().splitlines()
    return dict(line.split(": ", 1) for line in lines if line.strip() and not line.startswith("#"))


def in_container(command: str) -> str:
    """The Procfile command as a container runs it: listening on all interfaces."""
    return command.replace("--bind 127.0.0.1:", "--bind 0.0.0.0:")


def test_procfile_runs_the_contract_commands(procfile):
    assert set(procfile) == set(CONTRACT)
    for name, prefix in CONTRACT.items():
        argv = shlex.split(procfile[name])
        assert argv[: len(prefix)] == prefix, name
    assert "webapi:create_app()" in shlex.split(procfile["api"])
    assert shlex.split(procfile["worker"])[-4:-2] == ["-Q", "generate"]


def test_compose_services_run_the_procfile_commands(compose, procfile):
    services = compose["services"]
    assert {"postgres", "redis", "migrate", "api", "worker", "worker-cpu", "beat", "flower"} <= set(services)
    for name, command in procfile.items():
        assert services[name]["command"] == in_container(command), name
    assert services["worker-cpu"]["command"] == services["worker"]["command"]
    assert services["migrate"]["command"] == "alembic upgrade head"


def test_compose_ordering_health_and_gpu(compose):
    services = compose["services"]
    for name in ("postgres", "redis", "api", "worker", "worker-cpu", "flower"):
        assert services[name]["healthcheck"]["test"], name
    assert services["migrate"]["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert services["migrate"]["restart"] == "no"
    for name in ("api", "worker", "worker-cpu", "beat"):
        assert services[name]["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}, (
            name
        )
        assert services[name]["depends_on"]["redis"] == {"condition": "service_healthy"}, name
    [gpu] = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["capabilities"] == ["gpu"] and services["worker"]["environment"]["DEVICE"] == "cuda"
    assert "deploy" not in services["worker-cpu"] and services["worker-cpu"]["environment"]["DEVICE"] == "cpu"
    assert services["worker"]["profiles"] == ["gpu"] and services["worker-cpu"]["profiles"] == ["cpu"]
    for name in ("migrate", "api", "worker", "beat", "flower"):
        env = services[name]["environment"]
        assert "@postgres:5432/" in env["DATABASE_URL"] and env["REDIS_URL"].startswith("redis://redis:6379")


def test_env_example_documents_every_setting():
    text = (ROOT / ".env.example").read_text()
    documented = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", text, flags=re.M))
    assert {name.upper() for name in Settings.model_fields} <= documented
    used = set(
        re.findall(
            r"\$\{([A-Z][A-Z0-9_]+)",
            (ROOT / "docker-compose.yml").read_text() + (ROOT / "Procfile").read_text(),
        )
    )
    assert used <= documented
    assert {"FLOWER_BASIC_AUTH", "HF_TOKEN"} <= documented


def test_the_gpu_profile_builds_cuda_torch_and_the_default_profile_matches_its_torch():
    """`cp .env.example .env && docker compose up` must not run a CUDA worker on a CPU build of torch."""
    compose_file = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose_file["services"]
    gpu_index = services["worker"]["build"]["args"]["TORCH_INDEX_URL"]
    assert "/cu" in gpu_index and services["worker"]["image"] != services["worker-cpu"]["image"]
    env = dict(re.findall(r"^([A-Z_]+)=(.*)$", (ROOT / ".env.example").read_text(), flags=re.M))
    assert env["COMPOSE_PROFILES"] == "cpu" and env["TORCH_INDEX_URL"].endswith("/cpu")
    assert "/cu" in env["CUDA_TORCH_INDEX_URL"]
    assert services["api"]["build"]["args"]["EXTRAS"] == "api"  # the API's image has no torch
    assert "*,worker,*) pip install" in (ROOT / "Dockerfile").read_text()


def test_every_long_running_service_has_a_healthcheck_and_caches_are_writable(compose):
    services = compose["services"]
    for name, service in services.items():
        if name != "migrate":  # one-shot: its exit status is what others wait for
            assert service["healthcheck"]["test"], name
    dockerfile = (ROOT / "Dockerfile").read_text()
    mounts = {volume.split(":")[1] for volume in services["api"]["volumes"]}
    assert mounts == {"/home/genq/.cache/huggingface", "/home/genq/.cache/genq"}
    # the image makes the mount points and gives them to its user before `USER genq`
    assert 'mkdir -p "$HF_HOME" "$GENQ_KERNEL_CACHE"' in dockerfile
    assert "chown -R genq:genq /home/genq/.cache" in dockerfile
    assert dockerfile.index("chown -R genq") < dockerfile.index("USER genq")
    assert "HF_HOME=/home/genq/.cache/huggingface" in dockerfile
    assert "GENQ_KERNEL_CACHE=/home/genq/.cache/genq" in dockerfile


def test_gunicorn_processes_follow_the_cpu_quota():
    text = (ROOT / "gunicorn.conf.py").read_text()
    assert "2 * available_cpus()" in text and "cpu_count()" not in text
