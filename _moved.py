"""Module paths that moved, kept importable for a release.

The engine became subpackages and its torch-free types moved to `pdserve.common`
(docs/architecture.md, "Layout"). Code that imports an old path, say
`pdserve.engine.sampling_params`, still works: the old name is an alias of the new
module (the same object, so monkeypatching either patches both), and a
DeprecationWarning names the new path. Nothing in pdserve imports an old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

# old module -> new module, both under `pdserve.`
MOVED = {
    "engine.errors": "common.errors",
    "engine.hashing": "common.hashing",
    "engine.sampling_params": "common.sampling_params",
    "engine.model_config": "common.model_config",
    "engine.tokenizer": "common.tokenizer",
    "engine.config": "common.engine_config",
    "engine.scheduler": "engine.sched.scheduler",
    "engine.block_pool": "engine.sched.block_pool",
    "engine.kv_cache_manager": "engine.sched.kv_cache_manager",
    "engine.sequence": "engine.sched.sequence",
    "engine.step_cost": "engine.sched.step_cost",
    "engine.model": "engine.modeling.llama",
    "engine.attention": "engine.modeling.attention",
    "engine.linear": "engine.modeling.linear",
    "engine.rotary": "engine.modeling.rotary",
    "engine.ops": "engine.modeling.ops",
    "engine.weights": "engine.modeling.weights",
    "engine.sampler": "engine.sampler",
    "engine.kv_quant": "engine.modeling.kv_quant",
    "engine.triton_backend": "engine.modeling.triton_backend",
    "engine.cpu_kernels": "engine.cpu.kernels",
    "engine.cpu_bf16": "engine.cpu.bf16",
    "engine.cpu_int8": "engine.cpu.int8",
    "engine.model_runner": "engine.worker.model_runner",
    "engine.tp_worker": "engine.worker.tp_worker",
    "engine.parallel": "engine.worker.parallel",
    "engine.cuda_graphs": "engine.worker.cuda_graphs",
    "engine.memory_profile": "engine.worker.memory_profile",
    "engine.kv_pool_sizing": "engine.worker.kv_pool_sizing",
    "engine.kv_staging": "engine.worker.kv_staging",
    "engine.kv_handoff": "engine.worker.kv_handoff",
    "engine.device_hygiene": "engine.worker.device_hygiene",
    "engine.speculative": "engine.spec_decode.proposer",
    "engine.draft": "engine.spec_decode.draft",
    "engine.demo_model": "demo.model",
    "engine.demo_training": "demo.training",
    "engine.dummy_model": "demo.dummy",
    "engine.data": "demo.data",
    "cluster.replica": "runtime.replica",
    "cluster.tp_ranks": "runtime.tp_ranks",
    "cluster.kv_targets": "runtime.kv_targets",
    "cluster.index_member": "runtime.index_member",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as its new module."""

    def __init__(self, package: str) -> None:
        self._targets = {f"{package}.{old}": f"{package}.{new}" for old, new in MOVED.items()}

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._targets:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self._targets[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes in a later release",
            DeprecationWarning,
            stacklevel=2,
        )
        # An existing module's own __name__ and __spec__ are kept (module_from_spec does
        # not override them): the alias *is* the new module.
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran when it was imported


def install(package: str) -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias(package))
