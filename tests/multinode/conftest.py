"""Multi-node tests: network namespaces as hosts (`pdserve.benchmarks.netns`).

Need root (CI runs as root) and iproute2; elsewhere they skip with that reason.
"""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.benchmarks.netns import NEEDS, can_make_namespaces, topology


@pytest.fixture
def make_topology() -> Any:
    """`with make_topology(n) as topo:` n nodes, all removed afterwards."""
    if not can_make_namespaces():
        pytest.skip(NEEDS)
    return topology
