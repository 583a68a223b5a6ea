"""The Triton attention backend inside the engine: same greedy tokens as the torch one.

On CPU this runs the kernels in Triton's interpreter (tests/kernels/conftest.py), so the
model is tiny and the steps few. Float32, where both backends agree to rounding.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.ops import TorchOps, TritonOps

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


def _counting(calls: Counter[str], cls: type, method: str) -> Callable[..., Any]:
    original = getattr(cls, method)

    def counted(self: Any, *args: Any) -> Any:
        calls[f"{cls.__name__}.{method}"] += 1
        return original(self, *args)

    return counted
