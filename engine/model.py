"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Plain tensors and functions rather than nn.Modules: a decode step of a small model is
dominated by Python overhead, so each layer is a handful of torch calls. Projections are
fused (q|k|v and gate|up) at load time so one matmul replaces three and two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.engine.attention import AttentionBackend, AttentionMetadata, KVCache
from pdserve.engine.errors import CheckpointError
from pdserve.engine.linear import Linear
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.rotary import apply_rotary, cos_sin_cache
from pdserve.engine.weights import iter_weights


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (H + 2 * KVH) * D
    o: Linear  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * ffn
    down: Linear  # ffn -> hidden


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: statistics in float32, weight applied in x's dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class LlamaModel:
    """Weights plus a forward over a flat batch of tokens from many sequences."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        max_positions: int,
    ) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = Linear(lm_head)  # hidden -> vocab; the embedding itself when tied
        self.dtype = embed.dtype
        self.cos, self.sin = cos_sin_cache(config.rope, config.head_dim, max_positions, self.dtype)
        heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self._qkv_split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        self.scale = head_dim**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm)."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D]
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            residual = hidden
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            q, k, v = layer.qkv(x).split(self._qkv_split, dim=-1)
            q = apply_rotary(q.view(num_tokens, cfg.num_heads, cfg.head_dim), cos, sin)
            k = apply_rotary(k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            out = attn.forward(q, k, v, kv_cache, meta, self.scale)  # [T, H, D]
            hidden = residual + layer.o(out.reshape(num_tokens, -1))
            residual = hidden
            x = rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = residual + layer.down(F.silu(gate) * up)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows of `hidden` that sample."""
        x = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return self.lm_head(x).float()


def _cat_bias(tensors: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor | None:
    present = [tensors.pop(n, None) for n in names]
    if all(t is None for t in present):
        return None
    if any(t is None for t in present):
        raise CheckpointError(f"checkpoint has only some of the biases {names}")
    return torch.cat([t for t in present if t is not None])


def _take(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors.pop(name)
    except KeyError:
        raise CheckpointError(f"checkpoint lacks the tensor {name!r}") from None


def _layer(tensors: dict[str, torch.Tensor], i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    attn_names = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
    mlp_names = [f"{p}mlp.{n}_proj" for n in ("gate", "up")]
    qkv = torch.cat([_take(tensors, f"{n}.weight") for n in attn_names])
    gate_up = torch.cat([_take(tensors, f"{n}.weight") for n in mlp_names])
    return LayerWeights(
        input_norm=_take(tensors, f"{p}input_layernorm.weight"),
        qkv=Linear(qkv, _cat_bias(tensors, [f"{n}.bias" for n in attn_names])),
        o=Linear(
            _take(tensors, f"{p}self_attn.o_proj.weight"),
            tensors.pop(f"{p}self_attn.o_proj.bias", None),
        ),
        post_norm=_take(tensors, f"{p}post_attention_layernorm.weight"),
        gate_up=Linear(gate_up, _cat_bias(tensors, [f"{n}.bias" for n in mlp_names])),
        down=Linear(
            _take(tensors, f"{p}mlp.down_proj.weight"),
            tensors.pop(f"{p}mlp.down_proj.bias", None),
        ),
    )


def load_model(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
) -> LlamaModel:
    """Load the checkpoint's tensors into a LlamaModel (cast to dtype, on device).

    Raises:
        CheckpointError: a tensor is missing, or the checkpoint holds unexpected ones.
    """
    tensors = {
        name: t.to(device=device, dtype=dtype)
        for name, t in iter_weights(model_dir)
        if not name.endswith("rotary_emb.inv_freq")
    }
    embed = _take(tensors, "model.embed_tokens.weight")
    layers = [_layer(tensors, i) for i in range(config.num_layers)]
    final_norm = _take(tensors, "model.norm.weight")
    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is None:
        if not config.tie_word_embeddings:
            raise CheckpointError("checkpoint lacks 'lm_head.weight' and embeddings are not tied")
        lm_head = embed
    elif config.tie_word_embeddings:
        lm_head = embed
    if tensors:
        raise CheckpointError(f"checkpoint holds unexpected tensors: {sorted(tensors)[:5]}")
    return LlamaModel(config, embed, layers, final_norm, lm_head, max_positions)
