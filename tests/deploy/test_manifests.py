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
import trustme
import yaml
from ray.serve.schema import ServeDeploySchema

from pdserve.cluster.config import ClusterConfig
from pdserve.deploy.redis_server import (
    EmbeddedRedis,
    drain,
    free_port,
    wait_for_line,
)

REPO_DIR = Path(__file__).resolve().parents[2]
SERVE_CONFIG = REPO_DIR / "deploy" / "serve_config.yaml"
K8S_DIR = REPO_DIR / "deploy" / "k8s"
DOCKERFILE = REPO_DIR / "Dockerfile"

START_TIMEOUT_S = 240.0
STOP_LIMIT_S = 30.0  # every stop, in every state (docs/failures.md, "Stopping")
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
# Kinds whose pod template sits at spec.template.
TEMPLATED_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
COMPONENT = "app.kubernetes.io/component"

Doc = dict[str, Any]


# --- `serve run deploy/serve_config.yaml` ------------------------------------------------


def render_serve_config(model_dir: Path, redis_url: str, port: int, out: Path, **args: Any) -> Path:
    """The repository's Serve config with only what this machine must change overridden
    (and `args`, the application's).

    1 prefill + 1 decode replica asking for no Ray CPUs, so the app fits 2 busy cores;
    `disagg_policy: always`, so that the short prompt below proves the split.
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
        disagg_policy="always",
        **args,
    )
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def _health(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 while a pool has no worker
        return exc.code, json.loads(exc.read())


def _wait_health(url: str, run: Any, ok: Any, what: str, poll: Any) -> Any:
    """Poll GET /health until `ok(status, body)` or the deadline; the body."""

    def check() -> Any:
        if run.proc.poll() is not None:
            raise AssertionError(f"serve run exited with {run.proc.returncode}:\n{run.tail()}")
        try:
            status, body = _health(url)
        except (urllib.error.URLError, OSError, ValueError):  # not serving it yet
            return None
        return body if ok(status, body) else None

    return poll(f"serve run's /health: {what}", check, START_TIMEOUT_S, interval_s=0.5)


class ServeRun:
    """`serve run` on the rendered config, a Redis of its own: a user's terminal.

    `direct_ingress`: the router replicas serve HTTP themselves, with the environment
    `pdserve up` gives them (deploy/serve_env.py), as docs/failures.md says to run
    `serve run` for streams to end cleanly when it stops (Serve's own proxy is killed at
    once on `serve shutdown`, cutting what passes through it).
    """

    def __init__(
        self,
        stoppable: Any,
        poll: Any,
        model_dir: Path,
        redis_url: str,
        tmp_path: Path,
        direct_ingress: bool = False,
        **args: Any,
    ) -> None:
        from pdserve.deploy.serve_env import SERVE_ENV, direct_ingress_env

        proxy_port = port = free_port()
        env: dict[str, str | None] = {
            "RAY_DEDUP_LOGS": "0",
            "OMP_NUM_THREADS": "1",
            "RAY_ADDRESS": None,
        }
        if direct_ingress:
            port = free_port()
            env |= {**SERVE_ENV, **direct_ingress_env(port, 1, 2.0)}
        self.url = f"http://127.0.0.1:{port}"
        config_path = render_serve_config(
            model_dir, redis_url, proxy_port, tmp_path / "serve_config.yaml", **args
        )
        serve_cli = Path(sys.executable).with_name("serve")
        # `--address local`: a fresh local Ray cluster, never one somebody else started.
        argv = [str(serve_cli), "run", "--address", "local", str(config_path)]
        self.run = stoppable(argv, env)
        self.poll = poll

    def healthy(self) -> Any:
        return _wait_health(self.url, self.run, lambda status, _: status == 200, "200", self.poll)


@pytest.fixture
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as redis_server:
        yield redis_server.url


@pytest.fixture
def serve_run(
    demo_model_dir: Path, tmp_path: Path, stoppable: Any, redis_url: str, poll: Any
) -> Iterator[str]:
    """`serve run` on the rendered config, with its own Redis; yields the base URL, and
    stops it with Ctrl-C, as a user does, once the test is done."""
    served = ServeRun(stoppable, poll, demo_model_dir, redis_url, tmp_path)
    health = served.healthy()
    assert health["workers"] == {"prefill": 1, "decode": 1}, health
    yield served.url
    code, _ = served.run.stop(signal.SIGINT)
    assert code == 0, f"serve run exited with {code}:\n{served.run.tail()}"


def test_serve_run_starts_the_app_from_the_config_file(serve_run: str, api: Any) -> None:
    client = openai.OpenAI(base_url=f"{serve_run}/v1", api_key="unused", timeout=120, max_retries=0)
    (model,) = client.models.list().data
    out = client.completions.create(
        model=model.id, prompt="The river", max_tokens=4, temperature=0.0
    )
    assert out.usage is not None and out.usage.completion_tokens >= 1
    assert out.choices[0].finish_reason in ("length", "stop")
    # The config file's cluster is disaggregated: the prompt's KV crossed, and the
    # decode worker prefilled nothing itself.
    assert api.metric(serve_run, "pdserve_kv_transfer_blocks_total") >= 1
    assert api.local_prefills(serve_run) == {}


# Every stop of `serve run` stops (as tests/faults/test_stop_states.py for `pdserve up`):
# within STOP_LIMIT_S, leaving no process of its session, in every state.


def test_serve_run_stops_while_starting(
    stoppable: Any, demo_model_dir: Path, redis_url: str, tmp_path: Path, poll: Any
) -> None:
    served = ServeRun(stoppable, poll, demo_model_dir, redis_url, tmp_path)
    served.run.wait_for("Submitted deploy config successfully", START_TIMEOUT_S)
    code, elapsed = served.run.stop(signal.SIGINT)  # the replicas are starting
    assert code == 0, served.run.tail()
    assert elapsed < STOP_LIMIT_S


def test_serve_run_stops_while_its_replicas_cannot_be_scheduled(
    stoppable: Any, demo_model_dir: Path, redis_url: str, tmp_path: Path, poll: Any
) -> None:
    """A decode pool asking for a resource no node has: /health names it (what one
    replica asks for, what the cluster has), and SIGTERM still stops everything."""
    served = ServeRun(
        stoppable,
        poll,
        demo_model_dir,
        redis_url,
        tmp_path,
        decode_resources={"pdserve_test_pool": 1},
    )

    def named(status: int, body: Any) -> bool:
        return any(u["deployment"] == "Decode" for u in body.get("unscheduled", []))

    body = _wait_health(served.url, served.run, named, "Decode in /health's unscheduled", poll)
    (decode,) = body["unscheduled"]
    assert decode["replica_asks"] == {"pdserve_test_pool": 1.0}
    assert decode["cluster_free"] == {"pdserve_test_pool": 0.0}
    assert "cannot be scheduled" in decode["message"]
    code, elapsed = served.run.stop(signal.SIGTERM)
    # Ray's driver turns SIGTERM into sys.exit(15); now and then its C++ core worker
    # then aborts while tearing down (-6, seen in CI on a loaded machine). Either way
    # it stopped, within the limit and leaving nothing behind (`stop` asserts both).
    assert code in (15, -signal.SIGABRT), served.run.tail()
    assert elapsed < STOP_LIMIT_S


def test_serve_run_stops_while_streaming(
    stoppable: Any, make_checkpoint: Any, redis_url: str, tmp_path: Path, poll: Any
) -> None:
    """Ctrl-C with a stream running: the stream goes on for its grace, then ends with an
    error event (never a cut connection), and the stop takes less than STOP_LIMIT_S."""
    model_dir = Path(make_checkpoint(max_position_embeddings=8192))
    served = ServeRun(
        stoppable, poll, model_dir, redis_url, tmp_path, direct_ingress=True,
        shutdown_grace_s=3, dtype="float32",
    )  # fmt: skip
    served.healthy()
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=client.models.list().data[0].id, prompt="The river", max_tokens=8000,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    received = 0
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            received += 1
            if received == 5:
                started = time.monotonic()
                served.run.proc.send_signal(signal.SIGINT)
    assert not isinstance(caught.value, openai.APIConnectionError), "the stream was cut"
    assert caught.value.body is not None and caught.value.body["code"] == "shutting_down"
    code, elapsed = served.run.wait_stopped(started)
    assert code == 0, served.run.tail()
    assert elapsed < STOP_LIMIT_S


def test_serve_run_stops_after_a_worker_died(
    stoppable: Any, api: Any, demo_model_dir: Path, redis_url: str, tmp_path: Path, poll: Any
) -> None:
    served = ServeRun(
        stoppable, poll, demo_model_dir, redis_url, tmp_path, heartbeat_s=0.5, worker_lease_s=3
    )
    served.healthy()
    (decode,) = [
        w for w in api.get_json(f"{served.url}/workers")["workers"] if w["role"] == "decode"
    ]
    os.kill(decode["pid"], signal.SIGKILL)
    poll(  # its lease lapses (Serve may start its successor meanwhile, under another id)
        "the dead worker leaves the index",
        lambda: (
            decode["worker_id"]
            not in {w["worker_id"] for w in api.get_json(f"{served.url}/workers")["workers"]}
        ),
        60.0,
    )
    code, elapsed = served.run.stop(signal.SIGINT)
    assert code == 0, served.run.tail()
    assert elapsed < STOP_LIMIT_S


def test_serve_config_validates() -> None:
    config = ServeDeploySchema.model_validate(yaml.safe_load(SERVE_CONFIG.read_text()))
    (app,) = config.applications
    assert app.import_path == "pdserve.deploy.app:app_builder"
    ClusterConfig.model_validate(app.args)


SERVE_CONFIG_MULTI = REPO_DIR / "deploy" / "serve_config_multi.yaml"


def test_serve_config_of_several_models_builds_each_app(demo_model_dir: Path) -> None:
    """deploy/serve_config_multi.yaml: the router app and one app per model, each built
    by its builder; removing a model changes the router app's code version (Serve
    replaces its replicas) and no other model's app's (their replicas stay)."""
    from ray.serve._private.build_app import build_app  # what Serve's controller runs
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve._private.utils import import_attr

    from pdserve.cluster.config import model_app_name
    from pdserve.deploy import declarative

    raw = yaml.safe_load(SERVE_CONFIG_MULTI.read_text())
    (router,) = [app for app in raw["applications"] if app["name"] == "pdserve"]
    for entry in router["args"]["models"]:  # the anchors: the model apps' entries too
        entry["model"] = str(demo_model_dir)
    config = declarative.validate(raw)  # every app's args through its builder's checks
    cluster = ClusterConfig.from_serve_args(router["args"])
    ids = cluster.model_ids()
    assert len(ids) == 2 and {c.mode for c in cluster.model_configs()} == {"disagg", "colocated"}
    apps = {app.name: app for app in config.applications}
    assert set(apps) == {"pdserve", *(model_app_name(i) for i in ids)}
    assert apps["pdserve"].route_prefix == "/"
    for single in cluster.model_configs():
        app = apps[model_app_name(single.model_id)]
        assert app.route_prefix is None
        (own,) = ClusterConfig.from_serve_args(app.args).model_configs()
        assert own.model_dump(exclude={"cluster_token"}) == single.model_dump(
            exclude={"cluster_token"}
        )
        built = build_app(import_attr(app.import_path)(app.args), name=app.name)
        want = {"Decode"} | ({"Prefill"} if single.mode == "disagg" else set())
        assert {d.name for d in built.deployments} == want
    built = build_app(import_attr(router["import_path"])(router["args"]), name="pdserve")
    assert {d.name for d in built.deployments} == {"Router"}

    # redeployed without the second model
    before = {name: get_app_code_version(app) for name, app in apps.items()}
    kept, dropped = ids
    router["args"]["models"] = router["args"]["models"][:1]
    raw["applications"] = [a for a in raw["applications"] if a["name"] != model_app_name(dropped)]
    after = {app.name: get_app_code_version(app) for app in declarative.validate(raw).applications}
    assert set(after) == {"pdserve", model_app_name(kept)}
    assert after[model_app_name(kept)] == before[model_app_name(kept)]
    assert after["pdserve"] != before["pdserve"]


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


def selector_matches(selector: Doc, template: Doc) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against a pod template."""
    labels = template.get("metadata", {}).get("labels", {})
    if not labels_match(selector.get("matchLabels", {}), template):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


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


def test_the_image_sets_the_serve_settings_the_app_gives_its_replicas() -> None:
    """The HTTP proxy of a node reads Serve's settings from the node's environment only."""
    from pdserve.deploy.app import SERVE_ENV

    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env = dict(
        pair.split("=", 1)
        for line in text.splitlines()
        if line.startswith("ENV RAY_")
        for pair in line.split()[1:]
    )
    assert env == SERVE_ENV


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
        selectors = [policy["spec"]["podSelector"]]
        for rule in policy["spec"].get("ingress", []):
            selectors += [p["podSelector"] for p in rule.get("from", []) if "podSelector" in p]
        for selector in selectors:
            assert any(selector_matches(selector, t) for t in templates), (policy, selector)


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


def _readme_secrets() -> dict[str, set[str]]:
    """Secrets deploy/README.md creates (`kubectl create secret generic NAME ...`), with
    their keys (`--from-literal=KEY=...`, `--from-file=KEY`). They are not manifests, so
    that no secret value is ever committed."""
    text = (REPO_DIR / "deploy" / "README.md").read_text().replace("\\\n", " ")
    secrets: dict[str, set[str]] = {}
    for match in re.finditer(r"kubectl create secret generic (\S+)([^\n]*)", text):
        keys = re.findall(r"--from-(?:literal|file)=([\w.-]+)", match.group(2))
        secrets[match.group(1)] = set(keys)
    return secrets


def _secret_keys(template: Doc) -> Iterator[tuple[str, str]]:
    """(Secret, key) of every Secret key a pod template reads (env, or a volume's files)."""
    for container in containers(template):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                yield ref["name"], ref["key"]
    for volume in template["spec"].get("volumes", []):
        if "secret" in volume:
            for item in volume["secret"].get("items", []):
                yield volume["secret"]["secretName"], item["key"]


def test_referenced_objects_exist(manifests: list[Doc]) -> None:
    defined = {(doc["kind"], doc["metadata"]["name"]) for doc in manifests}
    defined |= {("Secret", name) for name in _readme_secrets()}
    for template in all_templates(manifests):
        for ref in _references(template):
            assert ref in defined, f"{ref} is used but neither defined nor created in the README"
        for name, key in _secret_keys(template):
            assert key in _readme_secrets()[name], f"the README's Secret {name} has no key {key}"
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


def _tls_files(folder: Path) -> dict[str, Any]:
    ca = trustme.CA()
    cert = ca.issue_cert("pdserve-kv")
    files = {name: folder / f"{name}.pem" for name in ("cert_file", "key_file", "ca_file")}
    cert.cert_chain_pems[0].write_to_path(str(files["cert_file"]))
    cert.private_key_pem.write_to_path(str(files["key_file"]))
    ca.cert_pem.write_to_path(str(files["ca_file"]))
    return {**{k: str(v) for k, v in files.items()}, "mutual": True, "server_name": "pdserve-kv"}


def test_ray_service_config_builds_the_app(
    manifests: list[Doc], demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded Serve config validates, and the deployments it overrides exist."""
    from ray.serve._private.build_app import build_app  # what Serve's controller runs
    from ray.serve._private.utils import import_attr

    config = serve_config(manifests)
    (app,) = config.applications
    assert app.import_path == "pdserve.deploy.app:app_builder"
    for name in ("PDSERVE_REDIS_PASSWORD", "PDSERVE_CLUSTER_TOKEN"):
        monkeypatch.setenv(name, f"value-of-{name}")  # the pods set them from Secrets
    monkeypatch.setenv("PDSERVE_API_KEYS", "sk-one,sk-two")
    args = ClusterConfig.from_serve_args(app.args)
    assert args.redis_url == "redis://:value-of-PDSERVE_REDIS_PASSWORD@pdserve-redis:6379/0"
    assert args.cluster_token == "value-of-PDSERVE_CLUSTER_TOKEN"
    assert args.api_keys == ["sk-one", "sk-two"]
    # The model folder and the TLS files are read where the app is built: here, the demo
    # model and files of a CA made for the test.
    builder = import_attr(app.import_path)
    local = {**app.args, "model": str(demo_model_dir), "kv_tls": _tls_files(tmp_path)}
    built = build_app(builder(local), name=app.name)
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


def test_the_engine_settings_reach_the_workers(manifests: list[Doc]) -> None:
    """gpu_memory_utilization and load_format in both Serve configs are ClusterConfig's
    fields and reach the engine config each worker builds."""
    (app,) = serve_config(manifests).applications
    k8s = ClusterConfig.model_validate(app.args)
    assert k8s.device == "cuda" and k8s.replica_num_gpus == 1  # one GPU: the whole share
    engine = k8s.engine_config()
    assert engine.gpu_memory_utilization == app.args["gpu_memory_utilization"] == 0.9
    assert engine.load_format == app.args["load_format"] == "auto"
    (local_app,) = yaml.safe_load(SERVE_CONFIG.read_text())["applications"]
    local = local_app["args"]
    assert {"gpu_memory_utilization", "load_format"} <= local.keys()
    engine = ClusterConfig.model_validate(local).engine_config()
    assert engine.gpu_memory_utilization == local["gpu_memory_utilization"]
    assert engine.load_format == local["load_format"] == "auto"


def test_every_ray_pod_mounts_the_model(manifests: list[Doc]) -> None:
    (app,) = serve_config(manifests).applications
    model = Path(app.args["model"])
    for template in pod_templates(ray_service(manifests)):
        (container,) = template["spec"]["containers"]
        mounts = [Path(m["mountPath"]) for m in container.get("volumeMounts", [])]
        assert any(model.is_relative_to(m) for m in mounts), container["name"]


# --- Secrets, authentication and exposure -------------------------------------------------

RAY_POD_SECRETS = {
    "PDSERVE_API_KEYS": ("pdserve-auth", "api-keys"),
    "PDSERVE_CLUSTER_TOKEN": ("pdserve-auth", "cluster-token"),
    "PDSERVE_REDIS_PASSWORD": ("pdserve-redis", "password"),
}


def _ray_containers(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    """(pod template, its one container) of the head and every worker group."""
    out = []
    for template in pod_templates(ray_service(docs)):
        (container,) = template["spec"]["containers"]
        out.append((template, container))
    return out


def _env(container: Doc) -> dict[str, Doc]:
    return {env["name"]: env for env in container.get("env", [])}


def _redis_container(docs: list[Doc]) -> Doc:
    (redis,) = [d for d in of_kind(docs, "Deployment") if d["metadata"]["name"] == "pdserve-redis"]
    (container,) = containers(redis["spec"]["template"])
    return container


def test_secrets_come_from_secrets_on_every_ray_pod(manifests: list[Doc]) -> None:
    """API keys, the cluster token and the Redis password are not in the RayService spec:
    the Serve config names environment variables that every Ray pod sets from Secrets."""
    (app,) = serve_config(manifests).applications
    assert "api_keys" not in app.args
    assert app.args["cluster_token"] == "${PDSERVE_CLUSTER_TOKEN}"
    assert urlsplit(app.args["redis_url"]).password == "${PDSERVE_REDIS_PASSWORD}"
    for template, container in _ray_containers(manifests):
        env = _env(container)
        for name, secret in RAY_POD_SECRETS.items():
            ref = env[name]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == secret, (template["metadata"]["labels"], name)


def test_the_router_service_says_clients_need_a_key() -> None:
    text = (K8S_DIR / "router-service.yaml").read_text()
    assert "no authentication" not in text
    assert "pdserve-auth" in text and "Authorization: Bearer" in text


def test_redis_runs_with_the_password_the_ray_pods_use(manifests: list[Doc]) -> None:
    container = _redis_container(manifests)
    ref = _env(container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == RAY_POD_SECRETS["PDSERVE_REDIS_PASSWORD"]
    script = " ".join(container["args"])
    assert "requirepass" in script and "protected-mode no" not in script
    assert "--requirepass" not in script, "a password on the command line shows in ps"


@pytest.mark.redis
def test_the_redis_command_requires_its_password(manifests: list[Doc], tmp_path: Path) -> None:
    """The Redis container's own shell command, run here (on loopback, a free port, in a
    temporary folder): unauthenticated clients are refused, the password is accepted, and
    it is on no process's command line."""
    import redis

    (script,) = _redis_container(manifests)["args"]
    port = free_port()
    assert "--bind 0.0.0.0 --port 6379" in script
    script = script.replace("--bind 0.0.0.0 --port 6379", f"--bind 127.0.0.1 --port {port}")
    script = script.replace("/tmp", str(tmp_path))
    password = "0123456789abcdef" * 4
    env = {**os.environ, "REDIS_PASSWORD": password}
    proc = subprocess.Popen(
        ["/bin/sh", "-c", script], env=env, stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        wait_for_line(proc.stdout, "Ready to accept connections", 30.0)
        drain(proc.stdout)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, socket_timeout=5).ping()
        client = redis.Redis.from_url(f"redis://:{password}@127.0.0.1:{port}/0", socket_timeout=5)
        assert client.ping() is True
        client.close()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()  # exec'd: redis-server
        assert b"redis-server" in cmdline and password.encode() not in cmdline
    finally:
        proc.terminate()
        proc.wait(timeout=STOP_LIMIT_S)


def test_the_dashboard_listens_on_the_pod_ip_only(manifests: list[Doc]) -> None:
    head = ray_service(manifests)["spec"]["rayClusterConfig"]["headGroupSpec"]
    host = head["rayStartParams"]["dashboard-host"]
    assert host not in ("0.0.0.0", "::", "[::]", "")
    match = re.fullmatch(r"\$(\w+)", host)
    assert match, f"dashboard-host {host!r}: expected the pod IP's variable"
    (container,) = head["template"]["spec"]["containers"]
    ref = _env(container)[match.group(1)]["valueFrom"]["fieldRef"]
    assert ref["fieldPath"] == "status.podIP"


def _peers(policies: list[Doc], template: Doc, port: int) -> list[Doc] | None:
    """Who may reach `port` of a pod of `template`: None if no policy selects the pod
    (then anyone may), else the allowed peers ({} = anyone)."""
    selecting = [p for p in policies if selector_matches(p["spec"]["podSelector"], template)]
    if not selecting:
        return None
    peers: list[Doc] = []
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if not ports or port in ports:
                peers += rule.get("from", [{}])
    return peers


def _only_ray_pods(peers: list[Doc] | None, docs: list[Doc]) -> bool:
    """Every peer is a pod selector of this namespace matching Ray pods only."""
    ray = [t for t, _ in _ray_containers(docs)]
    others = [t for t in all_templates(docs) if t not in ray]
    return bool(peers) and all(
        set(peer) == {"podSelector"}
        and any(selector_matches(peer["podSelector"], t) for t in ray)
        and not any(selector_matches(peer["podSelector"], t) for t in others)
        for peer in peers or []
    )


def test_network_policies_limit_who_reaches_redis_the_kv_ports_and_the_head(
    manifests: list[Doc],
) -> None:
    policies = of_kind(manifests, "NetworkPolicy")
    redis_template = next(
        t for t in all_templates(manifests) if t["metadata"]["labels"].get(COMPONENT) == "redis"
    )
    assert _only_ray_pods(_peers(policies, redis_template, 6379), manifests), "Redis"
    by_component = {t["metadata"]["labels"][COMPONENT]: t for t, _ in _ray_containers(manifests)}
    assert set(by_component) == {"ray-head", "prefill", "decode"}
    # A decode receiver's port is random (transfer port 0); Ray's own ports too.
    for component, template in by_component.items():
        for port in (40123, 6379, 10001, 52365):
            assert _only_ray_pods(_peers(policies, template, port), manifests), (component, port)
    head = by_component["ray-head"]
    assert {} in (_peers(policies, head, 8000) or []), "the router's port is open"
    dashboard = _peers(policies, head, 8265) or []
    outside = [p for p in dashboard if not _only_ray_pods([p], manifests)]
    assert outside == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}}
    ]


def test_kv_pushes_use_mutual_tls_with_files_of_a_secret(manifests: list[Doc]) -> None:
    (app,) = serve_config(manifests).applications
    args = ClusterConfig.model_validate(
        {**app.args, "redis_url": "redis://pdserve-redis:6379/0", "cluster_token": "t"}
    )
    assert args.transport == "grpc" and args.kv_tls is not None
    assert args.kv_tls.mutual and args.kv_tls.server_name  # pod IPs are not in the cert
    files = [Path(f) for f in (args.kv_tls.cert_file, args.kv_tls.key_file, args.kv_tls.ca_file)]
    created = _readme_secrets()
    for template, container in _ray_containers(manifests):
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        for file in files:
            (name,) = [n for n, m in mounts.items() if Path(m["mountPath"]) == file.parent]
            assert mounts[name].get("readOnly") is True
            secret = volumes[name]["secret"]["secretName"]
            assert file.name in created[secret], f"{secret} has no key {file.name}"
