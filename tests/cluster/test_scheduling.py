"""cluster/scheduling.py: what a replica asks Ray for, and when one is reported unplaced.

Plain values, no Ray: the asks come from real configurations, the cluster views are
built by hand (tests/faults/test_stop_states.py reads them from a real cluster).
"""

from __future__ import annotations

from pathlib import Path

from pdserve.cluster.config import ClusterConfig, model_app_name
from pdserve.cluster.scheduling import (
    ClusterView,
    ReplicaAsk,
    SchedulingWatch,
    _replica_of,
    cluster_asks,
    replica_ask,
)

APP = "pdserve"


def config(model_dir: Path | None, **fields: object) -> ClusterConfig:
    model = {} if model_dir is None else {"model": str(model_dir)}
    return ClusterConfig(redis_url="redis://127.0.0.1:1/0", **model, **fields)  # type: ignore[arg-type]


def view(waiting: dict[str, tuple[str, str]], free: float, total: float = 4.0) -> ClusterView:
    return ClusterView(
        waiting=waiting,
        free_per_node=[{"CPU": free}],
        total_per_node=[{"CPU": total}],
        autoscaling=False,
    )


def test_a_tensor_parallel_replica_asks_for_its_bundles_on_one_node(random_model_dir: Path) -> None:
    cfg = config(random_model_dir, prefill_tp=2, replica_num_cpus=1.5, prefill_resources={"p": 1})
    ask = replica_ask(cfg, "prefill", APP)
    assert ask.bundles == ({"CPU": 1.5, "p": 1.0}, {"CPU": 1.5, "p": 1.0})
    assert ask.per_node() == {"CPU": 3.0, "p": 2.0}
    assert ask.group_options()["placement_group_strategy"] == "STRICT_PACK"
    assert "placement group of 2 bundles ({CPU 1.5, p 1} each)" in ask.describe()
    # one node must hold all of it; two half-free nodes do not
    assert not ask.fits([{"CPU": 2.0, "p": 1.0}, {"CPU": 2.0, "p": 1.0}])
    assert ask.fits([{"CPU": 3.0, "p": 2.0}])
    decode = replica_ask(cfg, "decode", APP)
    assert (decode.bundles, decode.per_node()) == ((), {"CPU": 1.5})


def test_each_model_of_a_cluster_is_asked_for_in_its_own_application(
    random_model_dir: Path,
) -> None:
    cfg = config(
        None,
        models=[
            {"model": str(random_model_dir), "served_model_name": "a"},
            {"model": str(random_model_dir), "served_model_name": "b", "mode": "colocated"},
        ],
    )
    keys = {(a.app, a.deployment) for a in cluster_asks(cfg, APP)}
    assert keys == {
        (APP, "Router"),
        (model_app_name("a"), "Prefill"),
        (model_app_name("a"), "Decode"),
        (model_app_name("b"), "Decode"),
    }


def test_serve_replica_names_are_parsed() -> None:
    assert _replica_of("SERVE_REPLICA::pdserve#Decode#ab12") == ("pdserve", "Decode")
    assert _replica_of("SERVE_CONTROLLER_ACTOR") is None
    assert _replica_of("SERVE_REPLICA::bad") is None


def test_a_replica_is_reported_once_it_waited_and_no_node_can_hold_it() -> None:
    ask = ReplicaAsk(APP, "Decode", num_cpus=1.0, num_gpus=0.0)
    watch = SchedulingWatch([ask], after_s=10.0)
    waiting = {"actor-1": (APP, "Decode")}
    assert watch.check(view(waiting, free=0.0), now=100.0) == []  # just seen
    assert watch.check(view(waiting, free=0.0), now=109.0) == []
    (report,) = watch.check(view(waiting, free=0.0), now=111.0)
    assert (report.num_waiting, round(report.waiting_s)) == (1, 11)
    message = report.message()
    assert "1 replica of Decode (application pdserve) cannot be scheduled" in message
    assert "asks for CPU 1" in message and "0 of 4 CPU free (1 node)" in message
    assert report.as_json()["cluster_free"] == {"CPU": 0.0}
    # a node that could hold it now: it is being placed, not refused
    assert watch.check(view(waiting, free=1.0), now=112.0) == []
    # placed: forgotten; waiting again later starts a new count
    assert watch.check(view({}, free=0.0), now=113.0) == []
    assert watch.check(view(waiting, free=0.0), now=114.0) == []


def test_an_autoscaling_cluster_is_said_to_be_waiting_for_nodes() -> None:
    ask = ReplicaAsk(APP, "Prefill", num_cpus=0.0, num_gpus=1.0)
    watch = SchedulingWatch([ask], after_s=0.0)
    scaling = ClusterView({"a": (APP, "Prefill")}, [{"CPU": 8.0}], [{"CPU": 8.0}], True)
    (report,) = watch.check(scaling, now=1.0)
    assert "asks for GPU 1" in report.message()
    assert "0 of 0 GPU free" in report.message()
    assert report.message().endswith("the autoscaler is adding nodes: waiting for them")


def test_other_applications_replicas_are_not_ours() -> None:
    watch = SchedulingWatch([ReplicaAsk(APP, "Decode", 1.0, 0.0)], after_s=0.0)
    assert watch.check(view({"x": ("other", "Decode")}, free=0.0), now=5.0) == []
