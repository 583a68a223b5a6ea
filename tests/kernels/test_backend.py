"""The Triton attention backend inside the engine: same greedy tokens as the torch one.

On CPU this runs the kernels in Triton's interpreter (tests/kernels/conftest.py), so the
model is tiny and the steps few. Float32, where both backends agree to rounding, with an
8-bit KV cache too (engine/modeling/kv_quant.py): the Triton kernels write the rows the torch path
does and read them as it does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.modeling.ops import TorchOps, TritonOps

PROMPTS = [
    list(range(10, 30)),  # one full block of 16 and a partial one
    [*list(range(10, 30)), 7, 8, 9],  # shares the first block: a prefix hit
    [5, 6, 7],
]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        {"enable_prefix_caching": True},
        {"enable_prefix_caching": False, "max_num_batched_tokens": 8},  # chunked prefill
    ],
    ids=["prefix-cache", "chunked"],
)
def test_triton_backend_tokens_equal_torch_backend(
    make_checkpoint: Any, engine_kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    calls: Counter[str] = Counter()
    for cls in (TorchOps, TritonOps):
        for method in ("norm", "rotate"):
            monkeypatch.setattr(cls, method, _counting(calls, cls, method))
    results = {}
    for backend in ("torch", "triton"):
        calls.clear()
        llm = LLM(model_dir, dtype="float32", attention_backend=backend, **engine_kwargs)
        assert llm.engine.runner.backend.name == backend
        results[backend] = [out.token_ids for out in llm.generate(PROMPTS, params)]
        llm.engine.block_pool.check_no_leaks()
        if backend == "triton":
            # The model ran RMSNorm (residual add fused) and rotary in the Triton kernels:
            # a forward rotates once and norms twice per layer, `logits` norms once more.
            assert isinstance(llm.engine.model.ops, TritonOps)
            num_layers = llm.engine.model_config.num_layers
            forwards, rest = divmod(calls["TritonOps.rotate"], num_layers)
            assert forwards > 0 and rest == 0
            logits_calls = calls["TritonOps.norm"] - 2 * num_layers * forwards
            assert params.max_tokens <= logits_calls <= forwards
        else:
            assert not calls  # the torch backend keeps the model's plain torch forward
    assert results["triton"] == results["torch"]
    assert all(len(tokens) == 5 for tokens in results["triton"])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_triton_backend_tokens_equal_torch_backend_8bit_cache(
    make_checkpoint: Any, kv_dtype: str
) -> None:
    """Over an 8-bit KV cache: a prefill (it reads its own fresh rows back from the cache),
    a second prompt's prefill after a prefix hit (cached rows and fresh ones), decode
    steps. Fewer prompts and tokens than above: every kernel launch is interpreted."""
    model_dir = make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(model_dir, dtype="float32", attention_backend=backend, kv_cache_dtype=kv_dtype)
        runner = llm.engine.runner
        assert runner.backend.name == backend and runner.backend.kv_cache_dtype == kv_dtype
        assert runner.kv_cache.dtype == torch.uint8
        outs = [llm.generate([prompt], params)[0] for prompt in PROMPTS[:2]]
        assert outs[1].num_cached_tokens == 16  # a prefix hit on the first block
        results[backend] = [out.token_ids for out in outs]
        llm.engine.block_pool.check_no_leaks()
    assert results["triton"] == results["torch"]
    assert all(len(tokens) == 3 for tokens in results["triton"])


def _counting(calls: Counter[str], cls: type, method: str) -> Callable[..., Any]:
    original = getattr(cls, method)

    def counted(self: Any, *args: Any) -> Any:
        calls[f"{cls.__name__}.{method}"] += 1
        return original(self, *args)

    return counted
