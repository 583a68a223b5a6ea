"""The router's Prometheus metrics (`GET /metrics`), every name prefixed `pdserve_`.

Request-level figures (latencies, the TTFT breakdown, prefix hits per pool, transfer
bytes) are observed by the router replica that served the request, from what the
workers report with each call. Worker gauges (running and waiting requests, KV blocks,
queued prefill tokens) are read from the prefix index at scrape time, so any router
replica shows the whole cluster. Scrape every router replica and sum the counters.
With several models (docs/architecture.md, "Several models") every request-level series
and every worker gauge carries the model's id as a `model` label.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from pdserve.cluster.index_follower import MATCH_SOURCES, SNAPSHOT_REASONS
from pdserve.cluster.prefix_index import WorkerInfo
from pdserve.router.disagg import POLICY_LOCAL, REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75),
    *(1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
# Why a decode worker prefilled a prompt itself in disaggregated mode (README, "Metrics"):
# transfer_failed: the push failed or the KV that came could not be used; kv_late: no KV
# within kv_wait_timeout_s; prefill_failed: the prefill call failed; not_target: the
# replica that took the call would not take KV for it; no_prefill_worker: the index
# lists no live prefill worker; resume: a resumed stream, prefilled there on purpose;
# policy: conditional disaggregation chose it (pdserve_disagg_decisions_total says why).
LOCAL_PREFILL_REASONS = (
    "transfer_failed",
    "kv_late",
    "prefill_failed",
    "not_target",
    "no_prefill_worker",
    "resume",
    "policy",
)
TIERS = ("device", "host", "disk")
"""Where a worker holds a prompt block (`pdserve_placement_hit_blocks_total{tier}`)."""

# What became of a peer fetch (the receiver computes the prompt unless "used"): used:
# its blocks were written and served as a prefix hit; already_held: the worker that took
# the request held them itself (Serve gave it another replica than placement chose);
# not_held: the holder no longer held
# them; holder_failed: the holder's push failed or the holder was unreachable; late: not
# there within the wait; transfer_failed: refused by the receiver's checks or cut off;
# unusable: arrived but could not be written into the receiver's pool; refused: the
# receiver could not take a fetch (tensor parallelism, the id expected already).
FETCH_OUTCOMES = (
    "used",
    "already_held",
    "not_held",
    "holder_failed",
    "late",
    "transfer_failed",
    "unusable",
    "refused",
)
TTFT_STAGES = ("router_queue", "prefill_queue", "prefill_compute", "transfer", "decode_queue")
_WORKER_GAUGES = {
    "running": "Requests in the running batch",
    "waiting": "Requests waiting for admission",
    "queued_prefill_tokens": "Prompt tokens not yet prefilled",
    "kv_blocks_used": "KV blocks referenced by requests",
    "kv_blocks_total": "KV blocks in the pool",
    "pending_transfers": "KV transfers a decode worker expects, receives or holds",
    "prefill_tokens_per_s": "Measured prefill throughput, prompt tokens per busy second",
    "spec_proposed_tokens": "Speculative decoding: tokens proposed since start",
    "spec_accepted_tokens": "Speculative decoding: proposed tokens accepted since start",
    "spec_emitted_tokens": "Speculative decoding: tokens emitted by verify rows since start",
    "spec_draft_forward_us": "Speculative decoding: the draft model's forward time since start, us",
    "tp_all_reduce_us_per_step": "Tensor parallel: the driver's all-reduce time per step, us",
    "kernel_compiles_after_ready": "Triton kernel variants compiled after warm-up (each stalls"
    " every stream of the worker)",
    "kv_host_blocks": "Host KV tier: blocks held",
    "kv_host_blocks_total": "Host KV tier: blocks it can hold (kv_host_gib)",
    "kv_host_demoted_blocks": "Host KV tier: blocks copied in from the pool since start",
    "kv_host_hit_blocks": "Host KV tier: blocks copied back instead of computed since start",
    "kv_host_dropped_blocks": "Host KV tier: blocks dropped for room since start",
    "kv_host_demote_us_per_block": "Host KV tier: mean time to copy a block in, us",
    "kv_host_promote_us_per_block": "Host KV tier: mean time to copy a block back into the"
    " pool, us (a disk block's read: kv_disk_read_us_per_block)",
    "kv_disk_blocks": "Disk KV tier: blocks held",
    "kv_disk_blocks_total": "Disk KV tier: blocks its file holds (kv_disk_gib)",
    "kv_disk_hit_blocks": "Disk KV tier: blocks read back instead of computed since start",
    "kv_disk_corrupt_blocks": "Disk KV tier: blocks whose checksum failed (computed instead)",
    "kv_disk_recovered_blocks": "Disk KV tier: blocks found in its file at start",
    "kv_disk_read_us_per_block": "Disk KV tier: mean time to read and check a block, us",
    "lora_adapters": "LoRA adapters loaded (in host memory; resident ones too)",
    "lora_resident": "LoRA adapters resident on the device (at most max_loras)",
    "lora_slots_free": "LoRA adapter slots a new adapter could take now (empty, or held by"
    " an adapter no running request uses)",
    "lora_loads": "LoRA adapters copied onto the device since start",
    "lora_evictions": "LoRA adapters swapped out of the device for another since start",
}


class _WorkerCollector:
    """Exposes the last index snapshot of every live worker as gauges, per model."""

    def __init__(self) -> None:
        self.workers: Mapping[str, Sequence[WorkerInfo]] = {}

    def collect(self) -> Iterable[Metric]:
        for name, doc in _WORKER_GAUGES.items():
            family = GaugeMetricFamily(
                f"pdserve_worker_{name}", doc, labels=["model", "worker", "role"]
            )
            for model, workers in self.workers.items():
                for w in workers:
                    if name in w.load:
                        family.add_metric([model, w.worker_id, w.role], w.load[name])
            yield family
        live = GaugeMetricFamily(
            "pdserve_workers_live", "Live workers per model and pool", labels=["model", "role"]
        )
        for model, workers in self.workers.items():
            for role in ("prefill", "decode"):
                live.add_metric([model, role], sum(w.role == role for w in workers))
        yield live


class _Partial:
    """A labelled metric with its `model` label given: `.labels(*rest)` as if it were the
    metric without that label, so request-path code reads the same with or without it."""

    def __init__(self, metric: Any, model: str) -> None:
        self._metric = metric
        self._model = model

    def labels(self, *values: str) -> Any:
        return self._metric.labels(self._model, *values)


class ModelMetrics:
    """One model's view of a router replica's metrics (`RouterMetrics.for_model`): the
    same attributes, each with the `model` label filled in. Every model's series live in
    the replica's one registry."""

    def __init__(self, parent: RouterMetrics, model: str) -> None:
        p = parent
        self.model = model
        self.registry = p.registry
        self.inflight = p.inflight
        self.ttft = p.ttft.labels(model)
        self.itl = p.itl.labels(model)
        self.e2e = p.e2e.labels(model)
        self.generation_tokens = p.generation_tokens.labels(model)
        self.transfer_bytes = p.transfer_bytes.labels(model)
        self.transfer_blocks = p.transfer_blocks.labels(model)
        self.transfer_seconds = p.transfer_seconds.labels(model)
        self.transfers_failed = p.transfers_failed.labels(model)
        self.fetches = _Partial(p.fetches, model)
        self.fetch_blocks = p.fetch_blocks.labels(model)
        self.lora_requests = _Partial(p.lora_requests, model)
        self.lora_tokens = _Partial(p.lora_tokens, model)
        self.lora_loads = _Partial(p.lora_loads, model)
        self.fetch_bytes = p.fetch_bytes.labels(model)
        self.placement_hits = _Partial(p.placement_hits, model)
        self.resumes = p.resumes.labels(model)
        self.drain_migrations = p.drain_migrations.labels(model)
        self.planner_decisions = _Partial(p.planner_decisions, model)
        self.planner_target = _Partial(p.planner_target, model)
        self.planner_actual = _Partial(p.planner_actual, model)
        self.planner_rate = _Partial(p.planner_rate, model)
        self.planner_predicted = _Partial(p.planner_predicted, model)
        self.drain_notices = _Partial(p.drain_notices, model)
        self.ttft_stage = _Partial(p.ttft_stage, model)
        self.requests = _Partial(p.requests, model)
        self.prompt_tokens = _Partial(p.prompt_tokens, model)
        self.hit_tokens = _Partial(p.hit_tokens, model)
        self.local_prefills = _Partial(p.local_prefills, model)
        self.disagg_decisions = _Partial(p.disagg_decisions, model)
        self.disagg_saved = _Partial(p.disagg_saved, model)
        self.placements = _Partial(p.placements, model)
        self.placement_overrides = _Partial(p.placement_overrides, model)
        self.shed = _Partial(p.shed, model)
        self.result_cache_hits = p.result_cache_hits.labels(model)
        self.result_cache_misses = p.result_cache_misses.labels(model)
        self.result_cache_errors = p.result_cache_errors.labels(model)
        self.result_cache_stores = _Partial(p.result_cache_stores, model)
        self.result_cache_stored_bytes = p.result_cache_stored_bytes.labels(model)
        self.index_snapshots = _Partial(p.index_snapshots, model)
        self.index_matches = _Partial(p.index_matches, model)
        self.index_event_lag = p.index_event_lag.labels(model)
        for reason in SNAPSHOT_REASONS:
            self.index_snapshots.labels(reason)
        for source in MATCH_SOURCES:
            self.index_matches.labels(source)
        for result in ("stored", "too_large", "error"):
            self.result_cache_stores.labels(result)
        for outcome in FETCH_OUTCOMES:
            self.fetches.labels(outcome)
        for role in ("prefill", "decode"):
            for tier in TIERS:
                self.placement_hits.labels(role, tier)
        for reason in LOCAL_PREFILL_REASONS:  # every reason shows, at 0 until it happens
            self.local_prefills.labels(reason)
        for where, reasons in REASONS.items():
            for reason in reasons:
                self.disagg_decisions.labels(where, reason)
        for reason in POLICY_LOCAL:
            self.disagg_saved.labels(reason)
        self._parent = parent

    def render(self, workers: Sequence[WorkerInfo]) -> bytes:
        """The replica's whole registry, with `workers` as this model's live workers."""
        return self._parent.render({self.model: workers})


class RouterMetrics:
    """One registry per router replica (tests may build several in one process).

    Every request-level series carries a `model` label: a model's `RouterCore` records
    through its `for_model` view. The in-flight gauge is the replica's, for all models.
    """

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Request arrival at the router to its first token leaving it",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between consecutive streamed tokens",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request arrival to its last token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_stage = Histogram(
            "pdserve_ttft_breakdown_seconds",
            "Where time to first token went, per stage of the request path",
            ["model", "stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pdserve_requests", "Requests by outcome", ["model", "endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens",
            "Prompt tokens each pool was asked to hold",
            ["model", "pool"],
            registry=r,
        )
        self.hit_tokens = Counter(
            "pdserve_prefix_cache_hit_tokens",
            "Prompt tokens each pool found in its prefix cache",
            ["model", "pool"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated", ["model"], registry=r
        )
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes",
            "KV bytes pushed from prefill to decode",
            ["model"],
            registry=r,
        )
        self.transfer_blocks = Counter(
            "pdserve_kv_transfer_blocks",
            "KV blocks pushed from prefill to decode",
            ["model"],
            registry=r,
        )
        self.transfer_seconds = Counter(
            "pdserve_kv_transfer_seconds", "Seconds spent pushing KV", ["model"], registry=r
        )
        self.transfers_failed = Counter(
            "pdserve_kv_transfer_failures",
            "Pushes that failed (decode prefilled locally)",
            ["model"],
            registry=r,
        )
        # one series per adapter a request named (the cardinality is the adapters')
        self.lora_requests = Counter(
            "pdserve_lora_requests",
            "Requests that named a LoRA adapter, by adapter",
            ["model", "adapter"],
            registry=r,
        )
        self.lora_tokens = Counter(
            "pdserve_lora_generation_tokens",
            "Tokens generated for requests of a LoRA adapter, by adapter",
            ["model", "adapter"],
            registry=r,
        )
        self.lora_loads = Counter(
            "pdserve_lora_adapter_changes",
            "Runtime loads and unloads of LoRA adapters (POST /v1/load_lora_adapter,"
            " /v1/unload_lora_adapter), by what and outcome",
            ["model", "change", "outcome"],
            registry=r,
        )
        self.fetches = Counter(
            "pdserve_kv_fetch",
            "Peer fetches of a prompt prefix from the worker holding it, by outcome",
            ["model", "outcome"],
            registry=r,
        )
        self.fetch_blocks = Counter(
            "pdserve_kv_fetch_blocks",
            "KV blocks a peer fetch wrote into the receiving worker's pool",
            ["model"],
            registry=r,
        )
        self.fetch_bytes = Counter(
            "pdserve_kv_fetch_bytes",
            "KV bytes holders pushed for peer fetches",
            ["model"],
            registry=r,
        )
        self.placement_hits = Counter(
            "pdserve_placement_hit_blocks",
            "Prompt blocks the chosen worker held when placed, by pool and by where it held"
            " them (device pool, host-memory tier, disk tier)",
            ["model", "role", "tier"],
            registry=r,
        )
        self.local_prefills = Counter(
            "pdserve_decode_local_prefill",
            "Prompts a decode worker prefilled itself in disaggregated mode, by reason",
            ["model", "reason"],
            registry=r,
        )
        self.disagg_decisions = Counter(
            "pdserve_disagg_decisions",
            "Where each prompt was prefilled (or why it was shed), by the router's reason",
            ["model", "where", "reason"],
            registry=r,
        )
        self.disagg_saved = Counter(
            "pdserve_disagg_saved_seconds",
            "Seconds of time to first token that prompts prefilled on their decode worker by"
            " choice were predicted to save over the prefill pool (its estimate less the"
            " decode worker's), by the decision's reason",
            ["model", "reason"],
            registry=r,
        )
        self.resumes = Counter(
            "pdserve_decode_resumes",
            "Streams resumed on another decode worker after theirs failed",
            ["model"],
            registry=r,
        )
        self.drain_migrations = Counter(
            "pdserve_drain_migrations",
            "Streams moved to another decode worker because theirs left its pool and its"
            " drain deadline passed (also counted in pdserve_decode_resumes)",
            ["model"],
            registry=r,
        )
        # the planner's decisions (router/planner_loop.py): set by the router that leads
        self.planner_decisions = Counter(
            "pdserve_planner_decisions",
            "Replica counts the planner set, by pool and direction",
            ["model", "pool", "direction"],
            registry=r,
        )
        self.planner_target = Gauge(
            "pdserve_planner_target_replicas",
            "The replica count the planner wants per pool (the leading router's)",
            ["model", "pool"],
            registry=r,
        )
        self.planner_actual = Gauge(
            "pdserve_planner_actual_replicas",
            "Live workers per pool when the planner last decided",
            ["model", "pool"],
            registry=r,
        )
        self.planner_rate = Gauge(
            "pdserve_planner_request_rate",
            "Requests per second the planner observed over its last window, and forecast",
            ["model", "kind"],
            registry=r,
        )
        self.planner_predicted = Gauge(
            "pdserve_planner_predicted_seconds",
            "The planner's prediction at the counts it chose: TTFT and ITL at the SLO"
            " percentile (-1: the pools cannot keep up)",
            ["model", "metric"],
            registry=r,
        )
        self.drain_notices = Counter(
            "pdserve_drain_notices",
            "Workers this router saw leave their pool (a scale-down) and told to drain",
            ["model", "role"],
            registry=r,
        )
        self.placements = Counter(
            "pdserve_placements",
            "Requests served per worker (the replica that took the call)",
            ["model", "role", "worker"],
            registry=r,
        )
        self.placement_overrides = Counter(
            "pdserve_placement_overrides",
            "Calls Ray Serve gave to another replica than the one placement chose",
            ["model", "role"],
            registry=r,
        )
        # The result cache (router/result_cache.py); all 0 while it is off.
        self.result_cache_hits = Counter(
            "pdserve_result_cache_hits",
            "Requests answered from the result cache, without reaching a worker",
            ["model"],
            registry=r,
        )
        self.result_cache_misses = Counter(
            "pdserve_result_cache_misses",
            "Fully determined requests looked up in the result cache and not found",
            ["model"],
            registry=r,
        )
        self.result_cache_errors = Counter(
            "pdserve_result_cache_errors",
            "Result cache lookups Redis did not answer in time (served by the workers)",
            ["model"],
            registry=r,
        )
        self.result_cache_stores = Counter(
            "pdserve_result_cache_stores",
            "Results offered to the result cache, by outcome",
            ["model", "result"],
            registry=r,
        )
        self.result_cache_stored_bytes = Counter(
            "pdserve_result_cache_stored_bytes",
            "Bytes of results stored in the result cache",
            ["model"],
            registry=r,
        )
        self.shed = Counter(
            "pdserve_router_shed_requests",
            "Requests refused with 429 past a limit, by priority and which limit (priority.py)",
            ["model", "priority", "reason"],
            registry=r,
        )
        self.route_decisions = Counter(
            "pdserve_model_route_decisions",
            "Requests naming a routed model, by route, the rule that matched and the model",
            ["route", "rule", "model"],
            registry=r,
        )
        self.index_snapshots = Counter(
            "pdserve_router_index_snapshots",
            "Snapshots of the prefix index this router's view was built from, by reason",
            ["model", "reason"],
            registry=r,
        )
        self.index_matches = Counter(
            "pdserve_router_index_matches",
            "Prefix matches by where they were answered: memory, stale (the last view,"
            " Redis unreachable) or redis",
            ["model", "source"],
            registry=r,
        )
        self.index_event_lag = Histogram(
            "pdserve_router_index_event_lag_seconds",
            "A KV event's age when this router's view applied it",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "pdserve_router_inflight_requests",
            "Requests this router replica admitted and has not finished",
            registry=r,
        )
        self._workers = _WorkerCollector()
        r.register(self._workers)

    def for_model(self, model: str) -> ModelMetrics:
        """The metrics a model's `RouterCore` records into (its `model` label set)."""
        return ModelMetrics(self, model)

    def render(self, workers: Mapping[str, Sequence[WorkerInfo]]) -> bytes:
        """The registry, with `workers` (live workers by model id) as the worker gauges."""
        self._workers.workers = workers
        return generate_latest(self.registry)
