"""Summaries of a `pdserve bench` run: percentiles, throughput, goodput, server deltas.

`summarize(records, duration_s, slo, server)` reduces the per-request records of one run;
`ServerStats.from_scrapes(before, after)` turns two `GET /metrics` scrapes into the
prefix-hit rate per pool and the mean TTFT per stage of pdserve's request path;
`markdown(runs)` renders runs as Markdown tables.
"""

from __future__ import annotations

import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pdserve.benchmarks.bench_client import RequestRecord

PERCENTILES = (50, 90, 99)
HIT_TOKENS = "pdserve_prefix_cache_hit_tokens_total"
PROMPT_TOKENS = "pdserve_prompt_tokens_total"
TTFT_STAGE = "pdserve_ttft_breakdown_seconds"

# (sample name, sorted label items) -> value
Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in seconds; None leaves that side unconstrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def is_met(self, record: RequestRecord) -> bool:
        if not record.success or record.ttft_s is None:
            return False
        if self.ttft_s is not None and record.ttft_s > self.ttft_s:
            return False
        tpot = record.tpot_s  # None (one token) meets any TPOT objective
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


@dataclass(frozen=True)
class Latency:
    """Percentiles and mean of one latency, in seconds (all None without samples)."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Latency:
        if not values:
            return cls(None, None, None, None, 0)
        p50, p90, p99 = (float(v) for v in np.percentile(values, PERCENTILES))
        return cls(p50, p90, p99, float(np.mean(values)), len(values))


def parse_scrape(text: str) -> Scrape:
    """Prometheus text exposition -> {(sample name, labels): value}."""
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def sample(scrape: Scrape, name: str, **labels: str) -> float:
    """A sample of a scrape by its name and labels, summed over the labels not given
    (e.g. `model`, on a cluster serving several); 0 when absent."""
    want = labels.items()
    return sum(
        value
        for (sample_name, have), value in scrape.items()
        if sample_name == name and want <= dict(have).items()
    )


def scrape_metrics(base_url: str, timeout_s: float = 30.0) -> Scrape:
    """`GET {base_url}/metrics`, parsed (blocking: for tests and scripts)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as resp:
        return parse_scrape(resp.read().decode())


def _deltas(before: Scrape, after: Scrape, name: str, label: str) -> dict[str, float]:
    """after - before of every series of `name`, keyed by its `label` value."""
    out: dict[str, float] = {}
    for (sample, labels), value in after.items():
        if sample == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value - before.get((sample, labels), 0.0)
    return out


@dataclass(frozen=True)
class ServerStats:
    """What the server's /metrics counted during a run (one router replica's view)."""

    prompt_tokens: dict[str, float]  # per pool
    prefix_hit_tokens: dict[str, float]  # per pool
    prefix_hit_rate: dict[str, float | None]  # per pool: hit / prompt tokens
    ttft_stage_mean_s: dict[str, float | None]  # per stage
    ttft_stage_count: dict[str, float]

    @classmethod
    def from_scrapes(cls, before: Scrape, after: Scrape) -> ServerStats:
        prompt = _deltas(before, after, PROMPT_TOKENS, "pool")
        hits = _deltas(before, after, HIT_TOKENS, "pool")
        sums = _deltas(before, after, f"{TTFT_STAGE}_sum", "stage")
        counts = _deltas(before, after, f"{TTFT_STAGE}_count", "stage")
        return cls(
            prompt_tokens=prompt,
            prefix_hit_tokens=hits,
            prefix_hit_rate={p: hits.get(p, 0.0) / n if n else None for p, n in prompt.items()},
            ttft_stage_mean_s={s: sums.get(s, 0.0) / n if n else None for s, n in counts.items()},
            ttft_stage_count=counts,
        )


@dataclass(frozen=True)
class ResultCacheStats:
    """What pdserve's `x-pdserve-result-cache` header said over a run's successes."""

    hits: int
    misses: int
    bypassed: int
    repeats: int  # requests that resent an earlier one (`--repeat-fraction`)
    hit_rate: float | None  # hits / requests that carried the header
    ttft_hit_s: Latency
    ttft_miss_s: Latency

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> ResultCacheStats | None:
        """None when no response carried the header (no pdserve cache on the server)."""
        said = [r for r in records if r.result_cache]
        if not said:
            return None

        def ttft(status: str) -> Latency:
            return Latency.of([r.ttft_s for r in said if r.result_cache == status and r.ttft_s])

        hits = sum(r.result_cache == "hit" for r in said)
        return cls(
            hits=hits,
            misses=sum(r.result_cache == "miss" for r in said),
            bypassed=sum(r.result_cache == "bypass" for r in said),
            repeats=sum(r.repeat_of is not None for r in records),
            hit_rate=hits / len(said),
            ttft_hit_s=ttft("hit"),
            ttft_miss_s=ttft("miss"),
        )


@dataclass(frozen=True)
class Summary:
    """One run reduced. Throughputs are per second of the run's wall time."""

    num_requests: int
    num_succeeded: int
    failures: dict[str, int]  # by reason
    duration_s: float
    prompt_tokens: int  # over succeeded requests
    output_tokens: int  # over succeeded requests
    request_throughput: float
    output_token_throughput: float
    goodput: float  # requests/s that succeeded within the SLO
    num_within_slo: int
    ttft_s: Latency
    itl_s: Latency
    tpot_s: Latency
    e2e_s: Latency
    server: ServerStats | None = None
    slo: SLO = field(default_factory=SLO)
    result_cache: ResultCacheStats | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: SLO,
    server: ServerStats | None = None,
) -> Summary:
    """Reduce one run's records; latencies are over the requests that succeeded."""
    ok = [r for r in records if r.success]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    num_good = sum(slo.is_met(r) for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return Summary(
        num_requests=len(records),
        num_succeeded=len(ok),
        failures=dict(Counter(r.reason for r in records if not r.success)),
        duration_s=duration_s,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        output_token_throughput=output_tokens * per_s,
        goodput=num_good * per_s,
        num_within_slo=num_good,
        ttft_s=Latency.of([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_s=Latency.of([gap for r in ok for gap in r.itl_s]),
        tpot_s=Latency.of([t for r in ok if (t := r.tpot_s) is not None]),
        e2e_s=Latency.of([r.e2e_s for r in ok if r.e2e_s is not None]),
        server=server,
        slo=slo,
        result_cache=ResultCacheStats.of(ok),
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _latency_table(s: Summary) -> list[str]:
    rows = ["| latency (ms) | p50 | p90 | p99 | mean |", "|---|---:|---:|---:|---:|"]
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        lat: Latency = getattr(s, name)
        label = name.removesuffix("_s").upper()
        rows.append(
            f"| {label} | {_ms(lat.p50)} | {_ms(lat.p90)} | {_ms(lat.p99)} | {_ms(lat.mean)} |"
        )
    return rows


def _totals_table(s: Summary) -> list[str]:
    failures = ", ".join(f"{k}: {v}" for k, v in sorted(s.failures.items())) or "none"
    slo = ", ".join(
        f"{name} <= {limit:g} s"
        for name, limit in (("TTFT", s.slo.ttft_s), ("TPOT", s.slo.tpot_s))
        if limit is not None
    )
    rows = [
        "| | |",
        "|---|---|",
        f"| requests (succeeded / sent) | {s.num_succeeded} / {s.num_requests} |",
        f"| failures | {failures} |",
        f"| duration | {s.duration_s:.2f} s |",
        f"| request throughput | {s.request_throughput:.2f} req/s |",
        f"| output token throughput | {s.output_token_throughput:.1f} tok/s |",
        f"| goodput ({slo or 'no SLO'}) | {s.goodput:.2f} req/s ({s.num_within_slo} requests) |",
        f"| prompt / output tokens | {s.prompt_tokens} / {s.output_tokens} |",
    ]
    if (rc := s.result_cache) is not None:
        cached = "-" if rc.hit_rate is None else f"{rc.hit_rate:.1%}"
        rows += [
            f"| result cache hit rate | {cached} ({rc.hits} hits, {rc.misses} misses, "
            f"{rc.bypassed} bypassed; {rc.repeats} repeated requests) |",
            f"| TTFT p50 hits / misses | {_ms(rc.ttft_hit_s.p50)} / {_ms(rc.ttft_miss_s.p50)} ms |",
        ]
    if s.server is None:
        return [*rows, "| server metrics | not available |"]
    for pool, rate in sorted(s.server.prefix_hit_rate.items()):
        hit = "-" if rate is None else f"{rate:.1%}"
        rows.append(f"| prefix-cache hit rate ({pool}) | {hit} |")
    for stage, mean in s.server.ttft_stage_mean_s.items():
        rows.append(f"| TTFT stage {stage} (mean) | {_ms(mean)} ms |")
    return rows


def markdown(runs: Sequence[tuple[str, Summary]]) -> str:
    """Runs as Markdown: an overview row per run, then each run's tables."""
    lines = [
        "| run | ok / sent | req/s | out tok/s | goodput | TTFT p50 (ms) | TPOT p50 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, s in runs:
        lines.append(
            f"| {label} | {s.num_succeeded} / {s.num_requests} | {s.request_throughput:.2f} | "
            f"{s.output_token_throughput:.1f} | {s.goodput:.2f} | {_ms(s.ttft_s.p50)} | "
            f"{_ms(s.tpot_s.p50)} |"
        )
    for label, s in runs:
        lines += ["", f"### {label}", "", *_latency_table(s), "", *_totals_table(s)]
    return "\n".join(lines) + "\n"
