"""The model's shape, parsed from a Hugging Face `config.json` (plain Python, no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.common.errors import CheckpointError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Qwen2 puts a bias on q/k/v (not on o_proj) without saying so in config.json.
_QKV_BIAS_BY_DEFAULT = {"Qwen2ForCausalLM": True}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    torch_dtype: str
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, for a 4-byte dtype; scale by itemsize/4."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"model folder {path.parent} has no {path.name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        if value is None:
            continue
        for token_id in value if isinstance(value, list) else [value]:
            if int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def _sliding_window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return int(window)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse `config.json` (+ `generation_config.json` for eos ids) of an HF model folder.

    Raises:
        CheckpointError: the folder or `config.json` is missing or malformed.
        UnsupportedModelError: an architecture or rope type this engine does not implement.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model folder {model_dir} does not exist")
    cfg = _read_json(model_dir / "config.json")
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"architecture {archs or '(none)'} in {model_dir / 'config.json'} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", _QKV_BIAS_BY_DEFAULT.get(arch, False))),
            o_bias=arch not in _QKV_BIAS_BY_DEFAULT and bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            sliding_window=_sliding_window(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(gen.get("eos_token_id"), cfg.get("eos_token_id")),
        )
    except KeyError as exc:
        raise CheckpointError(f"{model_dir / 'config.json'} lacks the key {exc.args[0]!r}") from exc


def tensor_parallel_problems(config: ModelConfig, tp: int) -> list[str]:
    """Why `tp` ranks cannot shard a model of this shape (engine/worker/parallel.py); []
    if they can.

    Each reason refers to `tp` as "it": query heads and the MLP's intermediate size are
    split evenly, KV heads split too or, when there are fewer of them than ranks, each
    replicated over tp / num_key_value_heads ranks.
    """
    if tp == 1:
        return []
    problems = []
    if config.num_heads % tp:
        problems.append(f"num_attention_heads={config.num_heads} is not divisible by it")
    kvh = config.num_kv_heads
    if kvh % tp and tp % kvh:
        problems.append(
            f"num_key_value_heads={kvh} neither divides it nor is divisible by it"
            " (KV heads are split, or replicated when there are fewer than ranks)"
        )
    if config.intermediate_size % tp:
        problems.append(f"intermediate_size={config.intermediate_size} is not divisible by it")
    return problems


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Raises UnsupportedModelError unless `tp` ranks can shard this model."""
    problems = tensor_parallel_problems(config, tp)
    if problems:
        raise UnsupportedModelError(
            f"tensor_parallel_size={tp} cannot shard this model: " + "; ".join(problems)
        )
