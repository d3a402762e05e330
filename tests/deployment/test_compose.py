"""docker-compose.yml as `docker compose config` reads it after `cp .env.example .env`: every variable
interpolated the way Compose does, then checked against the Compose Specification's JSON schema.

Compose v2 cannot be installed from the registries this project reaches (Debian bookworm ships only
docker-compose 1.29, the Python v1, and no docker-compose-plugin; PyPI and npm have no official build),
so this is the same check without it: compose-spec.json beside this file is
schema/compose-spec.json of github.com/compose-spec/compose-spec (commit 170098ba, Apache-2.0), the schema
Compose v2 validates against. scripts/compose_smoke.sh runs the real thing where a Docker daemon runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema_rs
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from contract.dispatch import model_queue
from contract.settings import Settings
from tests.conftest import ROOT, gunicorn_conf

HERE = Path(__file__).parent
# Compose's interpolation: $$ (a literal $), ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
# ${VAR?error}, ${VAR:+other}, ${VAR+other}, $VAR
VARIABLE = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
BRACED = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?$", re.S)


class Unset(Exception):
    """A ${VAR:?error} or ${VAR?error} whose variable is unset (or empty, with the colon): compose stops."""


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a .env file (comments and blank lines skipped), as compose reads them."""
    pairs = (
        line.split("=", 1) for line in path.read_text().splitlines() if re.match(r"^[A-Za-z_]\w*=", line)
    )
    return {key: value.strip() for key, value in pairs}


def interpolate(value, env: dict[str, str]):
    """`value` (a parsed YAML tree) with every string's variables replaced, as compose does."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match) -> str:
        if match["dollar"]:
            return "$"
        if match["named"]:
            return env.get(match["named"], "")
        parts = BRACED.match(match["braced"])
        assert parts, f"not a Compose variable: ${{{match['braced']}}}"
        name, op, arg = parts["name"], parts["op"], parts["arg"]
        current = env.get(name)
        present = current is not None and (current != "" or not (op or "").startswith(":"))
        if op in (":-", "-"):
            return current if present else arg
        if op in (":?", "?"):
            if not present:
                raise Unset(f"{name}: {arg}")
            return current
        if op in (":+", "+"):
            return arg if present else ""
        return current or ""

    return VARIABLE.sub(replace, value)


def compose_config(env: dict[str, str]) -> dict:
    """docker-compose.yml parsed (anchors and merge keys resolved) and interpolated with `env`."""
    return interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), env)


@pytest.fixture(scope="module")
def env_file() -> dict[str, str]:
    return read_env_file(ROOT / ".env.example")


@pytest.fixture(scope="module")
def config(env_file) -> dict:
    return compose_config(env_file)


def test_the_interpolation_reads_variables_as_compose_does():
    env = {"SET": "x", "EMPTY": ""}
    assert (
        interpolate("$$HOSTNAME ${SET} $SET ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${SET:+y}", env)
        == "$HOSTNAME x x d d  y"
    )
    with pytest.raises(Unset, match="EMPTY: say"):
        interpolate("${EMPTY:?say}", env)


def test_compose_config_works_with_env_example_as_shipped_and_with_no_env_file(config, env_file):
    """`cp .env.example .env && docker compose config`: no variable stops it, the file is valid Compose."""
    validator = jsonschema_rs.Draft7Validator(json.loads((HERE / "compose-spec.json").read_text()))
    for env in (env_file, {}):  # also a fresh clone with no .env at all
        document = compose_config(env)
        errors = [
            f"{'/'.join(map(str, e.instance_path))}: {e.message}" for e in validator.iter_errors(document)
        ]
        assert errors == [], errors
    assert env_file["COMPOSE_PROFILES"] == "cpu"
    active = {
        name for name, s in config["services"].items() if not s.get("profiles") or "cpu" in s["profiles"]
    }
    assert {
        "postgres",
        "redis",
        "migrate",
        "api",
        "worker-cpu",
        "beat",
        "flower",
        "prometheus",
        "grafana",
    } == active


def test_the_validation_catches_what_compose_refuses(env_file):
    """The control: a key Compose does not know, and a required variable left empty, both fail."""
    validator = jsonschema_rs.Draft7Validator(json.loads((HERE / "compose-spec.json").read_text()))
    document = compose_config(env_file)
    document["services"]["api"]["stop_grace"] = "35s"
    assert not validator.is_valid(document)
    with pytest.raises(Unset):
        interpolate({"FLOWER_BASIC_AUTH": "${FLOWER_BASIC_AUTH:?set it}"}, env_file)


def test_files_the_services_mount_exist(config):
    for name, service in config["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), (name, source)


def test_prometheus_scrapes_the_api_and_every_worker(config, env_file):
    scrape = yaml.safe_load((ROOT / "deploy/compose/prometheus.yml").read_text())["scrape_configs"]
    targets = {job["job_name"]: job["dns_sd_configs"][0] for job in scrape}
    api_port = int(config["services"]["api"]["command"].split("--bind 0.0.0.0:")[1].split()[0])
    assert targets["genq-api"]["names"] == ["api"] and targets["genq-api"]["port"] == api_port
    # every worker service, whatever its profile (gpu, cpu, second-model), is a target on its metrics port
    workers = sorted(
        name for name, service in config["services"].items() if "workers worker" in service.get("command", "")
    )
    assert workers == ["worker", "worker-cpu", "worker-second-model"]
    assert sorted(targets["genq-worker"]["names"]) == workers
    for name in workers:
        assert (
            container_settings(config, env_file, name).worker_metrics_port == targets["genq-worker"]["port"]
        )
    assert "prometheus" in config["services"]["grafana"]["depends_on"]


def container_settings(config: dict, env_file: dict[str, str], service: str) -> Settings:
    """The settings a service's container reads: .env (env_file) overridden by the service's `environment` (an
    empty value is the default, as the settings read the environment: env_ignore_empty)."""
    env = {**env_file, **config["services"][service]["environment"]}
    return Settings(
        **{k.lower(): v for k, v in env.items() if k.lower() in Settings.model_fields and v != ""}
    )


def test_the_second_models_worker_serves_its_own_queue_and_labels_its_metrics_with_it(config, env_file):
    """The `second-model` profile's worker serves another name than the default model's worker, so its jobs,
    its queue and its metrics' `model` label (workers/metrics.py) are its own."""
    default = container_settings(config, env_file, "worker-cpu")
    second = container_settings(config, env_file, "worker-second-model")
    assert config["services"]["worker-second-model"]["profiles"] == ["second-model"]
    assert second.served_model_name() != default.served_model_name()
    assert second.fleet_default_model() == default.fleet_default_model() == default.served_model_name()
    assert model_queue(second, second.served_model_name()) == f"generate.{second.served_model_name()}"
    assert model_queue(default, default.served_model_name()) == "generate"


def exported_metrics() -> set[str]:
    """The metric names webapi/metrics.py and workers/metrics.py export."""
    source = (ROOT / "webapi/metrics.py").read_text() + (ROOT / "workers/metrics.py").read_text()
    return set(re.findall(r'"(genq_[a-z_]+)"', source))


def test_the_dashboard_shows_what_operators_watch_with_the_names_the_code_exports():
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/genq.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {
        re.sub(r"_(bucket|sum|count)$", "", name) for e in exprs for name in re.findall(r"genq_[a-z_]+", e)
    }
    exported = exported_metrics()
    assert used <= exported, used - exported
    for metric in (
        "genq_queue_depth",  # queue depth per priority
        "genq_engine_generated_tokens_total",  # tok/s
        "genq_job_ttft_seconds",
        "genq_job_time_between_tokens_seconds",  # ITL
        "genq_engine_device_kv_usage",
        "genq_engine_preemptions_total",
        "genq_jobs",  # jobs by status
    ):
        assert metric in used, metric
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    provider = yaml.safe_load((ROOT / "deploy/compose/grafana/provisioning/dashboards/genq.yml").read_text())
    mounts = dict(
        v.split(":")[:2]
        for v in yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]["volumes"]
    )
    assert mounts["./deploy/grafana/dashboards"] == provider["providers"][0]["options"]["path"]


def seconds(duration: str) -> float:
    """A Compose duration (`35s`, `2m`, `1m30s`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_the_api_gets_longer_than_gunicorn_drains_its_streams(config, tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    graceful = gunicorn_conf()["graceful_timeout"]
    assert seconds(config["services"]["api"]["stop_grace_period"]) > graceful == 30
    healthcheck = config["services"]["api"]["healthcheck"]["test"]
    assert "/readyz" in healthcheck[-1]


def test_genq_services_run_under_an_init_that_passes_sigterm_on(config):
    """PID 1 ignores a signal it has no handler for: without an init, a stop during start-up waits out the grace."""
    genq = [
        name for name, service in config["services"].items() if service.get("image", "").startswith("genq:")
    ]
    assert len(genq) >= 7, genq
    for name in genq:
        assert config["services"][name].get("init") is True, name


def test_workers_keep_the_triton_cache_in_a_volume(config):
    cache = DockerfileParser(path=str(ROOT / "Dockerfile")).envs["TRITON_CACHE_DIR"]
    for name in ("worker", "worker-cpu"):
        mounts = {v.split(":")[1]: v.split(":")[0] for v in config["services"][name]["volumes"]}
        assert mounts[cache] == "triton-cache", name
    assert "triton-cache" in config["volumes"]


def test_the_image_installs_through_the_lock_less_its_torch_and_triton_pins(tmp_path):
    """The Dockerfile's install step, run by bash with pip replaced by a copy of the constraints it is given:
    a CUDA build of torch brings its own triton, so the lock (resolved against CPU torch) must not pin it."""
    dockerfile = DockerfileParser(path=str(ROOT / "Dockerfile"))
    (step,) = [
        i["value"] for i in dockerfile.structure if i["instruction"] == "RUN" and "constraints" in i["value"]
    ]
    lock = (ROOT / "constraints.txt").read_text()
    (tmp_path / "constraints.txt").write_text(lock)
    script = step.replace("/tmp/", f"{tmp_path}/").replace("mkdir batching jobstore webapi workers", "true")
    fake_pip = f'pip() {{ if [ "$1" = install ]; then cp "$3" {tmp_path}/used.txt; fi; }}\n'
    subprocess.run(
        ["bash", "-ec", fake_pip + script],
        cwd=tmp_path,
        env={"EXTRAS": "api,worker", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    used = (tmp_path / "used.txt").read_text().splitlines()
    pins = {line.split("==")[0] for line in used if "==" in line and not line.startswith(" ")}
    assert not pins & {"torch", "triton"}
    expected = {
        line.split("==")[0] for line in lock.splitlines() if "==" in line and not line.startswith(" ")
    }
    assert pins == expected - {"torch", "triton"}
    assert shlex.split(step)[0] == "mkdir"


def test_redis_never_evicts_the_queues(config):
    assert "--maxmemory-policy noeviction" in config["services"]["redis"]["command"]


@pytest.mark.timeout(1800)
@pytest.mark.skipif(
    os.environ.get("GENQ_COMPOSE_SMOKE") != "1",
    reason="GENQ_COMPOSE_SMOKE=1 runs scripts/compose_smoke.sh (minutes: builds and starts the compose stack)",
)
def test_the_compose_stack_runs_readmes_flow():
    """scripts/compose_smoke.sh against a real Docker daemon: the CPU profile built and started, a key, a job
    that succeeds, the probes, Prometheus scraping the API and the worker, a clean stop. Its "skipped: <reason>"
    (no daemon, no Compose, no images) is this test's skip."""
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/compose_smoke.sh")], capture_output=True, text=True, timeout=1700
    )
    output = run.stdout + run.stderr
    skipped = [line for line in run.stdout.splitlines() if line.startswith("skipped: ")]
    if run.returncode == 0 and skipped:
        pytest.skip(skipped[-1])
    assert run.returncode == 0, output[-6000:]
    assert "compose smoke passed" in run.stdout, output[-6000:]
    stopped = [line for line in run.stdout.splitlines() if line.startswith("stopped in ")]
    assert stopped and "=137" not in stopped[0], stopped  # every service stopped within its grace
