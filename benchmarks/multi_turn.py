"""Multi-turn conversations against the KV tiers and peer fetch: tiers off, host,
host + disk, and on two workers host + disk + fetch.

    python -m pdserve.benchmarks.multi_turn [--model mid] [--conversations 24] [--turns 6]
        [--threads 2] [--quick]

Each conversation opens with its own system prompt and user message, then goes turn by
turn: its whole history (every earlier message and answer) plus a new user message is
the next prompt, after a think time (exponential, `--think-s` mean). Many conversations
run at once (`--concurrency`), many more than the engine's KV pool holds: the pool is
`--pool-blocks` blocks, and the working set (every conversation's history) is printed
as a multiple of it. The same conversations (seeded) are served by one engine per
configuration, in one process (`AsyncEngine`, the engine every worker replica runs, here
without the cluster around it):

- off: the pool alone (prefix caching on);
- host: `kv_host_gib` large enough for the working set;
- host+disk: a host tier of a quarter of the working set over a disk tier
  (`kv_disk_dir`, a temporary folder) holding all of it.

Two workers: the same conversations on two engines (each with the pool above and the
same `--threads`: a fleet of two), each turn placed on the other worker than its
conversation's last one, as load balancing does under load (the worst case for
locality): tiers off, host + disk, and host + disk + fetch, where the worker a turn
lands on first gets the history's blocks it lacks from the other worker, when that one
holds more of them (`LLMEngine.export_prefix` / `import_prefix`, the engine side of a
peer fetch, in one process: no transport, so the fetch costs the holder's export and
the receiver's import, not a network).

Reported per configuration: TTFT p50 / p99 over all turns after the first, prompt tokens
computed against served from the pool, the host tier, the disk tier and a peer (from
the engines' counters), and output tokens/s. On two workers each figure is compared with
two workers' tiers off. Then the restart case: an engine with a disk
tier serves every conversation's first turns and is closed; a new engine on the same
folder serves the next turn of each, against a new engine on an empty folder (TTFT p50
and prompt tokens computed).

Greedy decoding, ignore-eos; a random-weight checkpoint built with `transformers`
(benchmarks/engine_throughput.py's `mid` by default) in bfloat16, removed at the end.
Prints the CPU and its flags first: figures only compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.benchmarks.engine_throughput import MODELS, build_checkpoint
from pdserve.benchmarks.machine import print_machine
from pdserve.common.engine_config import EngineConfig
from pdserve.common.sampling_params import SamplingParams
from pdserve.demo.model import write_random_model
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.worker.kv_handoff import KVImportError


@dataclass
class Conversation:
    system: list[int]
    users: list[list[int]]  # one message per turn
    history: list[int] = field(default_factory=list)


@dataclass
class Turn:
    conversation: int
    index: int  # 0: the conversation's first turn
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    tokens: tuple[int, ...]


@dataclass
class Result:
    name: str
    turns: list[Turn]
    wall_s: float
    load: dict[str, int]
    fetched_blocks: int = 0


class Fleet:
    """The engines a run serves on; with two, each turn goes to the other one than its
    conversation's last turn, and with `fetch` first gets the history's blocks it lacks
    from the one that holds more of them."""

    def __init__(self, engines: list[AsyncEngine], fetch: bool = False) -> None:
        self.engines = engines
        self.fetch = fetch
        self.fetched_blocks = 0
        self.unusable = 0  # fetches the receiving pool had no room for
        self.export_hits: dict[str, int] = {}  # tier hits of holders' exports

    def engine_for(self, conversation: int, turn: int) -> AsyncEngine:
        return self.engines[(conversation + turn) % len(self.engines)]

    def import_prefix(
        self,
        engine: LLMEngine,
        request_id: str,
        prompt: list[int],
        first: int,
        payload: Any,
        hashes: Any,
    ) -> None:
        """Cache a fetched prefix in `engine` (on its thread); one that does not fit (no
        free blocks: the pool is busy) is dropped, and the prompt computed."""
        try:
            self.fetched_blocks += engine.import_prefix(
                prompt, payload, first, hashes, for_request=request_id
            )
        except KVImportError:
            self.unusable += 1

    def _export(self, engine: LLMEngine, prompt: list[int], num_blocks: int, have: int) -> Any:
        """The holder's export; the blocks it took from its own tiers for it are counted
        apart (they served the peer, not a prompt of its own)."""
        before = engine.load()
        export = engine.export_prefix("fetch", prompt, num_blocks, have)
        after = engine.load()
        for key in ("kv_host_hit_blocks", "kv_disk_hit_blocks"):
            self.export_hits[key] = self.export_hits.get(key, 0) + after[key] - before[key]
        return export

    async def prefix_for(
        self, engine: AsyncEngine, prompt: list[int]
    ) -> tuple[int, Any, tuple[bytes, ...]] | None:
        """(first block, payload, hashes) of the prompt's prefix another engine holds
        beyond what `engine` does, or None."""
        if not self.fetch:
            return None
        have = await engine.call(lambda e: e.held_prefix_blocks(prompt))
        num_blocks = (len(prompt) - 1) // 16
        for other in self.engines:
            if other is engine:
                continue
            export = await other.call(lambda e: self._export(e, prompt, num_blocks, have))
            if export is not None:
                try:
                    return have, export.wait().clone(), export.block_hashes
                finally:
                    export.release()
        return None


def make_conversations(args: argparse.Namespace, vocab: int) -> list[Conversation]:
    rng = random.Random(args.seed)

    def text(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    return [
        Conversation(text(args.system_len), [text(args.user_len) for _ in range(args.turns)])
        for _ in range(args.conversations)
    ]


async def run_turns(
    fleet: Fleet,
    conversations: list[Conversation],
    turns: range,
    args: argparse.Namespace,
    seed: int,
) -> list[Turn]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(args.concurrency)
    done: list[Turn] = []
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    async def one(conv: Conversation, index: int) -> None:
        for t in turns:
            prompt = (conv.history or conv.system) + conv.users[t]
            engine = fleet.engine_for(index, t)
            rid = engine.new_request_id(f"c{index}t{t}")

            async with gate:
                start = time.perf_counter()
                fetched = await fleet.prefix_for(engine, prompt)

                def start_request(
                    e: LLMEngine, rid: str = rid, prompt: list[int] = prompt, fetched: Any = fetched
                ) -> None:
                    if fetched is not None:
                        fleet.import_prefix(e, rid, prompt, *fetched)
                    e.add_request(rid, prompt, params, stream=True)

                first: float | None = None
                out: Any = None
                async for out in engine.stream(rid, start_request):
                    if first is None:
                        first = time.perf_counter()
                    if out.finished:
                        break
            assert out is not None and first is not None
            done.append(
                Turn(
                    index,
                    t,
                    first - start,
                    len(prompt),
                    out.num_cached_tokens,
                    tuple(out.token_ids),
                )
            )
            conv.history = prompt + list(out.token_ids)
            await asyncio.sleep(rng.expovariate(1.0 / args.think_s))

    await asyncio.gather(*(one(c, i) for i, c in enumerate(conversations)))
    return done


def engine_config(args: argparse.Namespace, model: Path, **tiers: Any) -> EngineConfig:
    return EngineConfig(
        model_id=str(model),
        dtype=args.dtype,
        num_threads=args.threads,
        num_kv_blocks=args.pool_blocks,
        max_model_len=args.pool_blocks * 16,
        **tiers,
    )


def serve(
    name: str,
    args: argparse.Namespace,
    model: Path,
    conversations: list[Conversation],
    turns: range,
    workers: int = 1,
    fetch: bool = False,
    **tiers: Any,
) -> Result:
    engines = []
    for i in range(workers):
        folder = tiers.get("kv_disk_dir")
        own = {**tiers, "kv_disk_dir": f"{folder}-{i}"} if folder and workers > 1 else tiers
        engines.append(LLMEngine(model, engine_config(args, model, **own)))

    async def main() -> Result:
        fleet = Fleet([AsyncEngine(e) for e in engines], fetch)
        start = time.perf_counter()
        try:
            done = await run_turns(fleet, conversations, turns, args, args.seed)
        finally:
            for e in fleet.engines:
                await e.close()
        wall = time.perf_counter() - start
        load: dict[str, int] = {}
        for engine in engines:
            for key, value in engine.load().items():
                load[key] = load.get(key, 0) + int(value)
        for key, value in fleet.export_hits.items():  # not the receiving prompts' hits
            load[key] -= value
        return Result(name, done, wall, load, fleet.fetched_blocks)

    try:
        return asyncio.run(main())
    finally:
        for engine in engines:
            engine.close()


def blocks_gib(model: Path, args: argparse.Namespace, num_blocks: int) -> float:
    from pdserve.common.model_config import load_model_config

    mc = load_model_config(model)
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    per_block = 16 * mc.kv_bytes_per_token // 4 * itemsize
    return num_blocks * per_block / (1 << 30)


def report(results: list[Result], reference_run: Result) -> None:
    print(
        "| tiers | TTFT p50 ms | TTFT p99 ms | prompt tokens computed | from pool | from host"
        " | from disk | from peer | output tok/s | tokens as off |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    reference = {(t.conversation, t.index): t.tokens for t in reference_run.turns}
    base_ttft = base_computed = None
    for r in results:
        ttfts = sorted(t.ttft_s for t in r.turns if t.index > 0)
        p50 = statistics.median(ttfts) * 1e3
        p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1e3
        prompt = sum(t.prompt_tokens for t in r.turns)
        cached = sum(t.cached_tokens for t in r.turns)
        computed = prompt - cached
        host = 16 * (r.load.get("kv_host_hit_blocks", 0) - r.load.get("kv_disk_hit_blocks", 0))
        disk = 16 * r.load.get("kv_disk_hit_blocks", 0)
        peer = 16 * r.fetched_blocks  # written into the pool, then found there
        pool = cached - host - disk - peer
        out_tok_s = sum(len(t.tokens) for t in r.turns) / r.wall_s
        same = sum(reference.get((t.conversation, t.index)) == t.tokens for t in r.turns)
        if base_ttft is None:
            base_ttft, base_computed = p50, computed
        assert base_computed is not None
        print(
            f"| {r.name} | {p50:.0f} ({p50 / base_ttft:.2f}x) | {p99:.0f} | {computed:,}"
            f" ({computed / base_computed:.2f}x) | {pool:,} | {host:,} | {disk:,} | {peer:,}"
            f" | {out_tok_s:.1f} | {same}/{len(r.turns)} |"
        )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="mid")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--think-s", type=float, default=0.5)
    p.add_argument("--pool-blocks", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model, few turns: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.model, args.conversations, args.turns, args.think_s = "tiny", 8, 3, 0.05
        args.system_len, args.pool_blocks = 64, 48
    return args


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    args = parse_args()
    torch.set_num_threads(args.threads)
    print_machine()
    with tempfile.TemporaryDirectory(prefix="pdserve-multi-turn-") as tmp:
        root = Path(tmp)
        model = build_checkpoint(
            MODELS[args.model], root / args.model, write_random_model(root / "tok")
        )
        vocab = MODELS[args.model].vocab_size
        history = args.system_len + args.turns * (args.user_len + args.output_len)
        working_blocks = args.conversations * -(-history // 16)
        ratio = working_blocks / args.pool_blocks
        print(
            f"{args.conversations} conversations x {args.turns} turns, history up to"
            f" {history} tokens; working set {working_blocks} blocks = {ratio:.1f}x the pool"
            f" ({args.pool_blocks} blocks), {args.concurrency} at once, think"
            f" {args.think_s:g} s, {args.model} {args.dtype}, {args.threads} threads",
            flush=True,
        )
        everything = blocks_gib(model, args, working_blocks)
        turns = range(args.turns)
        host_disk = {
            "kv_host_gib": everything / 4,
            "kv_disk_dir": str(root / "disk"),
            "kv_disk_gib": everything * 1.1 + 0.01,
        }
        results = []
        for name, workers, fetch, tiers in (
            ("off", 1, False, {}),
            ("host", 1, False, {"kv_host_gib": everything * 1.1}),
            ("host+disk", 1, False, host_disk),
            ("2 workers: off", 2, False, {}),
            ("2 workers: host+disk", 2, False, {**host_disk, "kv_disk_dir": str(root / "d2")}),
            (
                "2 workers: host+disk+fetch",
                2,
                True,
                {**host_disk, "kv_disk_dir": str(root / "d2f")},
            ),
        ):
            convs = make_conversations(args, vocab)
            results.append(serve(name, args, model, convs, turns, workers, fetch, **tiers))
            print(f"  {name}: {results[-1].wall_s:.1f} s", flush=True)
        report(results[:3], results[0])
        print("\ntwo workers, each turn on the other one than its conversation's last")
        report(results[3:], results[0])

        # the restart case: the first turns on one engine, the next on a new one
        first, rest = range(args.turns - 1), range(args.turns - 1, args.turns)
        restart = []
        for name, folder in (("empty folder", root / "empty"), ("same folder", root / "restart")):
            convs = make_conversations(args, vocab)
            kept: dict[str, Any] = {
                "kv_host_gib": everything / 4,
                "kv_disk_gib": everything * 1.1 + 0.01,
            }
            if name == "same folder":
                serve("before", args, model, convs, first, kv_disk_dir=str(folder), **kept)
            else:  # the same histories, served by an engine that is then gone with its KV
                serve("before", args, model, convs, first, kv_disk_dir=str(root / "gone"), **kept)
            restart.append(serve(name, args, model, convs, rest, kv_disk_dir=str(folder), **kept))
        print("\nrestart: the last turn of every conversation on a new engine")
        print("| new engine on | TTFT p50 ms | prompt tokens computed | from disk |")
        print("|---|---|---|---|")
        for r in restart:
            p50 = statistics.median(t.ttft_s for t in r.turns) * 1e3
            computed = sum(t.prompt_tokens - t.cached_tokens for t in r.turns)
            disk = 16 * r.load.get("kv_disk_hit_blocks", 0)
            print(f"| {r.name} | {p50:.0f} | {computed:,} | {disk:,} |")


if __name__ == "__main__":
    main()
