"""The inference engine both worker roles share, and the offline `LLM` API.

Subpackages: `sched` (scheduling, blocks; plain Python), `modeling` (the model and its
layers), `cpu` (C kernels), `worker` (model runner, TP, CUDA graphs, memory, KV staging
and handoff), `spec_decode`. Importing this package imports torch: what the router and
the cluster need without it is in `pdserve.common`.
"""

from pdserve.common.engine_config import EngineConfig
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
