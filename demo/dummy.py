"""Model folders without weights, for `load_format="dummy"` (benchmarks of a model's speed).

`write_config_only_model` writes a Hugging Face folder that holds a `config.json` of a
given shape (`LLAMA3_8B`: Llama-3-8B's) and a tokenizer, and no weight file: an engine
started on it with `EngineConfig(load_format="dummy")` makes random weights of that shape
on its device in seconds (`engine/modeling/llama.py`, `dummy_weights`) instead of reading 16 GB.
The tokenizer is another folder's (copied) or the random demo model's (vocabulary 512,
trained in well under a second): its ids only need to fall inside the shape's vocabulary.

Writing the folder needs no torch work and no weights, whatever the shape.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from pdserve.demo.model import _write_atomically, _write_json, write_random_tokenizer

# Copied from a tokenizer folder when present (tokenizer.json is required).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ConfigShape:
    """What a Llama-family `config.json` records of a model's shape."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    torch_dtype: str = "bfloat16"
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"


LLAMA3_8B = ConfigShape(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    torch_dtype="bfloat16",
    rms_norm_eps=1e-5,
)
# Llama-3-8B's proportions at a size a CPU runs in milliseconds (CI's smoke runs).
TINY = ConfigShape(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=224,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=500000.0,
    max_position_embeddings=2048,
    torch_dtype="float32",
)


def write_config_only_model(
    out_dir: str | Path, shape: ConfigShape = LLAMA3_8B, tokenizer_dir: str | Path | None = None
) -> Path:
    """Write a model folder of `shape` without weights to `out_dir`; return the path.

    The tokenizer files come from `tokenizer_dir` (its `tokenizer.json` is required;
    `tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json` and the
    bos/eos ids of its `config.json` come along when present), else from the random demo
    model. The write is atomic: the folder appears complete or not at all.

    Raises:
        ValueError: the tokenizer has more tokens than `shape.vocab_size`, or
            `tokenizer_dir` has no tokenizer.json.
    """

    def write(tmp: Path) -> None:
        if tokenizer_dir is None:
            ids = write_random_tokenizer(tmp)
            special = {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]}
        else:
            special = _copy_tokenizer(Path(tokenizer_dir), tmp)
        vocab = Tokenizer.from_file(str(tmp / "tokenizer.json")).get_vocab_size()
        if vocab > shape.vocab_size:
            raise ValueError(
                f"the tokenizer has {vocab} tokens, more than the shape's vocab_size "
                f"{shape.vocab_size}"
            )
        _write_json(tmp / "config.json", {**_config(shape), **special})

    return _write_atomically(out_dir, write)


def _copy_tokenizer(source: Path, dest: Path) -> dict[str, Any]:
    """Copy the tokenizer files; return the bos/eos ids of the source's config.json."""
    if not (source / "tokenizer.json").is_file():
        raise ValueError(f"{source} has no tokenizer.json")
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
    config_path = source / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    return {key: config[key] for key in ("bos_token_id", "eos_token_id") if key in config}


def _config(shape: ConfigShape) -> dict[str, Any]:
    return {
        "architectures": [shape.architecture],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "mlp_bias": False,
        "model_type": _MODEL_TYPES.get(shape.architecture, "llama"),
        "num_attention_heads": shape.num_heads,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": shape.num_kv_heads,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "torch_dtype": shape.torch_dtype,
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }
