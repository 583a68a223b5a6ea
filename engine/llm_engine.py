"""The engine loop: requests in, one scheduled step at a time, outputs out.

Both worker roles and the offline `LLM` drive this class. It is single-threaded: callers
serialise `add_request`, `abort` and `step` (the workers run it on one thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence as Seq
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pdserve.common.engine_config import (
    EngineConfig,
    default_num_threads,
)
from pdserve.common.errors import InvalidRequestError, PromptTooLongError
from pdserve.common.hashing import (
    LORA_GAUGE_PREFIX,
    BlockHash,
    hash_namespace,
    lora_model_id,
    request_namespace,
)
from pdserve.common.kv_events import KVEvent
from pdserve.common.model_config import ModelConfig, load_model_config
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.tokenizer import Tokenizer
from pdserve.engine.cpu import kernels as cpu_kernels
from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.lora.adapter import LoRAAdapter, LoRAError, LoRAInUseError, load_adapter
from pdserve.engine.modeling.attention import (
    AttentionBackend,
    CpuAttentionBackend,
    TorchAttentionBackend,
)
from pdserve.engine.modeling.linear import Int8Linear
from pdserve.engine.modeling.llama import LlamaModel, load_model
from pdserve.engine.outputs import RequestOutput, TextTracker, make_output
from pdserve.engine.sampler import Sampler
from pdserve.engine.sched.block_pool import BlockPool
from pdserve.engine.sched.kv_cache_manager import KVCacheManager
from pdserve.engine.sched.lora_slots import LoRASlots
from pdserve.engine.sched.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from pdserve.engine.sched.sequence import FinishReason, Sequence, SequenceStatus, TokenLogprobs
from pdserve.engine.sched.step_cost import StepCostModel
from pdserve.engine.spec_decode.draft import DraftProposer
from pdserve.engine.spec_decode.proposer import (
    BatchProposer,
    Proposer,
    SpecPolicy,
    SpecStats,
    check_draft_checkpoint,
    make_proposer,
)
from pdserve.engine.timeline import EngineTimeline
from pdserve.engine.worker.cuda_graphs import cuda_graphs_enabled
from pdserve.engine.worker.kv_disk_tier import HEADER_BYTES, DiskKVTier
from pdserve.engine.worker.kv_fetch import export_prefix, import_prefix, prefix_sequence
from pdserve.engine.worker.kv_handoff import (
    HeadRange,
    KVExport,
    KVImportError,
    export_block_ids,
    export_kv,
    export_ranges,
    import_prefilled,
)
from pdserve.engine.worker.kv_host_tier import HostKVTier, slots_for
from pdserve.engine.worker.kv_pool_sizing import KVPoolSizing
from pdserve.engine.worker.kv_staging import KVStaging
from pdserve.engine.worker.memory_profile import (
    MemoryProfile,
    MemoryReader,
)
from pdserve.engine.worker.model_runner import ModelRunner, StepResult, allocate_kv_cache
from pdserve.engine.worker.parallel import (
    CollectiveTimes,
    ParallelStats,
    RankMemory,
    TensorParallelError,
    TPShard,
    check_tensor_parallel,
)
from pdserve.engine.worker.tp_worker import RankLauncher, TPWorkers
from pdserve.kernels import _variants

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, model_config: ModelConfig) -> torch.dtype:
    if name == "auto":
        name = model_config.torch_dtype if model_config.torch_dtype in _DTYPES else "float32"
    return _DTYPES[name]


def make_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
) -> AttentionBackend:
    """`auto`: Triton on CUDA when installed; on CPU the compiled decode kernel when it
    builds here and takes `dtype` and `kv_cache_dtype` (`engine/cpu/kernels.py`), else
    the torch path."""
    if name == "triton" and device.type != "cuda" and not interpreting_triton():
        raise ValueError(
            "attention_backend='triton' off CUDA runs only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment (tests of the path CUDA runs)"
        )
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        try:
            from pdserve.engine.modeling.triton_backend import TritonAttentionBackend
        except ImportError:
            if name == "triton":
                raise
            return TorchAttentionBackend(kv_cache_dtype)
        return TritonAttentionBackend(kv_cache_dtype)
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        kernels = cpu_kernels.load()
        if kernels is not None and kernels.takes(dtype, kv_cache_dtype):
            return CpuAttentionBackend(kernels, kv_cache_dtype)
        if name == "cpu" and kernels is None:
            raise RuntimeError(
                "attention_backend='cpu' needs the compiled CPU kernels, which could not be"
                " built here (a C compiler is required; see the log for the error)"
            )
        if name == "cpu":
            raise ValueError(
                f"the CPU decode kernel does not take {dtype} with kv_cache_dtype={kv_cache_dtype}"
            )
    return TorchAttentionBackend(kv_cache_dtype)


def interpreting_triton() -> bool:
    """Whether Triton's kernels run in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_off_cuda(config: EngineConfig) -> bool:
    """Whether the engine runs all its Triton kernels off CUDA (CPU, under
    TRITON_INTERPRET=1): there the Triton attention backend is chosen only explicitly,
    to test the path CUDA runs, so the int8 matmul (`Int8Linear.on_triton`) and the KV
    pack/unpack (`KVStaging(use_kernels=True)`) leave their C / torch paths for the
    Triton kernels too. On CUDA they are Triton already."""
    return config.attention_backend == "triton" and torch.device(config.device).type != "cuda"


def int8_on_triton(model: LlamaModel) -> None:
    """The model's int8 projections multiplied by the Triton kernel from now on."""
    for layer in model.layers:
        for field in dataclasses.fields(layer):
            linear = getattr(layer, field.name)
            if isinstance(linear, Int8Linear):
                setattr(layer, field.name, linear.on_triton())


def _with_threads(config: EngineConfig) -> EngineConfig:
    """`config` with `num_threads` set: by default the cores this process may use, shared
    by its local TP ranks (Ray's ranks each have CPUs of their own)."""
    if config.num_threads is not None:
        return config
    ray_ranks = config.distributed_executor_backend == "ray"
    threads = default_num_threads(1 if ray_ranks else config.tensor_parallel_size)
    return config.model_copy(update={"num_threads": threads})


class LLMEngine:
    def __init__(
        self,
        model: str | Path,
        config: EngineConfig | None = None,
        *,
        memory_reader: MemoryReader | None = None,
        rank_launcher: RankLauncher | None = None,
    ) -> None:
        """`memory_reader`: how the KV pool's sizing reads the device (memory_profile.py);
        by default torch.cuda's on CUDA, and none on CPU (the pool is not measured there).
        A reader given on CPU makes the engine measure as on CUDA (tests).
        `rank_launcher`: how tensor-parallel ranks 1.. start; required with
        `distributed_executor_backend="ray"` (the cluster's, runtime/tp_ranks.py), local
        processes by default."""
        config = _with_threads(config or EngineConfig())
        self.config = config
        assert config.num_threads is not None
        torch.set_num_threads(config.num_threads)
        self.model_dir = Path(model).expanduser()
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        # Speculative decoding with a draft model: its folder checked before any weight
        # loads (engine/spec_decode/proposer.py, check_draft_checkpoint).
        spec = config.speculative_config
        self.draft_dir: Path | None = None
        self.draft_config: ModelConfig | None = None
        if spec is not None and spec.draft_model is not None:
            self.draft_dir = Path(spec.draft_model).expanduser()
            self.draft_config = check_draft_checkpoint(
                self.draft_dir, self.model_config, self.model_dir
            )
        self.model_id = config.model_id or self.model_dir.name
        # PDSERVE_TIMELINE_DIR: every step and request arrival, for benchmarks/timeline.py
        self.timeline = EngineTimeline.from_env(self.model_id)
        self.host_tier: HostKVTier | None = None  # close() reads it, whatever fails below
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            # Triton launches on the thread's current device, not its tensors': the model
            # loads, profiles and captures its graphs on this one (engine/llm_engine.py
            # `on_device` covers every later step, whatever thread runs it).
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config)
        tp = config.tensor_parallel_size
        check_tensor_parallel(self.model_config, tp)
        if tp > 1 and config.distributed_executor_backend == "ray" and rank_launcher is None:
            raise ValueError(
                'distributed_executor_backend="ray" needs the cluster\'s rank launcher'
                ' (runtime/tp_ranks.py); offline, use "mp"'
            )
        # Tensor parallel: this process is rank 0 (the driver) and holds shard 0.
        self._shard = TPShard(self.model_config, 0, tp) if tp > 1 else None
        self.tp_workers: TPWorkers | None = None
        # With neither num_kv_blocks nor kv_cache_memory_gb, a CUDA engine sizes its KV
        # pool from what the loaded model leaves of gpu_memory_utilization.
        self.memory_profile: MemoryProfile | None = None
        self.sizing = KVPoolSizing(
            config, self.model_config, self.dtype, self.device, self._shard, self.draft_config
        )
        reader = self.sizing.reader(memory_reader)
        if tp > 1 and reader is not None:
            raise ValueError(
                "tensor_parallel_size > 1 sizes the KV pool from num_kv_blocks or"
                " kv_cache_memory_gb (per rank), not by measuring the device: set one"
            )
        start = None if reader is None else self.sizing.memory_at_start(reader)
        self.max_model_len = self.sizing.context_len()
        if start is None:  # a configured pool: a too small one fails before the weights load
            self.max_model_len, self.num_kv_blocks = self.sizing.from_config()
        self.model: LlamaModel = self._load_weights(rank_launcher)
        if reader is not None and start is not None:
            self._size_pool_from_device(reader, start)
        self.block_pool = BlockPool(
            self.num_kv_blocks, enable_caching=config.enable_prefix_caching, enable_events=True
        )
        self.kv_manager = KVCacheManager(self.block_pool, config.block_size)
        self.scheduler = self._make_scheduler()
        self.clock = time.perf_counter  # step wall times (tests inject a fake)
        self.runner = self._make_runner()
        # LoRA adapters by name (load_lora), in host memory; the resident ones
        # (`lora_slots`, at most max_loras) also in the runner's `loras`, on the device
        self.loras: dict[str, LoRAAdapter] = {}
        if config.kv_host_gib:
            kv = self.runner.kv_cache
            disk = None
            if config.kv_disk_dir is not None:
                block = kv[:, :, 0]
                disk_slot = HEADER_BYTES + block.numel() * kv.element_size()
                disk = DiskKVTier(
                    config.kv_disk_dir,
                    tuple(block.shape),
                    kv.dtype,
                    max(1, int(config.kv_disk_gib * (1 << 30)) // disk_slot),
                )
            self.host_tier = HostKVTier(kv, max(1, slots_for(kv, config.kv_host_gib)), disk)
            self.block_pool.lower_tier = self.host_tier
        self.kv_staging = KVStaging(
            self.runner.kv_cache,
            config.kv_staging_mb << 20,
            use_kernels=True if triton_off_cuda(config) else None,
        )
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        # Structured output: compiled grammars, per spec, for this engine's tokenizer.
        self.grammars = GrammarCompiler(
            self.model_dir / "tokenizer.json", self.model_config.vocab_size, self.eos_token_ids
        )
        self._namespace = hash_namespace(self.model_id, config.cache_salt)
        self._seqs: dict[str, Sequence] = {}
        # fetched prefixes held for the request they came for, until it is admitted
        self._prefix_holds: dict[str, Sequence] = {}
        self._held: dict[str, Sequence] = {}  # finished prefills keeping their blocks
        self._trackers: dict[str, TextTracker] = {}
        # parallel sampling: parent request id -> the choices to fork from it once its
        # prompt is computed (child id, params, stream)
        self._forks: dict[str, list[tuple[str, SamplingParams, bool]]] = {}
        self._warm_up()

    def _load_weights(self, rank_launcher: RankLauncher | None) -> LlamaModel:
        """The model's weights (and the draft's); with TP, the other ranks load their
        shards meanwhile. Nothing is left running if a load fails."""
        config = self.config
        if config.tensor_parallel_size > 1:
            dtype_name = next(k for k, v in _DTYPES.items() if v == self.dtype)
            self.tp_workers = TPWorkers(
                self.model_dir,
                config,
                dtype_name,
                self.max_model_len,
                self.num_kv_blocks,
                self.device,
                rank_launcher,
            )
        try:
            model = load_model(
                self.model_dir,
                self.model_config,
                self.dtype,
                self.device,
                self.max_model_len,
                config.load_format,
                config.seed,
                self._shard,
                config.quantization,
            )
            if self.tp_workers is not None:
                model.tp = self.tp_workers.group
                self.tp_workers.wait_ready()
            self.model = model
            self.draft_model = self._load_draft()
            if triton_off_cuda(config):
                for loaded in (model, self.draft_model):
                    if loaded is not None:
                        int8_on_triton(loaded)
        except BaseException:
            self.close()
            raise
        return model

    def _size_pool_from_device(self, reader: MemoryReader, start: Any) -> None:
        """The KV pool from what the loaded model leaves of the device (CUDA)."""
        reserved = self._reserved_after_sizing(self.max_model_len)
        self.max_model_len, self.num_kv_blocks, profile = self.sizing.measure(
            reader, start, self.max_model_len, self._profile_runner, reserved
        )
        self.memory_profile = profile
        logger.info(
            "KV pool sized from the device: %s; the pool takes %d blocks (%.2f GiB)",
            profile.describe(),
            self.num_kv_blocks,
            self.num_kv_blocks * profile.block_bytes / (1 << 30),
        )

    def _make_scheduler(self) -> Scheduler:
        config = self.config
        spec = config.speculative_config
        target_ms = config.tpot_target_ms
        # Measured only with a target, adaptive speculation or for the planner: on CUDA
        # the measurement may cost a sync (see step).
        measured = (
            target_ms is not None
            or (spec is not None and spec.adaptive)
            or config.measure_step_cost
        )
        self.step_cost = StepCostModel() if measured else None
        scheduler = Scheduler(
            self.kv_manager,
            SchedulerLimits(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                step_time_target_s=None if target_ms is None else target_ms / 1000,
                prefill_wait_limit_s=(
                    None
                    if config.prefill_wait_limit_ms is None
                    else config.prefill_wait_limit_ms / 1000
                ),
                min_prefill_chunk=config.block_size,
            ),
            self.step_cost,
            proposer=self._make_proposer(),
            lora_slots=LoRASlots(config.max_loras),
            spec_policy=(
                SpecPolicy(self.step_cost)
                if spec is not None and spec.adaptive and self.step_cost is not None
                else None
            ),
        )
        if isinstance(scheduler.proposer, DraftProposer):
            scheduler.proposer.stats = scheduler.spec_stats
        return scheduler

    def _make_runner(self) -> ModelRunner:
        config = self.config
        return ModelRunner(
            self.model,
            allocate_kv_cache(
                self.model,
                self.num_kv_blocks,
                config.block_size,
                self.device,
                config.kv_cache_dtype,
            ),
            config.block_size,
            make_attention_backend(
                config.attention_backend, self.device, self.model.dtype, config.kv_cache_dtype
            ),
            Sampler(config.seed, self.device),
            self.device,
            self.tp_workers,
        )

    def _warm_up(self) -> None:
        """On CUDA, everything compiled before the first request: the decode graphs, or
        every kernel variant when eager."""
        config = self.config
        tp = config.tensor_parallel_size
        # NOTE: tensor parallel runs eagerly (no collectives inside captured graphs yet).
        if tp == 1 and cuda_graphs_enabled(config.enforce_eager, self.device, self.runner.backend):
            # Decode steps as CUDA graphs, captured once the KV cache is final.
            start_s = time.perf_counter()
            self.runner.capture_cuda_graphs(
                min(config.max_cuda_graph_batch_size, config.max_num_seqs), self.max_model_len
            )
            logger.info("captured decode CUDA graphs in %.1f s", time.perf_counter() - start_s)
        elif tp == 1 and self.device.type == "cuda":
            # Eager on CUDA: every kernel variant still compiles here, not at a step.
            start_s = time.perf_counter()
            if self.runner.warm_up_kernels(self.max_model_len, config.max_num_batched_tokens):
                logger.info("warmed up the kernels in %.1f s", time.perf_counter() - start_s)

    @property
    def kv_block_bytes(self) -> int:
        """One KV block's bytes (on each rank: its KV heads' share)."""
        return self.sizing.block_bytes

    def _load_draft(self) -> LlamaModel | None:
        """The draft model, loaded like the target (device, dtype, load format, seed and
        quantization) but whole: with tensor parallelism it runs on this rank only."""
        if self.draft_dir is None or self.draft_config is None:
            return None
        return load_model(
            self.draft_dir,
            self.draft_config,
            self.dtype,
            self.device,
            self.max_model_len,
            self.config.load_format,
            self.config.seed,
            None,
            self.config.quantization,
        )

    def _make_proposer(self) -> Proposer | BatchProposer | None:
        """Speculative decoding's proposer: prompt lookup, or the draft model over a KV
        cache of its own shape with the pool's blocks (engine/spec_decode/draft.py)."""
        cfg = self.config
        spec = cfg.speculative_config
        if spec is None:
            return None
        if self.draft_model is None:
            return make_proposer(spec)
        return DraftProposer(
            self.draft_model,
            self.num_kv_blocks,
            cfg.block_size,
            make_attention_backend(cfg.attention_backend, self.device, self.draft_model.dtype),
            self.device,
            spec.num_speculative_tokens,
            cfg.max_num_batched_tokens,
        )

    def _reserved_after_sizing(self, max_len: int) -> int:
        """What this engine takes after its pool is sized (KVPoolSizing's, with whether it
        will capture decode graphs, which only the engine decides)."""
        cfg = self.config
        backend = make_attention_backend(
            cfg.attention_backend, self.device, self.dtype, cfg.kv_cache_dtype
        )
        tp = cfg.tensor_parallel_size
        graphs = tp == 1 and cuda_graphs_enabled(cfg.enforce_eager, self.device, backend)
        return self.sizing.reserved_after_sizing(max_len, graphs)

    def _profile_runner(self, num_blocks: int) -> ModelRunner:
        """A runner like the engine's (below) over a scratch KV cache of `num_blocks`."""
        cfg = self.config
        return ModelRunner(
            self.model,
            allocate_kv_cache(
                self.model, num_blocks, cfg.block_size, self.device, cfg.kv_cache_dtype
            ),
            cfg.block_size,
            make_attention_backend(
                cfg.attention_backend, self.device, self.model.dtype, cfg.kv_cache_dtype
            ),
            Sampler(cfg.seed, self.device),
            self.device,
        )

    # -- requests -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        stream: bool = False,
        arrival_s: float | None = None,
        hold_kv: bool = False,
    ) -> Sequence:
        """Queue a request. Raises InvalidRequestError for a bad prompt or a duplicate id.

        `hold_kv` (prefill role): once finished, the request keeps its blocks for
        `export_kv` until `release_kv`.
        """
        seq = self._new_sequence(request_id, prompt, params, arrival_s)
        seq.hold_kv = hold_kv
        self._track(seq, stream)
        self.scheduler.add(seq)
        if self.timeline is not None:
            self.timeline.added(seq)
        return seq

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        first_token: int,
        params: SamplingParams,
        payload: torch.Tensor | Seq[tuple[HeadRange, torch.Tensor]],
        first_block: int = 0,
        stream: bool = False,
        first_logprobs: TokenLogprobs | None = None,
    ) -> RequestOutput:
        """Decode role: admit a request whose prompt KV was computed elsewhere.

        Blocks before `first_block` must still be in this engine's prefix cache; `payload`
        (kv_pack's layout) holds the rest of the prompt's blocks: one tensor of all this
        engine's KV heads, or parts (global KV-head range, tensor) that tile this rank's
        heads (`kv_head_range`). With tensor parallelism the other ranks write their own
        claimed parts of `request_id` (a `RankKVStore`'s) into the same blocks.
        `first_logprobs`: the first token's logprob and top-n as the prefill worker's
        sampler computed them (required when `params` asks for logprobs: they become the
        first entry of the request's logprobs). Returns the output of the first token.
        Raises KVImportError (nothing held, the other ranks' parts dropped) when the KV
        cannot be used: the caller then prefills the request locally instead.
        """
        workers = self.tp_workers
        try:
            _check_first_logprobs(first_token, params, first_logprobs)
            seq = self._new_sequence(request_id, prompt_token_ids, params, None)
            _check_first_token(seq, first_token)
            with on_device(self.device):
                import_prefilled(
                    seq,
                    payload,
                    first_block,
                    self.kv_manager,
                    self.kv_staging,
                    self.scheduler,
                    own=self.kv_head_range,
                    on_blocks=None if workers is None else partial(workers.import_kv, request_id),
                )
        except Exception:  # KVImportError, or a request refused: the ranks' parts go too
            self.drop_kv(request_id)
            raise
        self._track(seq, stream)
        seq.append_token(first_token)  # the grammar continues from the prefill's token
        if first_logprobs is not None and params.logprobs is not None:
            seq.output_logprobs.append(first_logprobs)
        reason = self.scheduler.stop_reason(seq, first_token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        if self.timeline is not None:
            self.timeline.added(seq, prefilled=True)
        return self._output(seq, [first_token], seq.is_finished)

    def fork_request(
        self, parent_id: str, child_id: str, params: SamplingParams, stream: bool = False
    ) -> None:
        """Parallel sampling: a request `child_id` of the same prompt as `parent_id` that
        shares the prompt's KV instead of computing it again.

        The child takes a reference on each of the parent's blocks that holds only prompt
        tokens before the last one (copy-on-write without the copy: no sequence ever
        writes into a block that full), and computes the rest of the prompt itself, at
        most one block's tokens ending at the last prompt token, in its own blocks. So
        its first token is sampled from its own logits of the last prompt position, with
        its own `params` (seed): exactly as a separate request with those params. Forked
        at once when the parent's prompt is computed (an imported request), else in the
        step that computes it. Raises InvalidRequestError for an unknown parent, an id in
        use, or another cache salt (the blocks' hashes would differ)."""
        parent = self._seqs.get(parent_id)
        if parent is None or parent.is_finished:
            raise InvalidRequestError(f"request {parent_id!r} is not running here")
        if (
            child_id in self._seqs
            or child_id in self._held
            or any(child_id == c for forks in self._forks.values() for c, _, _ in forks)
        ):
            raise InvalidRequestError(f"request id {child_id!r} is already running")
        if params.cache_salt != parent.params.cache_salt:
            raise InvalidRequestError("a fork must have its parent's cache_salt")
        if parent.num_computed_tokens >= parent.num_prompt_tokens:
            self._fork(parent, child_id, params, stream)
        else:
            self._forks.setdefault(parent_id, []).append((child_id, params, stream))

    def _fork(self, parent: Sequence, child_id: str, params: SamplingParams, stream: bool) -> None:
        """Admit `child_id` over `parent`'s prompt blocks (see `fork_request`)."""
        block_size = self.config.block_size
        num_prompt = parent.num_prompt_tokens
        num_shared = (num_prompt - 1) // block_size
        child = Sequence(
            request_id=child_id,
            prompt_token_ids=parent.prompt_token_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            hash_namespace=parent.hash_namespace,
            arrival_s=parent.arrival_s,
        )
        if params.grammar is not None:  # each choice walks the grammar on its own
            child.grammar = self.grammars.matcher(params.grammar)
        shared = parent.blocks[:num_shared]
        self.block_pool.touch(shared)
        child.blocks = list(shared)
        child.block_hashes = list(parent.full_block_hashes(block_size)[: num_prompt // block_size])
        child.num_computed_tokens = num_shared * block_size
        child.num_cached_prompt_tokens = num_shared * block_size
        child.first_scheduled_s = time.monotonic()
        child.status = SequenceStatus.RUNNING
        self._track(child, stream)
        self.scheduler.running.append(child)

    def _fork_ready(self, sched_out: SchedulerOutput) -> None:
        """Fork the waiting choices of every parent whose prompt this step computed (its
        KV is written: the step ran), before `update` may finish and free the parent."""
        for item in sched_out.scheduled:
            seq = item.seq
            if (
                seq.request_id in self._forks
                and item.start + item.num_new_tokens >= seq.num_prompt_tokens
            ):
                for child_id, params, stream in self._forks.pop(seq.request_id):
                    self._fork(seq, child_id, params, stream)

    @property
    def kv_head_range(self) -> HeadRange:
        """The model's KV heads [start, end) this process's cache holds (rank 0's)."""
        if self._shard is None:
            return (0, self.model_config.num_kv_heads)
        return self._shard.kv_head_range

    def kv_head_ranges(self) -> list[HeadRange]:
        """Every rank's KV heads, in rank order (one range without tensor parallelism)."""
        tp = self.config.tensor_parallel_size
        if tp == 1:
            return [self.kv_head_range]
        return [TPShard(self.model_config, r, tp).kv_head_range for r in range(tp)]

    def export_kv(
        self, request_id: str, first_block: int = 0, ranges: Seq[HeadRange] | None = None
    ) -> KVExport:
        """Prefill role: the prompt KV of a finished `hold_kv` request, from `first_block`.

        `ranges`: the KV-head ranges the receiving ranks own (a tensor-parallel decode
        replica's); the export holds this rank's overlap with each, one part per range
        (None: one part of all this rank's heads). With tensor parallelism the other ranks
        pack their own parts into their `RankKVStore`s (their transports send them).
        On CUDA the copy to host may still run: `wait()` for it off the event loop, and
        `release()` the export once its payload is sent (engine/worker/kv_staging.py).
        """
        seq = self._held.get(request_id)
        if seq is None:
            raise InvalidRequestError(f"request {request_id!r} holds no KV here")
        own = self.kv_head_range
        if self.tp_workers is not None:
            ids = export_block_ids(seq, self.config.block_size, first_block)
            self.tp_workers.export_kv(request_id, ids, ranges)
        with on_device(self.device):
            return export_kv(
                seq,
                self.kv_staging,
                self.config.block_size,
                first_block,
                export_ranges(own, True, ranges),  # rank 0 holds its heads' lowest copy
                own_start=own[0],
            )

    def export_prefix(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        num_blocks: int,
        first_block: int = 0,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> KVExport | None:
        """Peer fetch, holder side: blocks `first_block`.. of the prompt's first
        `num_blocks` full blocks that this engine holds (pool or lower tier), packed as
        a handoff's payload with their hashes (engine/worker/kv_fetch.py); None when it
        holds no more than `first_block` of them. `release()` it once sent."""
        self._check_fetch("export")
        seq = prefix_sequence(
            request_id,
            prompt_token_ids,
            num_blocks,
            self.config.block_size,
            self.namespace_for(cache_salt, lora),
        )
        with on_device(self.device):
            return export_prefix(seq, num_blocks, first_block, self.kv_manager, self.kv_staging)

    def import_prefix(
        self,
        prompt_token_ids: Seq[int],
        payload: torch.Tensor,
        first_block: int,
        block_hashes: Seq[BlockHash],
        cache_salt: str | None = None,
        lora: str | None = None,
        for_request: str | None = None,
    ) -> int:
        """Peer fetch, receiving side: cache a fetched prefix (blocks `first_block`.. of
        the prompt, hashed `block_hashes`) so that the request added next finds it;
        returns the blocks written. `for_request`: that request's id; the prefix stays
        referenced until it is admitted (or gone), so that nothing evicts it meanwhile.
        Raises KVImportError, holding nothing, when the payload does not fit (the
        request then computes its whole prompt)."""
        self._check_fetch("import")
        seq = prefix_sequence(
            "fetch",
            prompt_token_ids,
            first_block + len(block_hashes),
            self.config.block_size,
            self.namespace_for(cache_salt, lora),
        )
        hold = for_request is not None and for_request not in self._prefix_holds
        with on_device(self.device):
            written = import_prefix(
                seq, payload, first_block, block_hashes, self.kv_manager, self.kv_staging, hold
            )
        if hold:
            assert for_request is not None
            self._prefix_holds[for_request] = seq
        return written

    def _release_prefix_holds(self, scheduled: SchedulerOutput) -> None:
        """Fetched prefixes whose request was admitted (it references them now) or is
        gone: their holds end."""
        for item in scheduled.scheduled:
            hold = self._prefix_holds.pop(item.seq.request_id, None)
            if hold is not None:
                self.kv_manager.free(hold)
        for request_id in [r for r in self._prefix_holds if r not in self._seqs]:
            self.kv_manager.free(self._prefix_holds.pop(request_id))

    def held_prefix_blocks(
        self, prompt_token_ids: Seq[int], cache_salt: str | None = None, lora: str | None = None
    ) -> int:
        """How many leading full blocks of the prompt this engine holds (pool or lower
        tier) that its admission could use: what a peer fetch would start after."""
        if not self.config.enable_prefix_caching:
            return 0
        num_blocks = (len(prompt_token_ids) - 1) // self.config.block_size
        seq = prefix_sequence(
            "lookup",
            prompt_token_ids,
            num_blocks,
            self.config.block_size,
            self.namespace_for(cache_salt, lora),
        )
        return len(self.kv_manager.get_computed_blocks(seq)[:num_blocks])

    def _check_fetch(self, what: str) -> None:
        if self.tp_workers is not None or self.config.tensor_parallel_size > 1:
            raise KVImportError(f"a peer fetch cannot {what} KV with tensor parallelism")
        if not self.config.enable_prefix_caching:
            raise KVImportError(f"a peer fetch cannot {what} KV without prefix caching")

    def release_kv(self, request_id: str) -> None:
        """Prefill role: drop a held request's blocks (they stay in the prefix cache)."""
        seq = self._held.pop(request_id, None)
        if seq is not None:
            self.kv_manager.free(seq)
        self.drop_kv(request_id)  # what the other ranks' transports did not take

    def drop_kv(self, request_id: str) -> None:
        """Tensor parallel: make the other ranks forget `request_id`'s packed or claimed
        KV slices (after any export or import already sent them: the same socket, in
        order). Nothing to do with one rank, or after the group failed."""
        if self.tp_workers is not None and self.tp_workers.failure is None:
            self.tp_workers.drop_kv(request_id)

    def _new_sequence(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        arrival_s: float | None,
    ) -> Sequence:
        if request_id in self._seqs or request_id in self._held:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        if params.lora is not None and params.lora not in self.loras:
            raise InvalidRequestError(f"no LoRA adapter {params.lora!r} is loaded")
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=self._prompt_token_ids(prompt),
            params=params,
            eos_token_ids=self.eos_token_ids,
            hash_namespace=self.namespace_for(params.cache_salt, params.lora),
            arrival_s=time.monotonic() if arrival_s is None else arrival_s,
        )
        if params.grammar is not None:  # InvalidRequestError for a grammar it refuses
            seq.grammar = self.grammars.matcher(params.grammar)
        return seq

    def _track(self, seq: Sequence, stream: bool) -> None:
        self._seqs[seq.request_id] = seq
        if stream or seq.params.stop:
            self._trackers[seq.request_id] = TextTracker(self.tokenizer, seq)

    def _prompt_token_ids(self, prompt: str | Seq[int]) -> list[int]:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
            )
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens, including at least one generated token"
            )
        return token_ids

    def abort(self, request_ids: Seq[str]) -> None:
        """Cancel requests (any state); their blocks are freed at once. A parent's
        choices not forked yet (`fork_request`) go with it."""
        ids = set(request_ids)
        for parent_id in list(self._forks):
            kept = [f for f in self._forks[parent_id] if f[0] not in ids]
            if parent_id in ids or not kept:
                del self._forks[parent_id]
            else:
                self._forks[parent_id] = kept
        for seq in self.scheduler.abort(request_ids):
            self._release(seq)

    @property
    def hash_namespace(self) -> bytes:
        """What this engine's block hashes are salted with (model id, cache salt)."""
        return self._namespace

    def namespace_for(self, cache_salt: str | None, lora: str | None = None) -> bytes:
        """The namespace a request's block hashes are salted with: its own `cache_salt`
        when it has one (a tenant's), else the engine's (`hash_namespace`); a LoRA
        adapter's requests hash in a namespace of the adapter's (`lora_model_id`)."""
        if cache_salt is None and lora is None:
            return self._namespace
        return request_namespace(self.model_id, cache_salt, lora)

    def kv_model_id(self, lora: str | None = None) -> str:
        """The model id a KV transfer's header carries for a request: the model's, or
        its LoRA adapter's on it (`lora_model_id`), which the receiver checks like a
        model id: KV of one adapter is never taken for another's request."""
        return self.model_id if lora is None else lora_model_id(self.model_id, lora)

    # -- LoRA adapters --------------------------------------------------------------

    def load_lora(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load the PEFT adapter at `path` under `name` (what requests name in their
        params' `lora`). Raises LoRAError (nothing kept) for an adapter that does not fit
        this model, a rank above `max_lora_rank`, a name already loaded or that of the
        model itself, or tensor parallelism (not yet: the adapters would be sharded as
        the layers are)."""
        if name in self.loras or name == self.model_id:
            what = "an adapter" if name in self.loras else "the base model"
            raise LoRAError(f"{name!r} already names {what}")
        if self.config.tensor_parallel_size > 1:
            raise LoRAError("LoRA adapters are not yet served with tensor parallelism")
        adapter = load_adapter(
            name,
            path,
            self.model_config,
            self.config.max_lora_rank,
            self.model.dtype,
            torch.device("cpu"),
        )
        if self.device.type == "cuda":
            adapter = adapter.pinned()
        self.loras[name] = adapter  # resident once a request needs it (_swap_loras)
        return adapter

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`. Raises LoRAError when it is not loaded, LoRAInUseError
        when a request still runs with it (it may be unloaded once they finish)."""
        if name not in self.loras:
            raise LoRAError(f"no LoRA adapter {name!r} is loaded")
        running = [s.request_id for s in self._seqs.values() if s.params.lora == name]
        if running:
            raise LoRAInUseError(
                f"LoRA adapter {name!r} still serves {len(running)} request(s); unload it "
                "once they finish"
            )
        del self.loras[name]
        self.lora_slots.forget(name)
        self._swap_loras()

    @property
    def lora_slots(self) -> LoRASlots:
        slots = self.scheduler.lora_slots
        assert slots is not None
        return slots

    def _swap_loras(self) -> None:
        """Copy in the adapters the scheduler made resident, drop those it swapped out
        (engine/sched/lora_slots.py), before the step that uses them."""
        for change, name in self.lora_slots.take_changes():
            if change == "evict":
                self.runner.loras.pop(name, None)
            else:
                self.runner.loras[name] = self.loras[name].to(self.device)

    def _step_cost_gauges(self) -> dict[str, int]:
        """The fitted step cost (engine/sched/step_cost.py: a, b, c, d) once there is a
        fit, in integer units: the planner's model of this worker (router/planner.py)."""
        coef = self.step_cost.decode_coefficients if self.step_cost is not None else None
        if coef is None:
            return {}
        full = self.step_cost.coefficients if self.step_cost is not None else None
        a, b, c = coef[0], coef[1], coef[2]
        return {
            "step_fixed_us": round(a * 1e6),
            "step_row_us": round(b * 1e6),
            "step_context_ps": round(c * 1e12),
            # per prefill token: only from a fit that saw prefills (0: not yet)
            "step_prefill_token_ns": round(full[3] * 1e9) if full is not None else 0,
        }

    def _lora_gauges(self) -> dict[str, int]:
        """How many adapters are loaded and resident, the loads and evictions so far, the
        slots free now, and per adapter `lora:NAME` 1 while resident, 0 while only in
        host memory: placement prefers a worker that holds the adapter
        (router/placement.py)."""
        if not self.loras:
            return {"lora_adapters": 0}
        slots = self.lora_slots
        resident = set(slots.resident)
        return {
            "lora_adapters": len(self.loras),
            "lora_resident": len(resident),
            "lora_loads": slots.loads,
            "lora_evictions": slots.evictions,
            "lora_slots_free": slots.free(self.scheduler.adapters_running()),
            **{f"{LORA_GAUGE_PREFIX}{name}": int(name in resident) for name in self.loras},
        }

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def drain_kv_events(self) -> list[KVEvent]:
        return self.block_pool.drain_events()

    def kv_snapshot(self) -> list[KVEvent]:
        """Every held block as events (STORED for the pool's, DEMOTED for a lower
        tier's), dropping the pending events.

        For a worker whose index registration was lost: republishing this replaces the
        event history the index missed.
        """
        self.block_pool.drain_events()
        return self.block_pool.snapshot_events()

    def load(self) -> dict[str, int]:
        """Integer load gauges for placement and metrics (names as the index stores them)."""
        sched = self.scheduler
        queued = sum(
            max(seq.num_prompt_tokens - seq.num_computed_tokens, 0)
            for seq in (*sched.waiting, *sched.running)
        )
        pool = self.block_pool
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "queued_prefill_tokens": queued,
            "kv_blocks_used": pool.num_blocks - pool.num_free_blocks,
            "kv_blocks_total": pool.num_blocks,
            "preemptions": sched.stats.num_preemptions,
            "aborted": sched.stats.num_aborted,
            # what the step-time target lets a step prefill beside the running decodes now
            "step_prefill_budget": sched.prefill_budget(),
            # Triton variants first compiled after warm-up, each a stall of every stream
            # (kernels/_variants.py; per process, as Triton's kernel cache)
            "kernel_compiles_after_ready": _variants.REGISTRY.compiles_after_ready,
            # KV handoff blocks the Triton kernels moved: which path the handoffs took
            "kv_kernel_blocks_packed": self.kv_staging.kernel_blocks_packed,
            "kv_kernel_blocks_unpacked": self.kv_staging.kernel_blocks_unpacked,
            **self._lora_gauges(),
            **self._step_cost_gauges(),
            **self._host_tier_gauges(),
            **self._parallel_gauges(),
            **(sched.spec_stats.gauges() if sched.proposer is not None else {}),
        }

    def _host_tier_gauges(self) -> dict[str, int]:
        tier = self.host_tier
        if tier is None:
            return {}
        return {
            "kv_host_blocks": len(tier),
            "kv_host_blocks_total": tier.capacity,
            "kv_host_demoted_blocks": tier.stats.demoted,
            "kv_host_hit_blocks": tier.stats.promoted,
            "kv_host_dropped_blocks": tier.stats.dropped,
            # measured costs of a tier hit (placement may weigh them against computing)
            "kv_host_demote_us_per_block": tier.stats.us_per_block(
                tier.stats.demote_s, tier.stats.demoted
            ),
            "kv_host_promote_us_per_block": tier.stats.us_per_block(
                tier.stats.promote_s, tier.stats.promoted
            ),
            **(
                {}
                if tier.disk is None
                else {
                    "kv_disk_blocks": len(tier.disk),
                    "kv_disk_blocks_total": tier.disk.capacity,
                    "kv_disk_hit_blocks": tier.stats.disk_hits,
                    "kv_disk_corrupt_blocks": tier.disk.stats.corrupt,
                    "kv_disk_recovered_blocks": tier.disk.stats.recovered,
                    "kv_disk_read_us_per_block": tier.stats.us_per_block(
                        tier.disk.stats.read_s, tier.disk.stats.hits
                    ),
                }
            ),
        }

    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counters since start (all 0 when it is off): tokens
        proposed, accepted by the target, emitted by verify rows; verify rows and steps."""
        return self.scheduler.spec_stats

    def _parallel_gauges(self) -> dict[str, int]:
        """Tensor parallel: the driver's all-reduce time per step (microseconds), the
        share of a step the ranks spend exchanging partial sums."""
        if self.tp_workers is None:
            return {}
        times = self.tp_workers.group.times()
        per_step = times.all_reduce_s / times.steps if times.steps else 0.0
        return {"tp_all_reduce_us_per_step": round(per_step * 1e6)}

    # -- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for every request that changed.

        On this engine's device (`on_device`), whatever thread calls it.

        With a step-time target, the step's wall time (scheduling to outputs: what a
        stream waits between tokens) teaches the cost model. The sampled tokens' copy to
        the host already waits for the GPU; a step that samples nothing (prefill chunks
        only) would be timed at its kernel launches, so on CUDA it syncs first.
        """
        with on_device(self.device):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        start_s = self.clock()
        start_wall = time.time()
        sched_out = self.scheduler.schedule()
        if self.loras:
            self._swap_loras()
        if self._prefix_holds:
            self._release_prefix_holds(sched_out)
        if sched_out.is_empty:
            return []
        if len(self.kv_staging.imports):  # KV still copying in (engine/worker/kv_staging.py)
            self.kv_staging.await_imports(
                {b.block_id for item in sched_out.scheduled for b in item.seq.blocks}
            )
        if self.tp_workers is None:
            result = self.runner.execute(sched_out)
        else:
            result = self._execute_parallel(sched_out)
        if self._forks:
            self._fork_ready(sched_out)
        if self.step_cost is not None and not result.sampled and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        new: dict[str, tuple[list[int], list[str]]] = {}  # request id -> (tokens, texts)

        def on_token(seq: Sequence, index: int, token_id: int) -> bool:
            """Each appended token, in order: its logprobs, and the text so far checked
            for stop strings exactly as if the token had been the step's only one."""
            logprobs = result.logprobs.get(seq.request_id)
            if logprobs:
                seq.output_logprobs.append(logprobs[index])
            tokens, texts = new.setdefault(seq.request_id, ([], []))
            tokens.append(token_id)
            tracker = self._trackers.get(seq.request_id)
            if tracker is None:
                return False
            texts.append(tracker.add([token_id], seq.is_finished))
            return tracker.stopped

        finished = self.scheduler.update(sched_out, result.sampled, on_token)
        outputs = self._outputs(sched_out, new, finished)
        duration_s = self.clock() - start_s
        if self.step_cost is not None:
            self.step_cost.observe(sched_out.shape(), duration_s)
        if self.timeline is not None:
            produced = {rid: len(tokens) for rid, (tokens, _) in new.items()}
            self.timeline.step(start_wall, duration_s, sched_out, self.scheduler, produced)
        return outputs

    def _execute_parallel(self, sched_out: SchedulerOutput) -> StepResult:
        """`runner.execute` with other ranks: a failure (a rank gone, or a collective past
        distributed_timeout_s) stops the group and fails this and every later step."""
        workers = self.tp_workers
        assert workers is not None
        try:
            return self.runner.execute(sched_out)
        except Exception as exc:
            if workers.failure is None:
                workers.failure = exc
                logger.error("tensor-parallel step failed; killing the other ranks: %s", exc)
                workers.kill()
            if isinstance(exc, TensorParallelError):
                raise
            raise TensorParallelError(
                f"a tensor-parallel step failed (a rank died, or a collective waited past"
                f" distributed_timeout_s={self.config.distributed_timeout_s:g} s): {exc}"
            ) from exc

    def parallel_stats(self) -> ParallelStats:
        """Per-rank weight and KV bytes, and the driver's time in collectives."""
        sharded, replicated = self.model.weight_bytes()
        kv = self.runner.kv_cache
        driver = RankMemory(
            0, sharded + replicated, sharded, replicated, kv.numel() * kv.element_size()
        )
        workers = self.tp_workers
        times = workers.group.times() if workers is not None else CollectiveTimes()
        return ParallelStats(
            tensor_parallel_size=self.config.tensor_parallel_size,
            ranks=[driver, *(workers.ranks if workers is not None else [])],
            steps=times.steps,
            all_reduce_s=times.all_reduce_s,
            all_reduces=times.all_reduces,
            broadcast_s=times.broadcast_s,
            gather_s=times.gather_s,
        )

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do with one rank) and let go of a
        disk tier's file. Idempotent."""
        if self.tp_workers is not None:
            self.tp_workers.close()
        tier = self.host_tier
        if tier is not None and tier.disk is not None and not tier.disk.closed:
            self.flush_kv_tiers()
            tier.disk.close()
        if self.timeline is not None:
            self.timeline.close()

    def flush_kv_tiers(self) -> None:
        """Copy every block the pool caches into the KV tiers (through to a disk tier), so
        that a worker restarted on the disk folder finds them. Only between steps: every
        cached block's tokens are computed then."""
        tier = self.host_tier
        if tier is not None and tier.disk is not None and not tier.disk.closed:
            tier.demote(self.block_pool.cached_blocks())

    def _outputs(
        self,
        sched_out: SchedulerOutput,
        new: dict[str, tuple[list[int], list[str]]],
        finished: list[Sequence],
    ) -> list[RequestOutput]:
        """An output per sequence that got tokens (`new`: its tokens and, when tracked,
        their texts, from `step`)."""
        finished_ids = {s.request_id for s in finished}
        outputs = []
        for item in sched_out.scheduled:
            seq = item.seq
            if seq.request_id not in new:
                continue
            new_ids, texts = new[seq.request_id]
            finished_now = seq.request_id in finished_ids
            outputs.append(self._output(seq, new_ids, finished_now, "".join(texts)))
        return outputs

    def _output(
        self, seq: Sequence, new_ids: list[int], finished: bool, new_text: str | None = None
    ) -> RequestOutput:
        """`new_text`: the text of `new_ids`, when the caller already added them to the
        sequence's tracker (`step`); None: added here."""
        tracker = self._trackers.get(seq.request_id)
        if tracker is None:  # no stream, no stop strings: decode once, at the end
            new_text = ""
            skip = seq.params.skip_special_tokens
            text = self.tokenizer.decode(seq.output_token_ids, skip) if finished else ""
        else:
            if new_text is None:
                new_text = tracker.add(new_ids, finished)
                if tracker.stopped and not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.STOP)
            text = tracker.text
        want_logprobs = seq.params.logprobs is not None
        out = make_output(seq, text, new_ids, new_text, want_logprobs)
        if seq.is_finished:
            self._release(seq)
        return out

    def _release(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        if seq.hold_kv and seq.finish_reason is not FinishReason.ABORT:
            self._held[seq.request_id] = seq
        self._trackers.pop(seq.request_id, None)


def _check_first_logprobs(
    first_token: int, params: SamplingParams, first_logprobs: TokenLogprobs | None
) -> None:
    """Raises KVImportError when a request that wants logprobs lacks its first token's
    (a prefill worker that did not send them) or got another token's or count: local
    prefill then computes them, rather than a response missing one."""
    if params.logprobs is None:
        return
    if first_logprobs is None:
        raise KVImportError("the first token's logprobs did not come with the KV")
    if first_logprobs.token_id != first_token or len(first_logprobs.top) != params.logprobs:
        raise KVImportError(
            f"the first token's logprobs are for token {first_logprobs.token_id} with "
            f"{len(first_logprobs.top)} alternatives; token {first_token} with "
            f"{params.logprobs} expected"
        )


def _check_first_token(seq: Sequence, first_token: int) -> None:
    """Raises KVImportError when a constrained request's first token (sampled by the
    prefill worker) is not one its grammar allows: a prefill worker that did not apply
    the grammar. Local prefill then samples it under the grammar instead."""
    grammar = seq.grammar
    if grammar is None:
        return
    if not grammar.advance(first_token):
        raise KVImportError(f"the first token {first_token} breaks the request's grammar")
    grammar.rollback(1)  # append_token takes it again once the KV is in


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """`device` as the calling thread's current CUDA device for a block (Triton launches
    on the current device, not on its tensors'); nothing off CUDA."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
