"""Token-exact greedy correctness against `transformers`, in float32.

Every engine path (prefix caching on and off, forced chunked prefill, forced preemption)
must yield exactly the tokens of the Hugging Face reference for the same checkpoint.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pdserve.engine import LLM, SamplingParams

MAX_TOKENS = 24

# (name, make_checkpoint kwargs): together they cover GQA, MHA, tied embeddings, Qwen2's
# q/k/v bias, llama3 and linear rope scaling, head_dim 64 and 128, sharded safetensors.
CHECKPOINTS: list[tuple[str, dict[str, Any]]] = [
    ("llama-gqa-hd64", {"hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}),
    ("llama-mha-tied", {"num_heads": 4, "num_kv_heads": 4, "tie_word_embeddings": True}),
    ("qwen2-bias-hd64", {"arch": "qwen2", "hidden_size": 128, "num_heads": 2, "num_kv_heads": 1,
                         "head_dim": 64}),
    ("mistral-hd128", {"arch": "mistral", "hidden_size": 128, "num_heads": 2, "num_kv_heads": 1,
                       "head_dim": 128}),
    ("llama3-rope-sharded", {
        "num_heads": 8, "num_kv_heads": 2, "head_dim": 16, "shard": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    }),
    ("llama-linear-rope", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
]  # fmt: skip

# Engine settings: each must leave the tokens unchanged.
MODES: dict[str, dict[str, Any]] = {
    "prefix-cache": {"enable_prefix_caching": True},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 8, "block_size": 4},
    "preemption": {"num_kv_blocks": 32, "block_size": 4, "max_model_len": 128},
}


def make_prompts(seed: int = 0) -> list[list[int]]:
    """8 prompts of different lengths; four share a 40-token prefix, two a 20-token one."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, 512) for _ in range(n)]  # noqa: E731 - skip specials
    shared_long, shared_short = ids(40), ids(20)
    return [
        shared_long + ids(7),
        shared_long + ids(1),
        shared_long + ids(23),
        shared_long,
        shared_short + ids(5),
        shared_short + ids(30),
        ids(1),
        ids(66),
    ]


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def checkpoint(
    request: pytest.FixtureRequest, make_checkpoint: Any, hf_greedy: Any
) -> tuple[Path, list[Any]]:
    model_dir = make_checkpoint(**request.param[1])
    prompts = make_prompts()
    return model_dir, hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_equal_transformers(
    checkpoint: tuple[Path, list[list[int]]], mode: str
) -> None:
    model_dir, expected = checkpoint
    llm = LLM(model_dir, dtype="float32", **MODES[mode])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(make_prompts(), params)
    for i, (out, ref) in enumerate(zip(outs, expected, strict=True)):
        assert out.token_ids == ref, f"prompt {i} diverged in mode {mode}"
        assert out.finish_reason == "length"
    stats = llm.engine.scheduler.stats
    if mode == "prefix-cache":
        # prompts 1-3 reuse prompt 0's 40-token prefix (2 blocks of 16), 5 reuses 4's block
        assert [o.num_cached_tokens for o in outs[:4]] == [0, 32, 32, 32]
        assert outs[5].num_cached_tokens == 16
    if mode == "no-prefix-cache":
        assert all(o.num_cached_tokens == 0 for o in outs)
    if mode == "chunked-prefill":
        assert stats.num_chunked_prefill_steps > 0
    if mode == "preemption":
        assert stats.num_preemptions > 0
    llm.engine.block_pool.check_no_leaks()
