"""deploy/kubernetes: every object valid against Kubernetes' own schemas (kubernetes-validate bundles them,
no cluster needed), KEDA's ScaledObject against KEDA's CRD schema (keda.sh_scaledobjects.yaml beside this
file: config/crd/bases of github.com/kedacore/keda, commit 8b4f083c, Apache-2.0), and the manifests agreeing
with the code: the contract commands, the probes, the grace chain, the Postgres connection budget."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema_rs
import kubernetes_validate
import pytest
import yaml

from contract.settings import Settings
from jobstore.db import connection_plan
from tests.conftest import ROOT, gunicorn_conf
from tests.deployment.test_compose import exported_metrics

HERE = Path(__file__).parent
MANIFESTS = ROOT / "deploy/kubernetes"
VERSIONS = ("1.30.0", "1.37.0")  # the oldest Kubernetes these target, and the newest the validator knows
# Postgres' defaults: max_connections 100, superuser_reserved_connections 3
POSTGRES_AVAILABLE = 97


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization) -> dict[tuple[str, str], dict]:
    """Every object the kustomization applies, by (kind, name)."""
    found = {}
    for resource in kustomization["resources"]:
        for doc in yaml.safe_load_all((MANIFESTS / resource).read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, key
            found[key] = doc
    return found


def pod(objects, kind: str, name: str) -> dict:
    return objects[(kind, name)]["spec"]["template"]["spec"]


def container(objects, kind: str, name: str) -> dict:
    (only,) = pod(objects, kind, name)["containers"]
    return only


def strict(schema: dict) -> dict:
    """A CRD's schema rejecting unknown fields (the API server would drop them silently: a typo would pass)."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                if not node.get("x-kubernetes-preserve-unknown-fields"):
                    node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def keda_validator() -> jsonschema_rs.Draft7Validator:
    crd = yaml.safe_load((HERE / "keda.sh_scaledobjects.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return jsonschema_rs.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_kubernetes(objects, version):
    keda = keda_validator()
    for (kind, name), doc in objects.items():
        if doc["apiVersion"].startswith("keda.sh/"):
            errors = [f"{'/'.join(map(str, e.instance_path))}: {e.message}" for e in keda.iter_errors(doc)]
            assert errors == [], (kind, name, errors)
        else:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validators_reject_what_a_cluster_would(objects):
    """The controls: a misspelt field fails in a Deployment and in the ScaledObject."""
    deployment = copy.deepcopy(objects[("Deployment", "genq-api")])
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 40
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)
    scaled = copy.deepcopy(objects[("ScaledObject", "genq-worker")])
    scaled["spec"]["maxReplicas"] = 3
    assert not keda_validator().is_valid(scaled)


def test_the_pods_run_the_contract_commands(objects):
    commands = {
        ("Deployment", "genq-api"): ["gunicorn", "--bind", "0.0.0.0:8000", "webapi:create_app()"],
        ("Deployment", "genq-beat"): ["celery", "-A", "workers", "beat"],
        ("Deployment", "genq-flower"): [
            "celery",
            "-A",
            "workers",
            "flower",
            "--conf=workers/flowerconfig.py",
        ],
        ("Job", "genq-migrate"): ["alembic", "upgrade", "head"],
    }
    for (kind, name), prefix in commands.items():
        assert container(objects, kind, name)["command"][: len(prefix)] == prefix, name
    worker = container(objects, "Deployment", "genq-worker")["command"]
    assert worker[:7] == ["celery", "-A", "workers", "worker", "--pool", "threads", "--concurrency"]
    assert worker[8:10] == ["-Q", "generate"]


def test_probes_keep_liveness_and_readiness_apart(objects):
    api = container(objects, "Deployment", "genq-api")
    assert api["livenessProbe"]["httpGet"]["path"] == api["startupProbe"]["httpGet"]["path"] == "/livez"
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for kind, name in (
        ("Deployment", "genq-worker"),
        ("Deployment", "genq-beat"),
        ("Deployment", "genq-flower"),
    ):
        assert container(objects, kind, name)["livenessProbe"], name


def test_the_grace_chain_lets_gunicorn_end_its_streams(objects, tmp_path, monkeypatch):
    """preStop (the pod leaves the endpoints) + gunicorn's graceful_timeout < the kubelet's SIGKILL."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    graceful = gunicorn_conf()["graceful_timeout"]
    api_pod = pod(objects, "Deployment", "genq-api")
    sleep = api_pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    assert api_pod["terminationGracePeriodSeconds"] > int(sleep[1]) + graceful
    assert pod(objects, "Deployment", "genq-worker")["terminationGracePeriodSeconds"] == 120  # compose's 2m


def test_workers_take_a_gpu_and_scale_on_the_queue_depth(objects):
    worker = container(objects, "Deployment", "genq-worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"name": "DEVICE", "value": "cuda"} in worker["env"]
    scaled = objects[("ScaledObject", "genq-worker")]["spec"]
    assert scaled["scaleTargetRef"]["name"] == "genq-worker" and ("Deployment", "genq-worker") in objects
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus" and "genq_queue_depth" in trigger["metadata"]["query"]
    assert "genq_queue_depth" in exported_metrics()
    # only its own model's queue: another model's backlog starts no worker of this one (issue 40)
    config = objects[("ConfigMap", "genq")]["data"]
    served = config.get("MODEL_NAME") or config["MODEL"]
    assert f'genq_queue_depth{{model="{served}"}}' in trigger["metadata"]["query"]
    mounts = {m["mountPath"] for m in worker["volumeMounts"]}
    assert "/home/genq/.cache/triton" in mounts


def test_beat_is_one_replica_and_the_api_survives_a_drain(objects):
    beat = objects[("Deployment", "genq-beat")]["spec"]
    assert beat["replicas"] == 1 and beat["strategy"]["type"] == "Recreate"
    budget = objects[("PodDisruptionBudget", "genq-api")]["spec"]
    api = objects[("Deployment", "genq-api")]
    assert budget["minAvailable"] < api["spec"]["replicas"]
    assert budget["selector"]["matchLabels"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    for (kind, name), doc in objects.items():
        if kind == "Service":
            target = objects[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"].items() <= target.items(), name


def test_settings_and_images_are_the_ones_the_code_and_kustomization_know(objects, kustomization):
    """Every variable a ConfigMap or Secret sets is a setting (.env.example documents each)."""
    documented = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", (ROOT / ".env.example").read_text(), flags=re.M))
    settings = documented | {name.upper() for name in Settings.model_fields}
    for (kind, name), doc in objects.items():
        if kind in ("ConfigMap", "Secret"):
            data = doc.get("data") or doc.get("stringData")
            assert set(data) <= settings, (name, set(data) - settings)
    images = {i["name"] for i in kustomization["images"]}
    for (kind, name), doc in objects.items():
        if kind in ("Deployment", "Job"):
            for c in doc["spec"]["template"]["spec"]["containers"]:
                assert c["image"] in images, name
                for source in c.get("envFrom", []):
                    ref = source.get("secretRef") or source.get("configMapRef")
                    assert (("Secret" if "secretRef" in source else "ConfigMap"), ref["name"]) in objects


def test_the_deployment_fits_postgres_default_max_connections(objects):
    """What the API's start-up check (jobstore.db) will count, from the manifests' own numbers."""
    config = objects[("ConfigMap", "genq")]["data"]
    assert int(config["API_INSTANCES"]) == objects[("Deployment", "genq-api")]["spec"]["replicas"]
    assert (
        int(config["WORKER_INSTANCES"]) == objects[("ScaledObject", "genq-worker")]["spec"]["maxReplicaCount"]
    )
    plan = connection_plan(
        api_instances=int(config["API_INSTANCES"]),
        api_workers=int(config["API_WORKERS"]),
        api_pool_size=int(config["DB_POOL_SIZE"]),
        worker_instances=int(config["WORKER_INSTANCES"]),
    )
    assert sum(use.connections for use in plan) == 85 <= POSTGRES_AVAILABLE
