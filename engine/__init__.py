"""The inference engine both worker roles share, and the offline `LLM` API.

Exports load lazily so that plain-Python users of `pdserve.engine.hashing` or
`pdserve.engine.block_pool` (the router, the index) never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm import LLM
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.outputs import RequestOutput
    from pdserve.engine.sampling_params import SamplingParams

_EXPORTS = {
    "EngineConfig": "pdserve.engine.config",
    "LLM": "pdserve.engine.llm",
    "LLMEngine": "pdserve.engine.llm_engine",
    "RequestOutput": "pdserve.engine.outputs",
    "SamplingParams": "pdserve.engine.sampling_params",
}
__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
