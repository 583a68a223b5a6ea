"""Soak: mixed load for a set time while a random worker is killed every N seconds.

    python -m pdserve.benchmarks.soak --duration 600 --kill-every 30

Starts `pdserve up` (2 prefill + 2 decode workers by default; Ray Serve restarts killed
replicas), runs a closed loop of streaming greedy requests drawn from a fixed pool of
prompts whose reference tokens come from the offline engine (equal to `transformers`'
greedy tokens, as the engine's tests show), and SIGKILLs a random live worker every
`--kill-every` seconds. Each request ends as exactly one of:

- completed: every token equal to the reference;
- wrong: completed, but with other tokens (must be 0);
- failed cleanly: an HTTP error status, or an error event before `data: [DONE]`;
- lost: anything else — no answer within the client's deadline, a connection dropped
  without an error event, a stream that ended without `[DONE]` (must be 0).

Prints those counts and the resident memory of each process of the cluster at the start
and at the end (a killed replica's successor is matched by its role).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.benchmarks.compare import cluster_process
from pdserve.benchmarks.machine import print_machine

REQUEST_TIMEOUT_S = 120.0


def session_rss(sid: int) -> dict[str, int]:
    """RSS in KiB of every process of a session, keyed by its command name (+ a count)."""
    out: Counter[str] = Counter()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) != sid:
                continue
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")[0].decode() or "?"
            status = (stat.parent / "status").read_text()
        except (OSError, IndexError, ValueError):
            continue
        rss = next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")), 0
        )
        out[_role(cmd)] += rss
    return dict(out)


def _role(cmd: str) -> str:
    for role in ("Router", "Prefill", "Decode", "ServeController", "ProxyActor"):
        if role in cmd:
            return f"ray::{role}"
    return Path(cmd.split()[0]).name


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], want: list[int]
) -> str:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": len(want),
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    tokens: list[int] = []
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    return "failed_clean"
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        return "completed" if tokens == want else "wrong"
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return "failed_clean"
                    tokens += chunk["choices"][0].get("token_ids", [])
        return "lost"  # the stream ended without [DONE]
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return "lost"


async def run_soak(args: argparse.Namespace, url: str, sid: int) -> dict[str, Any]:
    from pdserve.engine import LLM, SamplingParams

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(5, 512) for _ in range(rng.randrange(8, 200))] for _ in range(24)]
    llm = LLM(args.model, dtype="float32", num_threads=1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    refs = [out.token_ids for out in llm.generate(prompts, params)]
    del llm

    outcomes: Counter[str] = Counter()
    kills: list[str] = []
    deadline = time.monotonic() + args.duration
    rss_start = session_rss(sid)

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]

        async def user(i: int) -> None:
            r = random.Random(args.seed + i)
            while time.monotonic() < deadline:
                k = r.randrange(len(prompts))
                outcomes[await one_request(session, url, model, prompts[k], refs[k])] += 1

        async def killer() -> None:
            while (left := deadline - time.monotonic()) > args.kill_every:
                await asyncio.sleep(args.kill_every)  # the soak's own schedule
                async with session.get(f"{url}/workers") as resp:
                    workers = [w for w in (await resp.json())["workers"] if "pid" in w]
                if workers:
                    w = rng.choice(workers)
                    try:
                        os.kill(int(w["pid"]), signal.SIGKILL)
                        kills.append(f"{w['role']}:{w['worker_id']} at {args.duration - left:.0f}s")
                    except ProcessLookupError:
                        pass

        await asyncio.gather(killer(), *(user(i) for i in range(args.users)))
    return {
        "outcomes": dict(outcomes),
        "kills": kills,
        "rss_kib": {"start": rss_start, "end": session_rss(sid)},
    }


def main() -> None:
    print_machine()  # the CPU and its flags, with every figure
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the demo model)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    parser.add_argument("--users", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prefill-replicas", type=int, default=2)
    parser.add_argument("--decode-replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    from pdserve.demo.model import resolve_model

    args.model = str(resolve_model(args.model))
    flags = [
        *("--prefill-replicas", str(args.prefill_replicas)),
        *("--decode-replicas", str(args.decode_replicas)),
        *("--replica-cpus", "0", "--dtype", "float32", "--heartbeat-s", "0.5"),
        *("--worker-lease-s", "3"),
    ]
    with cluster_process(args.model, flags) as (url, proc):
        result = asyncio.run(run_soak(args, url, proc.pid))
    print(render(result, args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def render(result: dict[str, Any], args: argparse.Namespace) -> str:
    o = result["outcomes"]
    sent = sum(o.values())
    lines = [
        f"soak: {args.duration:g} s, {args.users} users, a random worker killed every "
        f"{args.kill_every:g} s ({len(result['kills'])} kills)",
        "",
        "| requests sent | completed, reference tokens | wrong tokens | failed cleanly | lost |",
        "| --- | --- | --- | --- | --- |",
        f"| {sent} | {o.get('completed', 0)} | {o.get('wrong', 0)} | "
        f"{o.get('failed_clean', 0)} | {o.get('lost', 0)} |",
        "",
        "| process | RSS at start (MiB) | RSS at end (MiB) |",
        "| --- | --- | --- |",
    ]
    start, end = result["rss_kib"]["start"], result["rss_kib"]["end"]
    for name in sorted(set(start) | set(end)):
        lines.append(
            f"| {name} | {start.get(name, 0) / 1024:.0f} | {end.get(name, 0) / 1024:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
