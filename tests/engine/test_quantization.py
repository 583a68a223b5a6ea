"""`quantization="int8"`: the blocks' projections as int8 rows with one scale per row.

Quantizing loses at most half a step per weight; the int8 linear computes the matmul of
the dequantized weight to float rounding, on CPU both through the C kernel
(`engine/cpu/int8.py`, where it builds vectorised) and through torch's
`_weight_int8pack_mm` (whose bf16 kernel needs rows of a multiple of 16 and an aligned x,
which `Int8Linear` provides); the two pick the same greedy tokens (float32). An
int8 engine picks the float engine's greedy next token at >= 90% of positions (teacher
forced on the float engine's tokens) and holds half the projections' bytes of bf16 and
a quarter of fp32's. Tensor parallel, each rank quantizes its own slices: q|k|v and
gate|up are sliced by rows, so their rows and scales are TP=1's; o and down are sliced by
columns, so each rank has its own scale per row and the logits differ from TP=1's by
about as much as int8 differs from float (not to float rounding, as the float engine's
TP=2 logits do).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.model_config import load_model_config
from pdserve.demo.dummy import TINY, write_config_only_model
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.cpu import int8 as cpu_int8
from pdserve.engine.modeling import linear
from pdserve.engine.modeling.linear import Int8Linear, dequantize_int8, quantize_int8
from pdserve.engine.modeling.llama import LlamaModel, dummy_weights

NUM_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
NEXT_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
BASE = {"num_kv_blocks": 512, "max_num_seqs": 128}
MIN_AGREEMENT = 0.9
KERNEL = cpu_int8.load()
HAS_KERNEL = KERNEL is not None and KERNEL.vectorised
# Int8Linear against the float64 matmul of the dequantized weight: the matmul's rounding
# to the dtype and the bias add's (relative; absolute where subnormal), plus float32
# accumulation over K (relative to sum |x * w|).
OUTPUT_RTOL = {torch.float32: 2e-7, torch.bfloat16: 2**-8, torch.float16: 2**-11}
ACCUMULATION_RTOL = 1e-6


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 5, 17, 30, 44, 66)]


@contextmanager
def llm(model_dir: Path, **config: Any) -> Iterator[LLM]:
    engine = LLM(model_dir, **{**BASE, **config})
    try:
        yield engine
    finally:
        engine.close()


def greedy_sequences(engine: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt followed by its NUM_TOKENS greedy tokens."""
    outs = engine.generate(prompts, GREEDY)
    return [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]


def teacher_forced(engine: LLM, sequences: list[list[int]], prompt_lens: list[int]) -> list[int]:
    """The greedy next token after every prefix of `sequences` past its prompt."""
    prefixes = [
        s[:n] for s, p in zip(sequences, prompt_lens, strict=True) for n in range(p, len(s))
    ]
    return [out.token_ids[0] for out in engine.generate(prefixes, NEXT_TOKEN)]


def record_logits(engine: LLM) -> list[torch.Tensor]:
    """Every logits tensor the driver's sampler sees, in step order."""
    runner = engine.engine.runner
    seen: list[torch.Tensor] = []
    sample = runner.sampler

    def recording(logits: torch.Tensor, *args: Any) -> Any:
        seen.append(logits.clone())
        return sample(logits, *args)

    runner.sampler = recording  # type: ignore[assignment]
    return seen


def projection_bytes(model: LlamaModel) -> int:
    return sum(
        lin.weight_bytes
        for layer in model.layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    )


def random_weight(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of very different scales, one with an outlier, one all zero."""
    gen = torch.Generator().manual_seed(rows * cols)
    w = torch.randn(rows, cols, generator=gen) * torch.logspace(-4, 1, rows)[:, None]
    w[1, 3] = 50.0
    w[2] = 0.0
    return w.to(dtype)


@pytest.fixture(params=["c", "torch"])
def cpu_backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Int8Linear's CPU matmul for the test: the C kernel, or torch's op."""
    if request.param == "c" and not HAS_KERNEL:
        pytest.skip("the C int8 kernel is not built vectorised here (needs AVX-512)")
    if request.param == "torch":
        monkeypatch.setattr(linear, "_cpu_kernel", lambda scales: None)
    return str(request.param)


# -- quantization and the int8 linear ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_at_most_half_a_step_per_row(dtype: torch.dtype) -> None:
    w = random_weight(12, 40, dtype)
    q = quantize_int8(w)
    assert q.weight.dtype == torch.int8 and q.scales.dtype == dtype
    assert q.weight.shape == w.shape and q.scales.shape == (12,)
    error = (w.float() - dequantize_int8(q)).abs()  # [rows, cols]
    step = q.scales.float()
    assert (error.amax(dim=1) <= step / 2 * (1 + 1e-6)).all(), (error.amax(dim=1), step)
    assert q.scales[2] == 0 and (q.weight[2] == 0).all()  # the zero row
    # The largest magnitude of a row takes the whole range (symmetric: max / 127), unless
    # its scale is subnormal in the dtype and so coarser (float16's first rows here).
    normal = q.scales.float() >= torch.finfo(dtype).tiny
    assert (q.weight[normal].abs().amax(dim=1) == 127).all()
    assert q.weight.min() >= -127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "in_features"), [(1, 64), (4, 200), (5, 40), (33, 100), (300, 72), (0, 32)]
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_int8_linear_matches_the_dequantized_matmul(
    cpu_backend: str, dtype: torch.dtype, rows: int, in_features: int, with_bias: bool
) -> None:
    """Columns not a multiple of 16 (torch's op) or 64 (the C kernel's chunks) are padded;
    the C kernel widens the weight in registers up to 4 rows, through a tile from 5, and
    takes 256 rows a pass (300)."""
    out_features = 26  # not a multiple of the C kernel's 4-row groups
    w = random_weight(out_features, in_features, dtype)
    bias = torch.randn(out_features).to(dtype) if with_bias else None
    lin = Int8Linear.quantize(w, bias)
    assert lin.backend == cpu_backend
    assert lin.weight.dtype == torch.int8  # the float weight is not kept
    assert torch.equal(lin.int8_weight().weight, quantize_int8(w).weight)  # packing undone
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    deq = dequantize_int8(lin.int8_weight()).double()
    matmul = x.double() @ deq.T
    expected = matmul + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ deq.abs().T
    y = lin(x)
    assert y.dtype == dtype and y.shape == (rows, out_features)
    rounding = OUTPUT_RTOL[dtype] * (matmul.abs() + expected.abs())
    subnormal_step = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    bound = rounding + ACCUMULATION_RTOL * magnitude + subnormal_step
    assert ((y.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_takes_strided_and_unaligned_inputs(
    cpu_backend: str, dtype: torch.dtype
) -> None:
    """A view 2 bytes into its storage crashed torch's bf16 kernel (aligned loads)."""
    lin = Int8Linear.quantize(random_weight(20, 64, dtype))
    assert lin.backend == cpu_backend
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    expected = lin(x)
    unaligned = torch.empty(3 * 64 + 1, dtype=dtype)[1:].view(3, 64).copy_(x)
    strided = torch.empty(3, 128, dtype=dtype)[:, ::2].copy_(x)
    assert torch.equal(lin(unaligned), expected)
    assert torch.equal(lin(strided), expected)
    # Each row's result depends on that row alone.
    assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(3)]), expected)


# -- the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_agrees_with_float_and_holds_a_fraction_of_its_bytes(
    make_checkpoint: Callable[..., Path], dtype: str
) -> None:
    model_dir = make_checkpoint()
    prompts = make_prompts()
    with llm(model_dir, dtype=dtype) as float_engine:
        sequences = greedy_sequences(float_engine, prompts)
        float_model = float_engine.engine.model
    with llm(model_dir, dtype=dtype, quantization="int8") as int8_engine:
        tokens = teacher_forced(int8_engine, sequences, [len(p) for p in prompts])
        int8_model = int8_engine.engine.model
    expected = [t for s, p in zip(sequences, prompts, strict=True) for t in s[len(p) :]]
    agreement = sum(a == b for a, b in zip(tokens, expected, strict=True)) / len(expected)
    assert agreement >= MIN_AGREEMENT, f"{agreement:.0%} of {len(expected)} next tokens agree"

    projections = [
        lin
        for layer in int8_model.layers
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    assert all(isinstance(lin, Int8Linear) for lin in projections)
    num_weights = sum(lin.out_features * lin.in_features for lin in projections)
    num_rows = sum(lin.out_features for lin in projections)
    itemsize = float_model.dtype.itemsize
    # A bf16 weight is held widened to float32 where the CPU has no bf16 matmul (linear.py).
    float_layer = float_model.layers[0].qkv
    assert isinstance(float_layer, linear.Linear)
    held_itemsize = 4 if float_layer.widened else itemsize
    # One byte per weight and a scale per row, against 2 (bf16) or 4 (fp32) per weight.
    assert projection_bytes(float_model) == num_weights * held_itemsize
    assert projection_bytes(int8_model) == num_weights + num_rows * itemsize
    # The scales add 1 / in_features: 1.6% and 0.8% at this checkpoint's 64 and 128.
    ratio = projection_bytes(int8_model) / projection_bytes(float_model)
    assert 1 / held_itemsize < ratio < 1.1 / held_itemsize, ratio
    # weight_bytes() counts the same saving; the embedding, LM head and norms are unchanged.
    saved = sum(float_model.weight_bytes()) - sum(int8_model.weight_bytes())
    assert saved == projection_bytes(float_model) - projection_bytes(int8_model)


@pytest.mark.skipif(not HAS_KERNEL, reason="the C int8 kernel is not built vectorised here")
def test_c_kernel_and_torch_op_pick_the_same_tokens(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32, greedy: the two sum in different orders, so logits agree to rounding."""
    model_dir = make_checkpoint()
    prompts = make_prompts()
    runs = {}
    for backend in ("c", "torch"):
        if backend == "torch":
            monkeypatch.setattr(linear, "_cpu_kernel", lambda scales: None)
        with llm(model_dir, dtype="float32", quantization="int8") as engine:
            assert engine.engine.model.layers[0].qkv.backend == backend
            logits = record_logits(engine)
            runs[backend] = (greedy_sequences(engine, prompts), torch.cat(logits))
    (c_tokens, c_logits), (op_tokens, op_logits) = runs["c"], runs["torch"]
    assert c_tokens == op_tokens
    assert torch.allclose(c_logits, op_logits, rtol=1e-5, atol=1e-5)


def test_disabled_c_kernel_leaves_torch_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    cpu_int8.load.cache_clear()
    try:
        assert cpu_int8.load() is None
        lin = Int8Linear.quantize(random_weight(8, 32, torch.bfloat16))
        assert lin.backend == "torch" and lin.weight.shape == (8, 32)
    finally:
        cpu_int8.load.cache_clear()


def test_dummy_weights_are_quantized_from_the_same_random_weights(tmp_path: Path) -> None:
    model_dir = write_config_only_model(tmp_path / "tiny", TINY)
    config = {"load_format": "dummy", "dtype": "float32", "quantization": "int8", "seed": 3}
    with llm(model_dir, **config) as engine:
        assert len(engine.generate([[5, 17, 99]], GREEDY)[0].token_ids) == NUM_TOKENS
        qkv = engine.engine.model.layers[0].qkv
    assert isinstance(qkv, Int8Linear)
    tensors = dummy_weights(load_model_config(model_dir), torch.float32, torch.device("cpu"), 3)
    names = [f"model.layers.0.self_attn.{n}_proj.weight" for n in ("q", "k", "v")]
    weight = torch.cat([tensors[n] for n in names])
    error = (weight - dequantize_int8(qkv.int8_weight())).abs()
    assert (error.amax(dim=1) <= qkv.scales / 2 * (1 + 1e-6)).all()


def test_tp2_int8_logits_stay_within_the_quantization_error_of_tp1(
    make_checkpoint: Callable[..., Path],
) -> None:
    """Teacher forced on the float engine's tokens, so every run sees the same contexts."""
    model_dir = make_checkpoint()
    prompts = make_prompts()
    with llm(model_dir, dtype="float32") as engine:
        sequences = greedy_sequences(engine, prompts)
        logits = record_logits(engine)
        teacher_forced(engine, sequences, [len(p) for p in prompts])
        float_logits = torch.cat(logits)
    runs = {}
    for tp in (1, 2):
        config = {"dtype": "float32", "quantization": "int8", "tensor_parallel_size": tp}
        with llm(model_dir, **config) as engine:
            logits = record_logits(engine)
            tokens = teacher_forced(engine, sequences, [len(p) for p in prompts])
            runs[tp] = (tokens, torch.cat(logits), engine.engine.parallel_stats())
    (tokens1, logits1, stats1), (tokens2, logits2, stats2) = runs[1], runs[2]
    assert logits2.shape == logits1.shape == float_logits.shape
    quantization_error = (logits1 - float_logits).abs().max().item()
    tp_difference = (logits2 - logits1).abs().max().item()
    # Both runs are within about one quantization error of the float logits (TP=2's o and
    # down have finer scales), so they are within two of each other; a rank with a wrong
    # slice or scale moves logits of magnitude ~3 by O(1).
    assert 0 < tp_difference <= 2 * quantization_error, (tp_difference, quantization_error)
    agreement = sum(a == b for a, b in zip(tokens1, tokens2, strict=True)) / len(tokens1)
    assert agreement >= MIN_AGREEMENT
    # Both ranks hold int8: each half of TP=1's quantized projections (plus its own scales
    # of the row-parallel layers' rows).
    (whole,) = stats1.ranks
    for rank in stats2.ranks:
        assert 0.5 < rank.sharded_weight_bytes / whole.sharded_weight_bytes < 0.52


# -- the user-facing switches ---------------------------------------------------------------


def test_pdserve_up_quantization_reaches_the_engine_config(random_model_dir: Path) -> None:
    code = (
        "import sys\n"
        "from pdserve.deploy import cli\n"
        "import pdserve.deploy.up as up\n"
        "def fake_run_up(config, *args, **kw):\n"
        "    print('engine', config.quantization, config.engine_config('prefill').quantization)\n"
        "    return 0\n"
        "up.run_up = fake_run_up\n"
        "sys.exit(cli.main(['up', '--model', *sys.argv[1:]]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(random_model_dir), "--quantization", "int8"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "engine int8 int8" in result.stdout, result.stdout + result.stderr
