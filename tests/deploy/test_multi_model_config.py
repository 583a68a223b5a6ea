"""Several models' configuration (`ClusterConfig.models`, `pdserve up --model A --model
B,...`): what is checked before anything starts. No cluster here (tests/deploy/
test_multi_model.py runs one)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pdserve.cluster.config import ClusterConfig, ConfigError, model_app_name
from pdserve.deploy.app import deploy_config
from pdserve.deploy.cli import _model_spec, build_parser


def test_each_model_gets_the_cluster_fields_and_its_own() -> None:
    cfg = ClusterConfig(
        models=[
            {"model": "/m/alpha"},
            {"model": "/m/beta", "served_model_name": "b", "mode": "colocated", "dtype": "float32"},
        ],
        block_size=8,
        api_keys=["sk-1"],
    )
    alpha, beta = cfg.model_configs()
    assert (alpha.model_id, alpha.mode, alpha.dtype) == ("alpha", "disagg", "auto")
    assert (beta.model_id, beta.mode, beta.dtype) == ("b", "colocated", "float32")
    for one in (alpha, beta):  # the cluster's fields, one token for the whole cluster
        assert (one.block_size, one.api_keys, one.models) == (8, ["sk-1"], [])
        assert one.cluster_token == cfg.cluster_token
    assert cfg.model_ids() == ["alpha", "b"]
    assert model_app_name("org/model v2") == "pdserve-model-org-model-v2"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({}, "exactly one of `model` and `models`"),
        ({"model": "/m/a", "models": [{"model": "/m/b"}]}, "exactly one of"),
        ({"models": [{"model": "/x/a"}, {"model": "/y/a"}]}, "clash"),
        ({"models": [{"model": "/x/a"}], "served_model_name": "x"}, "each entry names"),
        ({"models": [{"model": "/x/a", "served_model_name": "a.b"}, {"model": "/y/a-b"}]}, "clash"),
        # a model's own field is checked as the cluster's would be, naming the model
        ({"models": [{"model": "/m/a", "block_size": 12}]}, "model '/m/a'"),
        ({"models": [{"model": "/m/a", "mode": "disagg", "prefill_replicas": 0}]}, "prefill"),
    ],
)
def test_a_bad_set_of_models_is_refused(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        ClusterConfig(**fields)


def test_preflight_checks_every_model_and_names_it(make_checkpoint: Any, tmp_path: Path) -> None:
    good = make_checkpoint(max_position_embeddings=256)
    cfg = ClusterConfig(models=[{"model": str(good)}, {"model": str(tmp_path / "missing")}])
    with pytest.raises(ConfigError, match="model missing"):
        cfg.preflight()
    ok = ClusterConfig(
        models=[{"model": str(good)}, {"model": str(good), "served_model_name": "again"}]
    ).preflight()
    assert [c.max_model_len for c in ok.model_configs()] == [256, 256]  # resolved per model


def test_up_takes_each_model_with_its_own_fields(random_model_dir: Path) -> None:
    args = build_parser().parse_args(
        [
            "up",
            "--model",
            str(random_model_dir),
            "--model",
            f"{random_model_dir},mode=colocated,served_model_name=b,decode_replicas=2",
        ]
    )
    assert isinstance(args, argparse.Namespace) and len(args.model) == 2
    spec = _model_spec(args.model[1], Path)
    assert spec == {
        "model": str(random_model_dir.resolve()),
        "mode": "colocated",
        "served_model_name": "b",
        "decode_replicas": 2,
    }
    with pytest.raises(ConfigError, match="not FIELD=VALUE"):
        _model_spec(f"{random_model_dir},transport=ucx", Path)  # a cluster-wide field


def test_the_serve_config_of_several_models(random_model_dir: Path) -> None:
    cfg = ClusterConfig(
        models=[
            {"model": str(random_model_dir)},
            {"model": str(random_model_dir), "served_model_name": "b", "mode": "colocated"},
        ]
    )
    config = deploy_config(cfg, "127.0.0.1", 8000)
    apps = {app["name"]: app for app in config["applications"]}
    assert set(apps) == {"pdserve", model_app_name(random_model_dir.name), "pdserve-model-b"}
    assert apps["pdserve"]["route_prefix"] == "/"
    assert apps["pdserve-model-b"]["route_prefix"] is None
    # a model's app holds its own configuration alone
    b = ClusterConfig.model_validate(apps["pdserve-model-b"]["args"])
    assert (b.model_id, b.mode, b.models) == ("b", "colocated", [])
