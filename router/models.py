"""The router's served models: per model, what the request path needs of it.

A router replica serves one model (`ClusterConfig.model`) or several (`models`): each gets
a `ServedModel` holding its single-model configuration, its tokenizer and limits, and a
`RouterCore` of its own (its pools' handles, its part of the prefix index, namespaced by
the model id). A request's `model` field picks one; all share the replica's Redis client,
tracer and metrics registry (every request-level series labelled with the model).

Pools: with one model the Serve application binds them to the router (one application).
With several, each model's pools are an application of their own
(`pdserve-model-<slug>`, deploy/app.py), so that redeploying the cluster without a model,
or with a new one, leaves the other models' replicas untouched; the router then finds a
model's pools by name.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from opentelemetry.trace import Tracer

from pdserve.cluster.config import ClusterConfig, model_app_name
from pdserve.cluster.drain import DrainNotices
from pdserve.cluster.index_follower import PLACEMENT_SHORTLIST, IndexFollower
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.common.model_config import load_model_config
from pdserve.common.tokenizer import Tokenizer
from pdserve.router.core import PrefixMatcher, RouterCore
from pdserve.router.metrics import ModelMetrics, RouterMetrics
from pdserve.router.tool_calls import tool_format

PREFILL_DEPLOYMENT = "Prefill"
DECODE_DEPLOYMENT = "Decode"


class ServedModel:
    """One model a router replica serves."""

    def __init__(
        self,
        config: ClusterConfig,
        prefill: Any | None,
        decode: Any,
        redis: Any,
        tracer: Tracer | None,
        metrics: RouterMetrics,
    ) -> None:
        assert config.max_model_len is not None, "pass ClusterConfig.resolved()"
        assert config.model is not None
        self.config = config
        self.model_id = config.model_id
        self.max_model_len: int = config.max_model_len
        self.tokenizer = Tokenizer(Path(config.model))
        self.vocab_size = load_model_config(Path(config.model)).vocab_size
        self.index = prefix_matcher(config, redis, metrics.for_model(config.model_id))
        self.core = RouterCore(config, prefill, decode, self.index, tracer, metrics)
        self.drain_notices = DrainNotices(redis, config.model_id)  # router/departures.py
        self.drain_deadline_s = config.drain_deadline_s
        self.token_text: Callable[[int], str] = lru_cache(maxsize=65536)(self._decode_one)
        # the format tool_choice "auto" parses calls from; None: auto is a 400
        self.tool_format = tool_format(config.tool_call_parser, self.tokenizer.chat_template)

    def count_drain(self, role: str) -> None:
        self.core.metrics.drain_notices.labels(role).inc()

    def stop_index(self) -> None:
        """Stop following the prefix index's events (the replica stops)."""
        if isinstance(self.index, IndexFollower):
            self.index.stop()

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def card(self) -> dict[str, Any]:
        """Its entry in `GET /v1/models`."""
        return {
            "id": self.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": self.max_model_len,
        }


def prefix_matcher(config: ClusterConfig, redis: Any, metrics: ModelMetrics) -> PrefixMatcher:
    """The index a model's router matches prompts in: the Redis index itself, or a
    view of it in this process's memory (`router_index`, cluster/index_follower.py)."""
    index = PrefixIndex(
        redis, config.model_id, config.worker_lease_s, stream_len=config.index_events_len()
    )
    if config.router_index == "redis":
        return index
    return IndexFollower(
        index,
        refresh_s=config.heartbeat_s,
        shortlist=PLACEMENT_SHORTLIST,
        on_snapshot=lambda reason: metrics.index_snapshots.labels(reason).inc(),
        on_match=lambda source: metrics.index_matches.labels(source).inc(),
        on_lag=metrics.index_event_lag.observe,
    )


def pool_handles(config: ClusterConfig) -> tuple[Any | None, Any]:
    """A model's (prefill, decode) Serve handles, found by name in its own application
    (`detach`ed: each call a Serve request of its own).

    The handles are made without asking the controller whether the deployments exist:
    the router and the models' applications are deployed together and build in any
    order (a call waits until the pool has a replica).
    """
    from ray import serve

    from pdserve.router.serve_calls import detach

    app = model_app_name(config.model_id)
    decode = serve.get_deployment_handle(DECODE_DEPLOYMENT, app_name=app, _check_exists=False)
    prefill = None
    if config.mode == "disagg":
        prefill = serve.get_deployment_handle(PREFILL_DEPLOYMENT, app_name=app, _check_exists=False)
    # every call on a pool is a Serve request of its own (router/serve_calls.py)
    return None if prefill is None else detach(prefill), detach(decode)


def served_models(
    config: ClusterConfig,
    prefill: Any | None,
    decode: Any,
    redis: Any,
    tracer: Tracer | None,
    metrics: RouterMetrics,
) -> dict[str, ServedModel]:
    """Every model `config` serves, by id: with one model, on the bound `prefill` and
    `decode` handles; with several, on each model application's pools (`pool_handles`)."""
    if not config.models:
        return {config.model_id: ServedModel(config, prefill, decode, redis, tracer, metrics)}
    out = {}
    for cfg in config.model_configs():
        pools = pool_handles(cfg)
        out[cfg.model_id] = ServedModel(cfg, *pools, redis, tracer, metrics)
    return out
