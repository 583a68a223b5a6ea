"""Loading Hugging Face model folders: config parsing, dtypes, shards, and clear errors.

Broken folders are copies of a good `make_checkpoint()` folder, damaged on purpose; every
error must name what is missing or unsupported, so a user can fix the folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.errors import CheckpointError, UnsupportedModelError
from pdserve.common.model_config import SUPPORTED_ARCHITECTURES, load_model_config
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.modeling.weights import iter_weights

# Small pool: these tests load many engines; the default sizing would allocate ~128 MB each.
ENGINE_KWARGS: dict[str, Any] = {"num_kv_blocks": 32, "block_size": 16}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [1, 56, 263, 458, 69, 225]


@pytest.fixture
def good_copy(make_checkpoint: Any, tmp_path: Path) -> Path:
    """A private copy of the default llama checkpoint, free to damage."""
    return Path(shutil.copytree(make_checkpoint(), tmp_path / "model"))


@pytest.fixture
def sharded_copy(make_checkpoint: Any, tmp_path: Path) -> Path:
    return Path(shutil.copytree(make_checkpoint(shard=True), tmp_path / "sharded"))


def _edit_json(path: Path, **updates: Any) -> None:
    data = json.loads(path.read_text())
    data.update(updates)
    path.write_text(json.dumps(data))


def _greedy_tokens(llm: LLM) -> list[int]:
    (out,) = llm.generate([PROMPT], GREEDY)
    llm.engine.block_pool.check_no_leaks()
    return out.token_ids


# -- missing files -------------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(CheckpointError, match="no-such-model"):
        LLM(missing, **ENGINE_KWARGS)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(good_copy: Path, name: str) -> None:
    (good_copy / name).unlink()
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        LLM(good_copy, **ENGINE_KWARGS)


def test_index_naming_a_missing_shard(sharded_copy: Path) -> None:
    index = json.loads((sharded_copy / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (sharded_copy / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        LLM(sharded_copy, **ENGINE_KWARGS)


@pytest.mark.parametrize(
    "tensor",
    ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
     "model.norm.weight", "lm_head.weight"],
)  # fmt: skip
def test_missing_tensor_is_named(good_copy: Path, tensor: str) -> None:
    path = good_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors[tensor]
    save_file(tensors, path, {"format": "pt"})
    with pytest.raises(CheckpointError, match=tensor.replace(".", r"\.")):
        LLM(good_copy, **ENGINE_KWARGS)


def test_unexpected_tensor_is_rejected(good_copy: Path) -> None:
    path = good_copy / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.9.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path, {"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.9\.mlp\.extra\.weight"):
        LLM(good_copy, **ENGINE_KWARGS)


def test_missing_config_key_is_named(good_copy: Path) -> None:
    config = json.loads((good_copy / "config.json").read_text())
    del config["vocab_size"]
    (good_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_model_config(good_copy)


# -- unsupported models --------------------------------------------------------------


def test_unknown_architecture_names_it_and_the_supported_ones(good_copy: Path) -> None:
    _edit_json(good_copy / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError) as info:
        LLM(good_copy, **ENGINE_KWARGS)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
        {"rope_parameters": None, "rope_scaling": {"type": "yarn", "factor": 4.0}},
    ],
    ids=["rope_parameters", "legacy-rope_scaling"],
)
def test_unsupported_rope_type(good_copy: Path, rope: dict[str, Any]) -> None:
    _edit_json(good_copy / "config.json", **rope)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        LLM(good_copy, **ENGINE_KWARGS)


# -- config.json parsing (hand-written configs) ----------------------------------------

BASE_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "eos_token_id": 2,
}
LLAMA3_PARAMS = {
    "factor": 8.0,
    "low_freq_factor": 2.0,
    "high_freq_factor": 6.0,
    "original_max_position_embeddings": 512,
}


def _write_config(folder: Path, generation: dict[str, Any] | None = None, **cfg: Any) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**BASE_CONFIG, **cfg}))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.mark.parametrize(
    "cfg",
    [
        {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_PARAMS}},
        {"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_PARAMS}},
        {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_PARAMS}},
    ],
    ids=["rope_parameters", "legacy-type", "legacy-rope_type"],
)
def test_llama3_rope_both_spellings(tmp_path: Path, cfg: dict[str, Any]) -> None:
    rope = load_model_config(_write_config(tmp_path, **cfg)).rope
    assert rope.rope_type == "llama3"
    assert rope.theta == 500000.0
    assert (rope.factor, rope.low_freq_factor, rope.high_freq_factor) == (8.0, 2.0, 6.0)
    assert rope.original_max_position_embeddings == 512


@pytest.mark.parametrize(
    "cfg",
    [
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 20000.0, "factor": 4.0}},
        {"rope_theta": 20000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
    ],
    ids=["rope_parameters", "legacy-type"],
)
def test_linear_rope_both_spellings(tmp_path: Path, cfg: dict[str, Any]) -> None:
    rope = load_model_config(_write_config(tmp_path, **cfg)).rope
    assert (rope.rope_type, rope.theta, rope.factor) == ("linear", 20000.0, 4.0)


def test_defaults_without_rope_or_head_dim(tmp_path: Path) -> None:
    config = load_model_config(_write_config(tmp_path))
    assert config.head_dim == 64 // 4
    assert (config.rope.rope_type, config.rope.theta, config.rope.factor) == (
        "default",
        10000.0,
        1.0,
    )
    assert config.torch_dtype == "float32"
    assert not (config.qkv_bias or config.o_bias or config.mlp_bias)


def test_null_head_dim_defaults_to_hidden_over_heads(tmp_path: Path) -> None:
    assert load_model_config(_write_config(tmp_path, head_dim=None)).head_dim == 16
    assert load_model_config(_write_config(tmp_path, head_dim=32)).head_dim == 32


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_dtype_both_spellings(tmp_path: Path, key: str) -> None:
    assert load_model_config(_write_config(tmp_path, **{key: "bfloat16"})).torch_dtype == (
        "bfloat16"
    )


def test_eos_ids_merge_generation_config_and_config(tmp_path: Path) -> None:
    folder = _write_config(tmp_path, generation={"eos_token_id": [4, 2]}, eos_token_id=7)
    assert load_model_config(folder).eos_token_ids == (4, 2, 7)
    folder = _write_config(tmp_path, generation={"eos_token_id": 4}, eos_token_id=[2, 4])
    assert load_model_config(folder).eos_token_ids == (4, 2)


def test_qwen2_defaults_to_qkv_bias_only(tmp_path: Path) -> None:
    config = load_model_config(
        _write_config(
            tmp_path,
            architectures=["Qwen2ForCausalLM"],
            sliding_window=4096,
            use_sliding_window=False,
        )
    )
    assert config.architecture == "Qwen2ForCausalLM"
    assert config.qkv_bias and not config.o_bias and not config.mlp_bias
    assert config.sliding_window is None


def test_attention_bias_on_llama_covers_qkv_and_o(tmp_path: Path) -> None:
    config = load_model_config(_write_config(tmp_path, attention_bias=True))
    assert config.qkv_bias and config.o_bias


# -- dtypes and shards ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint_loads_in_its_dtype(make_checkpoint: Any, dtype: str) -> None:
    llm = LLM(make_checkpoint(dtype=dtype), dtype="auto", **ENGINE_KWARGS)
    assert llm.engine.model.dtype == getattr(torch, dtype)
    assert len(_greedy_tokens(llm)) == 4


def test_sharded_checkpoint_equals_unsharded(make_checkpoint: Any) -> None:
    single, sharded = make_checkpoint(seed=0), make_checkpoint(seed=0, shard=True)
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    single_weights, sharded_weights = dict(iter_weights(single)), dict(iter_weights(sharded))
    assert single_weights.keys() == sharded_weights.keys()
    assert all(torch.equal(single_weights[k], sharded_weights[k]) for k in single_weights)

    single_tokens = _greedy_tokens(LLM(single, **ENGINE_KWARGS))
    assert len(single_tokens) == 4
    assert _greedy_tokens(LLM(sharded, **ENGINE_KWARGS)) == single_tokens
