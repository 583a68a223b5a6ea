"""The cluster's configuration: one validated object that every deployment receives.

`pdserve up` builds it from its flags; a Ray Serve config file passes the same fields as
the application's arguments (`deploy/app.py`). Plain Python: no torch.

Validation has two steps. Constructing a `ClusterConfig` checks what needs nothing but
the values (ranges, the engine's own rules such as a power-of-two block size, TLS only
with gRPC). `preflight()` checks what needs the machine: the model folder, the lengths
and KV pool it allows, whether each pool's tensor-parallel size shards it, the TLS files,
Redis. `pdserve up` and the Serve app builder run both before any replica starts, so a
bad configuration fails in seconds with the field's name instead of replicas
crash-looping until a ready timeout.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pdserve.cluster.model_routes import ModelRoute, route_problems
from pdserve.cluster.settings import (  # re-exported: the configuration's own names
    KVTLS,
    MODEL_APP_PREFIX,
    ROLES,
    SECRET_FIELDS,
    APIKeyDefaults,
    ConfigError,
    DisaggPolicy,
    Mode,
    ModelSpec,
    Placement,
    PlacementWeights,
    PlannerSettings,
    PoolAutoscaling,
    RouterIndex,
    ToolCallParserName,
    Transport,
    app_slug,
    expand_env,
    model_app_name,
    parse_cpu_set,
    redact_url,
)
from pdserve.common.engine_config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    AttentionBackendName,
    DType,
    EngineConfig,
    KVCacheDtype,
    LoadFormat,
    Quantization,
    engine_field,
)
from pdserve.common.errors import EngineError
from pdserve.common.model_config import ModelConfig, load_model_config, tensor_parallel_problems
from pdserve.common.speculative import SpeculativeConfig, check_draft_checkpoint
from pdserve.kv_transfer.tls import TLSConfig


def _setting(data: dict[str, Any], name: str) -> Any:
    """`name`'s value in a configuration being validated: given, else as declared (a
    derived default reads the declared ones, never restates them)."""
    if name in data:
        return data[name]
    field = ClusterConfig.model_fields[name]
    return field.get_default(call_default_factory=True, validated_data=data)


# What a derived wait never goes below.
MIN_KV_WAIT_S = 10.0
MIN_FIRST_TOKEN_S = 120.0


def _default_kv_wait_timeout_s(data: dict[str, Any]) -> float:
    """The KV wait of a request whose queue is at the shedding bound (ClusterConfig)."""
    bound = _setting(data, "kv_wait_factor") * _setting(data, "max_prefill_queue_s")
    return max(MIN_KV_WAIT_S, bound + _setting(data, "kv_wait_floor_s"))


def _default_tpot_target_ms(data: dict[str, Any]) -> float | None:
    """Colocated, every prompt is prefilled beside the streams: whole prompts (the token
    budget alone) serve mixed load with a lower TTFT *and* TPOT than 100 ms chunks, whose
    steps each pay the weights' pass again and run smaller matmuls (docs/measurements.md,
    "The TPOT target"). Disaggregated, a decode worker prefills only what spills or
    fails over, and the target keeps that from stalling its streams."""
    return None if _setting(data, "mode") == "colocated" else 100.0


def _default_first_token_timeout_s(data: dict[str, Any]) -> float:
    return max(MIN_FIRST_TOKEN_S, 2.0 * _setting(data, "kv_wait_timeout_s"))


class ClusterConfig(BaseModel):
    """Everything a router, prefill or decode replica needs to know about the cluster."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None, description="HF model folder, readable on every node (or `models`)"
    )
    # Several models behind one router (docs/architecture.md, "Several models"): each
    # entry overrides the per-model fields above and below; `model` is then unset.
    models: list[ModelSpec] = Field(
        default_factory=list,
        description=(
            "several models behind one router: each entry a model's folder and its own"
            " fields (docs/architecture.md, 'Several models')"
        ),
    )
    served_model_name: str | None = Field(
        default=None, description="the model id clients send (default: the folder name)"
    )
    # How `tool_choice: "auto"` finds calls in the model's output (router/tool_calls.py):
    # "hermes" (JSON in <tool_call> tags: Qwen 2.5, Hermes), "json" (a JSON object:
    # Llama 3.x), "none" (auto is a 400; required and named functions still work), or
    # "auto": from the chat template (<tool_call> -> hermes, <|python_tag|> -> json).
    tool_call_parser: ToolCallParserName = Field(
        default="auto",
        description=(
            "the format tool_choice=auto parses calls from: hermes (<tool_call> tags),"
            " json (a JSON object), none (auto is a 400), or auto (from the chat template)"
        ),
    )
    # Routed model names (cluster/model_routes.py): a name clients send, mapped by the
    # operator's rules (prompt length, max_tokens, header, metadata tag, canary share) to
    # one of the served models.
    routes: list[ModelRoute] = Field(
        default_factory=list,
        description=(
            "routed model names: a name clients send, mapped by the operator's rules to"
            " one of the served models (cluster/model_routes.py)"
        ),
    )
    mode: Mode = Field(
        default="disagg",
        description=(
            "disagg: prompts prefilled by the prefill pool, their KV shipped to the"
            " decode pool; colocated: decode workers prefill locally (the baseline)"
        ),
    )
    transport: Transport = Field(
        default="grpc",
        description=("the KV block transport between the pools"),
    )
    placement: Placement = Field(
        default="prefix-aware",
        description=(
            "how a request's workers are chosen: by where its prefix is cached and by"
            " load, or round-robin or random (for comparisons)"
        ),
    )
    weights: PlacementWeights = Field(
        default_factory=PlacementWeights,
        description=("placement's cost weights (router/placement.py), as JSON"),
    )
    router_index: RouterIndex = Field(
        default="memory",
        description=(
            "where a router matches prompts against the prefix index: memory (its own"
            " view, fed by the workers' events in Redis) or redis (a script per request)"
        ),
    )
    index_stream_len: int = Field(
        default=10_000,
        ge=100,
        le=10_000_000,
        description=(
            "entries the index's events stream keeps; a router further behind takes a new snapshot"
        ),
    )
    # Where a prompt is prefilled in disagg mode (router/disagg.py, docs/architecture.md
    # "Conditional disaggregation and admission"): "always" on a prefill worker;
    # "conditional" on the chosen decode worker instead when its uncached part is at most
    # local_prefill_max_tokens, or when the decode worker runs at most
    # local_prefill_max_running sequences and would finish it sooner than the prefill
    # pool even with its time weighted by 1 + local_prefill_interference x those
    # sequences (every one of them stalls while it prefills). The default 0: a decode
    # worker prefills a long prompt by choice only while it streams nothing, so no
    # stream's TPOT pays for another's TTFT (short prompts and a saturated prefill pool
    # aside).
    disagg_policy: DisaggPolicy = Field(
        default="conditional",
        description=(
            "disagg mode: conditional lets the chosen decode worker prefill when that is"
            " sooner (a short prompt, a saturated prefill pool); always: every prompt"
            " through the split"
        ),
    )
    local_prefill_max_tokens: int = Field(
        default=32,
        ge=0,
        description=("conditional: uncached prompt tokens up to which the decode worker prefills"),
    )
    local_prefill_max_running: int = Field(
        default=0,
        ge=0,
        description=(
            "conditional: a decode worker running more sequences than this never prefills"
            " a long prompt because it would be sooner (0: only an idle one, whose streams"
            " it would not stall)"
        ),
    )
    local_prefill_interference: float = Field(
        default=0.05,
        ge=0,
        description=(
            "conditional: weight of a local prefill's time per sequence the decode worker runs"
        ),
    )
    # Admission: past this many seconds of queued prefill work on every option, a
    # request gets 429 with Retry-After. The decode worker waits for a request's KV
    # kv_wait_factor x the estimated prefill time + kv_wait_floor_s, at most
    # kv_wait_timeout_s, whose default is that wait for a queue at the bound (2 x 4 s +
    # 2 s = 10 s with the defaults; raising the bound raises it): KV admitted at the bound
    # is not expected late. The floor absorbs call latencies and scheduling jitter that no
    # estimate of compute sees.
    max_prefill_queue_s: float = Field(
        default=4.0,
        gt=0,
        description=(
            "past this many seconds of queued prefill work on every worker that could"
            " prefill a prompt, the request gets 429 with Retry-After"
        ),
    )
    # Conditional disaggregation spills a prompt to its decode worker once the prefill
    # worker's queue is past this (reason prefill_saturated), at most max_prefill_queue_s:
    # raising the shedding bound to queue more does not leave the decode workers idle
    # while the prefill pool's queue grows.
    prefill_spill_queue_s: float = Field(
        default=4.0,
        gt=0,
        description=(
            "conditional: past this many seconds of queued work on the prefill worker,"
            " the decode worker prefills instead (at most max_prefill_queue_s)"
        ),
    )
    # Before that, a prompt that would queue on the prefill worker goes to its decode
    # worker when that is sooner, within a budget: at most this share of each decode
    # worker's time (over a 10 s window) goes to such spills (`prefill_busy`,
    # router/disagg.py's SpillBudget), so its streams keep most of the TPOT the split
    # buys. 0: none; prompts then spill only past prefill_spill_queue_s.
    decode_prefill_share: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description=(
            "conditional: at most this share of a decode worker's time goes to prompts"
            " spilled to it because the prefill worker has a queue and it is sooner"
            " (0: only past prefill_spill_queue_s)"
        ),
    )
    kv_wait_factor: float = Field(
        default=2.0,
        ge=1,
        description=(
            "a decode worker waits for a request's KV this many times the estimated"
            " prefill time, plus kv_wait_floor_s"
        ),
    )
    kv_wait_floor_s: float = Field(
        default=2.0,
        ge=0,
        description=("what a KV wait adds to its estimate (see kv_wait_factor)"),
    )
    # Peer fetch (docs/kv-tiers.md, "Fetching from a peer"): when a decode worker is to
    # prefill a prompt of which another worker holds more, the holder pushes the blocks
    # it has beyond the chosen worker's, if they are at least this many and the measured
    # push is sooner than computing them there.
    kv_fetch_min_blocks: int = Field(
        default=4,
        ge=0,
        description=(
            "the fewest blocks of a prompt's prefix a decode worker fetches from the worker"
            " that holds them instead of computing them (0: never fetch)"
        ),
    )

    prefill_replicas: int = Field(
        default=1,
        ge=0,
        description=("prefill worker replicas (disagg mode)"),
    )
    decode_replicas: int = Field(
        default=1,
        ge=1,
        description=("decode worker replicas"),
    )
    router_replicas: int = Field(
        default=1,
        ge=1,
        description=("router replicas (with direct ingress: one HTTP port each, from --port up)"),
    )
    # Tensor parallelism per pool (docs/configuration.md, "Tensor parallelism per pool"):
    # each replica of the pool is that many ranks, one placement-group bundle each, all
    # on one node; KV moves rank to rank, re-sliced, so any two valid sizes work together.
    prefill_tp: int = Field(
        default=1,
        ge=1,
        description="tensor-parallel ranks per prefill replica (disagg mode); each rank takes"
        " replica_num_cpus CPUs and replica_num_gpus GPUs, on the replica's node",
    )
    decode_tp: int = Field(
        default=1,
        ge=1,
        description="tensor-parallel ranks per decode replica; each rank takes"
        " replica_num_cpus CPUs and replica_num_gpus GPUs, on the replica's node",
    )
    # Set a pool's autoscaling to size it by its own signal between min and max replicas
    # (its *_replicas field is then the initial count).
    prefill_autoscaling: PoolAutoscaling | None = Field(
        default=None,
        description=(
            "autoscale the prefill pool on queued prefill tokens: JSON of"
            ' PoolAutoscaling, e.g. \'{"min_replicas": 1, "max_replicas": 4}\''
        ),
    )
    decode_autoscaling: PoolAutoscaling | None = Field(
        default=None,
        description=(
            "autoscale the decode pool on running sequences and KV use: JSON of PoolAutoscaling"
        ),
    )
    # Latency targets: set, the planner sizes both pools to meet them (router/planner.py)
    # through the external scaler, instead of the per-pool autoscaling above.
    slo_ttft_ms: float | None = Field(
        default=None,
        gt=0,
        description="the time-to-first-token target: with it (or slo_itl_ms) the planner"
        " sizes both pools to meet the targets at slo_percentile (docs/planner.md)",
    )
    slo_itl_ms: float | None = Field(
        default=None, gt=0, description="the inter-token latency target (see slo_ttft_ms)"
    )
    slo_percentile: float = Field(
        default=90.0,
        gt=0,
        lt=100,
        description="the percentile of requests (TTFT) and of tokens (ITL) the targets hold",
    )
    planner: PlannerSettings = Field(
        default_factory=PlannerSettings,
        description="the planner's bounds, budget and pacing, as JSON (router/planner.py)",
    )
    replica_num_cpus: float = Field(
        default=1.0,
        ge=0,
        description=("Ray CPUs per worker replica (per rank with TP)"),
    )
    # Linux CPU sets ("0", "0-3", "0,2") a pool's replicas are pinned to, so that on a
    # shared host prefill and decode never steal each other's cores (benchmarks).
    prefill_cpus: str | None = Field(
        default=None,
        description=("pin prefill replicas to these CPUs, e.g. '0-3,8'"),
    )
    decode_cpus: str | None = Field(
        default=None,
        description=("pin decode replicas to these CPUs"),
    )
    replica_num_gpus: float = Field(
        default=0.0,
        ge=0,
        description=("Ray GPUs per worker replica; a fraction shares one GPU (0.5: two replicas)"),
    )
    # Node pools: Ray custom resources each replica of a pool asks for, so that its
    # replicas land only on nodes started with them (`ray start --resources
    # '{"prefill_pool": 8}'`): prefill on compute-sized nodes, decode on bandwidth-sized
    # ones, routers next to the load balancer. Empty: any node.
    prefill_resources: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Ray custom resources each prefill replica needs, as JSON, e.g."
            " '{\"prefill_pool\": 1}': its replicas go only to nodes that have them"
        ),
    )
    decode_resources: dict[str, float] = Field(
        default_factory=dict,
        description=("Ray custom resources each decode replica needs, as JSON"),
    )
    router_resources: dict[str, float] = Field(
        default_factory=dict,
        description=("Ray custom resources each router replica needs, as JSON"),
    )

    # redis://[:PASSWORD@]HOST:PORT/DB (a password is never printed; see redact_url).
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        repr=False,
        description=(
            "the cluster's Redis, redis://[:PASSWORD@]HOST:PORT/DB (a password is never"
            " printed); pdserve up embeds one on loopback when not given"
        ),
    )
    # Address the KV receivers bind and announce: "auto" is each decode node's own
    # address as Ray knows it (multi-node clusters); never all interfaces by default.
    transfer_host: str = Field(
        default="127.0.0.1",
        description=(
            "the address KV receivers bind and announce; auto: each decode node's own"
            " address as Ray knows it"
        ),
    )
    cluster_token: str = Field(
        default_factory=lambda: secrets.token_hex(16),
        repr=False,
        description=("the secret every KV push carries (generated when not given)"),
    )
    # TLS on the KV pushes (gRPC transport); None: plaintext, for one trusted host or a
    # private network (the cluster token still authenticates each push).
    kv_tls: KVTLS | None = Field(
        default=None,
        description=(
            "TLS on the KV pushes (gRPC only); None: plaintext, the cluster token still"
            " authenticating each push"
        ),
    )

    # Engine settings (both roles): EngineConfig's declarations (engine_field), each
    # stated there once; a cluster's own default overrides where it differs.
    dtype: DType = engine_field("dtype")
    device: str = engine_field("device")
    load_format: LoadFormat = engine_field("load_format")
    quantization: Quantization = engine_field("quantization")
    # One KV format for the cluster: blocks cross only between workers of one format, and
    # the prefix index refuses a worker of another.
    kv_cache_dtype: KVCacheDtype = engine_field("kv_cache_dtype")
    attention_backend: AttentionBackendName = engine_field("attention_backend")
    # The decode pool speculates: the prefill pool samples one token per request, so it
    # has nothing to speculate; in colocated mode the one pool (the decode deployment)
    # does. A draft's folder is a path on the workers (preflight checks it here).
    speculative: str | None = engine_field("speculative")
    num_threads: int | None = engine_field(
        "num_threads",
        description="torch threads per worker replica (per rank with TP). None: the"
        " replica's share, the size of its pool's pinned CPU set (prefill_cpus,"
        " decode_cpus) when it has one, otherwise replica_num_cpus rounded down, at least 1",
    )
    block_size: int = engine_field("block_size")
    max_model_len: int | None = engine_field("max_model_len")
    num_kv_blocks: int | None = engine_field("num_kv_blocks")
    gpu_memory_utilization: float | None = engine_field(
        "gpu_memory_utilization",
        description="CUDA, without num_kv_blocks: the fraction of its GPU's memory each"
        " worker replica may use, the KV pool taking what the model leaves. None: 0.9,"
        " times replica_num_gpus when that is a fraction (replicas sharing a GPU split it)",
    )
    max_num_seqs: int = engine_field("max_num_seqs")
    max_num_batched_tokens: int = engine_field("max_num_batched_tokens")
    enforce_eager: bool = engine_field("enforce_eager")
    kv_staging_mb: int = engine_field("kv_staging_mb")
    kv_host_gib: float = engine_field("kv_host_gib")
    kv_disk_dir: str | None = engine_field("kv_disk_dir")
    kv_disk_gib: float = engine_field("kv_disk_gib")
    # LoRA adapters of the model (docs/lora.md): every worker replica of both pools
    # loads each at start; a request names one in `model`.
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters every worker loads at start, name -> PEFT folder (as"
        " JSON; `pdserve up --lora NAME=PATH`, repeated); a request names one in `model`,"
        " /v1/models lists each with its base as `parent`",
    )
    # Off by default: a load names a folder every worker then reads, which an operator
    # must choose to let API clients do (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    allow_runtime_lora: bool = Field(
        default=False,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's"
        " API; behind the API key when keys are set): API clients load and unload LoRA"
        " adapters from folders every worker can read",
    )
    max_lora_rank: int = engine_field("max_lora_rank")
    max_loras: int = engine_field("max_loras")
    # a GPU step stays far below it, so it binds only where a prompt really would stall
    # the streams (CPU)
    tpot_target_ms: float | None = engine_field(
        "tpot_target_ms",
        default_factory=_default_tpot_target_ms,
        description="Keep a step that has decode rows within this time, by capping its"
        " prefill tokens from the measured step cost; None (off): the token budget alone"
        " (default: off colocated, 100 disaggregated)",
    )
    # Without it, prompts arriving faster than capped steps prefill them queue without
    # bound.
    prefill_wait_limit_ms: float | None = engine_field("prefill_wait_limit_ms", default=500.0)
    stream_hold_above: int | None = Field(
        default=16,
        ge=0,
        description="above this many streams on a decode worker, a stream's tokens after"
        " the first go out two per message (one waits at most one step); None (off): one"
        " message per step",
    )
    seed: int = engine_field("seed")

    # Router limits. api_keys: if any, every /v1 and /workers call needs
    # "Authorization: Bearer KEY" (401 otherwise). Past max_inflight_requests streams
    # per router replica, new requests get 429 with Retry-After.
    api_keys: list[str] = Field(
        default_factory=list,
        repr=False,
        description=(
            "if any, every /v1 route and /workers need 'Authorization: Bearer KEY' (else 401)"
        ),
    )
    # Per-key defaults (priority, cache_salt), keyed by the API key itself (each must be
    # one of api_keys); from `KEY priority=N cache_salt=S` lines of --api-keys-file.
    api_key_defaults: dict[str, APIKeyDefaults] = Field(
        default_factory=dict,
        repr=False,
        description=("per API key: its default priority and cache_salt"),
    )
    max_inflight_requests: int = Field(
        default=1024,
        ge=1,
        description=("requests admitted at once per router replica; past it, 429 with Retry-After"),
    )
    max_body_bytes: int = Field(
        default=4 << 20,
        ge=1024,
        description=("larger request bodies get 413"),
    )
    # The result cache (router/result_cache.py): fully determined requests' outputs
    # (greedy or seeded) kept in the cluster's Redis for this long; None: off. At most
    # result_cache_max_entries entries (the oldest go first), each at most
    # result_cache_max_entry_bytes (a larger result is not stored).
    result_cache_ttl_s: float | None = Field(
        default=None,
        gt=0,
        description=(
            "keep fully determined requests' results (greedy, or seeded) in Redis this"
            " long and answer repeats from there; None (off): no result cache"
        ),
    )
    result_cache_max_entries: int = Field(
        default=10_000,
        ge=1,
        description=("the most results kept, over all router replicas (the oldest go first)"),
    )
    result_cache_max_entry_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        description=("a larger result is not cached"),
    )
    # Shedding by priority (router/priority.py): this fraction of max_inflight_requests
    # and of max_prefill_queue_s is kept for requests of priority >= priority_reserved_min;
    # lower ones are shed once the load passes the rest, so an important request is never
    # shed while a less important one is admitted. 0: one limit for every priority.
    priority_headroom: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description=(
            "fraction of the router's limits kept for priorities >= priority_reserved_min"
            " (a larger priority is more important); 0: one limit for every priority"
        ),
    )
    priority_reserved_min: int = Field(
        default=1,
        ge=-1000,
        le=1000,
        description=("the lowest priority that may use the priority_headroom"),
    )

    # Leases and deadlines (docs/kv-handoff.md).
    worker_lease_s: float = Field(
        default=10.0,
        gt=0,
        description=("a worker's index registration lives this long without a heartbeat"),
    )
    heartbeat_s: float = Field(
        default=1.0,
        gt=0,
        description=("a worker's heartbeat period (shorter than worker_lease_s)"),
    )
    # Unset, the KV wait for a queue at max_prefill_queue_s (at least 10 s), and a first
    # token deadline of twice that (at least 120 s): a request admitted at the bound whose
    # KV still came late is then prefilled by its decode worker, about as long again.
    kv_wait_timeout_s: float = Field(
        default_factory=_default_kv_wait_timeout_s,
        gt=0,
        description=(
            "the longest a decode worker waits for pushed KV before prefilling itself"
            " (default: the wait of a queue at max_prefill_queue_s, at least 10)"
        ),
    )
    transfer_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "a KV push never takes longer; nor does the router's wait for the prefill"
            " worker's report once a request's last token is out"
        ),
    )
    first_token_timeout_s: float = Field(
        default_factory=_default_first_token_timeout_s,
        gt=0,
        description=(
            "the router's deadline for a request's first token (default: twice"
            " kv_wait_timeout_s, at least 120)"
        ),
    )
    max_resumes: int = Field(default=2, ge=0, description="decode failures one stream survives")
    stall_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description=("the router's deadline between two tokens of a stream"),
    )
    # How long running streams may go on once the cluster stops (pdserve up's SIGINT or
    # SIGTERM, `serve run`'s Ctrl-C, `serve shutdown`): then each ends with an error event
    # and the replicas stop. Within Kubernetes' default 30 s termination grace.
    shutdown_grace_s: float = Field(
        default=10.0,
        ge=0,
        le=600,
        description=(
            "once the cluster stops (Ctrl-C / SIGTERM, serve run's Ctrl-C, serve"
            " shutdown), running streams may go on this long; then each ends with an error"
            " event"
        ),
    )

    # A scale-down: Serve stops routing to the replica and waits for its requests; the
    # router sees it leave and tells it to drain (cluster/drain.py).
    drain_deadline_s: float = Field(
        default=20.0,
        gt=0,
        le=3600,
        description=(
            "a worker replica leaving its pool (a scale-down) leaves the index at once and"
            " lets its streams run this long; those still running then move to another"
            " decode worker, with exact tokens (as a resumed stream)"
        ),
    )
    external_scaler: bool = Field(
        default=False,
        description=(
            "let a scaler outside Serve set the pools' replica counts (Serve's external"
            " scaling API, e.g. its REST endpoint); the pools then keep no Serve"
            " autoscaling"
        ),
    )

    @property
    def planner_enabled(self) -> bool:
        """SLO targets are set: the planner sizes the pools (router/planner_loop.py)."""
        return self.slo_ttft_ms is not None or self.slo_itl_ms is not None

    @property
    def scaled_externally(self) -> bool:
        """The pools' counts come from outside Serve: `external_scaler`, or the planner."""
        return self.external_scaler or self.planner_enabled

    @field_validator("speculative")
    @classmethod
    def _check_speculative(cls, value: str | None) -> str | None:
        if value is not None:
            SpeculativeConfig.parse(value)  # the engine's own check: ValueError naming it
        return value

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if (self.model is None) == (not self.models):
            raise ConfigError("model", "give exactly one of `model` and `models`")
        if self.models:
            self._check_models()
            self._check_routes()
            return self
        for cpus in (self.prefill_cpus, self.decode_cpus):
            if cpus is not None:
                parse_cpu_set(cpus)
        if self.mode == "disagg" and self.prefill_replicas < 1:
            raise ValueError("disagg mode needs at least one prefill replica")
        unknown = [k for k in self.api_key_defaults if k not in self.api_keys]
        if unknown:  # never print a key: say how many
            raise ConfigError(
                "api_key_defaults", f"{len(unknown)} key(s) with defaults are not in api_keys"
            )
        if self.heartbeat_s >= self.worker_lease_s:
            raise ValueError("heartbeat_s must be shorter than worker_lease_s")
        if self.planner_enabled and (self.prefill_autoscaling or self.decode_autoscaling):
            raise ConfigError(
                "slo_ttft_ms",
                "the planner sizes both pools to the SLO targets: drop prefill_autoscaling"
                " and decode_autoscaling",
            )
        if self.external_scaler and (self.prefill_autoscaling or self.decode_autoscaling):
            raise ConfigError(
                "external_scaler",
                "an external scaler sets the pools' replica counts: drop prefill_autoscaling"
                " and decode_autoscaling (Serve refuses both at once)",
            )
        if self.kv_tls is not None and self.transport != "grpc":
            raise ConfigError(
                "kv_tls",
                f"the {self.transport} transport has no TLS (UCX does not encrypt); "
                "use transport 'grpc' for encrypted KV transfers, or drop kv_tls",
            )
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError("device", f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device != "cpu" and self.replica_num_gpus <= 0:
            # Ray sets CUDA_VISIBLE_DEVICES="" in an actor that asks for no GPU.
            raise ConfigError(
                "replica_num_gpus",
                f"device {self.device!r} needs GPUs per worker replica (Ray hides every GPU "
                "from a replica that asks for none): 1, or 0.5 for two replicas on one GPU",
            )
        scheme = urlsplit(self.redis_url).scheme
        if self.redis_url and scheme not in ("redis", "rediss", "unix"):
            raise ConfigError("redis_url", "must be a redis://, rediss:// or unix:// URL")
        self._check_routes()
        self._check_tensor_parallel()
        self._check_lora_modules()
        try:
            for role in self.roles():  # the engine's own rules (block_size a power of two, ...)
                self.engine_config(role)
        except ValidationError as exc:
            why = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            named = [f for f in ClusterConfig.model_fields if re.search(rf"\b{f}\b", why)]
            raise ConfigError(named[0] if named else "engine", why) from None
        return self

    def _check_lora_modules(self) -> None:
        """Adapter names never shadow a served model, and need one rank per engine."""
        for name in self.lora_modules:
            if not name or name == self.model_id or name in self.model_ids():
                raise ConfigError(
                    "lora_modules", f"adapter name {name!r} is empty or names a served model"
                )
        if self.lora_modules and (self.tp("prefill") > 1 or self.tp("decode") > 1):
            raise ConfigError(
                "lora_modules", "LoRA adapters are not yet served with tensor parallelism"
            )

    def _check_models(self) -> None:
        """Each model's own config is valid, and ids (and so Serve app names) are unique."""
        if self.served_model_name is not None:
            raise ConfigError("served_model_name", "with `models`, each entry names its own model")
        seen: dict[str, str] = {}
        for cfg in self.model_configs():  # each runs every single-model check
            slug = app_slug(cfg.model_id)
            if slug in seen:
                raise ConfigError(
                    "models",
                    f"the served model ids {seen[slug]!r} and {cfg.model_id!r} clash (each "
                    "model needs a distinct served_model_name; ids may differ in more than "
                    "punctuation)",
                )
            seen[slug] = cfg.model_id

    def model_configs(self) -> list[ClusterConfig]:
        """One plain single-model configuration per served model, the cluster's fields
        with the model's overrides applied (`[self]` for a single-model configuration):
        what each model's pools and its part of the router receive."""
        if not self.models:
            return [self]
        # routes are the router's: each model's own configuration serves only its model
        base = self.model_dump(exclude={"models", "model", "routes"})
        out = []
        for spec in self.models:
            try:
                out.append(
                    ClusterConfig.model_validate({**base, **spec.model_dump(exclude_none=True)})
                )
            except ValidationError as exc:
                why = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
                raise ConfigError("models", f"model {spec.model!r}: {why}") from None
        return out

    def _check_routes(self) -> None:
        problems = route_problems(self.routes, self.model_ids())
        if problems:
            raise ConfigError("routes", "; ".join(problems))

    def model_ids(self) -> list[str]:
        """The served model ids, in configuration order."""
        return [cfg.model_id for cfg in self.model_configs()]

    def _check_tensor_parallel(self) -> None:
        """What a pool's TP size needs of the other fields (the model's shape: preflight)."""
        if self.mode != "disagg" and self.prefill_tp > 1:
            raise ConfigError(
                "prefill_tp",
                f"--prefill-tp {self.prefill_tp}: {self.mode} mode has no prefill pool (the "
                "decode replicas prefill themselves); use --decode-tp, or mode disagg",
            )
        for role in self.roles():
            tp = self.tp(role)
            if tp == 1:
                continue
            flag = f"--{role}-tp {tp}"
            if not self.rank_bundle(role):
                # Ray rejects a placement-group bundle that asks for nothing
                raise ConfigError(
                    f"{role}_tp",
                    f"{flag}: each rank takes a placement-group bundle of replica_num_cpus "
                    "CPUs and replica_num_gpus GPUs, and Ray refuses an empty one: set "
                    "replica_num_cpus (a fraction will do) or replica_num_gpus above 0",
                )
            if self.device == "cpu":
                continue
            if self.replica_num_gpus < 1:
                raise ConfigError(
                    "replica_num_gpus",
                    f"{flag}: each rank needs a GPU of its own (NCCL runs no two ranks on one "
                    f"GPU), but replica_num_gpus={self.replica_num_gpus} lets ranks share one",
                )
            if self.num_kv_blocks is None:
                raise ConfigError(
                    "num_kv_blocks",
                    f"{flag}: a tensor-parallel engine does not measure GPU memory to size its "
                    "KV pool; set num_kv_blocks (--num-kv-blocks), the blocks of each rank",
                )

    @classmethod
    def from_serve_args(cls, args: dict[str, Any]) -> ClusterConfig:
        """The configuration a Serve config's `args` describe.

        `${NAME}` in `redis_url` and `cluster_token` is replaced by the environment
        variable NAME, and keys in `$PDSERVE_API_KEYS` (comma-separated, as for `pdserve
        up`) are added to `api_keys`: on Kubernetes both come from Secrets, so neither
        the Redis password, the token nor an API key is written in the RayService spec.
        """
        args = dict(args)
        for name in SECRET_FIELDS:
            if isinstance(args.get(name), str):
                args[name] = expand_env(name, args[name])
        env_keys = [k.strip() for k in os.environ.get("PDSERVE_API_KEYS", "").split(",")]
        if any(env_keys):
            args["api_keys"] = [*args.get("api_keys", []), *(k for k in env_keys if k)]
        return cls.model_validate(args)

    @property
    def model_id(self) -> str:
        if self.model is None:
            raise ValueError("a configuration of several models has no single model_id")
        return self.served_model_name or Path(self.model).name

    def roles(self) -> tuple[str, ...]:
        """The worker pools this cluster runs: colocated mode has only the decode pool."""
        return ROLES if self.mode == "disagg" else ("decode",)

    def tp(self, role: str) -> int:
        """Tensor-parallel ranks per replica of the `role` pool ("prefill" | "decode")."""
        if role not in ROLES:
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def index_events_len(self) -> int:
        """The events stream's length the workers write: 0 (none) unless the routers
        keep the index in memory (`router_index`)."""
        return self.index_stream_len if self.router_index == "memory" else 0

    def threads(self, role: str) -> int:
        """Torch threads of each replica (and rank) of the `role` pool: `num_threads`, else
        the CPUs the replica is given (its pinned set, else its Ray CPUs)."""
        self.tp(role)  # checks the role
        if self.num_threads is not None:
            return self.num_threads
        pinned = self.prefill_cpus if role == "prefill" else self.decode_cpus
        if pinned:
            return len(parse_cpu_set(pinned))
        return max(1, int(self.replica_num_cpus))

    def pool_resources(self, role: str) -> dict[str, float]:
        """The Ray custom resources each replica (and each rank) of the `role` pool asks for."""
        self.tp(role)  # checks the role
        return dict(self.prefill_resources if role == "prefill" else self.decode_resources)

    def rank_bundle(self, role: str) -> dict[str, float]:
        """The placement-group bundle of one rank of a `role` replica (TP > 1): the Ray
        resources a replica asks for without TP, zero-valued ones left out. Bundle 0 holds
        the Serve replica itself (rank 0), bundle r rank r (runtime/tp_ranks.py)."""
        bundle = {
            "CPU": self.replica_num_cpus,
            "GPU": self.replica_num_gpus,
            **self.pool_resources(role),
        }
        return {name: float(value) for name, value in bundle.items() if value > 0}

    def _with_models(self, each: Callable[[ClusterConfig], ClusterConfig]) -> ClusterConfig:
        """A copy whose every model spec gets max_model_len from `each(its config)`; an
        error names the model."""
        specs = []
        for spec, cfg in zip(self.models, self.model_configs(), strict=True):
            try:
                max_len = each(cfg).max_model_len
            except ConfigError as exc:
                raise ConfigError(exc.field, f"(model {cfg.model_id}) {exc}") from None
            specs.append(spec.model_copy(update={"max_model_len": max_len}))
        return self.model_copy(update={"models": specs})

    def resolved(self) -> ClusterConfig:
        """A copy with max_model_len filled in from the checkpoint (all roles must agree);
        with several models, in each model's entry."""
        if self.models:
            return self._with_models(ClusterConfig.resolved)
        if self.max_model_len is not None:
            return self
        assert self.model is not None
        mc = load_model_config(Path(self.model))
        max_len = mc.max_position_embeddings
        if mc.sliding_window is not None:
            max_len = min(max_len, mc.sliding_window)
        return self.model_copy(update={"max_model_len": max_len})

    def preflight(self, check_redis: bool = False, redis_timeout_s: float = 3.0) -> ClusterConfig:
        """Check what a replica would find wrong only at start; return `resolved()`.

        The model folder (config.json, architecture, tokenizer), a speculative draft
        model's folder (its vocabulary against the model's), each pool's TP size
        against the model's heads, KV heads and intermediate size (the engine's own
        `check_tensor_parallel`), `max_model_len` against the model's and against each
        pool's KV pool, the TLS files, and with `check_redis` that `redis_url` answers a
        PING (with its password) within `redis_timeout_s`.

        With several models, each model's configuration is checked so (Redis once).

        Raises:
            ConfigError: naming the field at fault.
        """
        if self.models:
            out = self._with_models(ClusterConfig.preflight)
            if check_redis:
                _ping_redis(self.redis_url, redis_timeout_s)
            return out
        assert self.model is not None
        interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        off_cuda = not self.device.startswith("cuda")
        if self.attention_backend == "triton" and off_cuda and not interpreting:
            raise ConfigError(
                "attention_backend",
                "triton off CUDA runs only in Triton's interpreter: set TRITON_INTERPRET=1 "
                "in the environment of pdserve up (its replicas inherit it)",
            )
        try:
            mc = load_model_config(Path(self.model))
            from pdserve.common.tokenizer import Tokenizer

            Tokenizer(Path(self.model))
        except EngineError as exc:
            raise ConfigError("model", str(exc)) from None
        spec = None if self.speculative is None else SpeculativeConfig.parse(self.speculative)
        if spec is not None and spec.draft_model is not None:
            try:  # the engine's own check: the folder, its vocabulary and tokenizer
                check_draft_checkpoint(Path(spec.draft_model), mc, Path(self.model))
            except EngineError as exc:
                raise ConfigError("speculative", str(exc)) from None
        limit = mc.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ConfigError(
                "max_model_len",
                f"{self.max_model_len} exceeds the model's max_position_embeddings ({limit})",
            )
        for role in self.roles():
            problems = tensor_parallel_problems(mc, self.tp(role))
            if problems:
                raise ConfigError(
                    f"{role}_tp",
                    f"--{role}-tp {self.tp(role)}: "
                    + "; ".join(problems)
                    + f", so the {role} pool's ranks cannot shard {Path(self.model).name}",
                )
        cfg = self.resolved()
        assert cfg.max_model_len is not None
        for role in self.roles():
            _check_kv_pool(cfg, mc, self.tp(role))
        if self.kv_tls is not None:
            try:
                self.kv_tls.transport().check()
            except ValueError as exc:
                raise ConfigError("kv_tls", str(exc)) from None
        if check_redis:
            _ping_redis(self.redis_url, redis_timeout_s)
        return cfg

    def transfer_tls(self) -> TLSConfig | None:
        """What `make_sender` / `make_receiver` take: None unless kv_tls is set."""
        return None if self.kv_tls is None else self.kv_tls.transport()

    def worker_gpu_memory_utilization(self) -> float | None:
        """`gpu_memory_utilization`, or where unset and worker replicas share a GPU
        (`replica_num_gpus` below 1), their share of the default: two replicas of 0.5
        GPU get 0.45 each and fit side by side. None: the engine's default."""
        if self.gpu_memory_utilization is not None or not 0 < self.replica_num_gpus < 1:
            return self.gpu_memory_utilization
        return DEFAULT_GPU_MEMORY_UTILIZATION * self.replica_num_gpus

    def engine_config(self, role: str = "decode") -> EngineConfig:
        """The engine configuration of a `role` ("prefill" | "decode") replica: its pool's
        TP size, with ranks 1.. as Ray actors in the replica's placement group. The
        default, "decode", is the pool every mode has (colocated mode's only one)."""
        tp = self.tp(role)
        parallel: dict[str, Any] = {}  # TP 1: the engine's defaults
        if tp > 1:
            parallel = {"tensor_parallel_size": tp, "distributed_executor_backend": "ray"}
        return EngineConfig(
            model_id=self.model_id,
            dtype=self.dtype,
            device=self.device,
            num_threads=self.threads(role),
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            gpu_memory_utilization=self.worker_gpu_memory_utilization(),
            load_format=self.load_format,
            quantization=self.quantization,
            kv_cache_dtype=self.kv_cache_dtype,
            attention_backend=self.attention_backend,
            speculative=self.speculative if role == "decode" else None,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enforce_eager=self.enforce_eager,
            kv_staging_mb=self.kv_staging_mb,
            kv_host_gib=self.kv_host_gib,
            kv_disk_dir=self.kv_disk_dir,
            kv_disk_gib=self.kv_disk_gib,
            max_lora_rank=self.max_lora_rank,
            max_loras=self.max_loras,
            tpot_target_ms=self.tpot_target_ms,
            measure_step_cost=self.planner_enabled,
            prefill_wait_limit_ms=self.prefill_wait_limit_ms,
            seed=self.seed,
            **parallel,
        )


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_DEFAULT_KV_BYTES = 1 << 30  # LLMEngine's pool when nothing sizes it


def _check_kv_pool(cfg: ClusterConfig, mc: ModelConfig, tp: int = 1) -> None:
    """The KV pool a replica of `tp` ranks would allocate (on each rank) holds one
    sequence of `max_model_len` tokens.

    NOTE: mirrors `LLMEngine._size_kv_pool` and `_block_bytes` (which need torch, this
    module must not): a replica raises the same error at start. A CUDA replica without
    num_kv_blocks measures its pool at start (gpu_memory_utilization): nothing to check.
    """
    assert cfg.max_model_len is not None
    if cfg.num_kv_blocks is None and cfg.device != "cpu":
        return
    dtype = cfg.dtype if cfg.dtype != "auto" else mc.torch_dtype
    # a rank's KV heads (TPShard.num_kv_heads): its share, or one replicated head
    kv_heads = 1 if tp > mc.num_kv_heads else mc.num_kv_heads // tp
    per_token = mc.kv_bytes_per_token // mc.num_kv_heads * kv_heads
    block_bytes = cfg.block_size * per_token * _ITEMSIZE.get(dtype, 4) // 4
    if cfg.kv_cache_dtype != "auto":  # engine/modeling/kv_quant.py: rows of head_dim + 2 bytes
        block_bytes = cfg.block_size * 2 * mc.num_layers * kv_heads * (mc.head_dim + 2)
    if cfg.num_kv_blocks is not None:
        num_blocks, field = cfg.num_kv_blocks, "num_kv_blocks"
    else:
        wanted = cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)
        num_blocks, field = min(wanted, _DEFAULT_KV_BYTES // block_bytes), "max_model_len"
    if num_blocks * cfg.block_size < cfg.max_model_len:
        raise ConfigError(
            field,
            f"the KV pool ({num_blocks} blocks of {cfg.block_size} tokens) cannot hold one "
            f"sequence of max_model_len={cfg.max_model_len} tokens",
        )


def _ping_redis(url: str, timeout_s: float) -> None:
    import redis
    import redis.exceptions

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
    except (redis.exceptions.RedisError, OSError) as exc:
        # redis-py's messages name host and port, never the password
        raise ConfigError("redis_url", f"{redact_url(url)} does not answer: {exc}") from None
    finally:
        client.close()


__all__ = [
    "KVTLS",
    "MODEL_APP_PREFIX",
    "ROLES",
    "SECRET_FIELDS",
    "APIKeyDefaults",
    "ClusterConfig",
    "ConfigError",
    "DisaggPolicy",
    "Mode",
    "ModelSpec",
    "Placement",
    "PlacementWeights",
    "PlannerSettings",
    "PoolAutoscaling",
    "RouterIndex",
    "ToolCallParserName",
    "Transport",
    "app_slug",
    "expand_env",
    "model_app_name",
    "parse_cpu_set",
    "redact_url",
]
