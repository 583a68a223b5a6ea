"""LoRA adapters through the served cluster: `pdserve up --lora NAME=PATH` (three
adapters of ranks 4, 8 and 16, targeting q and v, all seven projections, and o with the
MLP under rsLoRA), the official client naming an adapter in `model`.

Colocated, and disaggregated over gRPC and UCX, where the prompt's KV crosses from the prefill
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
import requests

from tests.engine.test_lora import _make_adapter, _merged

MAX_TOKENS = 6
RESIDENT = "pdserve_worker_lora_adapters"  # summed: the workers of both pools
FLAGS = ("--dtype", "float32", "--block-size", "8", "--threads", "1", "--replica-cpus", "0")
MODES = {
    "colocated": ("--mode", "colocated", "--decode-replicas", "1"),
    "disagg": ("--mode", "disagg", "--disagg-policy", "always", "--transport", "grpc"),
    "disagg_ucx": ("--mode", "disagg", "--disagg-policy", "always", "--transport", "ucx"),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_requests_name_adapters_and_get_their_merged_models_tokens(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, tmp_path: Path, mode: str
) -> None:
    base = Path(make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2))
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {
        "qv4": _make_adapter(base, tmp_path / "qv4", 4, 8, ["q_proj", "v_proj"], False, 1),
        "all8": _make_adapter(base, tmp_path / "all8", 8, 16, all7, False, 2),
        "mlp16": _make_adapter(base, tmp_path / "mlp16", 16, 8, all7[3:], True, 3),
    }
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(20 + 7 * i)] for i in range(8)]
    names: list[str | None] = [None, "qv4", "all8", "mlp16"] * 2
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
        assert set(cards) == {base_id, *adapters}
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
        if mode != "colocated":  # the split happened for every request, adapters' included
            assert api.metric(url, "pdserve_kv_transfer_blocks_total") > 0
            assert api.local_prefills(url) == {}
        # runtime loading is the operator's choice: off unless started with it
        off = requests.post(f"{url}/v1/load_lora_adapter", json=_load("x", base), timeout=30)
        assert off.status_code == 403, off.text
        assert "allow-runtime-lora" in off.json()["error"]["message"]


def _load(name: str, path: Path) -> dict[str, str]:
    return {"lora_name": name, "lora_path": str(path)}


def test_adapters_loaded_and_unloaded_at_runtime(
    api: Any, make_checkpoint: Any, pdserve_up: Any, hf_greedy: Any, poll: Any, tmp_path: Path
) -> None:
    """`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's API) on a
    disaggregated cluster: both pools load the adapter, its requests get the merged
    model's tokens, every bad load is a 400 naming why and leaves nothing behind, an
    unload while a stream runs with it is a 409 and the stream finishes, and an adapter
    unloaded and loaded again serves the same tokens."""
    base = Path(make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2))
    other = Path(make_checkpoint(hidden_size=32, num_heads=4, num_kv_heads=2))
    qv4 = _make_adapter(base, tmp_path / "qv4", 4, 8, ["q_proj", "v_proj"], False, 1)
    big = _make_adapter(base, tmp_path / "big", 8, 16, ["o_proj"], False, 2)
    foreign = _make_adapter(other, tmp_path / "foreign", 4, 8, ["q_proj"], False, 3)
    rng = random.Random(6)
    prompts = [[rng.randrange(5, 500) for _ in range(12 + 5 * i)] for i in range(4)]
    want = hf_greedy(_merged(base, qv4, tmp_path / "m-qv4"), prompts, MAX_TOKENS)
    flags = ("--allow-runtime-lora", "--max-lora-rank", "4")
    with pdserve_up(base, *FLAGS, *MODES["disagg"], *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        base_id = client.models.list().data[0].id

        def post(path: str, body: dict[str, Any]) -> requests.Response:
            return requests.post(f"{url}/v1/{path}", json=body, timeout=60)

        def complete(model: str, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
            out = client.completions.create(
                model=model, prompt=prompt, max_tokens=n, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            return list(out.choices[0].model_extra["token_ids"])

        # bad loads: each a 400 naming why, and no adapter left anywhere
        bad = {
            "missing": (_load("a", tmp_path / "nowhere"), "no adapter_config.json"),
            "rank": (_load("a", big), "above this engine's max_lora_rank 4"),
            "base": (_load("a", foreign), "does not fit this base model"),
            "shadow": (_load(base_id, qv4), "names a served model"),
            "body": ({"lora_name": "a"}, "lora_path"),
        }
        for what, (body, message) in bad.items():
            resp = post("load_lora_adapter", body)
            assert resp.status_code == 400, (what, resp.text)
            assert message in resp.json()["error"]["message"], (what, resp.text)
        assert [m.id for m in client.models.list().data] == [base_id]
        with pytest.raises(openai.NotFoundError):
            complete("a", prompts[0])
        gone = post("unload_lora_adapter", {"lora_name": "a"})
        assert gone.status_code == 404, gone.text

        # load, serve (with the base in the same batches), and the name is taken
        for round_ in range(2):  # the second time: after an unload
            ok = post("load_lora_adapter", _load("qv4", qv4))
            assert ok.status_code == 200 and "added successfully" in ok.text, ok.text
            cards = {m.id: m for m in client.models.list().data}
            assert set(cards) == {base_id, "qv4"}, round_
            assert cards["qv4"].model_extra["parent"] == base_id
            with ThreadPoolExecutor(2 * len(prompts)) as pool:
                got = list(pool.map(lambda p: complete("qv4", p), prompts))
                list(pool.map(lambda p: complete(base_id, p), prompts))
            assert got == want, round_
            poll("both workers report the adapter", lambda: api.metric(url, RESIDENT) == 2, 10)
            again = post("load_lora_adapter", _load("qv4", qv4))
            assert again.status_code == 400 and "already been loaded" in again.text

            # an unload while a stream runs with it: refused, and the stream finishes
            stream = client.completions.create(
                model="qv4", prompt=prompts[0], max_tokens=600, temperature=0, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            chunks = iter(stream)
            tokens = list(next(chunks).choices[0].model_extra["token_ids"])
            busy = post("unload_lora_adapter", {"lora_name": "qv4"})
            assert busy.status_code == 409, busy.text
            assert "still serves requests" in busy.json()["error"]["message"]
            tokens += [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
            assert len(tokens) == 600
            assert complete("qv4", prompts[1]) == want[1]  # loaded still, everywhere

            done = post("unload_lora_adapter", {"lora_name": "qv4"})
            assert done.status_code == 200 and "removed successfully" in done.text, done.text
            assert [m.id for m in client.models.list().data] == [base_id]
            with pytest.raises(openai.NotFoundError):
                complete("qv4", prompts[0])
        # the split happened for every request, the adapter's included
        assert api.metric(url, "pdserve_kv_transfer_blocks_total") > 0
        assert api.local_prefills(url) == {}
        changes = "pdserve_lora_adapter_changes_total"
        pairs = [("load", "done"), ("load", "failed"), ("unload", "done"), ("unload", "in_use")]
        counted = {
            (change, outcome): api.metric(url, changes, change=change, outcome=outcome)
            for change, outcome in pairs
        }  # the bad loads the workers refused: missing, rank, base
        assert counted == {k: 2.0 for k in counted} | {("load", "failed"): 3.0}, counted
        # per adapter: 4 + 1 + 1 requests a round, and the stream's 600 tokens
        assert api.metric(url, "pdserve_lora_requests_total", adapter="qv4") == 12
        lora_tokens = api.metric(url, "pdserve_lora_generation_tokens_total", adapter="qv4")
        assert lora_tokens == 2 * (600 + 5 * MAX_TOKENS)
