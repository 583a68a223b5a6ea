"""Validated engine configuration: one object, passed in explicitly (no globals)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from pdserve.common.speculative import SpeculativeConfig

DType = Literal["auto", "float32", "bfloat16", "float16"]
AttentionBackendName = Literal["auto", "torch", "cpu", "triton"]
LoadFormat = Literal["auto", "dummy"]
Quantization = Literal["none", "int8"]
# the model's dtype, or an 8-bit format (engine/modeling/kv_quant.py; not imported here: no torch)
KVCacheDtype = Literal["auto", "int8", "fp8"]
# What `gpu_memory_utilization=None` means on CUDA (vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class EngineConfig(BaseModel):
    """Knobs of one engine instance (one worker process).

    The KV pool is sized either by `num_kv_blocks` or by `kv_cache_memory_gb`; with
    neither, on CUDA from the memory the loaded model leaves of `gpu_memory_utilization`
    (engine/worker/memory_profile.py), on CPU with enough blocks for `max_num_seqs` sequences of
    `max_model_len` tokens but at most 1 GiB.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_id: str | None = Field(
        default=None, description="Name served and hashed into block hashes; folder name if unset."
    )
    dtype: DType = Field(
        default="auto",
        description="the weights' and activations' dtype; auto: the checkpoint's"
        " (torch_dtype), float32 where it names none",
    )
    device: str = Field(default="cpu", description="'cpu', or 'cuda[:N]'")
    load_format: LoadFormat = Field(
        default="auto",
        description="auto: the folder's safetensors weights; dummy: random weights of the"
        " shape config.json gives (seeded by `seed`), made on the device, no weight file"
        " read: for benchmarks and tests of a model's speed, not its text.",
    )
    quantization: Quantization = Field(
        default="none",
        description="int8: the transformer blocks' projections (q|k|v, o, gate|up, down)"
        " quantized at load to int8 with one scale per output row (symmetric, round to"
        " nearest), half the weight bytes of bf16 that each decode step reads; the"
        " embedding, LM head and norms stay in `dtype` (engine/modeling/linear.py, Int8Linear)."
        " On CPU with AVX-512 a C kernel reads the int8 weight, packed at load, once per"
        " step (engine/cpu/int8.py); elsewhere torch's int8 matmul, vectorised for"
        " bfloat16 only and compute-bound, so there the memory is the gain (README,"
        " 'Offline generation', has the measurements).",
    )
    kv_cache_dtype: KVCacheDtype = Field(
        default="auto",
        description="auto: the KV cache in the model's dtype. int8 or fp8 (float8 e4m3): 8"
        " bits per K/V value with one bfloat16 scale per token and KV head, computed from"
        " that token alone when it is written (engine/modeling/kv_quant.py): about half the"
        " KV bytes that each decode step reads and each handoff ships, about twice the"
        " blocks in the same memory. A prefill and a decode worker must use the same (a"
        " transfer between different ones is refused).",
    )
    num_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch threads for this process (and for each local tensor-parallel"
        " rank). None: OMP_NUM_THREADS when it is set, otherwise the CPUs this process may"
        " run on (its affinity mask) shared among the local ranks (default_num_threads).",
    )
    block_size: int = Field(
        default=16, ge=1, le=1024, description="tokens per KV block (a power of two)"
    )
    num_kv_blocks: int | None = Field(
        default=None, ge=1, description="KV blocks in the pool (per rank with TP)"
    )
    kv_cache_memory_gb: float | None = Field(default=None, gt=0)
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="CUDA: the fraction of the device's total memory this engine may use"
        " (weights, the largest step's activations, its memory outside torch, and the KV"
        " pool that fills the rest, measured at start: engine/worker/memory_profile.py); that much"
        " must be free at start. None: 0.9. num_kv_blocks and kv_cache_memory_gb override"
        " it; ignored on CPU, where the pool is at most 1 GiB.",
    )
    kv_host_gib: float = Field(
        default=0.0,
        ge=0,
        description="A host-memory tier under the KV pool (GiB; 0: off): cached blocks the"
        " pool evicts are copied there (LRU within this budget) and copied back when a"
        " later prompt starts with them, instead of being computed again. Pinned memory on"
        " CUDA, a separate budget on CPU (engine/worker/kv_host_tier.py). Needs prefix"
        " caching; not yet with tensor parallelism or a draft model.",
    )
    kv_disk_dir: str | None = Field(
        default=None,
        description="A disk tier under the host tier (needs kv_host_gib): every block the"
        " host tier takes is also written to an arena file in this folder, checksummed, and"
        " read back when a prompt starts with it; a worker restarted on the folder finds its"
        " blocks again (engine/worker/kv_disk_tier.py). None: off.",
    )
    kv_disk_gib: float = Field(
        default=4.0, gt=0, description="The disk tier's file size (GiB), with kv_disk_dir"
    )
    kv_staging_mb: int = Field(
        default=256,
        ge=0,
        description="Pinned host memory (MiB, CUDA only, allocated at the first KV export and"
        " reused) that exported KV is copied into for sending; a payload that does not fit"
        " gets a one-off allocation (engine/worker/kv_staging.py).",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=2,
        description="the longest sequence, prompt and output (default: the model's,"
        " capped to what the KV pool holds)",
    )
    max_num_seqs: int = Field(default=256, ge=1, description="sequences in one step, at most")
    max_num_batched_tokens: int = Field(
        default=2048, ge=1, description="Token budget of one step (prefill chunks + decodes)."
    )
    enable_chunked_prefill: bool = True
    tpot_target_ms: float | None = Field(
        default=None,
        gt=0,
        description="Keep a step that has decode rows within this time, by capping its prefill"
        " tokens from the measured step cost (needs chunked prefill); None: the token budget"
        " alone.",
    )
    measure_step_cost: bool = Field(
        default=False,
        description="Fit the step cost model (engine/sched/step_cost.py) even without"
        " tpot_target_ms, and publish its coefficients with the load gauges (step_*): the"
        " planner's performance model of this worker. On CUDA a step that samples nothing"
        " then syncs to be timed.",
    )
    prefill_wait_limit_ms: float | None = Field(
        default=None,
        gt=0,
        description="With tpot_target_ms: while a request not yet admitted has waited longer"
        " than this since arrival, steps take the whole token budget, so that capped steps"
        " cannot let the queue grow without bound (a prompt already being prefilled in"
        " chunks does not count); None: the target always holds.",
    )
    enable_prefix_caching: bool = True
    cache_salt: str | None = None
    attention_backend: AttentionBackendName = Field(
        default="auto",
        description="auto: Triton on CUDA; on CPU the C decode kernel where it builds and"
        " takes the dtype and KV format, else torch. triton off CUDA (CPU, only under"
        " TRITON_INTERPRET=1: tests of the path CUDA runs) runs every Triton kernel the"
        " engine has: attention, cache writes, norm and rotary, and also the int8 matmul"
        " and the KV handoff's pack/unpack, which otherwise take the C or torch paths there"
        " (engine/llm_engine.py, triton_off_cuda).",
    )
    enforce_eager: bool = Field(
        default=False,
        description="CUDA only: run every step eagerly; False replays decode-only steps as"
        " CUDA graphs (with the Triton attention backend).",
    )
    max_cuda_graph_batch_size: int = Field(
        default=256,
        ge=1,
        description="CUDA only: decode-only steps of up to this many sequences (and at most"
        " max_num_seqs) replay as CUDA graphs, padded up to the next captured batch size;"
        " larger ones run eagerly.",
    )
    seed: int = Field(
        default=0, description="seeds the sampling of requests without a seed, and dummy weights"
    )
    speculative: str | None = Field(
        default=None,
        description="Speculative decoding (engine/spec_decode/proposer.py):"
        ' "ngram:k=K[,n=N]" proposes up to K'
        " tokens (1..8) per decoding sequence by prompt lookup (its last N tokens,"
        " N..1, matched in its own prompt and output; N in 1..16, default 3) and verifies"
        " them in one forward pass: greedy tokens are exactly those without it, sampled"
        " ones have exactly its distribution. With adaptive=on (the default) only the"
        " proposed tokens worth their cost are verified (each sequence's acceptance so far"
        ' against the measured step costs); adaptive=off verifies all. "ngram" alone: K=4,'
        ' N=3. "draft:PATH[,k=K][,adaptive=on|off]": a smaller model of the same vocabulary'
        " (its folder PATH, checked at start) proposes K tokens greedily, over a KV cache of"
        " its own with the pool's blocks (engine/spec_decode/draft.py); tensor parallel: it runs on"
        " rank 0 only. None: off.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        description="Ranks the model is sharded over (Megatron-style, engine/worker/parallel.py):"
        " this process is rank 0 and starts the others as local processes; NCCL on CUDA"
        " (one GPU each, cuda:i+r), gloo on CPU. The KV pool is sized per rank.",
    )
    distributed_executor_backend: Literal["mp", "ray"] = Field(
        default="mp",
        description='Tensor parallel: how ranks 1.. start. "mp": local processes of this'
        ' one (offline use). "ray": Ray actors in the current placement group, one bundle'
        " per rank (a Serve replica's `placement_group_bundles`, deploy/app.py), which can"
        " also move their own KV slices to and from other replicas (runtime/tp_ranks.py).",
    )
    max_lora_rank: int = Field(
        default=64,
        ge=1,
        le=512,
        description="The highest rank of a LoRA adapter this engine loads; one above it is"
        " refused at load (engine/lora/adapter.py).",
    )
    max_loras: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="LoRA adapters resident on the device at once: what one step can mix."
        " Every loaded adapter is kept in host memory; one a request needs is copied in"
        " when a slot is free or held by an adapter no running request uses (the least"
        " recently used is swapped out), else the request waits for a slot"
        " (engine/sched/lora_slots.py).",
    )
    distributed_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Tensor parallel: how long any collective (and the ranks' start) may"
        " wait for the other ranks before it raises: a dead or stalled rank fails the"
        " engine, never hangs it.",
    )

    @field_validator("speculative")
    @classmethod
    def _check_speculative(cls, value: str | None) -> str | None:
        if value is not None:
            SpeculativeConfig.parse(value)  # raises ValueError naming the problem
        return value

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """`speculative` parsed; None when off."""
        return None if self.speculative is None else SpeculativeConfig.parse(self.speculative)

    @model_validator(mode="after")
    def _check_block_size(self) -> EngineConfig:
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        return self

    @model_validator(mode="after")
    def _check_host_tier(self) -> EngineConfig:
        if self.kv_disk_dir is not None and not self.kv_host_gib:
            raise ValueError("kv_disk_dir (a disk KV tier) needs kv_host_gib: it sits under it")
        if not self.kv_host_gib:
            return self
        # NOTE: each TP rank holds its own heads' share of a block, and a draft model a
        # cache of its own: both would need every copy made on every cache
        problem = (
            "needs enable_prefix_caching"
            if not self.enable_prefix_caching
            else "is not yet supported with tensor_parallel_size > 1"
            if self.tensor_parallel_size > 1
            else "is not yet supported with a draft model"
            if self.speculative_config is not None and self.speculative_config.method == "draft"
            else None
        )
        if problem is not None:
            raise ValueError(f"kv_host_gib (a host KV tier) {problem}")
        return self


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a container's or `taskset`'s
    limit, a pinned replica's set), else every CPU of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this OS
        return os.cpu_count() or 1


def default_num_threads(ranks: int = 1) -> int:
    """Torch threads for an engine told none: OMP_NUM_THREADS when it is set (a user's or
    a launcher's explicit choice), otherwise the usable CPUs shared among the `ranks`
    processes of one engine on this host (local tensor parallelism), at least one each.
    Torch's own default (physical cores of the machine, whatever the mask) oversubscribes
    a container; one thread leaves the other cores idle."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.strip().isdigit() and int(env) > 0:
        return int(env)
    return max(1, usable_cpus() // max(1, ranks))


def engine_field(name: str, **overrides: Any) -> Any:
    """EngineConfig's declaration of setting `name` (its constraints and description),
    with `overrides` (a cluster's own default): a configuration that passes engine
    settings on (`cluster/config.py`) declares them through this, so each is stated once."""
    field = FieldInfo.merge_field_infos(EngineConfig.model_fields[name], **overrides)
    if "default_factory" in overrides:
        # A derived default replaces the engine's plain one. pydantic merges what a field
        # info was given (`_attributes_set`) when the class is built, and refuses both.
        field.default = PydanticUndefined
        field._attributes_set.pop("default", None)
    return field
