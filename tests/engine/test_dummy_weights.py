"""`load_format="dummy"`: random weights from `config.json` alone, and the folders for it.

A folder with `config.json` and `tokenizer.json` but no weights serves with "dummy"
(the benchmarks' 8B-shaped engine starts in seconds that way) and fails with "auto" as
any folder without weights does. The dummy tensors must be exactly the ones a real
checkpoint of that shape holds (names and shapes, tied embeddings and Qwen2's biases
included), or the loader that assembles them would reject them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.engine_config import EngineConfig
from pdserve.common.errors import CheckpointError
from pdserve.common.model_config import load_model_config
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.demo.dummy import LLAMA3_8B, TINY, ConfigShape, write_config_only_model
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.modeling import llama as model_module
from pdserve.engine.modeling.llama import DUMMY_WEIGHT_RANGE, dummy_weights
from pdserve.engine.modeling.weights import iter_weights

ARCHS = [("llama", True), ("qwen2", False)]  # (arch, tie_word_embeddings)
PROMPTS = [[5, 17, 99, 3], [42] * 9]


def config_only(checkpoint: Path, out: Path) -> Path:
    """`checkpoint`'s config.json and tokenizer.json, without its weights."""
    out.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(checkpoint / name, out / name)
    return out


def weight_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "safetensors" in p.name)


def generate(model_dir: Path, **config: Any) -> list[list[int]]:
    engine = LLMEngine(
        model_dir, EngineConfig(load_format="dummy", dtype="float32", num_kv_blocks=64, **config)
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    engine.block_pool.check_no_leaks()
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize(("arch", "tied"), ARCHS, ids=[a for a, _ in ARCHS])
def test_dummy_tensors_are_the_checkpoints_names_and_shapes(
    make_checkpoint: Any, arch: str, tied: bool
) -> None:
    checkpoint = Path(make_checkpoint(arch, tie_word_embeddings=tied))
    config = load_model_config(checkpoint)
    real = {
        name: tuple(t.shape)
        for name, t in iter_weights(checkpoint)
        if not name.endswith("rotary_emb.inv_freq")
    }
    dummy = dummy_weights(config, torch.bfloat16, torch.device("cpu"), seed=0)
    assert {name: tuple(t.shape) for name, t in dummy.items()} == real
    assert ("lm_head.weight" in dummy) is not tied
    assert any(name.endswith("q_proj.bias") for name in dummy) is (arch == "qwen2")
    for name, t in dummy.items():
        assert t.dtype == torch.bfloat16
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t))
        else:
            assert 0 < t.abs().max().item() <= DUMMY_WEIGHT_RANGE * 1.01  # bf16 rounding


@pytest.mark.parametrize(("arch", "tied"), ARCHS, ids=[a for a, _ in ARCHS])
def test_a_config_only_folder_serves_with_dummy_weights(
    make_checkpoint: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    tied: bool,
) -> None:
    folder = config_only(Path(make_checkpoint(arch, tie_word_embeddings=tied)), tmp_path / "m")

    def no_weight_files(model_dir: Path) -> Any:
        raise AssertionError("dummy weights read a weight file")

    monkeypatch.setattr(model_module, "iter_weights", no_weight_files)
    first = generate(folder, seed=3)
    assert [len(t) for t in first] == [6, 6]
    assert generate(folder, seed=3) == first  # the same seed, the same weights and tokens
    assert weight_files(folder) == []  # nothing written either


def test_the_seed_chooses_the_weights(make_checkpoint: Any) -> None:
    config = load_model_config(Path(make_checkpoint()))
    cpu = torch.device("cpu")
    one, again = (dummy_weights(config, torch.float32, cpu, seed=1) for _ in range(2))
    other = dummy_weights(config, torch.float32, cpu, seed=2)
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(one[name], again[name])
    assert not torch.equal(one[name], other[name])


def test_auto_on_a_folder_without_weights_is_a_checkpoint_error(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    folder = config_only(Path(make_checkpoint()), tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"has neither model\.safetensors"):
        LLMEngine(folder, EngineConfig(dtype="float32", num_kv_blocks=64))


def test_activations_stay_finite_in_bfloat16_through_32_layers(tmp_path: Path) -> None:
    deep = ConfigShape(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=224,
        num_layers=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        torch_dtype="bfloat16",
    )
    folder = write_config_only_model(tmp_path / "deep", deep)
    engine = LLMEngine(folder, EngineConfig(load_format="dummy", num_kv_blocks=16))
    assert engine.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    engine.add_request("r", list(range(5, 40)), params)
    logprobs = []
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                logprobs = out.logprobs or []
    assert len(logprobs) == 3
    for entry in logprobs:
        values = [entry.logprob, *(lp for _, lp in entry.top)]
        assert all(torch.isfinite(torch.tensor(values))), values


# -- folders for benchmarks -------------------------------------------------------------------


def test_an_8b_shaped_folder_is_written_without_weights(
    make_checkpoint: Any, tmp_path: Path
) -> None:
    source = Path(make_checkpoint())
    folder = write_config_only_model(tmp_path / "llama3-8b", LLAMA3_8B, tokenizer_dir=source)
    mc = load_model_config(folder)  # the shape only: nothing is instantiated
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == (4096, 32, 32, 8)
    assert (mc.intermediate_size, mc.vocab_size, mc.head_dim) == (14336, 128256, 128)
    assert mc.rope.theta == 500000.0 and mc.max_position_embeddings == 8192
    assert mc.torch_dtype == "bfloat16" and not mc.tie_word_embeddings
    assert mc.architecture == "LlamaForCausalLM"
    assert weight_files(folder) == []
    # the tokenizer and its special ids are the source's
    assert (folder / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    source_config = json.loads((source / "config.json").read_text())
    assert mc.bos_token_id == source_config["bos_token_id"]
    assert Tokenizer(folder).encode("The river") == Tokenizer(source).encode("The river")


def test_the_default_tokenizer_folder_serves(tmp_path: Path) -> None:
    folder = write_config_only_model(tmp_path / "tiny", TINY)
    assert weight_files(folder) == []
    assert generate(folder) == generate(folder)


def test_a_tokenizer_larger_than_the_shape_is_refused(tmp_path: Path) -> None:
    small = ConfigShape(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    with pytest.raises(ValueError, match="512 tokens, more than the shape's vocab_size 100"):
        write_config_only_model(tmp_path / "small", small)
    assert not (tmp_path / "small").exists()
