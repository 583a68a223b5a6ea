"""A PEFT LoRA adapter, loaded and checked against the base model it is to run on.

A PEFT folder holds `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`,
...) and `adapter_model.safetensors`: for each adapted projection of each layer, its
`lora_A` [r, in] and `lora_B` [out, r]. The projection's output becomes
`x W^T + scaling * (x A^T) B^T`, with `scaling = lora_alpha / r` (`/ sqrt(r)` with
`use_rslora`). What this engine cannot run exactly (DoRA, biases, extra trained modules,
per-layer rank patterns, a rank above the engine's maximum, a module it does not know,
a shape that is not the base's) is refused at load with `LoRAError`, before anything of
the adapter is kept: an adapter is never half loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from pdserve.common.errors import InvalidRequestError
from pdserve.common.model_config import ModelConfig

# The projections an adapter may target, and where each sits in the engine's fused
# layers: (fused layer, index of its part).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served on this base model (an HTTP 400)."""


class LoRAInUseError(LoRAError):
    """An unload refused: requests still run with the adapter (an HTTP 409)."""


@dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights in the engine's dtype, in host memory (what the engine keeps
    of every adapter it serves) or on its device (`to`: a resident one).

    `weights[layer][module]`: (A [r, in], B [out, r]) for every adapted projection.
    """

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    weights: tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], ...]

    def to(self, device: torch.device) -> LoRAAdapter:
        """This adapter with its weights on `device` (itself where they are already:
        on a CPU engine the host copy is the resident one)."""
        if all(a.device == device for layer in self.weights for a, _ in layer.values()):
            return self
        weights = tuple(
            {
                m: (a.to(device, non_blocking=True), b.to(device, non_blocking=True))
                for m, (a, b) in layer.items()
            }
            for layer in self.weights
        )
        return dataclasses.replace(self, weights=weights)

    def pinned(self) -> LoRAAdapter:
        """This adapter in page-locked host memory, so copies to a GPU run asynchronously
        on the engine's stream."""
        weights = tuple(
            {m: (a.pin_memory(), b.pin_memory()) for m, (a, b) in layer.items()}
            for layer in self.weights
        )
        return dataclasses.replace(self, weights=weights)

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for layer in self.weights
            for a, b in layer.values()
        )


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection an adapter may target."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q, kv = config.num_heads * head_dim, config.num_kv_heads * head_dim
    ffn = config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, ffn),
        "up_proj": (hidden, ffn),
        "down_proj": (ffn, hidden),
    }


def load_adapter(
    name: str,
    path: str | Path,
    config: ModelConfig,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoRAAdapter:
    """Read, check and place the adapter at `path`; LoRAError for anything it cannot be."""
    folder = Path(path)
    for required in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            found = (folder / required).is_file()
        except (OSError, ValueError) as exc:  # a name the OS refuses (a NUL, too long)
            raise LoRAError(f"adapter {name!r}: cannot read {str(folder)!r}: {exc}") from exc
        if not found:
            raise LoRAError(f"adapter {name!r}: no {required} in {str(folder)!r}")
    try:
        spec = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"adapter {name!r}: unreadable adapter_config.json: {exc}") from exc
    rank, alpha = int(spec.get("r", 0)), float(spec.get("lora_alpha", 0) or 0)
    _check_spec(name, spec, rank, max_rank)
    targets = spec.get("target_modules") or []
    targets = {targets} if isinstance(targets, str) else set(targets)
    unknown = sorted(targets - set(TARGETS))
    if unknown:
        raise LoRAError(
            f"adapter {name!r} targets {unknown}, which this engine cannot adapt "
            f"(it adapts {sorted(TARGETS)})"
        )
    try:
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except Exception as exc:  # a truncated or foreign file: safetensors' own errors
        raise LoRAError(f"adapter {name!r}: unreadable adapter_model.safetensors: {exc}") from exc
    shapes = module_shapes(config)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
        {} for _ in range(config.num_layers)
    ]
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: unexpected tensor {key!r}")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise LoRAError(f"adapter {name!r}: tensor {key!r} adapts an unknown module")
        if layer >= config.num_layers:
            raise LoRAError(
                f"adapter {name!r}: layer {layer}, but the base model has {config.num_layers}"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAError(
                f"adapter {name!r} does not fit this base model: layer {layer} {module} has "
                f"A {tuple(a.shape)} and B {tuple(b.shape)}, the base needs "
                f"A {(rank, fan_in)} and B {(fan_out, rank)}"
            )
        layers[layer][module] = (
            a.to(device=device, dtype=dtype).contiguous(),
            b.to(device=device, dtype=dtype).contiguous(),
        )
    if not pairs:
        raise LoRAError(f"adapter {name!r} holds no LoRA weights")
    scaling = alpha / math.sqrt(rank) if spec.get("use_rslora") else alpha / rank
    return LoRAAdapter(
        name, str(folder), rank, scaling, frozenset(m for _, m in pairs), tuple(layers)
    )


def _check_spec(name: str, spec: dict[str, object], rank: int, max_rank: int) -> None:
    if spec.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"adapter {name!r} is a {spec.get('peft_type')} adapter, not LoRA")
    if rank <= 0:
        raise LoRAError(f"adapter {name!r}: rank r={rank} is not positive")
    if rank > max_rank:
        raise LoRAError(
            f"adapter {name!r} has rank {rank}, above this engine's max_lora_rank {max_rank}"
        )
    refused = {
        "use_dora": "DoRA",
        "fan_in_fan_out": "fan_in_fan_out weights",
        "modules_to_save": "extra trained modules (modules_to_save)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layers_to_transform": "a subset of layers (layers_to_transform)",
    }
    for field, what in refused.items():
        if spec.get(field):
            raise LoRAError(f"adapter {name!r} uses {what}, which this engine does not serve")
    if spec.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r} trains biases (bias={spec.get('bias')!r})")
