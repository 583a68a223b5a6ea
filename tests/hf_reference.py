"""`transformers`' greedy tokens: the reference every serving path's tokens must equal.

Imported by tests/conftest.py (the `hf_greedy` fixture) and run as a script by it for a
long reference, one process per share of the prompts (the test process runs torch on
one thread, so a second core would otherwise idle through minutes of `generate`):

    python tests/hf_reference.py JOB.json OUT.json

JOB.json: {"model_dir": ..., "prompts": [[...]], "max_new_tokens": N, "kv_cache_dtype":
"auto"}; OUT.json gets the prompts' tokens, one JSON list. Not a test module (pytest collects
`test_*.py` only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def generate(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, kv_cache_dtype: str = "auto"
) -> list[list[int]]:
    """Each prompt's `max_new_tokens` greedy tokens, one prompt at a time, in float32,
    with no eos at all (our requests set ignore_eos; min_new_tokens would *mask* eos).
    `kv_cache_dtype="int8"` or `"fp8"`: every K and V rounded through that 8-bit format
    (`engine/modeling/kv_quant.py`) before attention, the model an 8-bit KV cache serves."""
    import torch
    from transformers import AutoModelForCausalLM

    attn = "sdpa" if kv_cache_dtype == "auto" else _kv8_attention(kv_cache_dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn
    ).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(ids[0, len(prompt) :].tolist())
    return outs


def _kv8_attention(kv_cache_dtype: str) -> str:
    """The name of a `transformers` attention that rounds K and V through an 8-bit KV
    format first (the whole cache each call: the rounding is idempotent, so tokens
    rounded in an earlier step are unchanged), registered on first use."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from pdserve.engine.modeling.kv_quant import fake_quantize

    name = f"pdserve_kv_{kv_cache_dtype}"

    def attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
        key, value = fake_quantize(key, kv_cache_dtype), fake_quantize(value, kv_cache_dtype)
        return sdpa_attention_forward(module, query, key, value, *args, **kw)

    AttentionInterface.register(name, attention)
    return name


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)  # one share of the prompts per core
    job = json.loads(Path(sys.argv[1]).read_text())
    tokens = generate(
        Path(job["model_dir"]), job["prompts"], job["max_new_tokens"], job["kv_cache_dtype"]
    )
    Path(sys.argv[2]).write_text(json.dumps(tokens))
