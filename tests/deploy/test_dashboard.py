"""The Grafana dashboard and the Prometheus alerts ask only for what pdserve exports.

`deploy/grafana/pdserve-dashboard.json` and `deploy/prometheus/pdserve-alerts.yaml` are
PromQL against the router's `GET /metrics`. A renamed metric or label would leave a panel
empty or an alert silent, and nothing else would notice. So every metric name in every
expression (panel targets, template variables, alert rules) must be a series the router's
real registry exposes, every label a selector or a grouping names must be one of that
series', every metric must be in docs/metrics.md, and every alert must say how bad it is
and what it means. No Ray, no network: the registry is built in this process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.index_follower import MATCH_SOURCES, SNAPSHOT_REASONS
from pdserve.cluster.prefix_index import WorkerInfo
from pdserve.router.disagg import REASONS
from pdserve.router.metrics import (
    FETCH_OUTCOMES,
    LOCAL_PREFILL_REASONS,
    TTFT_STAGES,
    RouterMetrics,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "pdserve-alerts.yaml"
METRICS_DOC = ROOT / "docs" / "metrics.md"

# PromQL's functions, aggregations and keywords, and Grafana's variable-query functions:
# every other identifier in an expression is a metric name.
_WORDS = """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg avg_over_time bottomk
    ceil changes clamp clamp_max clamp_min cos cosh count count_over_time count_values
    day_of_month day_of_week day_of_year days_in_month deg delta deriv exp floor group
    histogram_avg histogram_count histogram_fraction histogram_quantile histogram_stddev
    histogram_stdvar histogram_sum holt_winters hour idelta increase irate label_join
    label_replace last_over_time limitk limit_ratio ln log10 log2 mad_over_time max
    max_over_time min min_over_time minute month pi predict_linear present_over_time
    quantile quantile_over_time rad rate resets round scalar sgn sin sinh sort
    sort_by_label sort_by_label_desc sort_desc sqrt stddev stddev_over_time stdvar
    stdvar_over_time sum sum_over_time tan tanh time timestamp topk vector year
    and or unless by without on ignoring group_left group_right bool offset start end
    inf nan le label_values label_names metrics query_result
    """
PROMQL_WORDS = frozenset(_WORDS.split())
# Labels Prometheus adds to every scraped series (the scrape target's).
TARGET_LABELS = frozenset({"instance", "job"})
# The label values pdserve's code enumerates; a selector naming another matches nothing.
LABEL_VALUES: dict[tuple[str | None, str], tuple[str, ...]] = {
    (None, "role"): ("prefill", "decode"),
    ("pdserve_ttft_breakdown_seconds", "stage"): TTFT_STAGES,
    ("pdserve_decode_local_prefill", "reason"): LOCAL_PREFILL_REASONS,
    ("pdserve_kv_fetch", "outcome"): FETCH_OUTCOMES,
    ("pdserve_router_index_matches", "source"): MATCH_SOURCES,
    ("pdserve_router_index_snapshots", "reason"): SNAPSHOT_REASONS,
    ("pdserve_router_shed_requests", "reason"): ("inflight", "prefill_queue"),
    ("pdserve_disagg_decisions", "where"): tuple(REASONS),
}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
# not after a word character (a number's exponent, a duration's unit), a `$` or a `.`
_IDENT = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*")
_SELECTOR = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)\s*\{([^{}]*)\}")
_MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_LABEL_VALUES = re.compile(r"label_values\(\s*(.*?)\s*,\s*([A-Za-z_]\w*)\s*\)")


class Series(NamedTuple):
    family: str
    type: str
    labels: frozenset[str]


def metric_names(expr: str) -> set[str]:
    """Every metric name in a PromQL expression (a Grafana variable query included)."""
    text = _LABEL_VALUES.sub(r"label_values(\1)", expr)  # its second argument is a label
    text = _STRING.sub('""', text)  # label values, `$model` among them
    text = _BRACES.sub("{}", text)  # label matchers
    text = _BRACKETS.sub("[]", text)  # ranges, `$__rate_interval`
    text = _GROUPING.sub(r"\1()", text)  # label lists: by (le), on (model), ...
    return {word for word in _IDENT.findall(text) if word not in PROMQL_WORDS}


def selectors(expr: str) -> Iterator[tuple[str, list[tuple[str, str, str]]]]:
    """`(metric, [(label, op, value), ...])` for every `metric{...}` in `expr`."""
    for match in _SELECTOR.finditer(expr):
        if match.group(1) not in PROMQL_WORDS:
            yield match.group(1), _MATCHER.findall(match.group(2))


def grouping_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for _, labels in _GROUPING.findall(_STRING.sub('""', expr))
        for label in labels.split(",")
        if label.strip()
    }


@cache
def exported() -> dict[str, Series]:
    """Every series name a router replica's `GET /metrics` can carry, with its labels.

    From the real registry (`RouterMetrics`), rendered as Prometheus scrapes it: every
    labelled metric given one child, and one worker reporting every gauge the router
    re-exports from the workers' heartbeats (the `pdserve_worker_*` families).
    """
    metrics = RouterMetrics()
    # a labelled metric shows no series until it has a child (prometheus_client keeps
    # its label names in `_labelnames`, no public accessor)
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*("x" for _ in metric._labelnames))
    load = {
        family.name.removeprefix("pdserve_worker_"): 1
        for family in metrics.registry.collect()
        if family.name.startswith("pdserve_worker_")
    }
    assert "kv_blocks_used" in load  # the worker gauges are in the registry
    scrape = metrics.render({"m": [WorkerInfo("w0", "decode", "", load=load)]}).decode()
    series: dict[str, Series] = {}
    for family in text_string_to_metric_families(scrape):
        for sample in family.samples:
            labels = series[sample.name].labels if sample.name in series else frozenset()
            series[sample.name] = Series(
                family.name, family.type, labels | frozenset(sample.labels)
            )
    return series


def family_of(name: str) -> Series | None:
    """The family `name` is a series of (`_bucket`, `_total`, ... mapped back), if any."""
    families = {s.family: s for s in exported().values()}
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created", ""):
        base = name.removesuffix(suffix) if suffix else name
        if (
            name.endswith(suffix)
            and base in families
            and suffix in _SUFFIXES.get(families[base].type, ())
        ):
            return families[base]
    return None


def documented_name(series: Series) -> str:
    """The name docs/metrics.md gives the family: counters with `_total`, as scraped."""
    return f"{series.family}_total" if series.type == "counter" else series.family


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@cache
def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def variable(name: str) -> dict[str, Any]:
    (found,) = [v for v in dashboard()["templating"]["list"] if v["name"] == name]
    return found


def variable_query(var: dict[str, Any]) -> str:
    query = var["query"]
    return query["query"] if isinstance(query, dict) else query


def expressions() -> list[tuple[str, str]]:
    """`(where, PromQL)`: every panel target, the model variable's query, every alert."""
    found = [
        (f"panel {panel['title']!r}", target["expr"])
        for panel in _panels(dashboard()["panels"])
        for target in panel.get("targets", [])
    ]
    found.append(("variable 'model'", variable_query(variable("model"))))
    found += [(f"alert {rule['alert']}", rule["expr"]) for rule in rules()]
    return found


def used_metrics() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for where, expr in expressions():
        for name in metric_names(expr):
            used.setdefault(name, []).append(where)
    return used


# -- the checks can fail ------------------------------------------------------------------


def test_the_extraction_finds_metrics_and_only_metrics() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (le, model) (rate(pdserve_not_a_metric_bucket"
        '{model=~"$model", stage="transfer"}[$__rate_interval]))) / on (model) group_left'
        " sum without (worker)"
        " (pdserve_other_total offset 5m) > bool 1e-3 and pdserve_bare"
    )
    assert metric_names(expr) == {
        "pdserve_not_a_metric_bucket",
        "pdserve_other_total",
        "pdserve_bare",
    }
    assert grouping_labels(expr) == {"le", "model", "worker"}
    assert metric_names("label_values(pdserve_requests_total, model)") == {"pdserve_requests_total"}
    assert next(selectors(expr)) == (
        "pdserve_not_a_metric_bucket",
        [("model", "=~", "$model"), ("stage", "=", "transfer")],
    )


def test_an_unknown_metric_is_not_exported() -> None:
    series = exported()
    assert "pdserve_time_to_first_token_seconds_bucket" in series  # the scrape saw metrics
    assert "pdserve_worker_kv_blocks_used" in series  # and the heartbeat gauges
    assert "le" in series["pdserve_time_to_first_token_seconds_bucket"].labels
    for name in (
        "pdserve_not_a_metric",
        "pdserve_not_a_metric_total",
        "pdserve_not_a_metric_bucket",
    ):
        assert name not in series
        assert family_of(name) is None
    # a suffix the family's type does not have is no series of it
    assert family_of("pdserve_requests_bucket") is None
    assert family_of("pdserve_worker_running_total") is None
    assert family_of("pdserve_requests_total") is not None


def test_the_files_use_many_metrics() -> None:
    used = used_metrics()
    assert len(used) >= 15, sorted(used)
    assert "pdserve_time_to_first_token_seconds_bucket" in used
    assert "pdserve_kv_transfer_failures_total" in used


# -- the dashboard and the alerts ---------------------------------------------------------


def test_every_metric_used_is_exported() -> None:
    series = exported()
    unknown = {name: where for name, where in used_metrics().items() if name not in series}
    assert not unknown, f"not exported by pdserve's router: {unknown}"
    assert all(family_of(name) is not None for name in used_metrics())


def test_every_metric_used_is_documented() -> None:
    text = METRICS_DOC.read_text()
    missing = set()
    for name in used_metrics():
        series = family_of(name)
        assert series is not None, name
        if f"`{documented_name(series)}`" not in text:
            missing.add(documented_name(series))
    assert not missing, f"docs/metrics.md lacks {sorted(missing)}"


@pytest.mark.parametrize("where, expr", expressions(), ids=[w for w, _ in expressions()])
def test_selectors_and_groupings_use_real_labels(where: str, expr: str) -> None:
    series = exported()
    available = set(TARGET_LABELS)
    for name, matchers in selectors(expr):
        assert name in series, f"{where}: {name}"
        labels = series[name].labels | TARGET_LABELS
        available |= labels
        for label, op, value in matchers:
            assert label in labels, f"{where}: {name} has no label {label!r}"
            allowed = LABEL_VALUES.get(
                (series[name].family, label), LABEL_VALUES.get((None, label))
            )
            if allowed is None or "$" in value:
                continue
            values = value.split("|") if op in ("=~", "!~") else [value]
            if op in ("=~", "!~") and not re.fullmatch(r"[\w|]+", value):
                continue  # a real regular expression: not checked
            bad = [v for v in values if v not in allowed]
            assert not bad, f"{where}: {name}{{{label}}} is never {bad} (only {allowed})"
        if "model" in series[name].labels and where.startswith("panel"):
            assert ("model", "=~", "$model") in matchers, f"{where}: {name} ignores $model"
    for name in metric_names(expr):
        available |= series[name].labels if name in series else set()
    bad_groups = grouping_labels(expr) - available
    assert not bad_groups, f"{where}: groups by labels no series has: {bad_groups}"


def test_the_dashboard_is_grafanas() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 36
    assert board["uid"] and board["title"]
    source = variable("datasource")
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    model = variable("model")
    assert model["datasource"]["uid"] == "${datasource}"
    match = _LABEL_VALUES.fullmatch(variable_query(model))
    assert match is not None, variable_query(model)
    (metric,) = metric_names(match.group(1))
    assert match.group(2) == "model" and "model" in exported()[metric].labels
    panels = list(_panels(board["panels"]))
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert rows == ["Request path", "Pools", "Transfer"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"{panel['title']} has no query"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["expr"].strip(), panel["title"]


def test_every_alert_says_how_bad_and_what() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names)), "alert names repeat"
    assert {
        "PdserveTTFTFastBurn",
        "PdserveTTFTSlowBurn",
        "PdserveShedding",
        "PdserveKVTransferFailures",
        "PdservePrefixIndexUnreachable",
    } <= set(names)
    for rule in rules():
        name = rule["alert"]
        assert rule.get("for"), f"{name} has no `for`"
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"].strip(), name
        assert rule["annotations"]["description"].strip(), name
        assert "pdserve_" in rule["expr"], name
