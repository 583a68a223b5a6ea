"""The model's normalisation, rotary and SiLU-and-multiply ops, chosen once per engine
from its backend.

- `TorchOps`: the engine's torch arithmetic. With it the model keeps its plain torch
  forward (`LlamaModel.forward`), token-exact against transformers.
- `CpuOps`: the C loops of engine/cpu/csrc/model_ops.c, with the CPU attention backend
  (the compiled kernels): the residual add with the norm, q and k rotated in one call, and
  the MLP's SiLU-and-multiply, each one call where torch dispatches 5-12 small ops (a
  decode step's fixed cost; with two threads ATen splits even those across the pool). The
  same roundings as the torch ops: bfloat16 results are equal to them, float32 ones up to
  the last bit of the norm's mean and of `exp` in the SiLU.
- `TritonOps`: `kernels/rms_norm.py`, the residual add fused into the norm (vLLM's
  `fused_add_rms_norm`), and `kernels/rotary_embedding.py`, cos/sin looked up by position
  inside the kernel. With the Triton attention backend (CUDA; on CPU under
  `TRITON_INTERPRET=1` in tests) the model runs its fused forward over these. Results
  equal the torch ops up to the float32 summation order of the norm's statistics.

The kernels are imported when a `TritonOps` is built, not with this module: Triton is
not a dependency of a CPU install.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from pdserve.engine.modeling.llama import rms_norm
from pdserve.engine.modeling.rotary import apply_rotary

if TYPE_CHECKING:
    from pdserve.engine.cpu.kernels import CpuKernels
    from pdserve.engine.modeling.attention import AttentionBackend


class ModelOps(ABC):
    name: str
    # Whether `LlamaModel` runs its fused forward (the residual stream through `norm`).
    fused: bool

    @abstractmethod
    def norm(
        self,
        x: torch.Tensor,  # [T, hidden]
        weight: torch.Tensor,  # [hidden]
        eps: float,
        residual: torch.Tensor | None,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * normalize(s), s): s = x + residual (rounded to x's dtype), or x.

        Returns new tensors for the first; x and residual are not modified.
        """

    @abstractmethod
    def rotate(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, H, D], any strides (views of the fused qkv output)
        k: torch.Tensor,  # [T, KVH, D]
        cos: torch.Tensor,  # [max_positions, D], engine.rotary.cos_sin_cache
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated (neox layout) by the cos/sin rows at `positions`; new tensors."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2I] (the fused gate and up projections)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class TorchOps(ModelOps):
    name = "torch"
    fused = False

    def norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = x if residual is None else x + residual
        return rms_norm(s, weight, eps), s

    def rotate(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos_t, sin_t = cos[positions], sin[positions]
        return apply_rotary(q, cos_t, sin_t), apply_rotary(k, cos_t, sin_t)


class TritonOps(ModelOps):
    """One kernel launch per norm (residual add included) and one per q/k rotation."""

    name = "triton"
    fused = True

    def __init__(self) -> None:
        from pdserve.kernels.rms_norm import rms_norm as triton_rms_norm
        from pdserve.kernels.rotary_embedding import rotary_embedding

        self._rms_norm: Callable[..., Any] = triton_rms_norm
        self._rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rotary_embedding

    def norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._rms_norm(x, weight, eps), x
        out, summed = self._rms_norm(x, weight, eps, residual)
        return out, summed

    def rotate(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rotary(positions, q, k, cos, sin)


class CpuOps(ModelOps):
    """The C loops of `CpuKernels` (module docstring); a dtype or width they do not take
    (float16, a norm wider than `OPS_MAX_HIDDEN`) runs the torch ops instead."""

    name = "cpu"
    fused = True

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels
        self._torch = TorchOps()

    def norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.kernels.takes_ops(x.dtype, x.shape[-1]) or x.device.type != "cpu":
            return self._torch.norm(x, weight, eps, residual)
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self.kernels.add_rms_norm(x, weight, eps, residual, torch.get_num_threads())

    def rotate(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = q.shape[-1]
        if (
            not self.kernels.takes_ops(q.dtype, head_dim)
            or q.device.type != "cpu"
            or cos.dtype != q.dtype
            or any(t.stride(2) != 1 or t.stride(1) != head_dim for t in (q, k))
        ):
            return self._torch.rotate(positions, q, k, cos, sin)
        return self.kernels.rotary_neox(positions, q, k, cos, sin, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if (
            not self.kernels.takes_ops(gate_up.dtype, 1)
            or gate_up.device.type != "cpu"
            or not gate_up.is_contiguous()
        ):
            return super().silu_mul(gate_up)
        return self.kernels.silu_mul(gate_up, torch.get_num_threads())


def ops_for(backend: AttentionBackend) -> ModelOps:
    """The Triton ops with a backend that wants them (the Triton one), the C ones with the
    CPU backend's compiled kernels, else torch's."""
    if backend.uses_triton_ops:
        return TritonOps()
    if backend.cpu_kernels is not None:
        return CpuOps(backend.cpu_kernels)
    return TorchOps()
