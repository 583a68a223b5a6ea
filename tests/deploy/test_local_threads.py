"""`pdserve up`'s threads on a cluster of its own (deploy/up.py, `with_local_threads`):
the machine's CPUs shared among the engine processes it will run, unless chosen."""

from __future__ import annotations

import pytest

from pdserve.cluster.config import ClusterConfig
from pdserve.deploy import up


@pytest.fixture
def eight_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "usable_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def threads(config: ClusterConfig) -> tuple[int, int]:
    local = up.with_local_threads(config)
    return local.threads("prefill"), local.threads("decode")


@pytest.mark.usefixtures("eight_cpus")
def test_the_cpus_are_shared_among_every_engine_process() -> None:
    assert threads(ClusterConfig(model="m", mode="colocated", decode_replicas=1)) == (8, 8)
    assert threads(ClusterConfig(model="m", prefill_replicas=1, decode_replicas=1)) == (4, 4)
    assert threads(ClusterConfig(model="m", prefill_replicas=2, decode_replicas=2)) == (2, 2)
    # TP ranks are processes too; colocated mode has no prefill pool
    config = ClusterConfig(model="m", mode="colocated", decode_replicas=2, decode_tp=2)
    assert up.engine_processes(config) == 4
    assert threads(config) == (2, 2)


@pytest.mark.usefixtures("eight_cpus")
def test_an_autoscaling_pool_counts_at_its_maximum() -> None:
    config = ClusterConfig(
        model="m",
        prefill_replicas=1,
        decode_replicas=1,
        decode_autoscaling={"min_replicas": 1, "max_replicas": 3},
    )
    assert up.engine_processes(config) == 4
    assert threads(config) == (2, 2)


@pytest.mark.usefixtures("eight_cpus")
def test_a_choice_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    assert threads(ClusterConfig(model="m", mode="colocated", num_threads=3)) == (3, 3)
    pinned = ClusterConfig(model="m", prefill_cpus="0", decode_cpus="1-2")
    assert threads(pinned) == (1, 2)
    # more replicas than CPUs: never below the pool's own default
    many = ClusterConfig(model="m", mode="colocated", decode_replicas=16)
    assert threads(many) == (1, 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads(ClusterConfig(model="m", mode="colocated")) == (1, 1)
