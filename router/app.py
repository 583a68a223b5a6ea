"""The router: Ray Serve ingress on FastAPI, serving the OpenAI API.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with SSE streaming
ending in `data: [DONE]`, and `stream_options.include_usage`), `GET /v1/models`,
`GET /health`, `GET /metrics`. The router tokenizes (the model's chat template for chat),
validates limits, then hands the token ids to `RouterCore`; workers never re-tokenize.
Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for bad
input, 404 for an unknown model, 503 when no worker could serve the request.

Extensions beyond OpenAI's schema: `top_k`, `ignore_eos`, `stop_token_ids`,
`return_token_ids` (each choice then carries `token_ids`, the response `prompt_token_ids`),
and `priority` (larger is more important; shed and scheduled by it, see priority.py).
"""

# NOTE: no `from __future__ import annotations` here: FastAPI must see `Request` as a
# class, not a string, in methods that Ray Serve's ingress re-binds.
import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from pydantic import BaseModel
from ray import serve
from redis.exceptions import RedisError

from pdserve.cluster import stop_notice, tracing
from pdserve.cluster.config import APIKeyDefaults, ClusterConfig, model_app_name
from pdserve.cluster.messages import ClientItem
from pdserve.cluster.prefix_index import WorkerInfo
from pdserve.cluster.scheduling import SchedulingWatch, cluster_asks, read_cluster
from pdserve.common.errors import InvalidRequestError
from pdserve.common.sampling_params import SamplingParams
from pdserve.router import departures
from pdserve.router.adapters import Adapters
from pdserve.router.core import Overloaded, RouterCore, ShuttingDown, UpstreamError
from pdserve.router.draining import Drain, serve_app_status
from pdserve.router.metrics import CONTENT_TYPE, RouterMetrics
from pdserve.router.model_routing import RULE_HEADER, ModelRouter, Picked, RouteFacts
from pdserve.router.models import (
    DECODE_DEPLOYMENT,
    PREFILL_DEPLOYMENT,
    ServedModel,
    served_models,
)
from pdserve.router.planner_loop import PlannerLoop
from pdserve.router.planner_loop import read_state as read_planner_state
from pdserve.router.prefix_cache import with_default_salt
from pdserve.router.priority import inflight_limit
from pdserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ProtocolError,
    UnloadLoRAAdapterRequest,
    check_model,
    parse_request,
    requested_max_tokens,
    to_sampling_params,
)
from pdserve.router.result_cache import HEADER as RESULT_CACHE_HEADER
from pdserve.router.result_cache import CachePlan, ResultCache
from pdserve.router.scaler import set_replicas_async
from pdserve.router.serve_calls import detach
from pdserve.router.tool_calls import (
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolMode,
    parse_tool_calls,
)

logger = logging.getLogger(__name__)

api = FastAPI(
    title="pdserve",
    description="OpenAI-compatible API of a disaggregated prefill/decode cluster",
    version="0.1.0",
)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/load_lora_adapter": LoadLoRAAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest,
}


def _openapi() -> dict[str, Any]:
    """The OpenAPI schema, with the request bodies the handlers parse themselves.

    The handlers read the raw body (to bound its size and to answer bad JSON with
    OpenAI's error body), so FastAPI cannot infer it: the models are added here.
    """
    if api.openapi_schema is None:
        schema = get_openapi(
            title=api.title, version=api.version, description=api.description, routes=api.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in _BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref}},
            }
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = _openapi  # type: ignore[method-assign]


def _error(exc: ProtocolError, retry_after_s: int = 1) -> JSONResponse:
    retry = exc.status_code == 429 or exc.code == ShuttingDown.code
    headers = {"Retry-After": str(retry_after_s)} if retry else None
    if exc.status_code == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)


def _upstream_error_body(exc: Exception) -> dict[str, Any]:
    refused = getattr(exc, "status_code", 503) == 400  # core.Refused
    return {
        "error": {
            "message": str(exc),
            "type": "invalid_request_error" if refused else "service_unavailable",
            "param": None,
            "code": getattr(exc, "code", "upstream_unavailable"),
        }
    }


def _shutting_down(reason: str) -> ProtocolError:
    return ProtocolError(reason, status_code=503, code=ShuttingDown.code)


_STOPPING = "the server is shutting down"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _SlotStreamingResponse(StreamingResponse):
    """A streaming response that releases its request's in-flight slot when sent.

    Starlette always calls the response it is handed, even for a client that has gone
    away; a generator that never started would never run its own `finally`.
    """

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], **kw: Any):
        super().__init__(content, **kw)
        self._release_slot = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release_slot()


_NO_DEFAULTS = APIKeyDefaults()


class _Request:
    """One validated request on its way through the router."""

    def __init__(
        self,
        kind: str,
        req: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_s: float,
    ) -> None:
        self.kind = kind  # "completion" or "chat"
        self.req = req
        self.prompt_ids = prompt_ids
        self.params = params
        self.arrival_s = arrival_s
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.span: Span | None = None  # the request's span when tracing is on
        self.key_defaults = _NO_DEFAULTS  # its API key's defaults (priority, cache_salt)
        self.served: ServedModel  # the model its `model` field named (set on parsing)
        self.route: Picked | None = None  # the route rule that picked it, if one did
        self.cache: CachePlan | None = None  # the result cache's plan (when it is on)
        self.cached_tokens = 0  # prompt tokens a prefix cache served (router/prefix_cache.py)
        # how its output holds tool calls (router/tool_calls.py); None: plain content
        self.tool_mode: ToolMode | None = None
        self.tool_name: str | None = None  # the function a "named" tool_choice forces


def _hit(r: _Request) -> bool:
    return r.cache is not None and r.cache.hit


def _tool_finish(r: _Request, finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the model stopped after calling (auto,
    required); a named function's forced call stays "stop", as OpenAI returns it."""
    if called and finish_reason == "stop" and r.tool_mode != "named":
        return "tool_calls"
    return finish_reason


def _tool_delta(parser: ToolCallParser, text: str, finish_reason: str | None) -> dict[str, Any]:
    """The streamed delta of a choice whose output may hold calls: its content text and
    call pieces from `text` (everything held back flushed when the choice finishes)."""
    parsed = parser.feed(text)
    content, calls = parsed.content, list(parsed.calls)
    if finish_reason is not None:
        tail = parser.finish()
        content, calls = content + tail.content, calls + tail.calls
    delta: dict[str, Any] = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [_call_delta_json(call) for call in calls]
    return delta


def _call_json(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


def _call_delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    """A streamed call piece, as OpenAI streams it: id, type and name on a call's first
    piece, then `arguments` fragments, all keyed by the call's `index`."""
    entry: dict[str, Any] = {"index": delta.index}
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.id is not None:
        entry |= {"id": delta.id, "type": "function"}
    if delta.name is not None:
        function = {"name": delta.name, **function}
    return {**entry, "function": function}


UNSCHEDULED_CHECK_S = 5.0  # /health reads Ray's scheduler state at most this often
POOL_HEALTH_TIMEOUT_S = 2.0  # per pool, when /health must ask the pools directly
READ_TURN_TIMEOUT_S = 1.0  # the longest a request waits for its turn to read its body


async def pools_health(core: RouterCore, index_error: str) -> JSONResponse:
    """/health without the index: 200 "degraded" if one replica of every pool answers
    `load` within POOL_HEALTH_TIMEOUT_S, else 503 naming the pools that did not."""
    pools = {"decode": core.decode, "prefill": core.prefill}

    async def answers(role: str, handle: Any) -> bool:
        try:
            await asyncio.wait_for(handle.load.remote(), POOL_HEALTH_TIMEOUT_S)
            return True
        except Exception as exc:  # no replica, a dead one, or too slow: not serving
            logger.debug("health: the %s pool did not answer (%r)", role, exc)
            return False

    # both pools at once: each call is a Serve request of its own (router/serve_calls.py)
    asked = {role: handle for role, handle in pools.items() if handle is not None}
    results = await asyncio.gather(*(answers(role, h) for role, h in asked.items()))
    answered = dict(zip(asked, results, strict=True))
    ok = all(answered.values())
    body = {
        "status": "degraded" if ok else "unavailable",
        "mode": core.config.mode,
        "index": index_error,
        "pools": {role: "ok" if up else "no answer" for role, up in answered.items()},
    }
    return JSONResponse(body, status_code=200 if ok else 503)


@serve.deployment(name="Router")
@serve.ingress(api)
class Router:
    """The HTTP ingress; any number of replicas (state lives in Redis and the workers)."""

    def __init__(self, config: dict[str, Any], prefill: Any | None, decode: Any) -> None:
        # The cluster's configuration: one model, or several (`models`; then `prefill` and
        # `decode` are None and each model's pools are found by name, router/models.py).
        # Its cluster-wide fields (limits, keys, Redis) are the router's; each model's own
        # configuration is `r.served.config`.
        self.config = cfg = ClusterConfig.model_validate(config)
        self.redis = aioredis.Redis.from_url(
            cfg.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        self.tracer = tracing.tracer("router")  # None unless OTEL_* variables ask for it
        self.router_metrics = RouterMetrics()
        # every call on a pool is a Serve request of its own (router/serve_calls.py)
        prefill = None if prefill is None else detach(prefill)
        decode = None if decode is None else detach(decode)
        self.by_model = served_models(
            cfg, prefill, decode, self.redis, self.tracer, self.router_metrics
        )
        # LoRA adapter name -> the served model it runs on (docs/lora.md)
        routed = [route.name for route in cfg.routes]
        self.adapters = Adapters(self.by_model, self.redis, [*self.by_model, *routed])
        self._api_keys = [key.encode() for key in cfg.api_keys]
        self._key_defaults = {k.encode(): v for k, v in cfg.api_key_defaults.items()}
        self._inflight = 0  # requests admitted and not yet finished, this replica
        self.model_router = ModelRouter(cfg.routes)
        for route in cfg.routes:  # every rule's series shows, at 0 until it is taken
            for rule in route.rules:
                self.router_metrics.route_decisions.labels(route.name, rule.name, rule.model)
            self.router_metrics.route_decisions.labels(route.name, "default", route.default)
        # bodies read at once (a bound on their memory), before a request takes a slot
        self._reading = asyncio.Semaphore(cfg.max_inflight_requests)
        self.router_metrics.inflight.set_function(lambda: self._inflight)
        # one result cache per model: each keys on its own model's identity
        self.result_caches = {
            model_id: ResultCache.from_config(served.config, self.redis, served.core.metrics)
            for model_id, served in self.by_model.items()
        }
        # what counts a request rejected before its model is known: the one model's
        # series, or (several models) the series labelled model=""
        only = next(iter(self.by_model.values())) if len(self.by_model) == 1 else None
        self._unrouted = (
            only.core.metrics if only is not None else self.router_metrics.for_model("")
        )
        # replicas Ray cannot place, for /health (cluster/scheduling.py): read at most
        # every UNSCHEDULED_CHECK_S, once this replica knows its application's name
        self._scheduling: SchedulingWatch | None = None
        self._unscheduled: list[dict[str, Any]] = []
        self._unscheduled_at = -UNSCHEDULED_CHECK_S
        # the cluster's stop, seen from here (draining.py): its application being deleted
        self.drain = Drain(
            cfg.shutdown_grace_s,
            on_expire=self._end_streams,
            app_status=self._app_status,
            inflight=lambda: self._inflight,
            on_drained=self._say_drained,
            notices=lambda on_notice: stop_notice.listen(self.redis, cfg.cluster_token, on_notice),
        )
        self._background: set[asyncio.Task[None]] = set()
        self._departures: asyncio.Task[None] | None = None  # router/departures.py
        self._planners: list[asyncio.Task[None]] = []  # router/planner_loop.py
        with contextlib.suppress(RuntimeError):  # no loop yet: started by the first call
            self._watch()

    def _watch(self) -> None:
        """Start what watches the cluster (once there is a loop): the stop, and workers
        leaving their pools."""
        self.drain.watch()
        loop = asyncio.get_running_loop()
        if self._departures is None or self._departures.done():
            single = not self.config.models
            self._departures = loop.create_task(departures.run(lambda: self.by_model, single))
        if not self._planners:
            self._planners = [
                loop.create_task(self._planner(served).run())
                for served in self.by_model.values()
                if served.config.planner_enabled
            ]

    def _planner(self, served: ServedModel) -> PlannerLoop:
        """The model's planner (router/planner_loop.py): every router runs one, the one
        holding its lease decides."""
        single = not self.config.models
        try:
            context = serve.get_replica_context()
            router_id, app = context.replica_id.unique_id, context.app_name
        except Exception:  # not a Serve replica (unit tests): never scales
            router_id, app = f"router-{uuid.uuid4().hex[:8]}", ""
        app = app if single else model_app_name(served.model_id)
        deployments = {"prefill": PREFILL_DEPLOYMENT, "decode": DECODE_DEPLOYMENT}

        async def scale(pool: str, n: int) -> None:
            await set_replicas_async(app, deployments[pool], n)

        return PlannerLoop(
            served.config,
            served.core.traffic,
            self.redis,
            router_id,
            served.core.live_workers,
            scale,
            served.core.metrics,
        )

    async def _app_status(self) -> str | None:
        try:
            app_name = serve.get_replica_context().app_name
        except Exception:  # not a Serve replica (unit tests): never stopped by Serve
            return None
        return await serve_app_status(app_name)

    async def unscheduled(self) -> list[dict[str, Any]]:
        """Deployments with replicas that no node can hold (cluster/scheduling.py)."""
        if time.monotonic() - self._unscheduled_at < UNSCHEDULED_CHECK_S:
            return self._unscheduled
        self._unscheduled_at = time.monotonic()
        try:
            if self._scheduling is None:
                app = serve.get_replica_context().app_name
                self._scheduling = SchedulingWatch(cluster_asks(self.config, app))
            view = await asyncio.to_thread(read_cluster, self._scheduling.apps)
            self._unscheduled = [u.as_json() for u in self._scheduling.check(view)]
        except Exception as exc:  # not in Serve (unit tests), or the GCS slow: none known
            logger.debug("scheduling check failed: %r", exc)
        return self._unscheduled

    def _say_drained(self) -> None:
        """No request left while draining: tell `pdserve up` (cluster/stop_notice.py)."""
        try:
            router_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # not a Serve replica (unit tests)
            router_id = f"router-{id(self)}"

        async def say() -> None:
            try:
                await stop_notice.mark_drained(self.redis, self.config.cluster_token, router_id)
            except (RedisError, OSError, TimeoutError) as exc:  # its stop goes on regardless
                logger.warning("could not report the drain done: %r", exc)

        task = asyncio.get_running_loop().create_task(say())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _end_streams(self) -> None:
        """The grace is over: every request in flight ends with an error (draining.py)."""
        for served in self.by_model.values():
            served.core.stop(f"{_STOPPING}: the request did not finish within its grace")

    def _served(self, model: str) -> ServedModel:
        """The served model a request names, directly or by one of its LoRA adapters
        (404 for any other)."""
        base = self.adapters.get(model)
        if base is not None:
            return self.by_model[base]
        check_model(model, [*self.by_model, *(name for name, _ in self.adapters.items())])
        return self.by_model[model]

    def _with_adapter(self, model: str, params: SamplingParams) -> SamplingParams:
        """A request naming a LoRA adapter runs its base model with that adapter."""
        if model not in self.adapters:
            return params
        return dataclasses.replace(params, lora=model)

    def __del__(self) -> None:
        """Serve stops the replica (no request left): close the decode channels, which
        the decode replicas' own stop waits for, stop following the prefix index's
        events, and export the spans still batched."""
        self.drain.close()
        for task in [self._departures, *self._planners]:
            if task is not None:
                task.cancel()
        for served in self.by_model.values():
            served.stop_index()
        tracing.flush()

    # -- endpoints --------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> JSONResponse:
        self._watch()
        if self.drain.draining:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return await self._health()

    async def _health(self) -> JSONResponse:
        """200 once every pool has a live worker, 503 while one has none.

        The prefix index says which workers are live. Without it (Redis down) each pool
        is asked directly, through its Serve handle: 200 "degraded" if every pool
        answers in time (serving works, placement is load-only), else 503. With several
        models, every model's pools must be so; `models` says how each one stands.
        """
        per_model: dict[str, dict[str, Any]] = {}
        all_ok = True
        for model_id, served in self.by_model.items():
            core = served.core
            try:
                workers = await core.live_workers()
            except Exception as exc:  # Redis down: ask the pools themselves
                answer = await pools_health(core, repr(exc))
                if len(self.by_model) == 1:
                    return answer
                per_model[model_id] = json.loads(bytes(answer.body))
                all_ok = all_ok and answer.status_code == 200
                continue
            roles = ("prefill", "decode")
            counts = {role: sum(w.role == role for w in workers) for role in roles}
            ok = counts["decode"] > 0 and (core.prefill is None or counts["prefill"] > 0)
            all_ok = all_ok and ok
            status = "ok" if ok else "starting"
            per_model[model_id] = {"status": status, "mode": core.config.mode, "workers": counts}
        unscheduled = await self.unscheduled()
        if len(self.by_model) == 1:
            body = next(iter(per_model.values()))
            if unscheduled:
                body = {**body, "unscheduled": unscheduled}
        else:
            total = {
                role: sum(m.get("workers", {}).get(role, 0) for m in per_model.values())
                for role in ("prefill", "decode")
            }
            status = "ok" if all_ok else "starting"
            body = {"status": status, "workers": total, "models": per_model}
            if unscheduled:
                body["unscheduled"] = unscheduled
        return JSONResponse(body, status_code=200 if all_ok else 503)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        workers: dict[str, list[WorkerInfo]] = {}
        for model_id, served in self.by_model.items():
            try:
                workers[model_id] = await served.core.live_workers()
            except (RedisError, OSError, TimeoutError):  # Redis down: no worker gauges
                workers[model_id] = []
        return Response(self.router_metrics.render(workers), media_type=CONTENT_TYPE)

    @api.get("/workers")
    async def workers(self, request: Request) -> JSONResponse:
        """Every live worker's exact state, asked of the worker itself (for operators)."""
        try:
            self._authorize(request)
        except ProtocolError as exc:
            return _error(exc)
        states: list[dict[str, Any]] = []
        for model_id, served in self.by_model.items():
            try:
                workers = await served.core.live_workers()
            except Exception as exc:
                return JSONResponse(_upstream_error_body(exc), status_code=503)
            states += [
                {**state, "model": model_id} for state in await served.core.worker_states(workers)
            ]
        body: dict[str, Any] = {"workers": states}
        planners = {}
        for model_id, served in self.by_model.items():
            if served.config.planner_enabled:
                with contextlib.suppress(RedisError, OSError):
                    planners[model_id] = await read_planner_state(self.redis, model_id)
        if planners:  # the planner's last decision per model (docs/planner.md)
            body["planner"] = planners
        return JSONResponse(body)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)  # every /v1 route needs the key when keys are set
        except ProtocolError as exc:
            return _error(exc)
        with contextlib.suppress(RedisError, OSError, TimeoutError):  # else: those known
            await self.adapters.refresh()  # adapters loaded through other router replicas
        cards = [served.card() for served in self.by_model.values()]
        for name, model_id in self.adapters.items():  # each LoRA adapter, on its base
            card = {"id": name, "object": "model", "created": 0, "owned_by": "pdserve"}
            cards.append({**card, "parent": model_id, "root": model_id})
        for route in self.config.routes:  # a routed name is a model id clients may send
            targets = sorted({route.default, *(rule.model for rule in route.rules)})
            card = {"id": route.name, "object": "model", "created": 0, "owned_by": "pdserve"}
            cards.append({**card, "routes_to": targets})
        return JSONResponse({"object": "list", "data": cards})

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """Load a LoRA adapter into every worker (vLLM's API; router/adapters.py)."""
        try:
            body, _ = await self._admit(request)
            text = await self.adapters.load(parse_request(LoadLoRAAdapterRequest, body))
        except ProtocolError as exc:
            return _error(exc)
        return PlainTextResponse(text)

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """Unload a LoRA adapter loaded at runtime from every worker (vLLM's API)."""
        try:
            body, _ = await self._admit(request)
            text = await self.adapters.unload(parse_request(UnloadLoRAAdapterRequest, body))
        except ProtocolError as exc:
            return _error(exc)
        return PlainTextResponse(text)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle("completion", request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle("chat", request)

    async def _handle(self, kind: str, request: Request) -> Response:
        arrival = time.monotonic()
        if self.tracer is None:  # tracing off: no span, no header parsing
            return await self._handle_request(kind, request, arrival, None)
        carrier = {h: request.headers[h] for h in tracing.TRACE_HEADERS if h in request.headers}
        span = tracing.start(
            self.tracer,
            f"POST {request.url.path}",
            tracing.parent(carrier),  # the client's traceparent, if it sent one
            start_s=arrival,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "url.path": request.url.path,
            },
        )
        try:
            response = await self._handle_request(kind, request, arrival, span)
        except BaseException as exc:
            tracing.fail(span, exc)
            span.end()
            raise
        span.set_attribute("http.response.status_code", response.status_code)
        if response.status_code >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status_code}"))
        if not isinstance(response, _SlotStreamingResponse):  # a stream ends it when sent
            span.end()
        return response

    async def _handle_request(
        self, kind: str, request: Request, arrival: float, span: Span | None
    ) -> Response:
        endpoint = "completions" if kind == "completion" else "chat"
        self._watch()
        if self.drain.draining:
            self._unrouted.requests.labels(endpoint, "503").inc()
            return _error(_shutting_down(_STOPPING))
        try:
            body, key_defaults = await self._admit(request)
        except ProtocolError as exc:
            self._unrouted.requests.labels(endpoint, str(exc.status_code)).inc()
            return _error(exc)
        parsed: _Request | None = None
        try:
            try:
                r = parsed = self._parse(kind, body, arrival, request.headers)
            except ProtocolError as exc:
                if exc.code != "model_not_found" or not await self._new_adapters():
                    raise
                r = parsed = self._parse(kind, body, arrival, request.headers)
            r.key_defaults = key_defaults
            self._take_slot(r)  # from here on, this request holds a slot
        except ProtocolError as exc:
            metrics = parsed.served.core.metrics if parsed is not None else self._unrouted
            metrics.requests.labels(endpoint, str(exc.status_code)).inc()
            return _error(exc)
        r.params = with_default_salt(r.params, key_defaults.cache_salt)
        result_cache = self.result_caches[r.served.model_id]
        # an adapter loaded at runtime is not in the cache's model identity (its folder
        # may hold other weights under the same name after an unload): never cached
        runtime_lora = r.params.lora is not None and r.params.lora not in self.adapters.static
        if result_cache is not None and not runtime_lora:  # the salt is in the key
            r.cache = result_cache.plan(
                r.prompt_ids, r.params, r.params.cache_salt, request.headers, r.req.result_cache
            )
        if span is not None:  # never the prompt's text: ids and counts only
            r.span = span
            span.set_attributes(
                {
                    "gen_ai.request.model": r.served.model_id,
                    "pdserve.request_id": r.id,
                    "gen_ai.usage.input_tokens": len(r.prompt_ids),
                    "pdserve.stream": bool(r.req.stream),
                }
            )
        return await self._serve(r)

    def _parse(
        self, kind: str, body: bytes, arrival: float, headers: Mapping[str, str]
    ) -> _Request:
        if kind == "completion":
            return self._parse_completion(body, arrival, headers)
        return self._parse_chat(body, arrival, headers)

    async def _new_adapters(self) -> bool:
        """A request named a model this replica does not know: perhaps a LoRA adapter
        loaded through another router replica since. True when the registry changed."""
        try:
            return await self.adapters.refresh()
        except (RedisError, OSError, TimeoutError):  # the 404 stands
            return False

    def _parse_completion(
        self, body: bytes, arrival: float, headers: Mapping[str, str]
    ) -> _Request:
        req = parse_request(CompletionRequest, body)
        prompt = req.prompt_input()

        def tokenize(served: ServedModel) -> list[int]:
            if isinstance(prompt, str):
                return served.tokenizer.encode(prompt)
            return self._check_token_ids(served, prompt)

        served, route, ids = self._pick_model(req, headers, tokenize)
        params = to_sampling_params(req, len(ids), served.max_model_len)
        params = self._with_adapter(req.model, params)
        r = _Request("completion", req, ids, params, arrival)
        r.served, r.route = served, route
        return r

    def _parse_chat(self, body: bytes, arrival: float, headers: Mapping[str, str]) -> _Request:
        req = parse_request(ChatCompletionRequest, body)

        def tokenize(served: ServedModel) -> list[int]:
            try:
                return served.tokenizer.encode_chat(
                    req.chat_messages(), req.add_generation_prompt, req.template_tools()
                )
            except InvalidRequestError as exc:
                raise ProtocolError(str(exc), param="messages") from exc

        served, route, ids = self._pick_model(req, headers, tokenize)
        params = to_sampling_params(req, len(ids), served.max_model_len)
        params = self._with_adapter(req.model, params)
        r = _Request("chat", req, ids, params, arrival)
        r.served, r.route = served, route
        mode = req.tool_mode()
        if mode == "auto":
            if served.tool_format is None:
                raise ProtocolError(
                    f"tool_choice 'auto' (the default with tools) needs the model's tool-call "
                    f"format, and {served.model_id!r} has none (its chat template shows no "
                    "known one; the operator sets it with --tool-call-parser); send "
                    "tool_choice 'required', a named function, or 'none'",
                    param="tool_choice",
                )
            r.tool_mode = served.tool_format
        elif mode is not None:
            r.tool_mode, r.tool_name = mode, req.named_function()
        return r

    def _pick_model(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        headers: Mapping[str, str],
        tokenize: Callable[[ServedModel], list[int]],
    ) -> tuple[ServedModel, Picked | None, list[int]]:
        """The model that serves `req`, the route rule that picked it (None: named
        directly) and the prompt in its tokens.

        A routed name (cluster/model_routes.py) measures the prompt in its default
        model's tokens, picks by its rules, and tokenizes again only when the picked
        model is another one.
        """
        if req.model not in self.model_router:
            served = self._served(req.model)
            return served, None, tokenize(served)
        default = self.by_model[self.model_router.default_model(req.model)]
        ids = tokenize(default)
        max_tokens = requested_max_tokens(req) or default.max_model_len
        facts = RouteFacts(len(ids), max_tokens, headers, req.metadata or {})
        picked = self.model_router.pick(req.model, facts)
        self.router_metrics.route_decisions.labels(*picked).inc()
        served = self.by_model[picked.model]
        return served, picked, ids if served is default else tokenize(served)

    # -- admission --------------------------------------------------------------------

    def _authorize(self, request: Request) -> APIKeyDefaults:
        """401 unless API keys are off or the bearer token is one (constant-time compare).

        Returns the key's defaults (priority, cache_salt): the empty defaults for a key
        without any, or when keys are off.
        """
        if not self._api_keys:
            return _NO_DEFAULTS
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        matched = None
        if scheme.lower() == "bearer":
            for key in self._api_keys:  # every key compared: the time says nothing
                if hmac.compare_digest(given, key):
                    matched = key
        if matched is not None:
            return self._key_defaults.get(matched, _NO_DEFAULTS)
        raise ProtocolError(
            "missing or invalid API key (send 'Authorization: Bearer KEY')",
            status_code=401,
            code="invalid_api_key",
        )

    async def _admit(self, request: Request) -> tuple[bytes, APIKeyDefaults]:
        """Authorize, read the body within its size bound; return the body and the API
        key's defaults. The in-flight slot is taken once the body says the request's
        priority (`_take_slot`). As many bodies as slots are read at once, more wait their
        turn (a 429 here could not tell an important request from another), for at most
        READ_TURN_TIMEOUT_S: bodies that do not come (slow clients) never hang the rest."""
        defaults = self._authorize(request)
        try:
            async with asyncio.timeout(READ_TURN_TIMEOUT_S):
                await self._reading.acquire()
        except TimeoutError:
            raise ProtocolError(
                f"the router is reading {self.config.max_inflight_requests} request bodies, "
                "its limit; retry later",
                status_code=429,
                code="overloaded",
            ) from None
        try:
            return await self._read_body(request), defaults
        finally:
            self._reading.release()

    def _take_slot(self, r: _Request) -> None:
        """Settle `r`'s priority (its own, else its API key's default) and take an
        in-flight slot, or raise 429 past the limit that priority sees (priority.py:
        lower priorities may be kept out of a reserved headroom)."""
        priority = r.req.priority if r.req.priority is not None else r.key_defaults.priority
        if priority != r.params.priority:
            r.params = dataclasses.replace(r.params, priority=priority)
        limit = inflight_limit(self.config, priority)
        if self._inflight >= limit:
            r.served.core.metrics.shed.labels(str(priority), "inflight").inc()
            raise ProtocolError(
                f"the router is at its limit of {limit} requests in flight for priority "
                f"{priority}; retry later",
                status_code=429,
                code="overloaded",
            )
        self._inflight += 1  # no await since the check: the two are not split

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ProtocolError(f"the request body exceeds {limit} bytes", status_code=413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ProtocolError(f"the request body exceeds {limit} bytes", status_code=413)
        return bytes(body)

    def _release(self) -> None:
        self._inflight -= 1
        if self.drain.draining:
            self.drain.idle()

    # -- serving ------------------------------------------------------------------------

    def _check_token_ids(self, served: ServedModel, ids: list[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < served.vocab_size]
        if bad:
            raise ProtocolError(
                f"token ids {bad[:5]} are outside the vocabulary [0, {served.vocab_size})",
                param="prompt",
            )
        return ids

    async def _serve(self, r: _Request) -> Response:
        """Serve an admitted request; its in-flight slot is released when it ends."""
        if r.params.lora is not None:
            r.served.core.metrics.lora_requests.labels(r.params.lora).inc()
        try:  # placed before the response begins: past capacity, a 429 and nothing sent
            items = await self._cached(r)
            if items is None:
                core = r.served.core
                items = await core.start(r.id, r.prompt_ids, r.params, r.arrival_s, r.span)
                cache = self.result_caches[r.served.model_id]
                if cache is not None and r.cache is not None and r.cache.write:
                    items = cache.record(r.cache, items)
        except Overloaded as exc:
            self._release()
            r.served.core.metrics.shed.labels(str(r.params.priority), "prefill_queue").inc()
            endpoint = "completions" if r.kind == "completion" else "chat"
            r.served.core.metrics.requests.labels(endpoint, "429").inc()
            shed = ProtocolError(str(exc), status_code=429, code="overloaded")
            return _error(shed, exc.retry_after_s)
        except ShuttingDown as exc:
            self._release()
            endpoint = "completions" if r.kind == "completion" else "chat"
            r.served.core.metrics.requests.labels(endpoint, "503").inc()
            return _error(_shutting_down(str(exc)))
        except BaseException:  # e.g. cancelled (the client went away): the slot is free
            self._release()
            raise
        cache_header = {} if r.cache is None else {RESULT_CACHE_HEADER: r.cache.status}
        if r.route is not None:  # explainable routing: the rule that picked the model
            cache_header[RULE_HEADER] = r.route.rule
        if r.req.stream:
            return _SlotStreamingResponse(
                self._stream(r, items),
                release=self._release if r.span is None else lambda: self._release_traced(r),
                media_type="text/event-stream",
                headers={**_SSE_HEADERS, **cache_header},
            )
        try:
            response = await self._complete(r, items)
            response.headers.update(cache_header)
            return response
        finally:
            self._release()

    async def _cached(self, r: _Request) -> AsyncIterator[ClientItem] | None:
        """The result cache's stored items for `r` (a hit), else None: no worker needed."""
        result_cache = self.result_caches[r.served.model_id]
        if result_cache is None or r.cache is None:
            return None
        items = await result_cache.replay(r.cache)
        if items is not None:
            # no worker computed anything of the prompt: every prompt token was cached
            r.cached_tokens = len(r.prompt_ids)
            if r.span is not None:
                r.span.set_attribute("pdserve.result_cache", "hit")
        return items

    async def _complete(self, r: _Request, items: AsyncIterator[ClientItem]) -> Response:
        endpoint = "completions" if r.kind == "completion" else "chat"
        n = r.params.n  # parallel sampling: each item names its choice ("index")
        token_ids: list[list[int]] = [[] for _ in range(n)]
        text: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[tuple[int, float, list[tuple[int, float]]]]] = [[] for _ in range(n)]
        finish_reasons: list[str | None] = [None] * n
        try:
            async for item in items:
                i = item.get("index", 0)
                token_ids[i] += item["token_ids"]
                text[i].append(item["text"])
                logprobs[i] += item.get("logprobs", [])
                finish_reasons[i] = item["finish_reason"] or finish_reasons[i]
                r.cached_tokens = item.get("cached_tokens", r.cached_tokens)
        except UpstreamError as exc:
            status = getattr(exc, "status_code", 503)  # 400: the engine refused it
            r.served.core.metrics.requests.labels(endpoint, str(status)).inc()
            if r.span is not None:
                tracing.fail(r.span, exc)
            return JSONResponse(_upstream_error_body(exc), status_code=status)
        num_tokens = sum(len(t) for t in token_ids)
        self._observe_done(r, num_tokens, finish_reasons[0])
        r.served.core.metrics.requests.labels(endpoint, "200").inc()
        choices = []
        for i in range(n):
            lps = logprobs[i]
            choice: dict[str, Any] = {"index": i, "finish_reason": finish_reasons[i]}
            if r.kind == "completion":
                choice["text"] = "".join(text[i])
                choice["logprobs"] = self._completion_logprobs(r, lps) if lps else None
            else:
                choice["message"] = self._message(r, "".join(text[i]))
                called = "tool_calls" in choice["message"]
                choice["finish_reason"] = _tool_finish(r, finish_reasons[i], called)
                choice["logprobs"] = self._chat_logprobs(r, lps) if lps else None
            if r.req.return_token_ids:
                choice["token_ids"] = token_ids[i]
            choices.append(choice)
        body: dict[str, Any] = {
            "id": r.id,
            "object": "text_completion" if r.kind == "completion" else "chat.completion",
            "created": r.created,
            "model": r.params.lora or r.served.model_id,
            "choices": choices,
            "usage": self._usage(r, num_tokens),
        }
        if r.req.return_token_ids:
            body["prompt_token_ids"] = r.prompt_ids
        return JSONResponse(body)

    def _message(self, r: _Request, text: str) -> dict[str, Any]:
        """A chat choice's message: the text, or (tools) its content and parsed calls."""
        if r.tool_mode is None:
            return {"role": "assistant", "content": text}
        content, calls = parse_tool_calls(r.tool_mode, text, r.tool_name)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [_call_json(call) for call in calls]
        return message

    async def _stream(self, r: _Request, items: AsyncIterator[ClientItem]) -> AsyncIterator[str]:
        endpoint = "completions" if r.kind == "completion" else "chat"
        obj = "text_completion" if r.kind == "completion" else "chat.completion.chunk"
        model = r.params.lora or r.served.model_id  # the adapter, when the request named one
        base = {"id": r.id, "object": obj, "created": r.created, "model": model}
        include_usage = bool(r.req.stream_options and r.req.stream_options.include_usage)
        num_tokens = 0
        last_token_s: float | None = None
        finish_reason = None
        parsers = (
            [ToolCallParser(r.tool_mode, r.tool_name) for _ in range(r.params.n)]
            if r.tool_mode is not None
            else []
        )
        try:
            if r.kind == "chat":
                delta = {"role": "assistant", "content": ""}
                # parallel sampling: each choice opens with its role (as OpenAI streams)
                firsts: list[dict[str, Any]] = [
                    {"index": i, "delta": delta, "finish_reason": None} for i in range(r.params.n)
                ]
                chunk = {**base, "choices": firsts}
                if r.req.return_token_ids:
                    chunk["prompt_token_ids"] = r.prompt_ids
                yield _sse(chunk)
            first_chunk = True
            async for item in items:
                now = time.monotonic()
                if last_token_s is not None and item["token_ids"] and not _hit(r):
                    r.served.core.metrics.itl.observe(now - last_token_s)
                last_token_s = now
                num_tokens += len(item["token_ids"])
                finish_reason = item["finish_reason"] or finish_reason
                r.cached_tokens = item.get("cached_tokens", r.cached_tokens)
                choice: dict[str, Any] = {
                    "index": item.get("index", 0),
                    "finish_reason": item["finish_reason"],
                }
                lps = item.get("logprobs")
                if r.kind == "completion":
                    choice["text"] = item["text"]
                    choice["logprobs"] = self._completion_logprobs(r, lps) if lps else None
                elif parsers:
                    parser = parsers[choice["index"]]
                    choice["delta"] = _tool_delta(parser, item["text"], item["finish_reason"])
                    choice["finish_reason"] = _tool_finish(r, item["finish_reason"], parser.called)
                    choice["logprobs"] = self._chat_logprobs(r, lps) if lps else None
                else:
                    choice["delta"] = {"content": item["text"]} if item["text"] else {}
                    choice["logprobs"] = self._chat_logprobs(r, lps) if lps else None
                if r.req.return_token_ids:
                    choice["token_ids"] = item["token_ids"]
                chunk = {**base, "choices": [choice]}
                if first_chunk and r.kind == "completion" and r.req.return_token_ids:
                    chunk["prompt_token_ids"] = r.prompt_ids
                first_chunk = False
                yield _sse(chunk)
            self._observe_done(r, num_tokens, finish_reason)
            if include_usage:
                yield _sse({**base, "choices": [], "usage": self._usage(r, num_tokens)})
            r.served.core.metrics.requests.labels(endpoint, "200").inc()
        except UpstreamError as exc:
            status = getattr(exc, "status_code", 503)  # 400: the engine refused it
            r.served.core.metrics.requests.labels(endpoint, str(status)).inc()
            if r.span is not None:
                tracing.fail(r.span, exc)
            yield _sse(_upstream_error_body(exc))
        finally:  # a client that went away cancels the request on the workers now
            await items.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    def _observe_done(self, r: _Request, num_tokens: int, finish_reason: str | None) -> None:
        r.served.core.metrics.e2e.observe(time.monotonic() - r.arrival_s)
        if not _hit(r):  # a result cache hit generated nothing
            r.served.core.metrics.generation_tokens.inc(num_tokens)
            r.served.core.traffic.output_tokens += num_tokens
            r.served.core.traffic.completed += 1
            if r.params.lora is not None:
                r.served.core.metrics.lora_tokens.labels(r.params.lora).inc(num_tokens)
        if r.span is not None:
            attrs: dict[str, Any] = {"gen_ai.usage.output_tokens": num_tokens}
            if finish_reason is not None:
                attrs["gen_ai.response.finish_reasons"] = [finish_reason]
            r.span.set_attributes(attrs)

    def _release_traced(self, r: _Request) -> None:
        """A traced stream is sent (or its client went away): free the slot, end the span."""
        self._release()
        if r.span is not None:
            r.span.end()

    def _usage(self, r: _Request, num_tokens: int) -> dict[str, Any]:
        n = len(r.prompt_ids)
        return {
            "prompt_tokens": n,
            "completion_tokens": num_tokens,
            "total_tokens": n + num_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
        }

    def _completion_logprobs(self, r: _Request, lps: list[Any]) -> dict[str, Any]:
        tokens = [r.served.token_text(t) for t, _, _ in lps]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in lps],
            "top_logprobs": [{r.served.token_text(t): v for t, v in top} for _, _, top in lps],
            "text_offset": offsets,
        }

    def _chat_logprobs(self, r: _Request, lps: list[Any]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = r.served.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            {**entry(t, lp), "top_logprobs": [entry(tt, v) for tt, v in top]} for t, lp, top in lps
        ]
        return {"content": content}
