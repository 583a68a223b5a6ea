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


_ROW = re.compile(r"^\| `([a-z_0-9]+)` \| ([^|]*) \| ([^|]*) \|", re.MULTILINE)
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _documented_default(cell: str) -> tuple[bool, object]:
    """(whether the cell states a plain value, that value)."""
    text = cell.strip().strip("`")
    if cell.strip() in ("off", "none", "None"):  # bare: no value (a backticked one is a word)
        return True, None
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return True, float(text)
    unit = re.fullmatch(r"(\d+) (KiB|MiB|GiB)", text)
    if unit:
        return True, float(int(unit.group(1)) * _UNITS[unit.group(2)])
    if cell.strip().startswith("`") and re.fullmatch(r"[a-z0-9_.:/-]+", text):
        return True, text
    return False, None


def test_each_documented_flag_and_default_is_the_models() -> None:
    """The flag and the default docs/configuration.md states for a field are the ones the
    command line and the model have (deploy/flags.py generates one from the other)."""
    from pdserve.deploy.flags import flag_fields, flag_name

    text = (DOCS / "configuration.md").read_text()
    fields = flag_fields(ClusterConfig)
    checked = 0
    wrong = []
    for name, flag_cell, default_cell in _ROW.findall(text):
        field = fields.get(name)
        if field is None:
            continue
        if flag_name(name) not in flag_cell:
            wrong.append(
                f"{name}: flag {flag_cell.strip()!r}, the command line's is {flag_name(name)}"
            )
        plain, value = _documented_default(default_cell)
        if not plain or field.default_factory is not None:
            continue
        checked += 1
        default = field.default
        same = value == (
            float(default)
            if isinstance(default, int | float) and not isinstance(default, bool)
            else default
        )
        if not same:
            wrong.append(
                f"{name}: documented default {default_cell.strip()!r}, the model's {default!r}"
            )
    assert not wrong, "\n".join(wrong)
    assert checked >= 40, f"only {checked} documented defaults could be checked"
