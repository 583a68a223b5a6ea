"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Plain tensors and functions rather than nn.Modules: a decode step of a small model is
dominated by Python overhead, so each layer is a handful of torch calls. Projections are
fused (q|k|v and gate|up) at load time so one matmul replaces three and two.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdserve.engine.attention import AttentionBackend, AttentionMetadata, KVCache
from pdserve.engine.errors import CheckpointError
from pdserve.engine.linear import Linear
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.rotary import apply_rotary, cos_sin_cache
from pdserve.engine.weights import iter_weights

if TYPE_CHECKING:
    from pdserve.engine.ops import ModelOps


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
        # Norm and rotary ops; the runner binds them to its attention backend
        # (`engine/ops.py`). None, or unfused ops: the plain torch forward below.
        self.ops: ModelOps | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm)."""
        if self.ops is not None and self.ops.fused:
            return self._forward_fused(self.ops, input_ids, positions, kv_caches, attn, meta)
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

    def _forward_fused(
        self,
        ops: ModelOps,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],
        attn: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`forward` over `ops`, the residual stream carried through the norms (as vLLM):
        each norm adds the previous sublayer's output to the residual in the same kernel,
        and the rotary kernel looks cos/sin up by position itself."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        num_tokens = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed)  # [T, hidden]
        residual: torch.Tensor | None = None  # the first norm takes hidden as the residual
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = ops.norm(hidden, layer.input_norm, eps, residual)
            q, k, v = layer.qkv(x).split(self._qkv_split, dim=-1)
            q, k = ops.rotate(
                positions,
                q.view(num_tokens, cfg.num_heads, cfg.head_dim),
                k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim),
                self.cos,
                self.sin,
            )
            v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            out = attn.forward(q, k, v, kv_cache, meta, self.scale)  # [T, H, D]
            attn_out = layer.o(out.reshape(num_tokens, -1))
            x, residual = ops.norm(attn_out, layer.post_norm, eps, residual)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            hidden = layer.down(F.silu(gate) * up)
        # The last MLP output joins the residual stream here, so that callers get the whole
        # hidden state (`logits` takes rows of it), as from the torch forward.
        return hidden if residual is None else residual + hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows of `hidden` that sample."""
        if self.ops is not None and self.ops.fused:
            x, _ = self.ops.norm(hidden, self.final_norm, self.config.rms_norm_eps, None)
        else:
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


# Dummy weights are uniform in [-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE] (as vLLM's), norm
# weights 1: each norm brings the residual stream back to unit scale, and the sublayers
# add little to it, so activations stay small and finite in bf16 at any depth.
DUMMY_WEIGHT_RANGE = 1e-3


def dummy_weights(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint of `config`'s shape holds, by its checkpoint name (tied
    embeddings: no `lm_head.weight`; biases where `config` has them), made on `device`
    in `dtype` from a generator there seeded with `seed`: the same seed and device type
    give the same weights, and nothing is copied from the host."""
    generator = torch.Generator(device=device).manual_seed(seed)
    r = DUMMY_WEIGHT_RANGE

    def rand(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device).uniform_(-r, r, generator=generator)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=dtype, device=device)

    hidden, ffn = config.hidden_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    tensors = {"model.embed_tokens.weight": rand(config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        tensors[f"{p}input_layernorm.weight"] = ones(hidden)
        for name, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            tensors[f"{p}self_attn.{name}_proj.weight"] = rand(rows, hidden)
            if config.qkv_bias:
                tensors[f"{p}self_attn.{name}_proj.bias"] = rand(rows)
        tensors[f"{p}self_attn.o_proj.weight"] = rand(hidden, q_size)
        if config.o_bias:
            tensors[f"{p}self_attn.o_proj.bias"] = rand(hidden)
        tensors[f"{p}post_attention_layernorm.weight"] = ones(hidden)
        for name in ("gate", "up"):
            tensors[f"{p}mlp.{name}_proj.weight"] = rand(ffn, hidden)
            if config.mlp_bias:
                tensors[f"{p}mlp.{name}_proj.bias"] = rand(ffn)
        tensors[f"{p}mlp.down_proj.weight"] = rand(hidden, ffn)
        if config.mlp_bias:
            tensors[f"{p}mlp.down_proj.bias"] = rand(hidden)
    tensors["model.norm.weight"] = ones(hidden)
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(config.vocab_size, hidden)
    return tensors


def load_model(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
) -> LlamaModel:
    """Load the checkpoint's tensors into a LlamaModel (cast to dtype, on device).

    `load_format="dummy"`: random weights of the checkpoint's shape instead
    (`dummy_weights`, seeded by `seed`); no weight file is read, or needed.

    Raises:
        CheckpointError: a tensor is missing, or the checkpoint holds unexpected ones.
    """
    if load_format == "dummy":
        tensors = dummy_weights(config, dtype, device, seed)
    elif load_format == "auto":
        tensors = {
            name: t.to(device=device, dtype=dtype)
            for name, t in iter_weights(model_dir)
            if not name.endswith("rotary_emb.inv_freq")
        }
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
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
