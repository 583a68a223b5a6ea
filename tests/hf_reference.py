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

MAX_BATCH = 16  # prompts in one `generate` call


def generate(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, kv_cache_dtype: str = "auto"
) -> list[list[int]]:
    """Each prompt's `max_new_tokens` greedy tokens, in float32, prompts of one length in
    one batch, with no eos at all (our requests set ignore_eos; min_new_tokens would *mask* eos).
    `kv_cache_dtype="int8"` or `"fp8"`: every K and V rounded through that 8-bit format
    (`engine/modeling/kv_quant.py`) before attention, the model an 8-bit KV cache serves."""
    import torch
    from transformers import AutoModelForCausalLM

    attn = "sdpa" if kv_cache_dtype == "auto" else _kv8_attention(kv_cache_dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn
    ).eval()
    model.generation_config.eos_token_id = None
    # Prompts of one length run as one batch (no padding, so each row's positions and
    # attention are its own): `generate`'s per-step overhead, most of a tiny model's
    # time, is paid once for the batch (8 prompts x 500 tokens: 12.6 s one at a time,
    # 2.0 s batched, the same tokens).
    groups: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(len(prompt), []).append(i)
    outs: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        for length, members in groups.items():
            for start in range(0, len(members), MAX_BATCH):
                batch = members[start : start + MAX_BATCH]
                ids = model.generate(
                    torch.tensor([prompts[i] for i in batch]),
                    attention_mask=torch.ones(len(batch), length, dtype=torch.long),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                for i, row in zip(batch, ids, strict=True):
                    outs[i] = row[length:].tolist()
    return outs


def greedy_along(
    model_dir: Path, prompts: list[list[int]], tokens: list[list[int]]
) -> list[list[int]]:
    """The token `transformers` picks greedily after each prefix of `prompt + tokens`
    (after the prompt, then after each of `tokens` but the last), one forward pass per
    prompt, in float32 with no eos: equal to `tokens` exactly when `tokens` are its
    greedy continuation, since greedy decoding picks each token from the prefix before it.

    The cheap way to hold a long run to the reference: `generate` decodes token by
    token (16 streams x 3,500 tokens of a tiny model: 91 s on 2 cores), one forward
    over the whole sequence takes a second. Where a row differs, its first difference
    is transformers' own next token; what follows it is not (it follows our tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    if not prompts:
        return []
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    outs: list[list[int]] = []
    with torch.inference_mode():
        for prompt, row in zip(prompts, tokens, strict=True):
            if not row:
                outs.append([])
                continue
            ids = torch.tensor([[*prompt, *row[:-1]]])
            logits = model(ids, logits_to_keep=len(row)).logits[0]
            outs.append(logits.argmax(dim=-1).tolist())
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
