"""LoRA adapters through the served cluster: `pdserve up --lora NAME=PATH`, the official
client naming an adapter in `model`.

Colocated, and disaggregated over gRPC, where the prompt's KV crosses from the prefill
worker (which ran the adapter too) to the decode worker: its blocks are hashed in the
adapter's namespace on both sides, so the decode worker takes them only for a request
of the same adapter. Greedy tokens equal transformers running the base with the adapter
merged by peft (float32); the base model's requests in the same batches are the base's.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.engine.test_lora import _make_adapter, _merged

MAX_TOKENS = 6
FLAGS = ("--dtype", "float32", "--block-size", "8", "--threads", "1", "--replica-cpus", "0")
MODES = {
    "colocated": ("--mode", "colocated", "--decode-replicas", "1"),
    "disagg": ("--mode", "disagg", "--disagg-policy", "always", "--transport", "grpc"),
}


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_requests_name_adapters_and_get_their_merged_models_tokens(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, tmp_path: Path, mode: str
) -> None:
    base = Path(make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2))
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {
        "qv4": _make_adapter(base, tmp_path / "qv4", 4, 8, ["q_proj", "v_proj"], False, 1),
        "all8": _make_adapter(base, tmp_path / "all8", 8, 16, all7, False, 2),
    }
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(20 + 7 * i)] for i in range(6)]
    names: list[str | None] = [None, "qv4", "all8"] * 2
    folders = {
        None: base,
        **{n: _merged(base, p, tmp_path / f"m-{n}") for n, p in adapters.items()},
    }
    want = [hf_greedy(folders[n], [p], MAX_TOKENS)[0] for n, p in zip(names, prompts, strict=True)]
    lora_flags = [f for n, p in adapters.items() for f in ("--lora", f"{n}={p}")]
    with pdserve_up(base, *FLAGS, *MODES[mode], *lora_flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        cards = {m.id: m for m in client.models.list().data}
        base_id = next(m for m in cards if m not in adapters)
        assert set(cards) == {base_id, "qv4", "all8"}
        assert all(cards[n].model_extra["parent"] == base_id for n in adapters)

        def complete(i: int) -> tuple[str, list[int]]:
            out = client.completions.create(
                model=names[i] or base_id, prompt=prompts[i], max_tokens=MAX_TOKENS,
                temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            return out.model, list(out.choices[0].model_extra["token_ids"])

        with ThreadPoolExecutor(len(prompts)) as pool:  # adapters and base in one batch
            got = list(pool.map(complete, range(len(prompts))))
        assert [tokens for _, tokens in got] == want
        assert [model for model, _ in got] == [n or base_id for n in names]
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="nope", prompt=prompts[0], max_tokens=1)
        if mode == "disagg":  # the split happened for every request, adapters' included
            assert api.metric(url, "pdserve_kv_transfer_blocks_total") > 0
            assert api.local_prefills(url) == {}
