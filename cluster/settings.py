"""The pieces of the cluster's configuration (cluster/config.py): its small settings
models, its names and literal types, and the helpers that read them. Plain Python.
"""

from __future__ import annotations

import os
import re
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.common.engine_config import DType, KVCacheDtype, LoadFormat, Quantization, engine_field
from pdserve.kv_transfer.tls import TLSConfig

Mode = Literal["disagg", "colocated"]
Transport = Literal["grpc", "ucx"]
Placement = Literal["prefix-aware", "round-robin", "random"]
RouterIndex = Literal["memory", "redis"]
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
    A request of a LoRA adapter the worker does not hold resident costs `lora_load` more
    on a decode worker (in running sequences) and `lora_load_tokens` more on a prefill
    worker, twice that where every adapter slot serves running requests (the load waits
    for one to finish); 0 ignores adapters.
    """

    model_config = ConfigDict(extra="forbid")

    running: float = Field(default=1.0, ge=0)
    kv_usage: float = Field(default=0.2, ge=0)
    hit: float = Field(default=0.5, ge=0)
    lora_load: float = Field(default=8.0, ge=0)
    lora_load_tokens: float = Field(default=512.0, ge=0)


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


class PlannerSettings(BaseModel):
    """How the planner sizes the pools once SLO targets are set (router/planner.py).

    Each pool between its `*_min` and `*_max` replicas, both together within `budget`
    (None: no budget). Every `interval_s` the leading router plans for the request rate
    forecast `horizon_s` ahead, meeting the targets within `headroom` of them; a pool
    shrinks only once `hold_s` of plans all wanted it smaller.
    """

    model_config = ConfigDict(extra="forbid")

    prefill_min: int = Field(default=1, ge=1)
    prefill_max: int = Field(default=4, ge=1)
    decode_min: int = Field(default=1, ge=1)
    decode_max: int = Field(default=4, ge=1)
    budget: int | None = Field(default=None, ge=1)
    interval_s: float = Field(default=5.0, gt=0)
    headroom: float = Field(default=0.8, gt=0, le=1)
    hold_s: float = Field(default=60.0, ge=0)
    horizon_s: float = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> PlannerSettings:
        if self.prefill_max < self.prefill_min or self.decode_max < self.decode_min:
            raise ValueError("each pool's max must be >= its min")
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
    # EngineConfig's settings, as it declares them (None: the cluster's)
    dtype: DType | None = engine_field("dtype", default=None)
    load_format: LoadFormat | None = engine_field("load_format", default=None)
    quantization: Quantization | None = engine_field("quantization", default=None)
    kv_cache_dtype: KVCacheDtype | None = engine_field("kv_cache_dtype", default=None)
    speculative: str | None = engine_field("speculative", default=None)
    block_size: int | None = engine_field("block_size", default=None)
    max_model_len: int | None = engine_field("max_model_len", default=None)
    num_kv_blocks: int | None = engine_field("num_kv_blocks", default=None)
    gpu_memory_utilization: float | None = engine_field("gpu_memory_utilization", default=None)
    max_num_seqs: int | None = engine_field("max_num_seqs", default=None)
    max_num_batched_tokens: int | None = engine_field("max_num_batched_tokens", default=None)


def app_slug(model_id: str) -> str:
    """The part of a model's Serve application name (`pdserve-model-<slug>`) its id gives:
    letters, digits, `_` and `-`, anything else as `-`."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", model_id).strip("-") or "model"


MODEL_APP_PREFIX = "pdserve-model-"


def model_app_name(model_id: str) -> str:
    """The Serve application that runs a model's pools when a cluster serves several."""
    return MODEL_APP_PREFIX + app_slug(model_id)
