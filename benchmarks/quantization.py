"""Weight-only int8 (`quantization="int8"`) and the 8-bit KV caches (`kv_cache_dtype`
int8, fp8) against bf16: decode speed, the KV handoff, the KV pool, and the quality they
cost, in one run on one checkpoint.

    python -m pdserve.benchmarks.quantization [--model-size mid|tiny]
        [--variants int8 kv-int8 kv-fp8] [--sections speed handoff quality kv]
        [--batches 1 32] [--steps 16] [--prompt-len 32] [--handoff-context 2032]
        [--kv-batch 8] [--kv-context 2032] [--kv-steps 8] [--threads 1]
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
- handoff: per variant, one `--handoff-context`-token request's KV handoff: the bytes of
  its blocks (codes and scales, for an 8-bit cache) and the time from export to admitted
  on the other side over gRPC on 127.0.0.1 (export, send, claim, import; the same engine
  plays the decode side, as a second request); and the blocks one GiB of KV memory holds
  (`LLMEngine.kv_block_bytes`).
- quality: bf16 generates `--quality-tokens` tokens after each of `--quality-prompts`
  random prompts, sampled at `--quality-temperature` with a seed per prompt (greedy, 0,
  soon repeats a few tokens on a random model); every variant then reads those sequences
  teacher forced (each whole sequence as one prefill of the idle engine:
  `sequence_logits`) and is scored at each generated position against bf16's next-token
  distribution there: top-1 agreement (argmax equal) and the mean KL(bf16 || variant),
  in nats.
- kv: the 8-bit KV cache (`kv_cache_dtype` int8 / fp8)
  against the model's dtype ("auto"): the median decode step of a whole engine at
  `--kv-batch` sequences of `--kv-context` tokens (`kv_step_times`: the sequences arrive
  as prefilled requests with random KV, so no prefill runs), and one layer's decode
  attention over such a cache (`kv_attention_times`), on the `cpu` backend (the C kernel
  reads the 8-bit rows in place) and on the `torch` one (gathers and dequantizes a copy).

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
from pdserve.benchmarks.machine import print_machine
from pdserve.benchmarks.tp_scaling import markdown_table
from pdserve.demo.model import write_random_model
from pdserve.engine import LLM, LLMEngine, SamplingParams
from pdserve.engine.cpu import kernels as cpu_kernels
from pdserve.engine.modeling import kv_quant
from pdserve.engine.modeling.attention import (
    AttentionBackend,
    AttentionMetadata,
    CpuAttentionBackend,
    DecodeMeta,
    KVCache,
    PrefillBatch,
    PrefillMeta,
    TorchAttentionBackend,
)

BASELINE = "bf16"
# Each variant: EngineConfig overrides on top of `base_config`. A new setting (an 8-bit
# KV cache, say) is one more entry; every section measures it against BASELINE.
VARIANTS: dict[str, dict[str, Any]] = {
    BASELINE: {},
    "int8": {"quantization": "int8"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
}
SECTIONS = ("speed", "handoff", "quality", "kv")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
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
class HandoffRow:
    variant: str
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
    kv_len = args.handoff_context + 8
    max_batch = max(args.batches)
    blocks = [max_batch * per_seq, -(-quality_len // BLOCK_SIZE) * 8]
    if "handoff" in args.sections:  # a handoff's two copies of one prompt
        blocks.append(2 * -(-kv_len // BLOCK_SIZE))
    return {
        "dtype": "bfloat16",
        "num_threads": args.threads,
        "block_size": BLOCK_SIZE,
        "num_kv_blocks": max(blocks) + 8,
        "max_num_seqs": max(max_batch, args.quality_prompts),
        "max_model_len": max(args.prompt_len + args.steps + 8, quality_len, kv_len),
        "max_num_batched_tokens": max(2048, args.handoff_context),
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


def measure_handoff(llms: dict[str, LLM], args: argparse.Namespace) -> list[HandoffRow]:
    rng = random.Random(7)
    prompt = [rng.randrange(MAX_PROMPT_ID) for _ in range(args.handoff_context)]
    rows = []
    for name, llm in llms.items():
        nbytes, seconds = handoff_times(llm, prompt, repeats=3)
        blocks = GIB // llm.engine.kv_block_bytes
        rows.append(HandoffRow(name, nbytes, seconds, blocks))
        print(f"  {name}: handoff {nbytes} B in {seconds * 1e3:.1f} ms", flush=True)
    return rows


def handoff_table(rows: list[HandoffRow], args: argparse.Namespace) -> str:
    base = next(r for r in rows if r.variant == BASELINE)
    cells = [
        [
            r.variant,
            f"{r.handoff_bytes / MIB:.2f}",
            f"{r.handoff_bytes / base.handoff_bytes:.3f}",
            f"{r.handoff_s * 1e3:.1f}",
            f"{base.handoff_s / r.handoff_s:.2f}x",
            str(r.blocks_per_gib),
            f"{r.blocks_per_gib / base.blocks_per_gib:.2f}x",
        ]
        for r in rows
    ]
    headers = [
        "variant",
        f"handoff MiB ({args.handoff_context} tokens)",
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


# -- 8-bit KV cache ---------------------------------------------------------------------------


def random_kv(shape: tuple[int, ...], kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """Random K/V values of `shape` (last dim head_dim) as `kv_cache_dtype` rows."""
    values = torch.randn(shape)
    if kv_quant.is_quantized(kv_cache_dtype):
        return kv_quant.quantize(values, kv_cache_dtype)
    return values.to(dtype)


def kv_step_times(
    model_dir: Path,
    config: dict[str, Any],
    kv_cache_dtypes: tuple[str, ...] = KV_CACHE_DTYPES,
    batch: int = 8,
    context_len: int = 2032,
    num_steps: int = 8,
) -> dict[str, list[float]]:
    """Per `kv_cache_dtype`, `num_steps` decode step times of an engine (`config` plus
    that format) holding `batch` sequences of `context_len` tokens of context.

    The sequences arrive as prefilled requests (`add_prefilled_request`, the decode
    role's path) with random KV in the engine's format: a decode step's cost does not
    depend on the values, and a CPU would take minutes to prefill them. The engines are
    up at once and take turns, one timed step each, after one warm-up step."""
    block_size = config.get("block_size", BLOCK_SIZE)
    per_seq = -(-(context_len + num_steps + 2) // block_size)
    config = {
        **config,
        "num_kv_blocks": batch * per_seq + 8,
        "max_num_seqs": batch,
        "max_model_len": context_len + num_steps + 2,
        "enable_prefix_caching": False,
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(MAX_PROMPT_ID) for _ in range(context_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=num_steps + 2, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {kv: [] for kv in kv_cache_dtypes}
    with contextlib.ExitStack() as stack:
        engines = {}
        for kv in kv_cache_dtypes:
            llm = stack.enter_context(LLM(model_dir, **config, kv_cache_dtype=kv))
            engine = engines[kv] = llm.engine
            cache = engine.runner.kv_cache  # [layers, 2, blocks, KVH, bs, row]
            layers, _, _, kv_heads, _, row = cache.shape
            head_dim = row - kv_quant.SCALE_BYTES if kv_quant.is_quantized(kv) else row
            shape = (layers, 2, -(-context_len // block_size), kv_heads, block_size, head_dim)
            for i, prompt in enumerate(prompts):
                payload = random_kv(shape, kv, cache.dtype)
                engine.add_prefilled_request(f"kv-{i}", prompt, prompt[-1], params, payload)
            engine.step()
        for _ in range(num_steps):
            for kv, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                times[kv].append(time.perf_counter() - start)
    return times


def kv_attention_times(
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    kv_cache_dtypes: tuple[str, ...] = KV_CACHE_DTYPES,
    batch: int = 8,
    context_len: int = 2048,
    num_iters: int = 20,
    block_size: int = BLOCK_SIZE,
) -> dict[tuple[str, str], list[float]]:
    """One layer's decode attention (the new token's K/V write included), per (backend,
    `kv_cache_dtype`): `batch` sequences of `context_len` tokens of random KV in shuffled
    blocks, on the `cpu` backend (the C kernel, when it builds here) and the `torch` one,
    taking turns, `num_iters` timed calls each after one warm-up."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context_len // block_size)
    num_blocks = batch * per_seq + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen)[: batch * per_seq] + 1).view(batch, -1)
    lens = torch.full((batch,), context_len, dtype=torch.int32)
    last = lens.long() - 1
    slots = tables.gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    decode = DecodeMeta(tables.int(), lens, lens.tolist())
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(batch, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    kernels = cpu_kernels.load()
    runs: dict[tuple[str, str], tuple[AttentionBackend, KVCache, AttentionMetadata]] = {}
    for kv in kv_cache_dtypes:
        shape = (num_blocks, kv_heads, block_size, head_dim)
        cache = (random_kv(shape, kv, dtype), random_kv(shape, kv, dtype))
        backends: list[AttentionBackend] = [TorchAttentionBackend(kv)]
        if kernels is not None and kernels.takes(dtype, kv):
            backends.append(CpuAttentionBackend(kernels, kv))
        for backend in backends:
            # a metadata per backend: its step plan is made once, as an engine step's is
            meta = AttentionMetadata(slots, 0, [], None, decode)
            runs[backend.name, kv] = (backend, cache, meta)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for i in range(num_iters + 1):
        for key, (backend, cache, meta) in runs.items():
            start = time.perf_counter()
            backend.forward(q, k, v, cache, meta, head_dim**-0.5)
            if i:
                times[key].append(time.perf_counter() - start)
    return times


def kv_table(steps: dict[str, list[float]], attention: dict[tuple[str, str], list[float]]) -> str:
    """Median times, and each against "auto" (the model's dtype) on the same path."""
    cells = []
    base_step = statistics.median(steps["auto"]) if "auto" in steps else None
    for kv, ts in steps.items():
        med = statistics.median(ts)
        ratio = f"{med / base_step:.2f}x" if base_step else "-"
        cells.append(["engine decode step", kv, "auto", f"{med * 1e3:.2f}", ratio])
    for (backend, kv), ts in attention.items():
        med = statistics.median(ts)
        base = attention.get((backend, "auto"))
        ratio = f"{med / statistics.median(base):.2f}x" if base else "-"
        cells.append(["one layer's decode attention", kv, backend, f"{med * 1e3:.3f}", ratio])
    headers = ["what", "kv_cache_dtype", "attention backend", "ms (median)", "vs auto"]
    return markdown_table(headers, cells)


def measure_kv(model_dir: Path, args: argparse.Namespace) -> str:
    spec = MODELS[args.model_size]
    config = {"dtype": "bfloat16", "num_threads": args.threads, "block_size": BLOCK_SIZE}
    steps = kv_step_times(
        model_dir, config, batch=args.kv_batch, context_len=args.kv_context, num_steps=args.kv_steps
    )
    attention = kv_attention_times(
        spec.num_heads,
        spec.num_kv_heads,
        spec.hidden_size // spec.num_heads,
        batch=args.kv_batch,
        context_len=args.kv_context,
    )
    return kv_table(steps, attention)


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
    handoff: list[HandoffRow] = []
    quality: list[QualityRow] = []
    with contextlib.ExitStack() as stack:
        llms: dict[str, LLM] = {}
        weight_sections = {"speed", "handoff", "quality"} & set(args.sections)
        for variant in [BASELINE, *args.variants] if weight_sections else []:
            start = time.perf_counter()
            llms[variant] = stack.enter_context(LLM(model_dir, **config, **VARIANTS[variant]))
            print(f"{variant}: engine up in {time.perf_counter() - start:.1f} s", flush=True)
        if "speed" in args.sections:
            speed, cpu_wait = measure_speed(llms, args)
            print("\n" + speed_table(speed))
            print(f"cpu-wait: {cpu_wait:.0%} of the speed section's runnable thread time\n")
        if "handoff" in args.sections:
            handoff = measure_handoff(llms, args)
            print("\n" + handoff_table(handoff, args) + "\n")
        if "quality" in args.sections:
            quality = measure_quality(llms, args)
            print(quality_table(quality))
    if "kv" in args.sections:  # engines of its own: the variants' are closed by now
        clock = thread_cpu_ns()
        print("\n" + measure_kv(model_dir, args))
        print(f"cpu-wait: {cpu_wait_since(clock):.0%} of the kv section's runnable thread time")
    print_summary(speed, handoff, quality)


def print_summary(
    speed: list[SpeedRow], handoff: list[HandoffRow], quality: list[QualityRow]
) -> None:
    base = {r.batch: r for r in speed if r.variant == BASELINE}
    print()
    for r in speed:
        if r.variant != BASELINE:
            ratio = r.tok_s / base[r.batch].tok_s
            print(f"{r.variant} vs {BASELINE} decode tok/s at batch {r.batch}: {ratio:.2f}x")
    kv_base = next((r for r in handoff if r.variant == BASELINE), None)
    for k in handoff:
        if kv_base is not None and k.variant != BASELINE:
            print(
                f"{k.variant} vs {BASELINE}: handoff bytes"
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
    parser.add_argument("--kv-batch", type=int, default=8, help="sequences of the kv section")
    parser.add_argument(
        "--kv-context", type=int, default=2032, help="context tokens per sequence (kv section)"
    )
    parser.add_argument(
        "--kv-steps",
        type=int,
        default=8,
        help="timed decode steps (kv section; context + steps stays under the model's 2048)",
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument(
        "--handoff-context", type=int, default=2032, help="prompt tokens of the handed-off request"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--quality-prompts", type=int, default=8)
    parser.add_argument("--quality-prompt-len", type=int, default=16)
    parser.add_argument("--quality-tokens", type=int, default=256, help="per prompt")
    parser.add_argument(
        "--quality-temperature", type=float, default=1.0, help="of bf16's sequences; 0: greedy"
    )
    return parser.parse_args()


def main() -> None:
    print_machine()  # the CPU and its flags, with every figure
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
