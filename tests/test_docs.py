"""The repository's docs stand alone and stay true to the code they describe.

`docs/configuration.md` must name every field of `ClusterConfig` and `docs/metrics.md`
every metric the router exports, so a new field or metric without documentation fails
here; no file may point outside the repository, and every relative link must resolve.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pdserve.cluster.config import KVTLS, ClusterConfig, PlacementWeights, PoolAutoscaling
from pdserve.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _tracked_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


@pytest.mark.parametrize(
    "model", [ClusterConfig, PlacementWeights, PoolAutoscaling, KVTLS], ids=lambda m: m.__name__
)
def test_every_configuration_field_is_documented(model: type) -> None:
    text = (DOCS / "configuration.md").read_text()
    missing = [name for name in model.model_fields if f"`{name}`" not in text]
    assert not missing, f"docs/configuration.md lacks {model.__name__} fields {missing}"


def test_every_router_metric_is_documented() -> None:
    text = (DOCS / "metrics.md").read_text()
    names = {metric.name for metric in RouterMetrics().registry.collect()}
    assert "pdserve_time_to_first_token_seconds" in names  # the scrape really saw metrics
    missing = sorted(name for name in names if name not in text)
    assert not missing, f"docs/metrics.md lacks {missing}"


def test_nothing_points_outside_the_repository() -> None:
    outside = re.compile(r"\.\./shared\b|shared[/](DESIGN|STYLE)|\bDESIGN\.md\b")
    offenders = []
    for path in _tracked_files():
        if path.suffix not in {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ""}:
            continue
        if path == Path(__file__).resolve():
            continue
        text = path.read_text(errors="replace")
        offenders += [
            f"{path.relative_to(ROOT)}:{n}"
            for n, line in enumerate(text.splitlines(), 1)
            if outside.search(line)
        ]
    assert not offenders, f"references outside the repository: {offenders[:20]}"


def test_relative_links_in_the_docs_resolve() -> None:
    pages = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"broken links: {broken}"
