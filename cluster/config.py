"""The cluster's configuration: one validated object that every deployment receives.

`pdserve up` builds it from its flags; a Ray Serve config file passes the same fields as
the application's arguments (`deploy/app.py`). Plain Python: no torch.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_config import load_model_config

Mode = Literal["disagg", "colocated"]
Transport = Literal["grpc", "ucx"]
Placement = Literal["prefix-aware", "round-robin", "random"]


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


class ClusterConfig(BaseModel):
    """Everything a router, prefill or decode replica needs to know about the cluster."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="HF model folder, readable on every node")
    served_model_name: str | None = Field(
        default=None, description="the model id clients send (default: the folder name)"
    )
    mode: Mode = "disagg"
    transport: Transport = "grpc"
    placement: Placement = "prefix-aware"
    weights: PlacementWeights = Field(default_factory=PlacementWeights)

    prefill_replicas: int = Field(default=1, ge=0)
    decode_replicas: int = Field(default=1, ge=1)
    router_replicas: int = Field(default=1, ge=1)
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

    redis_url: str = "redis://127.0.0.1:6379/0"
    # Address the KV receivers bind and announce: "auto" is each decode node's own
    # address as Ray knows it (multi-node clusters); never all interfaces by default.
    transfer_host: str = "127.0.0.1"
    cluster_token: str = Field(default_factory=lambda: secrets.token_hex(16), repr=False)

    # Engine (both roles).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    num_threads: int = Field(default=1, ge=1, description="torch threads per replica")
    block_size: int = Field(default=16, ge=1, le=1024)
    max_model_len: int | None = Field(default=None, ge=2)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    seed: int = 0

    # Router limits. api_keys: if any, every /v1 and /workers call needs
    # "Authorization: Bearer KEY" (401 otherwise). Past max_inflight_requests streams
    # per router replica, new requests get 429 with Retry-After.
    api_keys: list[str] = Field(default_factory=list, repr=False)
    max_inflight_requests: int = Field(default=1024, ge=1)
    max_body_bytes: int = Field(default=4 << 20, ge=1024)

    # Leases and deadlines (docs/kv-handoff.md).
    worker_lease_s: float = Field(default=10.0, gt=0)
    heartbeat_s: float = Field(default=1.0, gt=0)
    kv_wait_timeout_s: float = Field(default=10.0, gt=0)
    transfer_timeout_s: float = Field(default=30.0, gt=0)
    first_token_timeout_s: float = Field(default=120.0, gt=0)
    max_resumes: int = Field(default=2, ge=0, description="decode failures one stream survives")
    stall_timeout_s: float = Field(default=120.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        for cpus in (self.prefill_cpus, self.decode_cpus):
            if cpus is not None:
                parse_cpu_set(cpus)
        if self.mode == "disagg" and self.prefill_replicas < 1:
            raise ValueError("disagg mode needs at least one prefill replica")
        if self.heartbeat_s >= self.worker_lease_s:
            raise ValueError("heartbeat_s must be shorter than worker_lease_s")
        return self

    @property
    def model_id(self) -> str:
        return self.served_model_name or Path(self.model).name

    def resolved(self) -> ClusterConfig:
        """A copy with max_model_len filled in from the checkpoint (all roles must agree)."""
        if self.max_model_len is not None:
            return self
        mc = load_model_config(Path(self.model))
        max_len = mc.max_position_embeddings
        if mc.sliding_window is not None:
            max_len = min(max_len, mc.sliding_window)
        return self.model_copy(update={"max_model_len": max_len})

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_id=self.model_id,
            dtype=self.dtype,
            device=self.device,
            num_threads=self.num_threads,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            seed=self.seed,
        )
