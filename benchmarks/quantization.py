"""Weight-only int8 (`quantization="int8"`) and the 8-bit KV caches (`kv_cache_dtype`
int8, fp8) against bf16: decode speed, the KV handoff, the KV pool, and the quality they
cost, in one run on one checkpoint.

    python -m pdserve.benchmarks.quantization [--model-size mid|tiny]
        [--variants int8 kv-int8 kv-fp8] [--sections speed kv quality] [--batches 1 32]
        [--steps 16] [--prompt-len 32] [--kv-context 2048] [--kv-batch 16] [--threads 1]
        [--quality-prompts 8] [--quality-tokens 256] [--quality-temperature 1]

The checkpoint is `engine_throughput.py`'s (`build_checkpoint`): a seeded random float32
Llama with `transformers`' initialisation, by default its "mid" shape (hidden 1024, 8
layers, 16 heads, 4 KV heads, intermediate 2816, vocabulary 32000: ~156M parameters),
written to a temporary folder. Real weights, not `load_format="dummy"`: dummy weights give
near-uniform next-token distributions, where agreement means nothing. Every variant loads
it in bfloat16 with its `VARIANTS` overrides of EngineConfig; "bf16" (none) is the
baseline every ratio is taken against, measured in the same run.

- speed: per batch size, decode tokens/s = batch / median step time over `--steps` decode
  steps after the prefill, the ratio to bf16, and each variant's weight bytes
  (`LlamaModel.weight_bytes`). All variants' engines are up at once and take turns, one
  timed step each, so that other load on a shared machine falls on them alike; the share
  of the run's thread time spent waiting for a CPU (`engine_throughput.cpu_wait_since`)
  is printed with the table: near 0 the engines had their cores.
- kv: per variant, the decode step time at `--kv-batch` sequences of `--kv-context`
  tokens (where reading the KV is a large share of a step), the ratio to bf16; one
  `--kv-context`-token request's KV handoff: the bytes of its blocks (codes and scales,
  for an 8-bit cache) and the time from export to admitted on the other side over gRPC on
  127.0.0.1 (export, send, claim, import; the same engine plays the decode side, as a
  second request); and the blocks one GiB of KV memory holds (`LLMEngine.kv_block_bytes`).
- quality: bf16 generates `--quality-tokens` tokens after each of `--quality-prompts`
  random prompts, sampled at `--quality-temperature` with a seed per prompt (greedy, 0,
  soon repeats a few tokens on a random model); every variant then reads those sequences
  teacher forced (each whole sequence as one prefill of the idle engine:
  `sequence_logits`) and is scored at each generated position against bf16's next-token
  distribution there: top-1 agreement (argmax equal) and the mean KL(bf16 || variant),
  in nats.

A random model has no outlier channels and flatter distributions than a trained one:
the quality figures say the quantization works, not what it costs a real model. Timings
are the median step on a machine that may be shared; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.benchmarks.engine_throughput import (
    MAX_PROMPT_ID,
    MODELS,
    build_checkpoint,
    cpu_wait_since,
    thread_cpu_ns,
)
from pdserve.benchmarks.tp_scaling import markdown_table
from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.attention import AttentionMetadata, PrefillBatch, PrefillMeta
from pdserve.engine.demo_model import write_random_model

BASELINE = "bf16"
# Each variant: EngineConfig overrides on top of `base_config`. A new setting (an 8-bit
# KV cache, say) is one more entry; every section measures it against BASELINE.
VARIANTS: dict[str, dict[str, Any]] = {
    BASELINE: {},
    "int8": {"quantization": "int8"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
}
SECTIONS = ("speed", "kv", "quality")
GIB = 1 << 30
BLOCK_SIZE = 16
MIB = 1 << 20


@dataclass(frozen=True)
class SpeedRow:
    variant: str
    batch: int
    step_s: float  # median decode step
    weight_bytes: int

    @property
    def tok_s(self) -> float:
        return self.batch / self.step_s


@dataclass(frozen=True)
class KVRow:
    variant: str
    step_s: float  # median decode step at kv_batch x kv_context
    handoff_bytes: int  # one kv_context-token request's KV blocks
    handoff_s: float  # export -> admitted on the receiving side (median)
    blocks_per_gib: int


@dataclass(frozen=True)
class QualityRow:
    variant: str
    positions: int
    top1_agreement: float
    mean_kl: float


def base_config(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings every variant shares: bfloat16, and a KV pool that holds the
    largest batch of the speed section and a whole quality sequence."""
    per_seq = -(-(args.prompt_len + args.steps + 4) // BLOCK_SIZE)
    quality_len = args.quality_prompt_len + args.quality_tokens
    kv_len = args.kv_context + args.steps + 8
    max_batch = max(args.batches)
    blocks = [max_batch * per_seq, -(-quality_len // BLOCK_SIZE) * 8]
    if "kv" in args.sections:  # the long batch, or a handoff's two copies of one prompt
        blocks.append(max(args.kv_batch, 2) * -(-kv_len // BLOCK_SIZE))
    return {
        "dtype": "bfloat16",
        "num_threads": args.threads,
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": max(blocks) + 8,
        "max_num_seqs": max(max_batch, args.quality_prompts, args.kv_batch),
        "max_model_len": max(args.prompt_len + args.steps + 8, quality_len, kv_len),
        "max_num_batched_tokens": max(2048, args.kv_context),
        # sequence_logits writes the idle engine's first blocks: nothing may be cached there
        "enable_prefix_caching": False,
    }


# -- speed ------------------------------------------------------------------------------------


def decode_step_times(
    llms: dict[str, LLM], batch: int, prompt_len: int, num_steps: int
) -> dict[str, list[float]]:
    """Each engine's `num_steps` decode step times at `batch` sequences (the same random
    prompts for all), after their prefill and one warm-up step; the engines take turns."""
    rng = random.Random(batch)
    prompts = [[rng.randrange(MAX_PROMPT_ID) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=num_steps + 3, temperature=0.0, ignore_eos=True)
    for llm in llms.values():
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"speed-{batch}-{i}", prompt, params)
        sampled: set[str] = set()
        while len(sampled) < batch:  # the prefill, chunked within the step budget
            sampled.update(out.request_id for out in engine.step())
        engine.step()
    times: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(num_steps):
        for name, llm in llms.items():
            start = time.perf_counter()
            llm.engine.step()
            times[name].append(time.perf_counter() - start)
    for llm in llms.values():
        while llm.engine.has_unfinished:
            llm.engine.step()
    return times


def measure_speed(llms: dict[str, LLM], args: argparse.Namespace) -> tuple[list[SpeedRow], float]:
    """The rows of every variant and batch, and the share of thread time spent waiting."""
    clock = thread_cpu_ns()
    rows = []
    for batch in args.batches:
        times = decode_step_times(llms, batch, args.prompt_len, args.steps)
        for name, llm in llms.items():
            weight_bytes = sum(llm.engine.model.weight_bytes())
            rows.append(SpeedRow(name, batch, statistics.median(times[name]), weight_bytes))
            print(f"  {name} batch {batch}: {rows[-1].tok_s:.1f} tok/s", flush=True)
    return rows, cpu_wait_since(clock)


def speed_table(rows: list[SpeedRow]) -> str:
    base = {r.batch: r for r in rows if r.variant == BASELINE}
    cells = [
        [
            r.variant,
            str(r.batch),
            f"{r.step_s * 1e3:.2f}",
            f"{r.tok_s:.1f}",
            f"{r.tok_s / base[r.batch].tok_s:.2f}x",
            f"{r.weight_bytes / MIB:.1f}",
            f"{r.weight_bytes / base[r.batch].weight_bytes:.2f}",
        ]
        for r in rows
    ]
    headers = ["variant", "batch", "step ms (median)", "tok/s", "vs bf16", "weights MiB"]
    return markdown_table([*headers, "weights vs bf16"], cells)


# -- the KV cache: long-context steps, the handoff, the pool -----------------------------------


def handoff_times(llm: LLM, prompt: list[int], repeats: int) -> tuple[int, float]:
    """(bytes, median seconds) of `prompt`'s KV handoff: prefill (held), then export,
    send over gRPC on 127.0.0.1, claim and import as another request of the same engine;
    timed from the export to the import's return."""
    import asyncio

    from pdserve.kv_transfer import make_receiver, make_sender
    from pdserve.kv_transfer.base import ReceiverConfig, make_header
    from pdserve.kv_transfer.torch_payload import layout_of, payload_bytes, payload_tensor

    engine = llm.engine
    layout = layout_of(engine.runner.kv_cache, engine.config.kv_cache_dtype)
    token = "bench"
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    decode = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def body() -> tuple[int, list[float]]:
        receiver = make_receiver("grpc", ReceiverConfig(cluster_token=token, layout=layout))
        sender = make_sender("grpc")
        address = await receiver.start()
        times: list[float] = []
        nbytes = 0
        try:
            for i in range(repeats):
                rid = f"handoff-{i}"
                engine.add_request(rid, prompt, prefill, hold_kv=True)
                first = -1
                while engine.has_unfinished:
                    for out in engine.step():
                        first = out.token_ids[0]
                start = time.perf_counter()
                export = engine.export_kv(rid)
                payload = payload_bytes(export.wait())
                receiver.expect(rid)
                header = make_header(rid, "bench", layout, payload, token, first_token=first)
                await sender.send(address, header, payload, timeout_s=60)
                got = await receiver.claim(rid, timeout_s=60)
                tensor = payload_tensor(got.payload, got.header.layout)
                engine.add_prefilled_request(f"{rid}-d", prompt, first, decode, tensor)
                times.append(time.perf_counter() - start)
                nbytes = payload.size
                got.release()
                export.release()
                engine.release_kv(rid)
                while engine.has_unfinished:
                    engine.step()
        finally:
            await sender.close()
            await receiver.close()
        return nbytes, times

    nbytes, times = asyncio.run(body())
    return nbytes, statistics.median(times)


def measure_kv(llms: dict[str, LLM], args: argparse.Namespace) -> list[KVRow]:
    times = decode_step_times(llms, args.kv_batch, args.kv_context, args.steps)
    rng = random.Random(7)
    prompt = [rng.randrange(MAX_PROMPT_ID) for _ in range(args.kv_context)]
    rows = []
    for name, llm in llms.items():
        nbytes, seconds = handoff_times(llm, prompt, repeats=3)
        blocks = GIB // llm.engine.kv_block_bytes
        rows.append(KVRow(name, statistics.median(times[name]), nbytes, seconds, blocks))
        print(f"  {name}: step {rows[-1].step_s * 1e3:.1f} ms, handoff {nbytes} B", flush=True)
    return rows


def kv_table(rows: list[KVRow], args: argparse.Namespace) -> str:
    base = next(r for r in rows if r.variant == BASELINE)
    cells = [
        [
            r.variant,
            f"{r.step_s * 1e3:.1f}",
            f"{base.step_s / r.step_s:.2f}x",
            f"{r.handoff_bytes / MIB:.2f}",
            f"{r.handoff_bytes / base.handoff_bytes:.3f}",
            f"{r.handoff_s * 1e3:.1f}",
            f"{base.handoff_s / r.handoff_s:.2f}x",
            str(r.blocks_per_gib),
            f"{r.blocks_per_gib / base.blocks_per_gib:.2f}x",
        ]
        for r in rows
    ]
    ctx = f"{args.kv_batch} x {args.kv_context}"
    headers = [
        "variant",
        f"decode step ms at {ctx}",
        "speed vs bf16",
        f"handoff MiB ({args.kv_context} tokens)",
        "bytes vs bf16",
        "handoff ms",
        "vs bf16",
        "blocks per GiB",
        "vs bf16",
    ]
    return markdown_table(headers, cells)


# -- quality ----------------------------------------------------------------------------------


@torch.inference_mode()
def sequence_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len, vocab] at every position of `token_ids`: the whole sequence as
    one prefill through the engine's own model, attention backend and KV cache, into its
    first blocks (the engine must be idle, with prefix caching off)."""
    runner, device = engine.runner, engine.device
    num_tokens = len(token_ids)
    block_ids = torch.arange(-(-num_tokens // BLOCK_SIZE), device=device)
    positions = torch.arange(num_tokens, device=device)
    prefill = PrefillMeta(0, num_tokens, num_tokens, block_ids)
    batch = None
    if runner.backend.wants_prefill_batch:
        batch = PrefillBatch(
            block_tables=block_ids.to(torch.int32)[None, :],
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        )
    meta = AttentionMetadata(
        slot_mapping=block_ids[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE,
        num_prefill_tokens=num_tokens,
        prefills=[prefill],
        prefill_batch=batch,
        decode=None,
    )
    ids = torch.tensor(token_ids, device=device)
    hidden = engine.model.forward(ids, positions, runner.kv_caches, runner.backend, meta)
    return engine.model.logits(hidden)


def reference_sequences(llm: LLM, args: argparse.Namespace) -> list[list[int]]:
    """Random prompts, each followed by the baseline's continuation (seeded)."""
    rng = random.Random(0)
    prompts = [
        [rng.randrange(MAX_PROMPT_ID) for _ in range(args.quality_prompt_len)]
        for _ in range(args.quality_prompts)
    ]
    params = [
        SamplingParams(
            max_tokens=args.quality_tokens,
            temperature=args.quality_temperature,
            seed=seed,
            ignore_eos=True,
        )
        for seed in range(len(prompts))
    ]
    outs = llm.generate(prompts, params)
    return [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]


def generated_logits(llm: LLM, sequences: list[list[int]], prompt_len: int) -> torch.Tensor:
    """[positions, vocab]: the logits that predict each generated token, all sequences."""
    rows = [sequence_logits(llm.engine, s)[prompt_len - 1 : -1] for s in sequences]
    return torch.cat(rows).cpu()


def quality_row(variant: str, reference: torch.Tensor, logits: torch.Tensor) -> QualityRow:
    agreement = (logits.argmax(-1) == reference.argmax(-1)).double().mean().item()
    log_p, log_q = F.log_softmax(reference, -1), F.log_softmax(logits, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    return QualityRow(variant, logits.shape[0], agreement, kl)


def quality_table(rows: list[QualityRow]) -> str:
    cells = [
        [r.variant, str(r.positions), f"{r.top1_agreement:.2%}", f"{r.mean_kl:.2e}"] for r in rows
    ]
    headers = ["variant", "positions", "top-1 agreement vs bf16", "mean KL(bf16 || variant)"]
    return markdown_table(headers, cells)


# -- the run ----------------------------------------------------------------------------------


def measure_quality(llms: dict[str, LLM], args: argparse.Namespace) -> list[QualityRow]:
    sequences = reference_sequences(llms[BASELINE], args)
    distinct = len({t for s in sequences for t in s[args.quality_prompt_len :]})
    print(
        f"quality: teacher forced on bf16's tokens, sampled at temperature"
        f" {args.quality_temperature:g} ({distinct} distinct generated ids)",
        flush=True,
    )
    logits = {
        name: generated_logits(llm, sequences, args.quality_prompt_len)
        for name, llm in llms.items()
    }
    return [quality_row(name, logits[BASELINE], logits[name]) for name in llms]


def run(args: argparse.Namespace, model_dir: Path) -> None:
    config = base_config(args)
    speed: list[SpeedRow] = []
    kv: list[KVRow] = []
    quality: list[QualityRow] = []
    with contextlib.ExitStack() as stack:
        llms: dict[str, LLM] = {}
        for variant in [BASELINE, *args.variants]:
            start = time.perf_counter()
            llms[variant] = stack.enter_context(LLM(model_dir, **config, **VARIANTS[variant]))
            print(f"{variant}: engine up in {time.perf_counter() - start:.1f} s", flush=True)
        if "speed" in args.sections:
            speed, cpu_wait = measure_speed(llms, args)
            print("\n" + speed_table(speed))
            print(f"cpu-wait: {cpu_wait:.0%} of the speed section's runnable thread time\n")
        if "kv" in args.sections:
            clock = thread_cpu_ns()
            kv = measure_kv(llms, args)
            print("\n" + kv_table(kv, args))
            print(f"cpu-wait: {cpu_wait_since(clock):.0%} of the kv section's thread time\n")
        if "quality" in args.sections:
            quality = measure_quality(llms, args)
            print(quality_table(quality))
    print_summary(speed, kv, quality)


def print_summary(speed: list[SpeedRow], kv: list[KVRow], quality: list[QualityRow]) -> None:
    base = {r.batch: r for r in speed if r.variant == BASELINE}
    print()
    for r in speed:
        if r.variant != BASELINE:
            ratio = r.tok_s / base[r.batch].tok_s
            print(f"{r.variant} vs {BASELINE} decode tok/s at batch {r.batch}: {ratio:.2f}x")
    kv_base = next((r for r in kv if r.variant == BASELINE), None)
    for k in kv:
        if kv_base is not None and k.variant != BASELINE:
            print(
                f"{k.variant} vs {BASELINE}: long-context decode step"
                f" {kv_base.step_s / k.step_s:.2f}x as fast, handoff bytes"
                f" {k.handoff_bytes / kv_base.handoff_bytes:.3f}x, handoff"
                f" time {k.handoff_s / kv_base.handoff_s:.2f}x, blocks per GiB"
                f" {k.blocks_per_gib / kv_base.blocks_per_gib:.2f}x"
            )
    for q in quality:
        if q.variant != BASELINE:
            print(
                f"{q.variant} vs {BASELINE} over {q.positions} positions: top-1 agreement"
                f" {q.top1_agreement:.2%}, mean KL {q.mean_kl:.2e} nats"
            )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(MODELS), default="mid")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=[v for v in VARIANTS if v != BASELINE],
        default=[v for v in VARIANTS if v != BASELINE],
        help=f"measured against {BASELINE}, which always runs",
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--kv-context", type=int, default=2048, help="kv section: tokens a row")
    parser.add_argument("--kv-batch", type=int, default=16, help="kv section: decode rows")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--quality-prompts", type=int, default=8)
    parser.add_argument("--quality-prompt-len", type=int, default=16)
    parser.add_argument("--quality-tokens", type=int, default=256, help="per prompt")
    parser.add_argument(
        "--quality-temperature", type=float, default=1.0, help="of bf16's sequences; 0: greedy"
    )
    return parser.parse_args()


def main() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    args = parse_args()
    spec = MODELS[args.model_size]
    with tempfile.TemporaryDirectory(prefix="pdserve-quant-") as tmp:
        start = time.perf_counter()
        tokenizer_dir = write_random_model(Path(tmp) / "random")
        model_dir = build_checkpoint(spec, Path(tmp) / spec.name, tokenizer_dir)
        print(
            f"{spec.name} Llama (hidden {spec.hidden_size}, {spec.num_layers} layers,"
            f" intermediate {spec.intermediate_size}, vocabulary {spec.vocab_size}), random"
            f" weights, built in {time.perf_counter() - start:.1f} s; bfloat16 activations;"
            f" {args.threads} torch thread(s); variants {[BASELINE, *args.variants]}",
            flush=True,
        )
        run(args, model_dir)


if __name__ == "__main__":
    main()
