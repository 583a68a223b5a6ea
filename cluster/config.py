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
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pdserve.cluster.model_routes import ModelRoute, route_problems
from pdserve.engine.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    AttentionBackendName,
    EngineConfig,
    KVCacheDtype,
    LoadFormat,
    Quantization,
)
from pdserve.engine.errors import EngineError
from pdserve.engine.model_config import ModelConfig, load_model_config, tensor_parallel_problems
from pdserve.engine.speculative import SpeculativeConfig, check_draft_checkpoint
from pdserve.kv_transfer.tls import TLSConfig

Mode = Literal["disagg", "colocated"]
Transport = Literal["grpc", "ucx"]
Placement = Literal["prefix-aware", "round-robin", "random"]
DisaggPolicy = Literal["conditional", "always"]
ToolCallParserName = Literal["auto", "hermes", "json", "none"]
ROLES = ("prefill", "decode")


def parse_cpu_set(text: str) -> set[int]:
    """ "0-2,5" -> {0, 1, 2, 5}; raises ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        lo, hi = int(first), int(last) if sep else int(first)
        if lo < 0 or hi < lo:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(lo, hi + 1))
    return cpus


class ConfigError(ValueError):
    """A configuration a cluster cannot start with; the message starts with the field."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`: safe to print or log."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Fields that may name environment variables (`${NAME}`) in a Serve config, so that a
# secret comes from a Kubernetes Secret instead of the RayService spec.
SECRET_FIELDS = ("redis_url", "cluster_token")


def expand_env(field: str, text: str) -> str:
    """Replace each `${NAME}` in `text` by the environment variable NAME (which must be set)."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise ConfigError(field, f"names the environment variable {name}, which is not set")
        return os.environ[name]

    return _ENV_REF.sub(value, text)


class KVTLS(BaseModel):
    """TLS for KV pushes (gRPC only). The PEM files must exist at these paths on every
    node: decode replicas present cert/key, prefill replicas trust `ca_file` and, with
    `mutual`, present cert/key too, which the decode side then requires."""

    model_config = ConfigDict(extra="forbid")

    cert_file: str
    key_file: str
    ca_file: str
    mutual: bool = False
    # The name the decode replicas' certificate holds, when it is not the address they
    # announce (with transfer_host "auto" each pod announces its own IP).
    server_name: str | None = None

    def transport(self) -> TLSConfig:
        return TLSConfig(
            cert_file=self.cert_file,
            key_file=self.key_file,
            ca_file=self.ca_file,
            require_client_auth=self.mutual,
            server_name=self.server_name,
        )


class PlacementWeights(BaseModel):
    """How the prefix-aware placement trades cached prefix against load (docs/architecture.md).

    Prefill cost, in tokens: tokens left to prefill on the worker + its queued prefill
    tokens. Decode cost: `running` x (running + in-flight sequences) + `kv_usage` x
    (percent of KV blocks in use) - `hit` x (prompt blocks it already holds).
    """

    model_config = ConfigDict(extra="forbid")

    running: float = Field(default=1.0, ge=0)
    kv_usage: float = Field(default=0.2, ge=0)
    hit: float = Field(default=0.5, ge=0)


class PoolAutoscaling(BaseModel):
    """Ray Serve autoscaling of one pool (`deploy/autoscaling.py` holds the policies).

    `target` is queued prefill tokens per replica for the prefill pool, and running
    sequences per replica for the decode pool (which also keeps KV usage under
    `target_kv_usage`). Delays and bounds are Serve's own settings.
    """

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int = Field(default=4, ge=1)
    target: float = Field(default=2048.0, gt=0)
    target_kv_usage: float = Field(default=0.7, gt=0, le=1)
    upscale_delay_s: float = Field(default=10.0, ge=0)
    downscale_delay_s: float = Field(default=60.0, ge=0)
    look_back_period_s: float = Field(default=10.0, gt=0)
    metrics_interval_s: float = Field(default=2.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> PoolAutoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError("max_replicas must be >= min_replicas")
        return self


class APIKeyDefaults(BaseModel):
    """What a request made with one API key gets unless it says otherwise.

    `priority`: the request's scheduling and shedding priority when it sends none
    (larger is more important). `cache_salt`: the tenant's prefix-cache namespace when the
    request sends none: keys with different salts never share a KV block.
    """

    model_config = ConfigDict(extra="forbid")

    priority: int = Field(default=0, ge=-1000, le=1000)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class ModelSpec(BaseModel):
    """One model of a cluster that serves several (`ClusterConfig.models`).

    Each field set here replaces the cluster-wide one for this model's pools; a field left
    out (None) keeps the cluster's value. Everything else (Redis, transport, leases, the
    router's limits, API keys) is the cluster's, shared by every model.
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="HF model folder, readable on every node")
    served_model_name: str | None = None
    tool_call_parser: ToolCallParserName | None = None
    mode: Mode | None = None
    prefill_replicas: int | None = Field(default=None, ge=0)
    decode_replicas: int | None = Field(default=None, ge=1)
    prefill_tp: int | None = Field(default=None, ge=1)
    decode_tp: int | None = Field(default=None, ge=1)
    prefill_autoscaling: PoolAutoscaling | None = None
    decode_autoscaling: PoolAutoscaling | None = None
    prefill_cpus: str | None = None
    decode_cpus: str | None = None
    prefill_resources: dict[str, float] | None = None
    decode_resources: dict[str, float] | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    load_format: LoadFormat | None = None
    quantization: Quantization | None = None
    kv_cache_dtype: KVCacheDtype | None = None
    speculative: str | None = None
    block_size: int | None = Field(default=None, ge=1, le=1024)
    max_model_len: int | None = Field(default=None, ge=2)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=1)


def app_slug(model_id: str) -> str:
    """The part of a model's Serve application name (`pdserve-model-<slug>`) its id gives:
    letters, digits, `_` and `-`, anything else as `-`."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", model_id).strip("-") or "model"


MODEL_APP_PREFIX = "pdserve-model-"


def model_app_name(model_id: str) -> str:
    """The Serve application that runs a model's pools when a cluster serves several."""
    return MODEL_APP_PREFIX + app_slug(model_id)


def _default_kv_wait_timeout_s(data: dict[str, Any]) -> float:
    """The KV wait of a request whose queue is at the shedding bound (ClusterConfig)."""
    at_bound = data.get("kv_wait_factor", 2.0) * data.get("max_prefill_queue_s", 4.0)
    return max(10.0, at_bound + data.get("kv_wait_floor_s", 2.0))


def _default_first_token_timeout_s(data: dict[str, Any]) -> float:
    return max(120.0, 2.0 * data.get("kv_wait_timeout_s", 10.0))


class ClusterConfig(BaseModel):
    """Everything a router, prefill or decode replica needs to know about the cluster."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(
        default=None, description="HF model folder, readable on every node (or `models`)"
    )
    # Several models behind one router (docs/architecture.md, "Several models"): each
    # entry overrides the per-model fields above and below; `model` is then unset.
    models: list[ModelSpec] = Field(default_factory=list)
    served_model_name: str | None = Field(
        default=None, description="the model id clients send (default: the folder name)"
    )
    # How `tool_choice: "auto"` finds calls in the model's output (router/tool_calls.py):
    # "hermes" (JSON in <tool_call> tags: Qwen 2.5, Hermes), "json" (a JSON object:
    # Llama 3.x), "none" (auto is a 400; required and named functions still work), or
    # "auto": from the chat template (<tool_call> -> hermes, <|python_tag|> -> json).
    tool_call_parser: ToolCallParserName = "auto"
    # Routed model names (cluster/model_routes.py): a name clients send, mapped by the
    # operator's rules (prompt length, max_tokens, header, metadata tag, canary share) to
    # one of the served models.
    routes: list[ModelRoute] = Field(default_factory=list)
    mode: Mode = "disagg"
    transport: Transport = "grpc"
    placement: Placement = "prefix-aware"
    weights: PlacementWeights = Field(default_factory=PlacementWeights)
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
    disagg_policy: DisaggPolicy = "conditional"
    local_prefill_max_tokens: int = Field(default=32, ge=0)
    local_prefill_max_running: int = Field(default=0, ge=0)
    local_prefill_interference: float = Field(default=0.05, ge=0)
    # Admission: past this many seconds of queued prefill work on every option, a
    # request gets 429 with Retry-After. The decode worker waits for a request's KV
    # kv_wait_factor x the estimated prefill time + kv_wait_floor_s, at most
    # kv_wait_timeout_s, whose default is that wait for a queue at the bound (2 x 4 s +
    # 2 s = 10 s with the defaults; raising the bound raises it): KV admitted at the bound
    # is not expected late. The floor absorbs call latencies and scheduling jitter that no
    # estimate of compute sees.
    max_prefill_queue_s: float = Field(default=4.0, gt=0)
    # Conditional disaggregation spills a prompt to its decode worker once the prefill
    # worker's queue is past this (reason prefill_saturated), at most max_prefill_queue_s:
    # raising the shedding bound to queue more does not leave the decode workers idle
    # while the prefill pool's queue grows.
    prefill_spill_queue_s: float = Field(default=4.0, gt=0)
    kv_wait_factor: float = Field(default=2.0, ge=1)
    kv_wait_floor_s: float = Field(default=2.0, ge=0)

    prefill_replicas: int = Field(default=1, ge=0)
    decode_replicas: int = Field(default=1, ge=1)
    router_replicas: int = Field(default=1, ge=1)
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
    prefill_autoscaling: PoolAutoscaling | None = None
    decode_autoscaling: PoolAutoscaling | None = None
    replica_num_cpus: float = Field(default=1.0, ge=0)
    # Linux CPU sets ("0", "0-3", "0,2") a pool's replicas are pinned to, so that on a
    # shared host prefill and decode never steal each other's cores (benchmarks).
    prefill_cpus: str | None = None
    decode_cpus: str | None = None
    replica_num_gpus: float = Field(default=0.0, ge=0)
    # Node pools: Ray custom resources each replica of a pool asks for, so that its
    # replicas land only on nodes started with them (`ray start --resources
    # '{"prefill_pool": 8}'`): prefill on compute-sized nodes, decode on bandwidth-sized
    # ones, routers next to the load balancer. Empty: any node.
    prefill_resources: dict[str, float] = Field(default_factory=dict)
    decode_resources: dict[str, float] = Field(default_factory=dict)
    router_resources: dict[str, float] = Field(default_factory=dict)

    # redis://[:PASSWORD@]HOST:PORT/DB (a password is never printed; see redact_url).
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", repr=False)
    # Address the KV receivers bind and announce: "auto" is each decode node's own
    # address as Ray knows it (multi-node clusters); never all interfaces by default.
    transfer_host: str = "127.0.0.1"
    cluster_token: str = Field(default_factory=lambda: secrets.token_hex(16), repr=False)
    # TLS on the KV pushes (gRPC transport); None: plaintext, for one trusted host or a
    # private network (the cluster token still authenticates each push).
    kv_tls: KVTLS | None = None

    # Engine (both roles).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    # "dummy": random weights of config.json's shape, no weight file read (benchmarks).
    load_format: LoadFormat = "auto"
    # "int8": the blocks' projections as int8 with a scale per row, in both roles
    # (EngineConfig.quantization); the embedding, LM head and norms stay in dtype.
    quantization: Quantization = "none"
    # Both pools' KV cache format (EngineConfig.kv_cache_dtype): "auto" (the model's dtype),
    # "int8" or "fp8" (8 bits per value and a bf16 scale per token and KV head: half the
    # bytes per decode step and per handoff). One setting for the cluster: blocks cross only
    # between workers of one format, and the prefix index refuses a worker of another.
    kv_cache_dtype: KVCacheDtype = "auto"
    # Both pools' attention backend (EngineConfig.attention_backend). "triton" on CPU runs
    # every Triton kernel of the engine (the KV pack/unpack of each handoff included) in
    # Triton's interpreter: only with TRITON_INTERPRET=1 in the replicas' environment.
    attention_backend: AttentionBackendName = "auto"
    # The decode pool speculates (EngineConfig.speculative, engine/speculative.py):
    # "ngram:k=K[,n=N][,adaptive=on|off]", prompt lookup, or "draft:PATH[,k=K][,...]",
    # a draft model's folder (as `model`, a path on the workers; preflight checks it
    # here). The prefill pool samples one token per request, so it has nothing to
    # speculate; in colocated mode the one pool (the decode deployment) does.
    speculative: str | None = None
    num_threads: int = Field(default=1, ge=1, description="torch threads per replica")
    block_size: int = Field(default=16, ge=1, le=1024)
    max_model_len: int | None = Field(default=None, ge=2)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    # CUDA, without num_kv_blocks: the fraction of its GPU's memory each worker replica
    # may use, the KV pool taking what the model leaves (EngineConfig). None: 0.9, times
    # replica_num_gpus when that is a fraction (replicas sharing a GPU split it).
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    # CUDA only: every step eagerly, no decode CUDA graphs (EngineConfig.enforce_eager).
    enforce_eager: bool = False
    # CUDA only: pinned host memory (MiB) prefill workers stage exported KV in before
    # sending (EngineConfig.kv_staging_mb); a larger payload gets a one-off allocation.
    kv_staging_mb: int = Field(default=256, ge=0)
    # A step that has decode rows takes only the prefill tokens that keep its measured
    # cost within this (EngineConfig.tpot_target_ms). 100 ms: a GPU step stays far below
    # it, so it binds only where a prompt really would stall the streams (CPU).
    tpot_target_ms: float | None = Field(default=100.0, gt=0)
    # ...until a request has waited this long to be admitted: then steps take the whole
    # token budget until none has (EngineConfig.prefill_wait_limit_ms). Without it,
    # prompts arriving faster than capped steps prefill them queue without bound.
    prefill_wait_limit_ms: float | None = Field(default=500.0, gt=0)
    # While a decode worker streams more than this many requests, each stream's tokens
    # after the first go out two per message: one waits (at most one step) for the next.
    # Messages are what the router, the proxy and Serve's streams pay for; TPOT does not
    # change, an inter-token gap can grow by one step. None: one message per step.
    stream_hold_above: int | None = Field(default=16, ge=0)
    seed: int = 0

    # Router limits. api_keys: if any, every /v1 and /workers call needs
    # "Authorization: Bearer KEY" (401 otherwise). Past max_inflight_requests streams
    # per router replica, new requests get 429 with Retry-After.
    api_keys: list[str] = Field(default_factory=list, repr=False)
    # Per-key defaults (priority, cache_salt), keyed by the API key itself (each must be
    # one of api_keys); from `KEY priority=N cache_salt=S` lines of --api-keys-file.
    api_key_defaults: dict[str, APIKeyDefaults] = Field(default_factory=dict, repr=False)
    max_inflight_requests: int = Field(default=1024, ge=1)
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    # The result cache (router/result_cache.py): fully determined requests' outputs
    # (greedy or seeded) kept in the cluster's Redis for this long; None: off. At most
    # result_cache_max_entries entries (the oldest go first), each at most
    # result_cache_max_entry_bytes (a larger result is not stored).
    result_cache_ttl_s: float | None = Field(default=None, gt=0)
    result_cache_max_entries: int = Field(default=10_000, ge=1)
    result_cache_max_entry_bytes: int = Field(default=1 << 20, ge=1024)
    # Shedding by priority (router/priority.py): this fraction of max_inflight_requests
    # and of max_prefill_queue_s is kept for requests of priority >= priority_reserved_min;
    # lower ones are shed once the load passes the rest, so an important request is never
    # shed while a less important one is admitted. 0: one limit for every priority.
    priority_headroom: float = Field(default=0.0, ge=0, lt=1)
    priority_reserved_min: int = Field(default=1, ge=-1000, le=1000)

    # Leases and deadlines (docs/kv-handoff.md).
    worker_lease_s: float = Field(default=10.0, gt=0)
    heartbeat_s: float = Field(default=1.0, gt=0)
    # Unset, the KV wait for a queue at max_prefill_queue_s (at least 10 s), and a first
    # token deadline of twice that (at least 120 s): a request admitted at the bound whose
    # KV still came late is then prefilled by its decode worker, about as long again.
    kv_wait_timeout_s: float = Field(default_factory=_default_kv_wait_timeout_s, gt=0)
    transfer_timeout_s: float = Field(default=30.0, gt=0)
    first_token_timeout_s: float = Field(default_factory=_default_first_token_timeout_s, gt=0)
    max_resumes: int = Field(default=2, ge=0, description="decode failures one stream survives")
    stall_timeout_s: float = Field(default=120.0, gt=0)
    # How long running streams may go on once the cluster stops (pdserve up's SIGINT or
    # SIGTERM, `serve run`'s Ctrl-C, `serve shutdown`): then each ends with an error event
    # and the replicas stop. Within Kubernetes' default 30 s termination grace.
    shutdown_grace_s: float = Field(default=10.0, ge=0, le=600)

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
        try:
            for role in self.roles():  # the engine's own rules (block_size a power of two, ...)
                self.engine_config(role)
        except ValidationError as exc:
            why = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            named = [f for f in ClusterConfig.model_fields if re.search(rf"\b{f}\b", why)]
            raise ConfigError(named[0] if named else "engine", why) from None
        return self

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

    def pool_resources(self, role: str) -> dict[str, float]:
        """The Ray custom resources each replica (and each rank) of the `role` pool asks for."""
        self.tp(role)  # checks the role
        return dict(self.prefill_resources if role == "prefill" else self.decode_resources)

    def rank_bundle(self, role: str) -> dict[str, float]:
        """The placement-group bundle of one rank of a `role` replica (TP > 1): the Ray
        resources a replica asks for without TP, zero-valued ones left out. Bundle 0 holds
        the Serve replica itself (rank 0), bundle r rank r (cluster/tp_ranks.py)."""
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
            from pdserve.engine.tokenizer import Tokenizer

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
            num_threads=self.num_threads,
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
            tpot_target_ms=self.tpot_target_ms,
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
    if cfg.kv_cache_dtype != "auto":  # engine/kv_quant.py: rows of head_dim + 2 bytes
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
