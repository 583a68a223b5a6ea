"""Offline generation: `LLM(model_dir).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any, cast

from pdserve.common.engine_config import EngineConfig
from pdserve.common.sampling_params import SamplingParams
from pdserve.demo.model import resolve_model
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput

Prompt = str | Seq[int]


class LLM:
    """Runs a batch of prompts to completion with continuous batching.

    Args:
        model: An HF model folder; None or "demo" for the built-in demo model.
        **config: Fields of `EngineConfig` (block_size, num_kv_blocks, dtype,
            tensor_parallel_size, ...).

    With `tensor_parallel_size` > 1 the model runs sharded over that many local
    processes; `close()` (or leaving a `with` block, or the interpreter's exit) stops them.
    """

    def __init__(self, model: str | Path | None = None, **config: Any) -> None:
        self.engine = LLMEngine(resolve_model(model), EngineConfig(**config))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order.

        Raises:
            InvalidRequestError: a prompt is empty, too long or has out-of-vocabulary ids
                (no request of the batch is run then).
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_for(prompt_list, params)
        request_ids = [f"gen-{next(self._ids)}" for _ in prompt_list]
        try:
            for rid, prompt, p in zip(request_ids, prompt_list, params_list, strict=True):
                self.engine.add_request(rid, prompt, p)
        except Exception:
            self.engine.abort(request_ids)
            raise
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [finals[rid] for rid in request_ids]

    def load_lora(self, name: str, path: str | Path) -> None:
        """Load the PEFT adapter at `path`; requests run with it by naming it in their
        params (`SamplingParams(lora=name)`). Raises LoRAError for one that does not fit."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any (also done at exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _params_for(
        prompts: list[Prompt], params: SamplingParams | Seq[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * len(prompts)
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return list(params)


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (a string or a list of ids) or many, as a list of prompts."""
    if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
        return [cast(Prompt, prompts)]
    return list(cast(Seq[Prompt], prompts))
