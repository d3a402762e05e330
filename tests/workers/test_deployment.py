"""docker-compose.yml, the Procfile and .env.example agree with each other and with the contract commands.

No Docker engine runs here, so the compose file is checked by reading it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from contract.settings import Settings
from tests.conftest import ROOT, gunicorn_conf

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
def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(ROOT / "Dockerfile"))


@pytest.fixture(scope="module")
def procfile() -> dict[str, str]:
    lines = (ROOT / "Procfile").read_text().splitlines()
    return dict(line.split(": ", 1) for line in lines if line.strip() and not line.startswith("#"))


def in_container(command: str) -> str:
    """The Procfile command as a container runs it: listening on all interfaces, the API on its container port
    (8000, where Prometheus scrapes it; API_PORT is the host's port in compose)."""
    return command.replace("--bind 127.0.0.1:", "--bind 0.0.0.0:").replace("${API_PORT:-8000}", "8000")


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


def run_instruction(dockerfile: DockerfileParser, words: str) -> str:
    """The one RUN instruction of the Dockerfile whose command contains `words`."""
    (found,) = [i["value"] for i in dockerfile.structure if i["instruction"] == "RUN" and words in i["value"]]
    return found


def test_only_worker_images_install_torch(dockerfile):
    """The image's torch step, run by bash with `pip` replaced by an echo, for each EXTRAS compose builds."""
    step = run_instruction(dockerfile, "torch==")
    args = dockerfile.args
    installs = {}
    for extras in ("api", "api,worker"):
        env = {
            "EXTRAS": extras,
            "TORCH_INDEX_URL": args["TORCH_INDEX_URL"],
            "TORCH_VERSION": args["TORCH_VERSION"],
        }
        ran = subprocess.run(
            ["bash", "-c", f'pip() {{ echo "pip $*"; }}\n{step}'],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        installs[extras] = ran.stdout.split()
    assert installs["api"] == []
    assert installs["api,worker"] == [
        "pip",
        "install",
        "--index-url",
        args["TORCH_INDEX_URL"],
        f"torch=={args['TORCH_VERSION']}",
    ]


def test_every_long_running_service_has_a_healthcheck_and_caches_are_writable(compose, dockerfile):
    services = compose["services"]
    for name, service in services.items():
        if name != "migrate":  # one-shot: its exit status is what others wait for
            assert service["healthcheck"]["test"], name
    mounts = {volume.split(":")[1] for volume in services["api"]["volumes"]}
    caches = {dockerfile.envs["HF_HOME"], dockerfile.envs["GENQ_KERNEL_CACHE"]}
    assert mounts == caches == {"/home/genq/.cache/huggingface", "/home/genq/.cache/genq"}
    # the image makes the mount points and gives them to its user before `USER genq`, so a new volume
    # mounted there starts owned by genq
    step = run_instruction(dockerfile, "useradd")
    commands = [shlex.split(c) for c in step.split("&&")]
    assert ["mkdir", "-p", "$HF_HOME", "$GENQ_KERNEL_CACHE", "$TRITON_CACHE_DIR"] in commands
    assert ["chown", "-R", "genq:genq", "/home/genq/.cache"] in commands
    order = [i["instruction"] + " " + i["value"] for i in dockerfile.structure]
    assert order.index(f"RUN {step}") < order.index("USER genq")
    assert dockerfile.structure[-1]["instruction"] == "CMD" and "USER genq" in order


@pytest.mark.parametrize("quota, cpus", [(None, None), (0.5, 1), (1.5, 2)])
def test_gunicorn_runs_two_processes_per_cpu_of_the_quota(monkeypatch, tmp_path, quota, cpus):
    """gunicorn.conf.py, executed as gunicorn does, under a container's CPU quota (or none)."""
    from contract import cpus as cpu_module

    monkeypatch.setattr(cpu_module, "cgroup_quota", lambda: quota)
    monkeypatch.delenv("API_WORKERS", raising=False)
    monkeypatch.delenv("COMPLETION_SLOTS", raising=False)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    conf = gunicorn_conf()
    affinity = len(os.sched_getaffinity(0))
    assert conf["workers"] == 2 * min(affinity, cpus or affinity)
    assert conf["worker_class"] == "webapi.gevent_worker.GeventWorker" and conf["preload_app"] is False


def test_gunicorn_runs_at_most_six_processes_on_a_big_host(monkeypatch, tmp_path):
    """64 CPUs: 6 processes (jobstore.db.API_WORKERS_CAP), not 128 x DB_POOL_SIZE Postgres connections;
    API_WORKERS still says how many."""
    from contract import cpus as cpu_module

    monkeypatch.setattr(cpu_module, "available_cpus", lambda: 64)
    monkeypatch.delenv("API_WORKERS", raising=False)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert gunicorn_conf()["workers"] == 6
    monkeypatch.setenv("API_WORKERS", "12")
    assert gunicorn_conf()["workers"] == 12


def dry_run(target: str) -> list[list[str]]:
    """The commands `make TARGET` would run, split into words (`make -n`: nothing runs)."""
    out = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip() and not line.startswith("#")]


def position(commands: list[list[str]], *words: str) -> int:
    """Where the first command containing all `words` (as words, in order) is."""
    for i, command in enumerate(commands):
        names = [w.rsplit("/", 1)[-1] for w in command]
        rest = iter(names)
        if all(w in rest for w in words):
            return i
    raise AssertionError(f"no command with {words}: {commands}")


def test_make_run_starts_services_migrates_then_the_procfile():
    commands = dry_run("run")
    steps = [
        position(commands, "bash", "services.sh"),
        position(commands, "honcho", "run", "genq", "db", "create"),
        position(commands, "honcho", "run", "alembic", "upgrade", "head"),
        position(commands, "honcho", "start"),
    ]
    assert steps == sorted(steps), commands


def test_make_test_starts_services_then_runs_the_whole_suite():
    commands = dry_run("test")
    assert position(commands, "bash", "services.sh") < position(commands, "bash", "run_tests.sh"), commands
    runner = (ROOT / "scripts" / "run_tests.sh").read_text()  # the engine's tests, then the rest
    assert " tests/batching " in runner and " tests --ignore=tests/batching " in runner
