"""The router's Prometheus metrics (`GET /metrics`), every name prefixed `pdserve_`.

Request-level figures (latencies, the TTFT breakdown, prefix hits per pool, transfer
bytes) are observed by the router replica that served the request, from what the
workers report with each call. Worker gauges (running and waiting requests, KV blocks,
queued prefill tokens) are read from the prefix index at scrape time, so any router
replica shows the whole cluster. Scrape every router replica and sum the counters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from pdserve.cluster.prefix_index import WorkerInfo
from pdserve.router.disagg import REASONS

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
}


class _WorkerCollector:
    """Exposes the last index snapshot of every live worker as gauges."""

    def __init__(self) -> None:
        self.workers: Sequence[WorkerInfo] = ()

    def collect(self) -> Iterable[Metric]:
        for name, doc in _WORKER_GAUGES.items():
            family = GaugeMetricFamily(f"pdserve_worker_{name}", doc, labels=["worker", "role"])
            for w in self.workers:
                if name in w.load:
                    family.add_metric([w.worker_id, w.role], w.load[name])
            yield family
        live = GaugeMetricFamily("pdserve_workers_live", "Live workers per pool", labels=["role"])
        for role in ("prefill", "decode"):
            live.add_metric([role], sum(w.role == role for w in self.workers))
        yield live


class RouterMetrics:
    """One registry per router replica (tests may build several in one process)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Request arrival at the router to its first token leaving it",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Time between consecutive streamed tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_stage = Histogram(
            "pdserve_ttft_breakdown_seconds",
            "Where time to first token went, per stage of the request path",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pdserve_requests", "Requests by outcome", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens",
            "Prompt tokens each pool was asked to hold",
            ["pool"],
            registry=r,
        )
        self.hit_tokens = Counter(
            "pdserve_prefix_cache_hit_tokens",
            "Prompt tokens each pool found in its prefix cache",
            ["pool"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens generated", registry=r
        )
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes pushed from prefill to decode", registry=r
        )
        self.transfer_blocks = Counter(
            "pdserve_kv_transfer_blocks", "KV blocks pushed from prefill to decode", registry=r
        )
        self.transfer_seconds = Counter(
            "pdserve_kv_transfer_seconds", "Seconds spent pushing KV", registry=r
        )
        self.transfers_failed = Counter(
            "pdserve_kv_transfer_failures",
            "Pushes that failed (decode prefilled locally)",
            registry=r,
        )
        self.local_prefills = Counter(
            "pdserve_decode_local_prefill",
            "Prompts a decode worker prefilled itself in disaggregated mode, by reason",
            ["reason"],
            registry=r,
        )
        for reason in LOCAL_PREFILL_REASONS:  # every reason shows, at 0 until it happens
            self.local_prefills.labels(reason)
        self.disagg_decisions = Counter(
            "pdserve_disagg_decisions",
            "Where each prompt was prefilled (or why it was shed), by the router's reason",
            ["where", "reason"],
            registry=r,
        )
        for where, reasons in REASONS.items():
            for reason in reasons:
                self.disagg_decisions.labels(where, reason)
        self.resumes = Counter(
            "pdserve_decode_resumes",
            "Streams resumed on another decode worker after theirs failed",
            registry=r,
        )
        self.placements = Counter(
            "pdserve_placements",
            "Requests served per worker (the replica that took the call)",
            ["role", "worker"],
            registry=r,
        )
        self.placement_overrides = Counter(
            "pdserve_placement_overrides",
            "Calls Ray Serve gave to another replica than the one placement chose",
            ["role"],
            registry=r,
        )
        self.shed = Counter(
            "pdserve_router_shed_requests",
            "Requests refused with 429 past a limit, by priority and which limit (priority.py)",
            ["priority", "reason"],
            registry=r,
        )
        self.inflight = Gauge(
            "pdserve_router_inflight_requests",
            "Requests this router replica admitted and has not finished",
            registry=r,
        )
        self._workers = _WorkerCollector()
        r.register(self._workers)

    def render(self, workers: Sequence[WorkerInfo]) -> bytes:
        self._workers.workers = workers
        return generate_latest(self.registry)
