"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Plain tensors and functions rather than nn.Modules: a decode step of a small model is
dominated by Python overhead, so each layer is a handful of torch calls. Projections are
fused (q|k|v and gate|up) at load time so one matmul replaces three and two.

With `quantization="int8"` those projections (q|k|v, o, gate|up, down) are quantized at
load, from the weights cast to the model's dtype, to int8 with one scale per output row
(`engine/modeling/linear.py`, `Int8Linear`; as vLLM's online quantization, after the cast). The
embedding, the LM head and the norms stay in the model's dtype: the embedding is read one
row per token, and the LM head's and the norms' errors would reach the logits unmixed.
Tensor parallel: each rank quantizes its own slices, so a row-parallel projection (o,
down) gets a scale per row per rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdserve.common.engine_config import Quantization
from pdserve.common.errors import CheckpointError
from pdserve.common.model_config import ModelConfig
from pdserve.engine.lora.apply import LoRAStep
from pdserve.engine.modeling.attention import AttentionBackend, AttentionMetadata, KVCache
from pdserve.engine.modeling.linear import Int8Linear, Linear, LinearLayer
from pdserve.engine.modeling.rotary import apply_rotary, cos_sin_cache
from pdserve.engine.modeling.weights import checkpoint_files, iter_weights

if TYPE_CHECKING:
    from pdserve.engine.modeling.ops import ModelOps
    from pdserve.engine.worker.parallel import TPGroup, TPShard


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: LinearLayer  # hidden -> (H + 2 * KVH) * D
    o: LinearLayer  # H * D -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearLayer  # hidden -> 2 * ffn
    down: LinearLayer  # ffn -> hidden


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
        shard: TPShard | None = None,
    ) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]; tensor parallel: this rank's padded rows
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = Linear(lm_head)  # hidden -> vocab; the embedding itself when tied
        self.dtype = embed.dtype
        self.cos, self.sin = cos_sin_cache(
            config.rope, config.head_dim, max_positions, self.dtype, embed.device
        )
        # This rank's heads (all of them without tensor parallelism).
        self.shard = shard
        self.num_heads = config.num_heads if shard is None else shard.num_heads
        self.num_kv_heads = config.num_kv_heads if shard is None else shard.num_kv_heads
        self.vocab_start = 0 if shard is None else shard.vocab_range[0]
        # The tensor-parallel group the forward reduces over; None: one rank, no collective.
        self.tp: TPGroup | None = None
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, config.head_dim
        self._qkv_split = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        self.scale = head_dim**-0.5
        # Norm and rotary ops; the runner binds them to its attention backend
        # (`engine/modeling/ops.py`). None, or unfused ops: the plain torch forward below.
        self.ops: ModelOps | None = None
        # The LoRA adapters of the step being run and their rows (engine/lora/apply.py),
        # set by the runner around a forward; None: no row has an adapter.
        self.lora: LoRAStep | None = None

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
        tp = self.tp
        cos, sin = self.cos[positions], self.sin[positions]  # [T, D]
        hidden = self._embed(input_ids)  # [T, hidden]
        lora = self.lora
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            residual = hidden
            x = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            q, k, v = self._qkv(i, layer, x, lora)
            q = apply_rotary(q.view(num_tokens, self.num_heads, cfg.head_dim), cos, sin)
            k = apply_rotary(k.view(num_tokens, self.num_kv_heads, cfg.head_dim), cos, sin)
            v = v.view(num_tokens, self.num_kv_heads, cfg.head_dim)
            out = attn.forward(q, k, v, kv_cache, meta, self.scale)  # [T, H, D]
            attn_out = self._proj(i, "o", layer.o, out.reshape(num_tokens, -1), lora)
            if tp is not None:  # row-parallel: each rank's heads' share of the sum
                tp.all_reduce(attn_out)
            hidden = residual + attn_out
            residual = hidden
            x = rms_norm(hidden, layer.post_norm, cfg.rms_norm_eps)
            mlp_out = self._mlp(i, layer, x, lora)
            if tp is not None:
                tp.all_reduce(mlp_out)
            hidden = residual + mlp_out
        return hidden

    def _qkv(
        self, i: int, layer: LayerWeights, x: torch.Tensor, lora: LoRAStep | None
    ) -> tuple[torch.Tensor, ...]:
        """q, k, v of layer `i` (with the step's LoRA deltas, if any)."""
        qkv = layer.qkv(x)
        if lora is not None:
            lora.add(i, "qkv", x, qkv, self._qkv_split)
        return qkv.split(self._qkv_split, dim=-1)

    @staticmethod
    def _proj(
        i: int, fused: str, linear: LinearLayer, x: torch.Tensor, lora: LoRAStep | None
    ) -> torch.Tensor:
        out = linear(x)
        if lora is not None:
            lora.add(i, fused, x, out)
        return out

    def _mlp(
        self, i: int, layer: LayerWeights, x: torch.Tensor, lora: LoRAStep | None
    ) -> torch.Tensor:
        """Layer `i`'s MLP output (before its all-reduce under tensor parallelism)."""
        gate_up = layer.gate_up(x)
        if lora is not None:
            half = gate_up.shape[1] // 2
            lora.add(i, "gate_up", x, gate_up, (half, half))
        if self.ops is not None:
            act = self.ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self._proj(i, "down", layer.down, act, lora)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, hidden]; vocab-parallel: rows outside this rank's shard are
        zeros here and come from the rank that holds them (one all-reduce)."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed)
        hidden.masked_fill_(outside.unsqueeze(1), 0)
        return self.tp.all_reduce(hidden)

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
        tp = self.tp
        hidden = self._embed(input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None  # the first norm takes hidden as the residual
        lora = self.lora
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = ops.norm(hidden, layer.input_norm, eps, residual)
            q, k, v = self._qkv(i, layer, x, lora)
            q, k = ops.rotate(
                positions,
                q.view(num_tokens, self.num_heads, cfg.head_dim),
                k.view(num_tokens, self.num_kv_heads, cfg.head_dim),
                self.cos,
                self.sin,
            )
            v = v.view(num_tokens, self.num_kv_heads, cfg.head_dim)
            out = attn.forward(q, k, v, kv_cache, meta, self.scale)  # [T, H, D]
            attn_out = self._proj(i, "o", layer.o, out.reshape(num_tokens, -1), lora)
            if tp is not None:
                tp.all_reduce(attn_out)
            x, residual = ops.norm(attn_out, layer.post_norm, eps, residual)
            hidden = self._mlp(i, layer, x, lora)
            if tp is not None:
                tp.all_reduce(hidden)
        # The last MLP output joins the residual stream here, so that callers get the whole
        # hidden state (`logits` takes rows of it), as from the torch forward.
        return hidden if residual is None else residual + hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the rows of `hidden` that sample.

        Tensor parallel: each rank computes its vocabulary slice; the driver gets the
        whole rows (gathered), the other ranks their own slice back.
        """
        if self.ops is not None and self.ops.fused:
            x, _ = self.ops.norm(hidden, self.final_norm, self.config.rms_norm_eps, None)
        else:
            x = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        logits = self.lm_head(x).float()
        if self.tp is not None:
            logits = self.tp.gather_columns(logits, self.config.vocab_size)
        return logits

    def weight_bytes(self) -> tuple[int, int]:
        """(sharded, replicated) bytes of this rank's weights, as held (packed or not;
        int8 with its scales).

        Replicated: norms, a row-parallel layer's bias (held by the driver alone) and,
        when there are more ranks than KV heads, the K/V projections (each rank holds
        the KV head its query heads read). Sharded: the rest, 1/tp of the whole each.
        """
        norms = [self.final_norm] + [
            t for lay in self.layers for t in (lay.input_norm, lay.post_norm)
        ]
        replicated = sum(_nbytes(t) for t in norms)
        # A tied LM head shares the embedding's tensor unless it was packed (a copy).
        embed_bytes = 0 if self.lm_head.weight is self.embed else _nbytes(self.embed)
        total = replicated + self.lm_head.weight_bytes + embed_bytes
        kv_rows = 2 * self.num_kv_heads * self.config.head_dim
        for layer in self.layers:
            total += sum(
                lin.weight_bytes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
            for lin in (layer.o, layer.down):
                replicated += 0 if lin.bias is None else _nbytes(lin.bias)
            if self.shard is not None and self.shard.kv_replicated:
                replicated += kv_rows * layer.qkv.row_bytes
        return total - replicated, replicated


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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


def _layer(tensors: dict[str, torch.Tensor], i: int, quantization: Quantization) -> LayerWeights:
    p = f"model.layers.{i}."
    attn_names = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
    mlp_names = [f"{p}mlp.{n}_proj" for n in ("gate", "up")]
    qkv = torch.cat([_take(tensors, f"{n}.weight") for n in attn_names])
    gate_up = torch.cat([_take(tensors, f"{n}.weight") for n in mlp_names])
    # NOTE: per-row scales make quantizing the fused q|k|v (gate|up) the same as quantizing
    # q, k and v apart; the float weights are dropped as each layer is built.
    linear = Int8Linear.quantize if quantization == "int8" else Linear
    return LayerWeights(
        input_norm=_take(tensors, f"{p}input_layernorm.weight"),
        qkv=linear(qkv, _cat_bias(tensors, [f"{n}.bias" for n in attn_names])),
        o=linear(
            _take(tensors, f"{p}self_attn.o_proj.weight"),
            tensors.pop(f"{p}self_attn.o_proj.bias", None),
        ),
        post_norm=_take(tensors, f"{p}post_attention_layernorm.weight"),
        gate_up=linear(gate_up, _cat_bias(tensors, [f"{n}.bias" for n in mlp_names])),
        down=linear(
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
    shard: TPShard | None = None,
    quantization: Quantization = "none",
) -> LlamaModel:
    """Load the checkpoint's tensors into a LlamaModel (cast to dtype, on device).

    `load_format="dummy"`: random weights of the checkpoint's shape instead
    (`dummy_weights`, seeded by `seed`); no weight file is read, or needed.
    `shard`: tensor parallel, only this rank's slices (`_load_shard`).
    `quantization="int8"`: the blocks' projections as `Int8Linear` (module docstring).

    Raises:
        CheckpointError: a tensor is missing, or the checkpoint holds unexpected ones.
    """
    if shard is not None:
        return _load_shard(
            model_dir, config, dtype, device, max_positions, load_format, seed, shard, quantization
        )
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
    layers = [_layer(tensors, i, quantization) for i in range(config.num_layers)]
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


# -- tensor parallel: one rank's slices -------------------------------------------------------


class _SliceSource(Protocol):
    def names(self) -> list[str]: ...

    def read(self, name: str, part: tuple[int, int, int, bool] | None) -> torch.Tensor:
        """Tensor `name`, or its slice (dim, start, end, _) only."""
        ...


class _SafetensorsSlices:
    """A checkpoint's tensors read slice by slice (`safe_open(...).get_slice`): a rank
    reads its rows (or columns) of a sharded tensor, not the whole of it."""

    def __init__(self, model_dir: Path, stack: contextlib.ExitStack) -> None:
        self._where = {}
        for path in checkpoint_files(model_dir):
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                self._where[name] = handle

    def names(self) -> list[str]:
        return list(self._where)

    def read(self, name: str, part: tuple[int, int, int, bool] | None) -> torch.Tensor:
        handle = self._where[name]
        if part is None:
            return handle.get_tensor(name)
        dim, start, end, _ = part
        view = handle.get_slice(name)
        return view[start:end] if dim == 0 else view[:, start:end]


class _DummySlices:
    """Random slices of a checkpoint of `config`'s shape, made directly at the slice's
    shape (as `dummy_weights`, norms 1; seeded by seed and rank: ranks differ)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int
    ) -> None:
        self._shapes = _checkpoint_shapes(config)
        self._dtype, self._device = dtype, device
        self._generator = torch.Generator(device=device).manual_seed(seed)

    def names(self) -> list[str]:
        return list(self._shapes)

    def read(self, name: str, part: tuple[int, int, int, bool] | None) -> torch.Tensor:
        shape = list(self._shapes[name])
        if part is not None:
            shape[part[0]] = part[2] - part[1]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self._dtype, device=self._device)
        r = DUMMY_WEIGHT_RANGE
        out = torch.empty(shape, dtype=self._dtype, device=self._device)
        return out.uniform_(-r, r, generator=self._generator)


def _checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's name and full shape (as `dummy_weights` makes them)."""
    hidden, ffn = config.hidden_size, config.intermediate_size
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        for name, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, hidden)
            if config.qkv_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes[f"{p}self_attn.o_proj.weight"] = (hidden, q_size)
        if config.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
        for name in ("gate", "up"):
            shapes[f"{p}mlp.{name}_proj.weight"] = (ffn, hidden)
            if config.mlp_bias:
                shapes[f"{p}mlp.{name}_proj.bias"] = (ffn,)
        shapes[f"{p}mlp.down_proj.weight"] = (hidden, ffn)
        if config.mlp_bias:
            shapes[f"{p}mlp.down_proj.bias"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


_ROW_PARALLEL_BIASES = ("self_attn.o_proj.bias", "mlp.down_proj.bias")


def _load_shard(
    model_dir: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    load_format: str,
    seed: int,
    shard: TPShard,
    quantization: Quantization,
) -> LlamaModel:
    """`load_model` for rank `shard.rank`: each tensor's slice on this rank
    (`TPShard.slice_of`), q|k|v and gate|up fused per rank; the vocabulary shards padded
    to `vocab_per_rank` rows; a row-parallel layer's bias on the driver only (added once
    before the all-reduce)."""
    with contextlib.ExitStack() as stack:
        source: _SliceSource
        if load_format == "dummy":
            source = _DummySlices(config, dtype, device, seed + shard.rank)
        elif load_format == "auto":
            source = _SafetensorsSlices(model_dir, stack)
        else:
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
        tensors: dict[str, torch.Tensor] = {}
        for name in source.names():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if shard.rank > 0 and name.endswith(_ROW_PARALLEL_BIASES):
                continue
            part = shard.slice_of(name)
            tensor = source.read(name, part).to(device=device, dtype=dtype)
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                tensor = _pad_rows(tensor, shard.vocab_per_rank)
            tensors[name] = tensor
    embed = _take(tensors, "model.embed_tokens.weight")
    layers = [_layer(tensors, i, quantization) for i in range(config.num_layers)]
    final_norm = _take(tensors, "model.norm.weight")
    lm_head = tensors.pop("lm_head.weight", None)
    if lm_head is None and not config.tie_word_embeddings:
        raise CheckpointError("checkpoint lacks 'lm_head.weight' and embeddings are not tied")
    if lm_head is None or config.tie_word_embeddings:
        lm_head = embed
    if tensors:
        raise CheckpointError(f"checkpoint holds unexpected tensors: {sorted(tensors)[:5]}")
    return LlamaModel(config, embed, layers, final_norm, lm_head, max_positions, shard)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` with zero rows appended up to `rows` (the last vocabulary shard)."""
    if tensor.shape[0] == rows:
        return tensor
    pad = tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])
    return torch.cat([tensor, pad])
