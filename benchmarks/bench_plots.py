"""PNG plots of `pdserve bench` runs (matplotlib, Agg backend: no screen needed).

`plot_cdfs` draws the TTFT and TPOT CDFs (one curve per run); `plot_goodput` draws
goodput and request throughput against the offered request rate of a rate sweep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.benchmarks.bench_client import RequestRecord
from pdserve.benchmarks.bench_report import Summary


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: before pyplot is imported; never opens a window
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values: list[float], label: str) -> None:
    xs = sorted(v * 1000 for v in values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")


def plot_cdfs(runs: Sequence[tuple[str, Sequence[RequestRecord]]], out_dir: Path) -> list[Path]:
    """Write ttft_cdf.png and tpot_cdf.png (succeeded requests); return the paths."""
    plt = _pyplot()
    paths = []
    for name, title in (("ttft", "Time to first token"), ("tpot", "Time per output token")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, records in runs:
            values = [getattr(r, f"{name}_s") for r in records if r.success]
            values = [v for v in values if v is not None]
            if values:
                _cdf(ax, values, label)
        ax.set(xlabel=f"{name.upper()} (ms)", ylabel="fraction of requests", title=title)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        path = out_dir / f"{name}_cdf.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def plot_goodput(points: Sequence[tuple[float, Summary]], out_dir: Path) -> Path:
    """Write goodput_vs_rate.png from (offered rate, summary) points; return the path.

    A rate of inf (all requests at once) has no place on the axis: its goodput is drawn
    as a horizontal line instead.
    """
    plt = _pyplot()
    finite = [(rate, s) for rate, s in points if math.isfinite(rate)]
    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [rate for rate, _ in finite]
    ax.plot(rates, [s.goodput for _, s in finite], "o-", label="goodput (within SLO)")
    ax.plot(rates, [s.request_throughput for _, s in finite], "s--", label="throughput")
    for rate, s in points:
        if not math.isfinite(rate):
            ax.axhline(s.goodput, color="gray", linestyle=":", label="goodput, all at once")
    ax.set(xlabel="offered rate (req/s)", ylabel="req/s", title="Goodput vs request rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    path = out_dir / "goodput_vs_rate.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
