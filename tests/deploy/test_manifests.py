"""The deployment files: `deploy/serve_config.yaml`, `deploy/k8s/*.yaml`, `Dockerfile`.

The Serve config starts the real application with `serve run` (a local Ray cluster, a
real Redis, the official `openai` client). The Kubernetes manifests cannot be applied
here (no cluster, no GPU, no Docker engine), so they are checked for what `kubectl
apply` would not catch: dangling names, selectors that match no pod, images other than
the one the Dockerfile builds, containers without resource requests, and an embedded
Serve config that `app_builder` would reject or that asks for more GPU pods than exist.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from pdserve.cluster.config import ClusterConfig
from pdserve.deploy.redis_server import EmbeddedRedis, free_port, wait_session_empty

REPO_DIR = Path(__file__).resolve().parents[2]
SERVE_CONFIG = REPO_DIR / "deploy" / "serve_config.yaml"
K8S_DIR = REPO_DIR / "deploy" / "k8s"
DOCKERFILE = REPO_DIR / "Dockerfile"

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 90.0
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
# Kinds whose pod template sits at spec.template.
TEMPLATED_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}

Doc = dict[str, Any]


# --- `serve run deploy/serve_config.yaml` ------------------------------------------------


def render_serve_config(model_dir: Path, redis_url: str, port: int, out: Path) -> Path:
    """The repository's Serve config with only what this machine must change overridden.

    1 prefill + 1 decode replica asking for no Ray CPUs, so the app fits 2 busy cores.
    """
    config = yaml.safe_load(SERVE_CONFIG.read_text())
    config["http_options"]["port"] = port
    (app,) = config["applications"]
    app["args"].update(
        model=str(model_dir),
        redis_url=redis_url,
        prefill_replicas=1,
        decode_replicas=1,
        replica_num_cpus=0,
    )
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def _log_tail(log_path: Path, num_chars: int = 6000) -> str:
    return log_path.read_text(errors="replace")[-num_chars:]


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> Any:
    """Poll GET /health until 200 (every pool has a live worker) or the deadline."""
    deadline = time.monotonic() + START_TIMEOUT_S
    last: object = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve run exited with {proc.returncode}:\n{_log_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError) as exc:  # HTTPError (503) is a URLError
            last = exc
        time.sleep(0.5)
    tail = _log_tail(log_path)
    raise AssertionError(f"not healthy within {START_TIMEOUT_S:g}s ({last}):\n{tail}")


def _stop(proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Ctrl-C, as a user stops `serve run`; then nothing of its session may remain."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = None
    left = wait_session_empty(proc.pid)
    if code is None or left:
        os.killpg(proc.pid, signal.SIGKILL)  # never leave a Ray cluster on a shared box
        proc.wait()
    assert code is not None, f"serve run did not stop within {STOP_TIMEOUT_S:g}s"
    assert not left, f"serve run left processes behind: {left}"
    assert code == 0, f"serve run exited with {code}:\n{_log_tail(log_path)}"


@pytest.fixture
def serve_run(demo_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    """`serve run` on the rendered config, with its own Redis; yields the base URL."""
    with EmbeddedRedis() as redis_server:
        port = free_port()
        config_path = render_serve_config(
            demo_model_dir, redis_server.url, port, tmp_path / "serve_config.yaml"
        )
        serve_cli = Path(sys.executable).with_name("serve")
        # `--address local`: a fresh local Ray cluster, never one somebody else started.
        argv = [str(serve_cli), "run", "--address", "local", str(config_path)]
        env = {**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
        env["OMP_NUM_THREADS"] = "1"
        env.pop("RAY_ADDRESS", None)
        log_path = tmp_path / "serve-run.log"
        with log_path.open("wb") as log:  # a file, not a pipe: Ray's logs can never block it
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        try:
            url = f"http://127.0.0.1:{port}"
            health = _wait_healthy(url, proc, log_path)
            assert health["workers"] == {"prefill": 1, "decode": 1}, health
            yield url
        finally:
            _stop(proc, log_path)


def test_serve_run_starts_the_app_from_the_config_file(serve_run: str) -> None:
    client = openai.OpenAI(base_url=f"{serve_run}/v1", api_key="unused", timeout=120, max_retries=0)
    (model,) = client.models.list().data
    out = client.completions.create(
        model=model.id, prompt="The river", max_tokens=4, temperature=0.0
    )
    assert out.usage is not None and out.usage.completion_tokens >= 1
    assert out.choices[0].finish_reason in ("length", "stop")


def test_serve_config_validates() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_CONFIG.read_text()))
    (app,) = config.applications
    assert app.import_path == "pdserve.deploy.app:app_builder"
    ClusterConfig.model_validate(app.args)


# --- Kubernetes manifests ---------------------------------------------------------------


def load_manifests() -> list[Doc]:
    docs: list[Doc] = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


@pytest.fixture(scope="module")
def manifests() -> list[Doc]:
    return load_manifests()


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def pod_templates(doc: Doc) -> list[Doc]:
    """Every pod template in a manifest, including a RayService's head and worker groups."""
    spec = doc.get("spec", {})
    if doc["kind"] in TEMPLATED_KINDS:
        return [spec["template"]]
    if doc["kind"] == "CronJob":
        return [spec["jobTemplate"]["spec"]["template"]]
    if doc["kind"] in ("RayService", "RayCluster"):
        cluster = spec["rayClusterConfig"] if doc["kind"] == "RayService" else spec
        groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
        return [group["template"] for group in groups]
    if doc["kind"] == "Pod":
        return [doc]
    return []


def all_templates(docs: list[Doc]) -> list[Doc]:
    return [t for doc in docs for t in pod_templates(doc)]


def containers(template: Doc) -> list[Doc]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def labels_match(selector: dict[str, str], template: Doc) -> bool:
    labels = template.get("metadata", {}).get("labels", {})
    return all(labels.get(key) == value for key, value in selector.items())


def ray_service(docs: list[Doc]) -> Doc:
    (service,) = of_kind(docs, "RayService")
    return service


def serve_config(docs: list[Doc]) -> ServeDeploySchema:
    text = ray_service(docs)["spec"]["serveConfigV2"]
    return ServeDeploySchema.model_validate(yaml.safe_load(text))


def dockerfile_image() -> str:
    """The tag the Dockerfile's build instructions name (`docker build -t IMAGE .`)."""
    match = re.search(r"docker build -t (\S+) \.", DOCKERFILE.read_text())
    assert match, "the Dockerfile names no `docker build -t IMAGE .` command"
    return match.group(1)


def test_manifests_parse_with_unique_names(manifests: list[Doc]) -> None:
    assert {"RayService", "Deployment", "Service", "PersistentVolumeClaim"} <= {
        doc["kind"] for doc in manifests
    }
    keys = [(doc["kind"], doc["metadata"]["name"]) for doc in manifests]
    assert len(keys) == len(set(keys)), keys
    assert all(doc["apiVersion"] for doc in manifests)
    assert ray_service(manifests)["apiVersion"] == "ray.io/v1"


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


def test_every_image_is_the_one_the_dockerfile_builds(manifests: list[Doc]) -> None:
    image = dockerfile_image()
    version = tomllib.loads((REPO_DIR / "pyproject.toml").read_text())["project"]["version"]
    assert image.rsplit(":", 1)[1] == version, "the image tag is not the package version"
    images = {c["image"] for t in all_templates(manifests) for c in containers(t)}
    assert images == {image}


def test_ray_versions_agree(manifests: list[Doc]) -> None:
    """The base image's Ray, the RayService's rayVersion and the Ray tests run on."""
    match = re.search(r"^ARG RAY_VERSION=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)
    assert match
    ray_version = ray_service(manifests)["spec"]["rayClusterConfig"]["rayVersion"]
    assert match.group(1) == ray_version == ray.__version__


def test_selectors_match_pod_templates(manifests: list[Doc]) -> None:
    templates = all_templates(manifests)
    for service in of_kind(manifests, "Service"):
        matched = [t for t in templates if labels_match(service["spec"]["selector"], t)]
        assert matched, f"Service {service['metadata']['name']} selects no pod template"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for template in matched:
                declared = [p for c in containers(template) for p in c.get("ports", [])]
                assert any(target in (p.get("name"), p["containerPort"]) for p in declared), (
                    f"Service {service['metadata']['name']}: no container port {target}"
                )
    for doc in manifests:
        if doc["kind"] in TEMPLATED_KINDS - {"Job"}:
            assert labels_match(doc["spec"]["selector"]["matchLabels"], doc["spec"]["template"])
    for policy in of_kind(manifests, "NetworkPolicy"):
        selectors = [policy["spec"]["podSelector"]["matchLabels"]]
        for rule in policy["spec"].get("ingress", []):
            selectors += [p["podSelector"]["matchLabels"] for p in rule.get("from", [])]
        for selector in selectors:
            assert any(labels_match(selector, t) for t in templates), (policy, selector)


def _references(template: Doc) -> Iterator[tuple[str, str]]:
    """(kind, name) of every ConfigMap, Secret and PVC a pod template uses."""
    for volume in template["spec"].get("volumes", []):
        if "persistentVolumeClaim" in volume:
            yield "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]
        if "configMap" in volume:
            yield "ConfigMap", volume["configMap"]["name"]
        if "secret" in volume:
            yield "Secret", volume["secret"]["secretName"]
    for container in containers(template):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                yield "ConfigMap", source["configMapRef"]["name"]
            if "secretRef" in source:
                yield "Secret", source["secretRef"]["name"]
        for env in container.get("env", []):
            ref = env.get("valueFrom", {})
            if "configMapKeyRef" in ref:
                yield "ConfigMap", ref["configMapKeyRef"]["name"]
            if "secretKeyRef" in ref:
                yield "Secret", ref["secretKeyRef"]["name"]


def test_referenced_objects_exist(manifests: list[Doc]) -> None:
    defined = {(doc["kind"], doc["metadata"]["name"]) for doc in manifests}
    for template in all_templates(manifests):
        for ref in _references(template):
            assert ref in defined, f"{ref} is used but not defined"
    # The Serve app reaches Redis through a Service of these manifests, on its port.
    (app,) = serve_config(manifests).applications
    redis = urlsplit(app.args["redis_url"])
    services = {s["metadata"]["name"]: s for s in of_kind(manifests, "Service")}
    assert redis.hostname in services, f"no Service {redis.hostname}"
    assert redis.port in [p["port"] for p in services[redis.hostname]["spec"]["ports"]]


def test_every_container_requests_resources(manifests: list[Doc]) -> None:
    for template in all_templates(manifests):
        for container in containers(template):
            resources = container.get("resources", {})
            requests, limits = resources.get("requests", {}), resources.get("limits", {})
            assert {"cpu", "memory"} <= requests.keys(), container["name"]
            if "nvidia.com/gpu" in limits or "nvidia.com/gpu" in requests:
                # Kubernetes rejects extended resources whose request differs from the limit.
                assert requests.get("nvidia.com/gpu") == limits.get("nvidia.com/gpu")


def _worker_groups(docs: list[Doc]) -> list[Doc]:
    return list(ray_service(docs)["spec"]["rayClusterConfig"]["workerGroupSpecs"])


def _custom_resources(group: Doc) -> dict[str, float]:
    """A group's `rayStartParams.resources` (KubeRay's quoted JSON: '"{\\"x\\": 1}"')."""
    raw = group.get("rayStartParams", {}).get("resources")
    if raw is None:
        return {}
    return dict(json.loads(raw.strip('"').replace('\\"', '"')))


def _gpus_per_pod(group: Doc) -> int:
    (container,) = group["template"]["spec"]["containers"]
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


def test_ray_service_config_builds_the_app(manifests: list[Doc], demo_model_dir: Path) -> None:
    """The embedded Serve config validates, and the deployments it overrides exist."""
    from ray.serve._private.build_app import build_app  # what Serve's controller runs
    from ray.serve._private.utils import import_attr

    config = serve_config(manifests)
    (app,) = config.applications
    assert app.import_path == "pdserve.deploy.app:app_builder"
    args = ClusterConfig.model_validate(app.args)
    # The model folder is read where the app is built; here that is the demo model.
    builder = import_attr(app.import_path)
    built = build_app(builder({**app.args, "model": str(demo_model_dir)}), name=app.name)
    names = {deployment.name for deployment in built.deployments}
    assert {d.name for d in app.deployments} <= names, names
    # Replicas of different pods must reach each other's KV receivers.
    assert args.transfer_host not in LOOPBACK_HOSTS
    assert config.http_options.host == "0.0.0.0"


def test_pools_are_pinned_to_their_gpu_groups(manifests: list[Doc]) -> None:
    """Each pool's override asks for a custom resource only its worker group offers, with
    the args' CPUs and GPUs (Serve replaces `ray_actor_options` whole), and the group has
    GPU pods enough for the pool's replicas."""
    (app,) = serve_config(manifests).applications
    args = ClusterConfig.model_validate(app.args)
    groups = _worker_groups(manifests)
    pools = {"Prefill": args.prefill_replicas, "Decode": args.decode_replicas}
    overrides = {d.name: d.ray_actor_options.model_dump() for d in app.deployments}
    assert overrides.keys() == pools.keys()
    pool_groups: set[str] = set()
    for name, num_replicas in pools.items():
        options = overrides[name]
        assert options["num_cpus"] == args.replica_num_cpus
        assert options["num_gpus"] == args.replica_num_gpus
        (resource,) = options["resources"]
        offering = [g for g in groups if resource in _custom_resources(g)]
        assert len(offering) == 1, f"{name}: {len(offering)} worker groups offer {resource}"
        group = offering[0]
        pool_groups.add(group["groupName"])
        replicas_per_pod = min(
            _gpus_per_pod(group) // options["num_gpus"],
            _custom_resources(group)[resource] / options["resources"][resource],
        )
        assert group["replicas"] * replicas_per_pod >= num_replicas, (name, group["groupName"])
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["template"]["spec"]["nodeSelector"], group["groupName"]
    assert len(pool_groups) == len(pools), "the pools share a worker group"


def test_every_ray_pod_mounts_the_model(manifests: list[Doc]) -> None:
    (app,) = serve_config(manifests).applications
    model = Path(app.args["model"])
    for template in pod_templates(ray_service(manifests)):
        (container,) = template["spec"]["containers"]
        mounts = [Path(m["mountPath"]) for m in container.get("volumeMounts", [])]
        assert any(model.is_relative_to(m) for m in mounts), container["name"]
