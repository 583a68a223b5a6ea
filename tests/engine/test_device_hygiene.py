"""Device hygiene (engine/worker/device_hygiene.py): the engine's paths make and keep every tensor
of a step on its device, checked on CPU as a GPU would.

Each case builds the engine and serves requests under `DeviceHygiene`: a tensor factory
called without `device=`, or a host tensor meeting a device tensor in an op, raises
`DeviceMistake`. The paths: the model (plain and fused), sampling (greedy, seeded top-k
/ top-p, logprobs, n > 1), structured output, int8 weights, 8-bit KV caches, speculative
decoding (n-gram and a draft model), chunked prefill with prefix caching, KV export and
import between two engines, the Triton path (under the interpreter), and tensor-parallel
ranks (their processes run under the mode too). Attention runs on the torch backend, not
the CPU's C kernels (CPU-only code, which the mode leaves alone). The last tests show
the mode can fail: on the rotary tables as they were made before (on the host, never
moved), and on a `torch.arange(n)` put in the sampler."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.grammar import GrammarSpec
from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.worker.device_hygiene import ENV, DeviceHygiene, DeviceMistake

BLOCK = 4
BASE: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 96, "block_size": BLOCK}
TORCH = {"attention_backend": "torch"}  # the device-generic attention (not the C kernels)
CASES: dict[str, dict[str, Any]] = {
    "torch": TORCH,
    "chunked-prefix": {**TORCH, "max_num_batched_tokens": 8, "enable_prefix_caching": True},
    "int8": {**TORCH, "quantization": "int8"},
    "kv-int8": {**TORCH, "kv_cache_dtype": "int8"},
    "kv-fp8": {**TORCH, "kv_cache_dtype": "fp8"},
    "ngram": {**TORCH, "speculative": "ngram:k=3"},
    "triton": {"attention_backend": "triton"},
    "triton-kv8-int8": {
        "attention_backend": "triton",
        "kv_cache_dtype": "int8",
        "quantization": "int8",
    },
}


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(5, 512) for _ in range(12)]
    return [shared + [rng.randrange(5, 512) for _ in range(5)], shared, shared[:5] * 3]


def serve(llm: LLM) -> None:
    """Greedy, seeded sampling with logprobs and n > 1, and a JSON grammar."""
    ps = prompts()
    llm.generate(ps, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    sampled = SamplingParams(
        max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, seed=5, n=2, logprobs=2
    )
    llm.generate(ps[:1], sampled)
    llm.generate(ps[:1], SamplingParams(max_tokens=5, grammar=GrammarSpec("json_object")))


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(num_heads=4, num_kv_heads=2))


@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_of_a_step_is_on_the_engines_device(model_dir: Path, case: str) -> None:
    with DeviceHygiene() as mode:
        llm = LLM(model_dir, **BASE, **CASES[case])
        serve(llm)
        llm.close()
    assert mode.mistakes == []


def test_a_draft_model_keeps_its_tensors_on_the_device(model_dir: Path, make_draft: Any) -> None:
    draft = make_draft(model_dir, 1)
    with DeviceHygiene() as mode:
        llm = LLM(model_dir, **BASE, **TORCH, speculative=f"draft:{draft},k=2")
        serve(llm)
        llm.close()
    assert mode.mistakes == []


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kv_export_and_import_keep_their_tensors_on_the_device(
    model_dir: Path, backend: str
) -> None:
    """Through torch's gather and scatter, and through the Triton pack/unpack kernels."""
    prompt = prompts()[0]
    config = EngineConfig(**BASE, attention_backend=backend)
    with DeviceHygiene() as mode:
        p_eng = LLMEngine(model_dir, config)
        d_eng = LLMEngine(model_dir, config)
        p_eng.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0), hold_kv=True)
        first = _run(p_eng)["r"][0]
        export = p_eng.export_kv("r")
        export.wait()
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        d_eng.add_prefilled_request("r", prompt, first, greedy, export.payload)
        export.release()
        p_eng.release_kv("r")
        assert len(_run(d_eng)["r"]) == 4
    assert mode.mistakes == []


def test_tensor_parallel_ranks_keep_their_tensors_on_their_device(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "1")  # the ranks' processes run under the mode too
    with DeviceHygiene() as mode:
        llm = LLM(model_dir, **BASE, **TORCH, tensor_parallel_size=2)
        try:
            out = llm.generate(
                prompts(), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            )
        finally:
            llm.close()
    assert mode.mistakes == []
    assert all(len(o.token_ids) == 4 for o in out)


def _run(eng: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for out in eng.step():
            tokens[out.request_id] = out.token_ids
    return tokens


# -- the mode fails where a GPU would ---------------------------------------------------


def _host_tables(rope: Any, head_dim: int, max_positions: int, dtype: torch.dtype, *_: Any) -> Any:
    """engine/modeling/rotary.py's cos_sin_cache before the fix: made on the host, never moved."""
    from pdserve.engine.modeling.rotary import inverse_frequencies

    inv_freq = inverse_frequencies(rope, head_dim, "cpu")
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    emb = torch.cat([torch.outer(positions, inv_freq)] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.fixture
def from_pdserve(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Makes the mode take this test module's calls for pdserve's own (it checks only
    calls made from pdserve's code, and tests/ is not)."""
    from pdserve.engine.worker import device_hygiene

    monkeypatch.setattr(device_hygiene, "_TESTS", Path("/nonexistent"))
    yield


def test_tables_made_on_the_host_are_a_mistake(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, from_pdserve: None
) -> None:
    from pdserve.engine.modeling import llama as model

    monkeypatch.setattr(model, "cos_sin_cache", _host_tables)
    with DeviceHygiene() as mode, pytest.raises(DeviceMistake, match=r"torch\.arange"):
        LLM(model_dir, **BASE)
    assert any("without device=" in m for m in mode.mistakes), mode.mistakes
    # Left on the host (made where the mode did not look): the lookup is the mistake (the
    # torch forward's; the CPU and Triton ops look cos/sin up inside their kernels).
    llm = LLM(model_dir, **BASE, **TORCH)
    with DeviceHygiene(), pytest.raises(DeviceMistake, match="indexes a host tensor"):
        llm.engine.runner.model.cos = llm.engine.runner.model.cos.cpu()
        llm.generate(prompts()[:1], SamplingParams(max_tokens=2, temperature=0.0))
    llm.close()


def test_an_arange_without_a_device_in_the_sampler_is_a_mistake(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.engine import sampler

    original = sampler._filters

    def with_arange(params: SamplingParams, vocab: int) -> bool:
        torch.arange(vocab)  # what must not be there: a host tensor on every step
        return original(params, vocab)

    with_arange.__code__ = with_arange.__code__.replace(co_filename=sampler.__file__)
    monkeypatch.setattr(sampler, "_filters", with_arange)
    llm = LLM(model_dir, **BASE)
    with DeviceHygiene() as mode, pytest.raises(DeviceMistake, match=r"engine/sampler\.py"):
        llm.generate(prompts()[:1], SamplingParams(max_tokens=2, temperature=0.7, top_k=5))
    assert mode.mistakes and "torch.arange without device=" in mode.mistakes[0]
    llm.close()
