"""Rotary position embedding tables (neox layout), with `linear` and `llama3` scaling.

Computed in float32 exactly as `transformers` computes them, then cast once to the model
dtype, so positions rotate identically to the reference.
"""

from __future__ import annotations

import math

import torch

from pdserve.common.model_config import RopeConfig


def inverse_frequencies(
    rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as `rope.rope_type` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1 scaling: long wavelengths are divided by `factor`, short ones kept, and the
    # band in between interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(
    rope: RopeConfig,
    head_dim: int,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape [max_positions, head_dim] (halves repeated, neox layout),
    made on `device`: the model's, where every forward looks them up (as `transformers`
    computes them on the model's device too)."""
    inv_freq = inverse_frequencies(rope, head_dim, device)
    positions = torch.arange(max_positions, dtype=torch.int64, device=device).float()
    freqs = torch.outer(positions, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by per-token cos/sin [T, D] (neox: halves, not pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
