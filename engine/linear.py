"""Linear layers whose weights are prepacked for oneDNN on CPU (bfloat16 and float32).

`F.linear` on a bf16 CPU tensor re-lays the weight out on every call; a decode step
(one row per sequence) then runs at a third of memory bandwidth. oneDNN's blocked
layout, packed once at load, streams the weight at full speed. In float32, `F.linear`
(MKL) ran the mid model's linears at about 50 GFLOP/s for a batch of 33 rows, the
packed weights at about 100 (and 2.6x faster on 2 threads); measured in the same
process, 5 linears of hidden 1024: 57.8 ms against 30.0 ms. Results agree with
`F.linear` to float rounding (the fp32 token-exactness tests run through this path).
float16 and CUDA keep `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear:
    """y = x @ weight.T + bias for x [T, in_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        if _can_pack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                self.weight = None
            except RuntimeError as exc:  # an older oneDNN or an exotic CPU: stay unpacked
                logger.info("oneDNN weight packing unavailable (%s); using F.linear", exc)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
