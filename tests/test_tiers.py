"""The fast tier sees a missing tier marker before the slow one runs.

`_TierGuard` (tests/conftest.py) fails a test that starts a redis-server or a Ray cluster
without its marker, but only when that test runs, which the fast tier never does: a
module that starts one in a fixture of its own once reached CI unmarked and failed 40
tests there. This reads every test module instead: one that calls `EmbeddedRedis(...)`
must say `redis` (by marker, or by naming its fixture `redis_url`/`redis_server`, which
marks its users), one that calls `ray.init(...)` must say `cluster` or a marker under it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import TIER_FIXTURES, UMBRELLA

TESTS = Path(__file__).parent


def _calls(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                names.add(func.id)
            elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                names.add(f"{func.value.id}.{func.attr}")
    return names


def _markers(tree: ast.AST) -> set[str]:
    """`pytest.mark.X` anywhere in the module (pytestmark, decorators, param marks)."""
    found = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"
        ):
            found.add(node.attr)
    return found


def _fixtures(tree: ast.AST) -> set[str]:
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        and any("fixture" in ast.unparse(d) for d in node.decorator_list)
    }


def test_every_module_that_starts_redis_or_ray_carries_its_marker() -> None:
    unmarked = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == "conftest.py" or path == Path(__file__):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        calls, markers = _calls(tree), _markers(tree)
        name = path.relative_to(TESTS)
        if "EmbeddedRedis" in calls:
            by_fixture = _fixtures(tree) & TIER_FIXTURES["redis"]
            if "redis" not in markers and not by_fixture:
                unmarked.append(f"{name}: starts a redis-server, not marked `redis`")
        if "ray.init" in calls and not markers & {"cluster", *UMBRELLA}:
            unmarked.append(f"{name}: calls ray.init, not marked `cluster`")
    assert not unmarked, "\n".join(unmarked)


def test_the_check_sees_an_unmarked_module(tmp_path: Path) -> None:
    """The scan above is only worth something if it can fail."""
    source = "from x import EmbeddedRedis\n\ndef test_a():\n    EmbeddedRedis().start()\n"
    tree = ast.parse(source)
    assert "EmbeddedRedis" in _calls(tree)
    assert "redis" not in _markers(tree)
    marked = ast.parse("import pytest\npytestmark = pytest.mark.redis\n" + source)
    assert "redis" in _markers(marked)
