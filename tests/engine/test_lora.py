"""LoRA adapters on one base model, in the engine: greedy tokens of requests with
different adapters (and none) in the same steps must equal `transformers` running the
base model with each adapter merged into it by `peft`, in float32; an adapter that cannot
be served is refused at load with a clear error and nothing kept."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peft
import pytest
import torch

from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.lora.adapter import LoRAError
from pdserve.engine.worker.kv_handoff import KVImportError

MAX_TOKENS = 6
# (name, rank, alpha, target modules, rslora): ranks and targets differ on purpose
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = [
    ("qv4", 4, 8, ["q_proj", "v_proj"], False),
    ("all8", 8, 16, ALL, False),
    ("mlp16", 16, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], True),
]


@pytest.fixture(scope="module")
def base_dir(make_checkpoint: Any) -> Path:
    return Path(make_checkpoint(hidden_size=64, num_heads=4, num_kv_heads=2))


def _hf(base: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)


def _make_adapter(
    base: Path, folder: Path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int
) -> Path:
    """A PEFT adapter with random (non-zero) A and B, saved as PEFT saves one."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
        init_lora_weights=False,
    )  # fmt: skip
    model = peft.get_peft_model(_hf(base), config)
    with torch.no_grad():  # deltas large enough to change greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5 / p.abs().mean())
    model.save_pretrained(folder)
    return folder


def _merged(base: Path, adapter: Path, folder: Path) -> Path:
    """The base with the adapter merged into its weights (peft), a checkpoint folder."""
    merged = peft.PeftModel.from_pretrained(_hf(base), adapter).merge_and_unload()
    merged.save_pretrained(folder)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder)
    return folder


@pytest.fixture(scope="module")
def adapters(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: _make_adapter(base_dir, root / name, r, alpha, targets, rslora, seed)
        for seed, (name, r, alpha, targets, rslora) in enumerate(ADAPTERS)
    }


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def references(
    base_dir: Path,
    adapters: dict[str, Path],
    hf_greedy: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str | None, list[list[int]]], list[list[int]]]:
    root = tmp_path_factory.mktemp("merged")
    dirs: dict[str | None, Path] = {None: base_dir}
    for name, path in adapters.items():
        dirs[name] = _merged(base_dir, path, root / name)

    def reference(name: str | None, prompts: list[list[int]]) -> list[list[int]]:
        return list(hf_greedy(dirs[name], prompts, MAX_TOKENS))

    return reference


def _llm(base: Path, **config: Any) -> LLM:
    return LLM(base, dtype="float32", block_size=8, num_kv_blocks=128, **config)


def _params(name: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, lora=name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_batch_mixing_adapters_gives_each_its_merged_models_tokens(
    base_dir: Path, adapters: dict[str, Path], references: Any, backend: str
) -> None:
    """The torch forward, and the fused one the Triton backend runs (its kernels under
    Triton's interpreter here, a GPU's path)."""
    names: list[str | None] = [None, "qv4", "all8", "mlp16"]
    prompts = _prompts(12 if backend == "torch" else 4)
    # row i runs with adapter names[i % 4]: every step holds all four kinds of rows
    wanted = [references(names[i % 4], [p])[0] for i, p in enumerate(prompts)]
    llm = _llm(base_dir, attention_backend=backend)
    for name, path in adapters.items():
        llm.load_lora(name, path)
    outs = llm.generate(prompts, [_params(names[i % 4]) for i in range(len(prompts))])
    assert [o.token_ids for o in outs] == wanted
    # the adapters changed the tokens: a base-model run of the same prompts differs
    base_tokens = [o.token_ids for o in llm.generate(prompts, _params(None))]
    assert base_tokens != wanted
    assert base_tokens[::4] == wanted[::4]
    assert llm.engine.model.ops is not None and llm.engine.model.ops.fused == (backend == "triton")


def test_more_adapters_than_slots_swap_in_and_out_and_keep_every_rows_tokens(
    base_dir: Path, adapters: dict[str, Path], references: Any
) -> None:
    """max_loras=2 with three adapters and the base in one batch: no step holds rows of
    more than two adapters, each swapped-in adapter is the one its rows need, and every
    request still gets its merged model's tokens."""
    names: list[str | None] = [None, "qv4", "all8", "mlp16"]
    prompts = _prompts(8)
    wanted = [references(names[i % 4], [p])[0] for i, p in enumerate(prompts)]
    llm = _llm(base_dir, max_loras=2)
    for name, path in adapters.items():
        llm.load_lora(name, path)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, _params(names[i % 4]))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        running = {s.params.lora for s in engine.scheduler.running} - {None}
        assert running <= set(engine.runner.loras) and len(engine.runner.loras) <= 2
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == wanted
    gauges = engine.load()
    assert gauges["lora_adapters"] == 3 and gauges["lora_resident"] == 2
    assert gauges["lora_loads"] >= 3 and gauges["lora_evictions"] == gauges["lora_loads"] - 2
    assert sum(gauges[f"lora:{name}"] for name in adapters) == 2
    assert gauges["lora_slots_free"] == 2  # nothing runs: either slot can be taken


def test_a_prompt_prefilled_elsewhere_decodes_with_its_adapter_or_is_refused_without_a_slot(
    base_dir: Path, adapters: dict[str, Path], references: Any
) -> None:
    """The split, in the engine: a decode engine that takes a prompt's KV from a prefill
    engine gives the adapter's row a slot as it joins the batch, so it decodes with the
    adapter; with its one slot serving a running request of another adapter, the import
    is refused (KVImportError: the worker prefills it locally, through the queue) and
    nothing is held."""
    prompts = _prompts(2)
    p_eng, d_eng = _llm(base_dir).engine, _llm(base_dir, max_loras=1).engine
    for eng in (p_eng, d_eng):
        for name, path in adapters.items():
            eng.load_lora(name, path)

    def prefilled(rid: str, prompt: list[int], name: str) -> Any:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, lora=name)
        p_eng.add_request(rid, prompt, params, hold_kv=True)
        while p_eng.has_unfinished:
            p_eng.step()
        export = p_eng.export_kv(rid)
        p_eng.release_kv(rid)
        return export

    export = prefilled("a", prompts[0], "all8")
    d_eng.add_prefilled_request(
        "a", prompts[0], export.first_token, _params("all8"), export.payload
    )
    assert set(d_eng.runner.loras) == set() and "all8" in d_eng.lora_slots
    tokens = [export.first_token]
    for out in d_eng.step():  # the slot's adapter is copied in before the step using it
        tokens += out.new_token_ids
    assert set(d_eng.runner.loras) == {"all8"}
    other = prefilled("b", prompts[1], "qv4")
    with pytest.raises(KVImportError, match="no slot for LoRA adapter 'qv4'"):
        d_eng.add_prefilled_request(
            "b", prompts[1], other.first_token, _params("qv4"), other.payload
        )
    while d_eng.has_unfinished:
        for out in d_eng.step():
            tokens += out.new_token_ids
    assert tokens == references("all8", [prompts[0]])[0]
    d_eng.block_pool.check_no_leaks()


def test_an_adapter_unloaded_and_loaded_again_gives_the_same_tokens(
    base_dir: Path, adapters: dict[str, Path], references: Any
) -> None:
    prompts = _prompts(3)
    llm = _llm(base_dir)
    llm.load_lora("all8", adapters["all8"])
    first = [o.token_ids for o in llm.generate(prompts, _params("all8"))]
    llm.unload_lora("all8")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'all8'"):
        llm.generate(prompts, _params("all8"))
    llm.load_lora("all8", adapters["all8"])
    again = [o.token_ids for o in llm.generate(prompts, _params("all8"))]
    assert first == again == references("all8", prompts)


def test_no_kv_block_is_shared_across_adapters(base_dir: Path, adapters: dict[str, Path]) -> None:
    prompt = _prompts(1)[0] * 3  # several full blocks
    llm = _llm(base_dir)
    llm.load_lora("qv4", adapters["qv4"])
    llm.load_lora("qv4-again", adapters["qv4"])
    assert llm.generate([prompt], _params(None))[0].num_cached_tokens == 0
    assert llm.generate([prompt], _params("qv4"))[0].num_cached_tokens == 0  # not the base's
    assert llm.generate([prompt], _params("qv4-again"))[0].num_cached_tokens == 0
    assert llm.generate([prompt], _params("qv4"))[0].num_cached_tokens > 0  # its own, again


def test_an_adapter_with_requests_running_is_not_unloaded(
    base_dir: Path, adapters: dict[str, Path]
) -> None:
    llm = _llm(base_dir)
    llm.load_lora("qv4", adapters["qv4"])
    engine = llm.engine
    engine.add_request("r", _prompts(1)[0], _params("qv4"))
    with pytest.raises(LoRAError, match="still serves 1 request"):
        llm.unload_lora("qv4")
    while engine.has_unfinished:
        engine.step()
    llm.unload_lora("qv4")  # once it finished
    assert "qv4" not in engine.loras


def _edit_config(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    spec = json.loads((dst / "adapter_config.json").read_text())
    spec.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(spec))
    return dst


def test_what_cannot_be_served_is_refused_at_load_and_nothing_is_kept(
    base_dir: Path,
    adapters: dict[str, Path],
    make_checkpoint: Any,
    tmp_path: Path,
) -> None:
    llm = _llm(base_dir, max_lora_rank=8)
    other_base = Path(make_checkpoint(hidden_size=128, num_heads=4, num_kv_heads=2))
    other = _make_adapter(other_base, tmp_path / "other", 4, 8, ["q_proj"], False, 9)
    cases = [
        ("missing", tmp_path / "nowhere", "no adapter_config.json"),
        ("too-high", adapters["mlp16"], "rank 16, above this engine's max_lora_rank 8"),
        ("mismatch", other, "does not fit this base model"),
        (
            "lm-head",
            _edit_config(adapters["qv4"], tmp_path / "lm", target_modules=["q_proj", "lm_head"]),
            "cannot adapt",
        ),
        ("dora", _edit_config(adapters["qv4"], tmp_path / "dora", use_dora=True), "DoRA"),
        (llm.engine.model_id, adapters["qv4"], "already names the base model"),
    ]
    for name, path, message in cases:
        with pytest.raises(LoRAError, match=message):
            llm.load_lora(name, path)
        assert name not in llm.engine.loras
    llm.load_lora("qv4", adapters["qv4"])
    with pytest.raises(LoRAError, match="already names an adapter"):
        llm.load_lora("qv4", adapters["all8"])
    assert isinstance(LoRAError("x"), InvalidRequestError)  # a 400 wherever it surfaces
