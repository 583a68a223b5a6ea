"""KV pushes across a data-centre link: the TTFT breakdown's transfer stage against the link.

    python -m pdserve.benchmarks.link_transfer [--rate 10gbit] [--delay 100us] [--mib 16]

Needs root (network namespaces; `benchmarks/netns.py`). Three hosts on one bridge: the
head (Ray head, Redis, router), a prefill node and a decode node, each link shaped by
`tc netem` to `--rate` and `--delay` (so a round trip between prefill and decode is two
delays). A random-weights model (`load_format=dummy`) whose prompt of `--tokens` tokens
has `--mib` MiB of KV is served disaggregated over each transport, and `--requests`
prompts (distinct: every push is whole) go through the router one at a time. Reported per
transport, in one run:

- the transfer stage of the TTFT breakdown (pack + checksums + push, as the router's
  `pdserve_ttft_breakdown_seconds{stage="transfer"}` records it), mean per request;
- the push alone (`pdserve_kv_transfer_seconds`), mean;
- the link's bound, size / rate + round trip, and a raw TCP send of the same bytes between
  the same two namespaces measured in the same run (the baseline: what the link gives);
- the ratios. Target (issue): transfer stage within 1.5x of size / rate + RTT.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from pdserve.benchmarks.bench_report import sample, scrape_metrics
from pdserve.benchmarks.machine import print_machine
from pdserve.benchmarks.netns import NEEDS, Node, Topology, can_make_namespaces, start_cluster
from pdserve.benchmarks.netns import topology as make_topology

RAW_PORT = 17000


def parse_rate(text: str) -> float:
    """tc's rate ("10gbit", "800mbit") in bytes per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", text.strip().lower())
    if not m:
        raise ValueError(f"rate {text!r}: expected e.g. 10gbit, 800mbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    return float(m.group(1)) * scale / 8


def parse_delay(text: str) -> float:
    """tc's delay ("100us", "1ms") in seconds."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", text.strip().lower())
    if not m:
        raise ValueError(f"delay {text!r}: expected e.g. 100us, 1ms")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def model_folder(out: Path, tokens: int, mib: float) -> Path:
    """A config-only Llama whose `tokens`-token prompt holds about `mib` MiB of float32 KV."""
    from pdserve.demo.dummy import ConfigShape, write_config_only_model

    kv_heads, head_dim = 4, 32
    per_layer_token = 2 * kv_heads * head_dim * 4  # K and V, float32
    layers = max(1, round(mib * 2**20 / (tokens * per_layer_token)))
    shape = ConfigShape(
        vocab_size=512,
        hidden_size=kv_heads * head_dim * 2,
        intermediate_size=512,
        num_layers=layers,
        num_heads=kv_heads * 2,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=tokens + 64,
        torch_dtype="float32",
    )
    return write_config_only_model(out, shape)


RAW_SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); n = int(sys.argv[3]); got = 0
while got < n:
    chunk = c.recv(1 << 20)
    if not chunk: break
    got += len(chunk)
c.sendall(b"k"); c.close()
"""

RAW_CLIENT = r"""
import socket, sys, time
data = bytes(int(sys.argv[3])); s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
t = time.perf_counter(); s.sendall(data); s.recv(1); print(time.perf_counter() - t)
"""


def raw_tcp_seconds(sender: Node, receiver: Node, num_bytes: int, repeats: int = 3) -> float:
    """Best time to send `num_bytes` over a fresh TCP connection and get one byte back."""
    best = float("inf")
    for i in range(repeats):
        port = str(RAW_PORT + i)
        server = subprocess.Popen(
            receiver.exec_argv([sys.executable, "-c", RAW_SERVER, receiver.address, port,
                                str(num_bytes)]),
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            server.stdout.readline()  # "listening"
            out = subprocess.run(
                sender.exec_argv(
                    [sys.executable, "-c", RAW_CLIENT, receiver.address, port, str(num_bytes)]
                ),
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            )
            best = min(best, float(out.stdout.strip()))
        finally:
            server.wait(timeout=30)
    return best


def run_transport(
    topo: Topology, model_dir: Path, transport: str, args: argparse.Namespace, scratch: Path
) -> dict[str, float]:
    pools = ["router", "prefill", "decode"]
    flags = ["--dtype", "float32", "--load-format", "dummy", "--disagg-policy", "always"]
    flags += ["--max-model-len", str(args.tokens + 32)]
    url = start_cluster(topo, model_dir, transport, pools, scratch, flags)

    def complete(prompt: list[int]) -> None:
        body = json.dumps(
            {"model": model_dir.name, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
        ).encode()
        req = urllib.request.Request(
            f"{url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.read()

    complete([7] * 64)  # warm: first connections, first prefill
    before = scrape_metrics(url)
    for i in range(args.requests):
        complete([3 + (i * 131 + j * 7) % 500 for j in range(args.tokens)])
    after = scrape_metrics(url)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    n = delta("pdserve_ttft_breakdown_seconds_count", stage="transfer")
    stage_s = delta("pdserve_ttft_breakdown_seconds_sum", stage="transfer") / max(n, 1)
    pushes = max(n, 1)
    return {
        "requests": n,
        "bytes": delta("pdserve_kv_transfer_bytes_total") / pushes,
        "stage_s": stage_s,
        "push_s": delta("pdserve_kv_transfer_seconds_total") / pushes,
        "local_prefills": sum(
            v for (name, _), v in after.items() if name == "pdserve_decode_local_prefill_total"
        ),
    }


def main() -> int:
    print_machine()  # the CPU and its flags, with every figure
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", default="10gbit", help="netem rate of every link")
    parser.add_argument("--delay", default="100us", help="netem delay of every link (one way)")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--mib", type=float, default=16.0, help="KV MiB of one prompt")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--transports", default="grpc,ucx")
    args = parser.parse_args()
    if not can_make_namespaces():
        print(f"link_transfer: {NEEDS}", file=sys.stderr)
        return 2
    rate, delay = parse_rate(args.rate), parse_delay(args.delay)
    rows = []
    delayed = True
    with tempfile.TemporaryDirectory(prefix="pdserve-link-") as tmp:
        model_dir = model_folder(Path(tmp) / "model", args.tokens, args.mib)
        for transport in args.transports.split(","):
            with make_topology(3) as topo:
                delayed = all([topo.shape(node, args.rate, args.delay) for node in topo.nodes])
                _, prefill, decode = topo.nodes
                got = run_transport(topo, model_dir, transport, args, Path(tmp))
                raw_s = raw_tcp_seconds(prefill, decode, int(got["bytes"]))
                rtt = 2 * delay if delayed else 0.0
                bound_s = got["bytes"] / rate + rtt
                rows.append((transport, got, raw_s, bound_s))
    how = (
        f"{args.delay} each way (RTT {2 * delay * 1e6:.0f} us)"
        if delayed
        else "no added delay: this kernel has no sch_netem, so the rate comes from tbf"
    )
    print(f"link: {args.rate}, {how}; {args.tokens}-token prompts, {args.requests} requests")
    print("| transport | KV MiB/push | transfer stage ms | push ms | raw TCP ms "
          "| bound ms | stage / bound | stage / raw TCP | local prefills |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for transport, got, raw_s, bound_s in rows:
        print(
            f"| {transport} | {got['bytes'] / 2**20:.1f} | {got['stage_s'] * 1e3:.1f} "
            f"| {got['push_s'] * 1e3:.1f} | {raw_s * 1e3:.1f} | {bound_s * 1e3:.1f} "
            f"| {got['stage_s'] / bound_s:.2f}x | {got['stage_s'] / raw_s:.2f}x "
            f"| {got['local_prefills']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
