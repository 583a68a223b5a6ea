"""The whole engine on its Triton kernels, on CPU under Triton's interpreter.

`attention_backend="triton"` off CUDA runs every Triton kernel the engine has: attention
(prefill and decode), cache writes, RMSNorm, rotary, the int8 matmul and the KV handoff's
pack/unpack (engine/llm_engine.py, `triton_off_cuda`). On a tiny float32 checkpoint its
greedy tokens equal the torch backend's and `transformers'`, with prefix caching, chunked
prefill and a decode batch of several sequences, over an 8-bit KV cache too. With int8
weights the Triton matmul and the CPU one (the C kernel, or torch's op) sum in other
orders: tokens equal, logits to float32 rounding. A handoff packs and unpacks the very
bytes torch's gather and scatter move. Spies on the kernel launchers prove each ran, and
that the C / torch paths they replace did not.

Every kernel launch is interpreted: tiny shapes, few tokens.
"""

from __future__ import annotations

import os
import pkgutil
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.cpu import int8 as cpu_int8
from pdserve.engine.modeling import linear
from pdserve.engine.modeling.linear import Int8Linear
from pdserve.engine.worker.kv_staging import KVStaging

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "yes", "on"),
    reason="the Triton path on CPU runs only in Triton's interpreter (tests/conftest.py)",
)
BLOCK = 8
MAX_TOKENS = 4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
# The launchers an engine on the Triton path calls, by a short name: (module, attribute).
TRITON_LAUNCHERS = {
    "rms_norm": ("pdserve.kernels.rms_norm", "rms_norm"),
    "rotary": ("pdserve.kernels.rotary_embedding", "rotary_embedding"),
    "cache_write": ("pdserve.engine.modeling.triton_backend", "reshape_and_cache"),
    "prefill_attention": ("pdserve.engine.modeling.triton_backend", "paged_prefill_attention"),
    "decode_attention": ("pdserve.engine.modeling.triton_backend", "paged_decode_attention"),
    "int8_linear": ("pdserve.kernels.int8_linear", "int8_linear"),
    "kv_pack": ("pdserve.kernels.kv_pack", "kv_pack"),
    "kv_unpack": ("pdserve.kernels.kv_pack", "kv_unpack"),
}
# What runs in their place on CPU off the Triton path (the C int8 kernel where it builds).
CPU_PATHS = {
    "torch_gather": ("pdserve.engine.worker.kv_staging", "_gather"),
    "torch_scatter": ("pdserve.engine.worker.kv_staging", "_scatter"),
    "c_int8_linear": ("pdserve.engine.cpu.int8", "Int8CpuKernel.linear"),
}
FORWARD_KERNELS = {"rms_norm", "rotary", "cache_write", "prefill_attention", "decode_attention"}
# Int8 weights, Triton against the CPU matmul: float32 sums of the same products in other
# orders (and the Triton norm's statistics): measured 2.4e-6 at most, on logits up to 2.9.
INT8_LOGITS_ATOL = 1e-5


def _prompts() -> tuple[list[int], list[list[int]]]:
    """A first prompt, then a batch: one sharing its first two blocks (a prefix hit),
    one shorter than a block, one over three blocks."""
    rng = random.Random(3)
    first = [rng.randrange(3, 512) for _ in range(2 * BLOCK + 5)]
    batch = [
        [*first[: 2 * BLOCK], *(rng.randrange(3, 512) for _ in range(3))],
        [rng.randrange(3, 512) for _ in range(BLOCK - 3)],
        [rng.randrange(3, 512) for _ in range(3 * BLOCK + 2)],
    ]
    return first, batch


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    """Hidden 64, 2 layers, 4 query heads over 2 KV heads (GQA), head_dim 16."""
    return Path(make_checkpoint(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Calls of each Triton launcher and each CPU path, by the names above; set before
    an engine is built (the ops and the int8 layers bind their launchers then)."""
    counter: Counter[str] = Counter()
    for name, (module, attr) in {**TRITON_LAUNCHERS, **CPU_PATHS}.items():
        target = f"{module}.{attr}"
        monkeypatch.setattr(target, _spy(counter, name, pkgutil.resolve_name(target)))
    return counter


def _spy(counter: Counter[str], name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counter[name] += 1
        return original(*args, **kwargs)

    return counted


class Run(NamedTuple):
    tokens: list[list[int]]
    logits: torch.Tensor  # every logits row sampled from, in step order
    int8_backends: list[str]  # Int8Linear.backend of every int8 projection


def _generate(model_dir: Path, backend: str, **config: Any) -> Run:
    """Greedy tokens of the first prompt, then of the batch (a prefix hit, 3 sequences
    decoding together)."""
    llm = LLM(model_dir, dtype="float32", block_size=BLOCK, attention_backend=backend, **config)
    try:
        assert llm.engine.runner.backend.name == backend
        logits = _record_logits(llm)
        first, batch = _prompts()
        outs = llm.generate([first], GREEDY) + llm.generate(batch, GREEDY)
        assert outs[1].num_cached_tokens == 2 * BLOCK  # the shared blocks came from the cache
        llm.engine.block_pool.check_no_leaks()
        backends = [
            lin.backend
            for layer in llm.engine.model.layers
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
            if isinstance(lin, Int8Linear)
        ]
    finally:
        llm.close()
    return Run([out.token_ids for out in outs], torch.cat(logits), backends)


def _record_logits(llm: LLM) -> list[torch.Tensor]:
    runner = llm.engine.runner
    seen: list[torch.Tensor] = []
    sample = runner.sampler

    def recording(logits: torch.Tensor, *args: Any) -> Any:
        seen.append(logits.clone())
        return sample(logits, *args)

    runner.sampler = recording  # type: ignore[assignment]
    return seen


def _forward_kernels_ran(calls: Counter[str]) -> None:
    missing = [name for name in sorted(FORWARD_KERNELS) if not calls[name]]
    assert not missing, f"kernels that never ran: {missing} ({dict(calls)})"


@pytest.mark.parametrize(
    ("kv_dtype", "engine_kwargs"),
    [
        ("auto", {}),
        ("auto", {"max_num_batched_tokens": 8}),  # chunked prefill beside decode rows
        ("int8", {}),
        ("fp8", {}),
    ],
    ids=["prefix-cache", "chunked", "int8-kv", "fp8-kv"],
)
def test_triton_path_tokens_equal_torch_and_transformers(
    model_dir: Path,
    calls: Counter[str],
    hf_greedy: Any,
    kv_dtype: str,
    engine_kwargs: dict[str, Any],
) -> None:
    config = {"kv_cache_dtype": kv_dtype, **engine_kwargs}
    want = _generate(model_dir, "torch", **config).tokens
    assert not calls, f"the torch backend ran Triton launchers: {dict(calls)}"
    got = _generate(model_dir, "triton", **config).tokens
    _forward_kernels_ran(calls)
    assert got == want
    first, batch = _prompts()
    assert want == hf_greedy(model_dir, [first, *batch], MAX_TOKENS, kv_cache_dtype=kv_dtype)


def test_triton_int8_matmul_picks_the_cpu_matmuls_tokens(
    model_dir: Path, calls: Counter[str]
) -> None:
    """No `transformers` reference here (its weights are not int8): the CPU int8 path,
    itself pinned to the dequantized matmul (test_quantization.py), is."""
    cpu = _generate(model_dir, "torch", quantization="int8")
    num_linears = 4 * 2  # q|k|v, o, gate|up and down of 2 layers
    assert len(cpu.int8_backends) == num_linears
    (cpu_backend,) = set(cpu.int8_backends)
    assert cpu_backend in ("c", "torch") and calls["int8_linear"] == 0
    assert (calls["c_int8_linear"] > 0) == (cpu_backend == "c")
    calls.clear()
    triton = _generate(model_dir, "triton", quantization="int8")
    assert triton.int8_backends == ["triton"] * num_linears
    # the 4 projections of each layer in every forward (one rotary per layer per forward)
    assert calls["int8_linear"] > 0 and calls["int8_linear"] == 4 * calls["rotary"]
    assert calls["c_int8_linear"] == 0
    _forward_kernels_ran(calls)
    assert triton.tokens == cpu.tokens
    error = (triton.logits - cpu.logits).abs().max().item()
    assert error <= INT8_LOGITS_ATOL, error


@pytest.mark.parametrize("cpu_path", ["c", "torch"])
def test_on_triton_keeps_the_int8_rows_and_drops_the_cpu_layout(
    cpu_path: str, calls: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the C kernel's packed layout, or torch's op's rows padded to 16 columns (40
    here: 48 held), to plain [out, in] rows, computing the same to float32 rounding."""
    kernel = cpu_int8.load()
    if cpu_path == "c" and (kernel is None or not kernel.vectorised):
        pytest.skip("the C int8 kernel is not built vectorised here (needs AVX-512)")
    if cpu_path == "torch":
        monkeypatch.setattr(linear, "_cpu_kernel", lambda scales: None)
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 40, generator=gen), torch.randn(24, generator=gen)
    layer = Int8Linear.quantize(weight, bias)
    assert layer.backend == cpu_path
    on_triton = layer.on_triton()
    assert on_triton.backend == "triton" and on_triton.on_triton() is on_triton
    assert on_triton.weight.shape == (24, 40) and on_triton.weight.is_contiguous()
    rows, scales = layer.int8_weight()
    assert torch.equal(on_triton.weight, rows) and torch.equal(on_triton.scales, scales)
    x = torch.randn(5, 40, generator=gen)
    torch.testing.assert_close(on_triton(x), layer(x), rtol=1e-5, atol=1e-5)
    assert calls["int8_linear"] == 1


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_handoff_packs_and_unpacks_with_the_kernels(
    model_dir: Path, calls: Counter[str], hf_greedy: Any, kv_dtype: str
) -> None:
    """A prefill engine exports a prompt's KV through kv_pack, a decode engine imports it
    through kv_unpack and finishes the request: the same bytes as torch's gather and
    scatter, the tokens `transformers` picks."""
    config = EngineConfig(
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=16,
        attention_backend="triton",
        kv_cache_dtype=kv_dtype,
    )
    prefill, decode, decode_torch = (LLMEngine(model_dir, config) for _ in range(3))
    prompt = _prompts()[1][2]  # 3 full blocks and a partial one
    num_blocks = -(-len(prompt) // BLOCK)
    prefill.add_request("r", prompt, FIRST_TOKEN, hold_kv=True)
    _run(prefill)
    assert prefill.kv_staging.use_kernels and decode.kv_staging.use_kernels
    export = prefill.export_kv("r")
    assert calls["kv_pack"] == 1 and calls["torch_gather"] == 0
    assert prefill.load()["kv_kernel_blocks_packed"] == num_blocks
    # the torch path's export of the same cache: byte for byte the kernel's
    prefill.kv_staging = KVStaging(prefill.runner.kv_cache, 0, use_kernels=False)
    reference = prefill.export_kv("r")
    assert calls["torch_gather"] == 1
    payload = export.payload
    assert payload.shape[2] == num_blocks
    assert _bytes(payload) == _bytes(reference.payload)
    decode_torch.kv_staging = KVStaging(decode_torch.runner.kv_cache, 0, use_kernels=False)
    for eng in (decode, decode_torch):
        eng.add_prefilled_request("r", prompt, export.first_token, GREEDY, payload)
    export.release()
    reference.release()
    prefill.release_kv("r")
    assert calls["kv_unpack"] == 1 and calls["torch_scatter"] == 1
    assert decode.load()["kv_kernel_blocks_unpacked"] == num_blocks
    assert decode_torch.load()["kv_kernel_blocks_unpacked"] == 0
    # the whole pool, written by kv_unpack and by torch's scatter: the same bytes
    cache = decode.runner.kv_cache
    assert cache.count_nonzero() > 0
    assert _bytes(cache) == _bytes(decode_torch.runner.kv_cache)
    tokens = _run(decode)["r"]
    _forward_kernels_ran(calls)
    assert tokens == hf_greedy(model_dir, [prompt], MAX_TOKENS, kv_cache_dtype=kv_dtype)[0]
    for eng in (prefill, decode, decode_torch):
        eng.close()


def _run(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for out in eng.step():
            tokens[out.request_id] = out.token_ids
    return tokens


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()
