"""The Kubernetes manifests (deploy/k8s): every overlay renders with `kubectl kustomize`,
every object passes the Kubernetes schemas (kubernetes-validate, strict: an unknown field
fails) and KEDA's own CRD schemas, and every container starts a real CLI with flags it
accepts, as the compose check does. Then what the objects mean: the names they point at
exist, probes and requests are there, the worker's drain fits its grace period, KEDA reads
the keys the workers write, the GPU overlay asks for a GPU and refuses a CPU fallback, and
the shard group's pods can find rank 0.
"""

from __future__ import annotations

import copy
import functools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml  # type: ignore[import-untyped]

from common import mesh_state
from devmesh import compose_check
from tests.deploy.test_entrypoints import ROLES, SETTINGS, check_cli
from worker.settings import WorkerSettings

K8S = compose_check.DEPLOY / "k8s"
OVERLAYS = ["cpu", "gpu", "tp"]
# The oldest release these manifests need (gRPC probes GA 1.27; the StatefulSet pod-index
# label, which the tp overlay reads, 1.28) and the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.28.0", "1.37.0"]
KEDA_KINDS = {"ScaledObject": "scaledobjects", "TriggerAuthentication": "triggerauthentications"}
WORKLOADS = {"Deployment", "StatefulSet"}


def kubectl() -> str:
    return str(Path(sys.executable).with_name("kubectl"))


@functools.cache
def _render(overlay: str) -> str:
    result = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects, as `kubectl kustomize` renders them (a fresh copy each call)."""
    return [d for d in yaml.safe_load_all(_render(overlay)) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The CRD's schema as the API server applies it to a typo: unknown fields refused."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def keda_schema(kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((K8S / "schemas" / f"keda.sh_{KEDA_KINDS[kind]}.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return strict(version["schema"]["openAPIV3Schema"])


def validate(doc: dict[str, Any]) -> None:
    if doc["kind"] in KEDA_KINDS:
        assert doc["apiVersion"] == "keda.sh/v1alpha1"
        jsonschema.validate(doc, keda_schema(doc["kind"]))
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for doc in docs:
        if doc["kind"] in WORKLOADS:
            yield doc, doc["spec"]["template"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"].get("initContainers", []) + pod["spec"]["containers"]


def argv(container: dict[str, Any]) -> list[str]:
    return container.get("command", []) + container.get("args", [])


def flag(args: list[str], name: str, default: str | None = None) -> str | None:
    return args[args.index(name) + 1] if name in args else default


def env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert found, f"no {kind} {name}"
    return found[0]


def selects(selector: dict[str, str], docs: list[dict[str, Any]]) -> bool:
    return any(
        selector.items() <= pod["metadata"]["labels"].items() for _, pod in pod_templates(docs)
    )


# -- schemas --------------------------------------------------------------------------------


def test_every_object_passes_the_schemas(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "ScaledObject"}
    for doc in docs:
        validate(doc)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "meshserve"


def test_validation_catches_a_bad_manifest() -> None:
    docs = render("cpu")
    worker = copy.deepcopy(find(docs, "Deployment", "meshserve-worker"))
    probe = worker["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        validate(worker)
    scaled = copy.deepcopy(find(docs, "ScaledObject", "meshserve-worker"))
    scaled["spec"]["scaleTargetRef"] = {"nam": "meshserve-worker"}
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


# -- commands, environment, images ------------------------------------------------------------


def test_every_container_runs_a_real_cli(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = overlay
    started = set()
    for workload, pod in pod_templates(docs):
        for c in containers(pod):
            where = f"{name}: {workload['metadata']['name']}/{c['name']}"
            defined: set[str] = set()
            for e in c.get("env", []):  # $(VAR) expands only variables defined before it
                for ref in re.findall(r"\$\(([A-Z_]+)\)", e.get("value", "")):
                    assert ref in defined, f"{where}: {e['name']} uses $({ref}) before it is set"
                defined.add(e["name"])
                prefix = next((p for p in SETTINGS if e["name"].startswith(p)), None)
                if prefix:
                    field = e["name"].removeprefix(prefix).lower()
                    known = SETTINGS[prefix].model_fields
                    assert field in known, f"{where}: {e['name']} sets nothing"
            for ref in re.findall(r"\$\(([A-Z_]+)\)", " ".join(argv(c))):
                assert ref in defined, f"{where}: the command uses $({ref}), never set"
            if not c["image"].startswith("meshserve/"):
                continue
            module = check_cli(argv(c), where)
            started.add(module)
            role = c["image"].removeprefix("meshserve/").split(":")[0]
            assert role in ROLES, f"{where}: no deploy/Dockerfile.{role}"
            assert ROLES[role][1] == module, f"{where}: image {role} does not run {module}"
            assert c.get("resources", {}).get("requests"), f"{where}: no resource requests"
    assert {"router", "worker", "ledger"} <= started


# -- what the objects mean ----------------------------------------------------------------------


def test_services_and_budgets_select_pods(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    for doc in docs:
        if doc["kind"] == "Service":
            assert selects(doc["spec"]["selector"], docs), doc["metadata"]["name"]
        if doc["kind"] == "PodDisruptionBudget":
            assert selects(doc["spec"]["selector"]["matchLabels"], docs), doc["metadata"]["name"]
    budgets = {d["metadata"]["name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert {"meshserve-router", "meshserve-worker"} <= budgets


def test_routers_are_replicated_with_ids_of_their_own(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    router = find(docs, "Deployment", "meshserve-router")
    assert router["spec"]["replicas"] >= 2
    (c,) = router["spec"]["template"]["spec"]["containers"]
    assert env(c)["MESHSERVE_ROUTER_ROUTER_ID"]["value"] == "$(POD_NAME)"
    assert env(c)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert find(docs, "Service", "meshserve")["spec"]["ports"][0]["port"] == 8001


def test_grpc_servers_are_probed_on_grpc_health(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    for workload, pod in pod_templates(docs):
        for c in pod["spec"]["containers"]:
            args = argv(c)
            if args[:3] in (["python", "-m", "router"], ["python", "-m", "worker"]):
                port = int(flag(args, "--port") or 0)
                for probe in ("readinessProbe", "livenessProbe"):
                    assert c[probe]["grpc"]["port"] == port, workload["metadata"]["name"]
            else:
                assert "readinessProbe" in c, workload["metadata"]["name"]


def test_worker_drain_fits_the_grace_period(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    defaults = WorkerSettings()
    for workload, pod in pod_templates(docs):
        for c in pod["spec"]["containers"]:
            args = argv(c)
            if args[:3] != ["python", "-m", "worker"]:
                continue
            grace = float(flag(args, "--grace-seconds", str(defaults.grace_seconds)) or 0)
            drain = defaults.drain_seconds
            period = pod["spec"].get("terminationGracePeriodSeconds", 30)
            assert period >= drain + grace + 5, workload["metadata"]["name"]


def test_keda_scales_the_workers_on_the_keys_they_write(
    overlay: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = overlay
    scaled = find(docs, "ScaledObject", "meshserve-worker")
    target = find(docs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    assert target["metadata"]["name"] == "meshserve-worker"
    lists = set()
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "redis"
        find(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
        meta = trigger["metadata"]
        assert meta["address"] == "redis.meshserve.svc.cluster.local:6379"
        assert int(meta["listLength"]) > 0
        lists.add(meta["listName"])
    auth = find(docs, "TriggerAuthentication", "meshserve-redis")
    assert auth["spec"]["secretTargetRef"][0]["parameter"] == "password"
    # mlp is served by the worker image (devmesh/toy_models.py); smollm2 is the LLM.
    assert mesh_state.scale_queue_key("mlp") in lists
    assert {mesh_state.scale_queue_key("smollm2"), mesh_state.scale_kv_key("smollm2")} <= lists
    redis = find(docs, "Service", "redis")
    assert redis["metadata"]["namespace"] == "meshserve"
    assert redis["spec"]["ports"][0]["port"] == 6379


def test_gpu_overlay_requests_a_gpu_and_refuses_a_cpu_fallback() -> None:
    docs = render("gpu")
    (c,) = find(docs, "Deployment", "meshserve-worker")["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("meshserve/worker-gpu:")
    assert "--require-gpu" in argv(c) and flag(argv(c), "--providers") == "cuda"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    cpu = render("cpu")
    (c,) = find(cpu, "Deployment", "meshserve-worker")["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_tp_overlay_forms_one_group_across_its_pods() -> None:
    docs = render("tp")
    group = find(docs, "StatefulSet", "meshserve-tp")
    service = find(docs, "Service", group["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    pod = group["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    args = argv(c)
    assert int(flag(args, "--tp") or 0) == group["spec"]["replicas"] == 2
    name = group["metadata"]["name"]
    assert flag(args, "--tp-master-addr") == f"{name}-0.{service['metadata']['name']}"
    port = int(flag(args, "--tp-master-port") or 0)
    assert port in {p["containerPort"] for p in c["ports"]}
    assert port in {p["port"] for p in service["spec"]["ports"]}
    rank = env(c)["MESHSERVE_WORKER_TP_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert rank == "metadata.labels['apps.kubernetes.io/pod-index']"
    # The init container writes the shard set the ranks serve, for this --tp.
    (init,) = pod["spec"]["initContainers"]
    assert flag(argv(init), "--output") == flag(args, "--model-repository")
    assert flag(argv(init), "--tp") == flag(args, "--tp")
    assert init["image"].startswith("meshserve/build:")
