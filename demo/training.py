"""Trains the demo model's weights on the packaged corpus, deterministically, on a CPU.

`train_demo_weights` turns token windows of the demo corpus into a Hugging Face-named
Llama state dict (`model.layers.0.self_attn.q_proj.weight`, ...) with plain torch: a
small Llama written here for training only (autograd, no KV cache), numerically the same
model `transformers` and our engine run (RMSNorm in float32, rotate-half RoPE, grouped
KV heads, SwiGLU). A test checks that `transformers` computes the same logits from the
saved weights.

Determinism: one seeded `torch.Generator` draws the initial weights and every batch;
the thread count is set explicitly for the whole run (the order of a float reduction
depends on it) and restored afterwards, so two builds on one machine give the same bytes.

This module is runtime code: torch only, never transformers (a dev dependency only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PROGRESS_EVERY", "LlamaForTraining", "TrainConfig", "train_demo_weights"]

PROGRESS_EVERY = 50
_IGNORE = -100  # cross_entropy's ignore_index: padding predicts nothing


@dataclass(frozen=True)
class ModelShape:
    """The Llama dimensions a model folder's config.json records."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class TrainConfig:
    """The model's shape and the optimisation schedule."""

    shape: ModelShape
    rms_norm_eps: float
    rope_theta: float
    seq_len: int
    batch_size: int
    steps: int
    peak_lr: float
    final_lr: float
    warmup_steps: int
    weight_decay: float
    init_std: float
    seed: int
    num_threads: int


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Attention(nn.Module):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        shape = cfg.shape
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.q_proj = nn.Linear(cfg.shape.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(cfg.shape.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(cfg.shape.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.shape.hidden_size, bias=False)
        self.heads, self.kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = shape.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Query head h reads KV head h // (heads // kv_heads), as transformers' repeat_kv.
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.shape.hidden_size, cfg.shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.shape.hidden_size, cfg.shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.shape.intermediate_size, cfg.shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg.shape.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg.shape.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.shape.vocab_size, cfg.shape.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.shape.num_layers))
        self.norm = _RMSNorm(cfg.shape.hidden_size, cfg.rms_norm_eps)


class LlamaForTraining(nn.Module):
    """Parameter names are transformers' (`model.embed_tokens.weight`, `lm_head.weight`)."""

    cos: torch.Tensor  # [seq_len, head_dim] buffers: RoPE as transformers computes it
    sin: torch.Tensor

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.shape.hidden_size, cfg.shape.vocab_size, bias=False)
        inv_freq = 1.0 / cfg.rope_theta ** (
            torch.arange(0, cfg.shape.head_dim, 2, dtype=torch.float32) / cfg.shape.head_dim
        )
        freqs = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq = ids.shape[1]
        cos, sin = self.cos[:seq], self.sin[:seq]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@contextmanager
def _threads(num_threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _lr(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay from peak_lr to final_lr."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.final_lr + 0.5 * (cfg.peak_lr - cfg.final_lr) * (1 + math.cos(math.pi * progress))


def train_demo_weights(
    examples: Sequence[Sequence[int]],
    cfg: TrainConfig,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Trains on `examples` (token id lists of 2 to seq_len + 1 tokens; each predicts its
    own tokens from the ones before) and returns the weights: contiguous float32 tensors
    named as in a transformers Llama checkpoint.

    `progress(step, loss)` is called every `PROGRESS_EVERY` steps and after the last.
    """
    inputs, targets = _pad(examples, cfg.seq_len)
    with _threads(cfg.num_threads), torch.random.fork_rng(devices=[]):
        gen = torch.Generator().manual_seed(cfg.seed)
        torch.manual_seed(cfg.seed)  # nothing here draws from it; fixed all the same
        model = _init_model(cfg, gen)
        optimizer = _optimizer(model, cfg)
        model.train()
        for step in range(cfg.steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr(cfg, step)
            rows = torch.randint(len(inputs), (cfg.batch_size,), generator=gen)
            logits = model(inputs[rows])
            loss = F.cross_entropy(
                logits.reshape(-1, cfg.shape.vocab_size),
                targets[rows].reshape(-1),
                ignore_index=_IGNORE,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
            optimizer.step()
            if progress is not None and ((step + 1) % PROGRESS_EVERY == 0 or step + 1 == cfg.steps):
                progress(step + 1, loss.item())
        return {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}


def _pad(examples: Sequence[Sequence[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, seq_len] inputs and targets (the inputs shifted by one); padding is ignored."""
    inputs = torch.zeros(len(examples), seq_len, dtype=torch.long)
    targets = torch.full((len(examples), seq_len), _IGNORE, dtype=torch.long)
    for row, ids in enumerate(examples):
        if not 2 <= len(ids) <= seq_len + 1:
            raise ValueError(f"training example of {len(ids)} tokens; 2..{seq_len + 1} fit")
        inputs[row, : len(ids) - 1] = torch.tensor(ids[:-1])
        targets[row, : len(ids) - 1] = torch.tensor(ids[1:])
    return inputs, targets


def _init_model(cfg: TrainConfig, gen: torch.Generator) -> LlamaForTraining:
    model = LlamaForTraining(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, cfg.init_std, generator=gen)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                # GPT-2's scaling of residual outputs
                param.div_(math.sqrt(2 * cfg.shape.num_layers))
    return model


def _optimizer(model: LlamaForTraining, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and embeddings. The single-tensor implementation
    (foreach=False): its arithmetic does not depend on how tensors are grouped."""
    params = list(model.named_parameters())
    decay = [p for n, p in params if p.dim() == 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in params if p.dim() < 2 or "embed_tokens" in n]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=(0.9, 0.95), foreach=False)
