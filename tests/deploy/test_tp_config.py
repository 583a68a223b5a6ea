"""Tensor parallelism per pool: `--prefill-tp` / `--decode-tp`, from the flags to the
Serve deployment options (docs/configuration.md, "Tensor parallelism per pool").

No Ray cluster: the checks are the configuration's, the options are read off the
application `build_app` returns (Ray Serve's own option validation runs as it is built).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.deployment import Deployment, deployment_to_schema
from ray.serve.schema import ServeDeploySchema

from pdserve.cluster.config import ClusterConfig, ConfigError

REPO_DIR = Path(__file__).resolve().parents[2]
RAY_SERVICE = REPO_DIR / "deploy" / "k8s" / "rayservice.yaml"
SERVE_CONFIG = REPO_DIR / "deploy" / "serve_config.yaml"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Callable[..., Path]) -> Path:
    """4 attention heads, 2 KV heads, intermediate size 128: TP 1, 2 and 4 shard it."""
    return make_checkpoint(num_heads=4, num_kv_heads=2, intermediate_size=128)


def deployments(config: ClusterConfig) -> dict[str, Deployment]:
    """The deployments of `build_app(config)` by name, as Serve's controller builds them."""
    from ray.serve._private.build_app import build_app as serve_build

    from pdserve.deploy.app import build_app

    built = serve_build(build_app(config), name="pdserve")
    return {d.name: d for d in built.deployments}


# --- preflight: the model's shape ---------------------------------------------------


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_preflight_refuses_a_size_that_does_not_shard_the_model(model_dir: Path, role: str) -> None:
    config = ClusterConfig(model=str(model_dir), **{f"{role}_tp": 3})
    with pytest.raises(ConfigError) as info:
        config.preflight()
    assert info.value.field == f"{role}_tp"
    message = str(info.value)
    assert message.startswith(f"{role}_tp: --{role}-tp 3: "), message
    assert "num_key_value_heads=2 neither divides it" in message, message
    assert "num_attention_heads=4 is not divisible by it" in message, message
    assert "intermediate_size=128 is not divisible by it" in message, message
    assert f"the {role} pool's ranks cannot shard" in message, message
    other = "prefill" if role == "decode" else "decode"
    assert f"--{other}-tp" not in message, message


def test_the_serve_app_builder_refuses_it_too(model_dir: Path) -> None:
    from pdserve.deploy.app import app_builder

    with pytest.raises(ConfigError, match=r"^decode_tp: --decode-tp 3: .*num_key_value_heads=2"):
        app_builder({"model": str(model_dir), "decode_tp": 3})


def test_kv_heads_fewer_than_ranks_are_replicated_and_accepted(
    make_checkpoint: Callable[..., Path],
) -> None:
    """4 ranks over 2 KV heads replicate each over 2 ranks (KV heads divide the size);
    3 ranks over 1 KV head too; 2 ranks over 3 KV heads divide neither way."""
    four = make_checkpoint(num_heads=4, num_kv_heads=2, intermediate_size=128)
    ClusterConfig(model=str(four), prefill_tp=4, decode_tp=4).preflight()
    mqa = make_checkpoint(
        hidden_size=48, num_heads=3, num_kv_heads=1, head_dim=16, intermediate_size=96
    )
    ClusterConfig(model=str(mqa), decode_tp=3).preflight()
    gqa3 = make_checkpoint(
        hidden_size=96, num_heads=6, num_kv_heads=3, head_dim=16, intermediate_size=96
    )
    with pytest.raises(ConfigError, match=r"^prefill_tp: .*num_key_value_heads=3 neither"):
        ClusterConfig(model=str(gqa3), prefill_tp=2).preflight()


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_each_valid_pair_of_sizes_passes(model_dir: Path, prefill_tp: int, decode_tp: int) -> None:
    config = ClusterConfig(model=str(model_dir), prefill_tp=prefill_tp, decode_tp=decode_tp)
    resolved = config.preflight()
    assert resolved.max_model_len is not None
    for role, tp in (("prefill", prefill_tp), ("decode", decode_tp)):
        engine = resolved.engine_config(role)
        assert engine.tensor_parallel_size == tp
        assert engine.distributed_executor_backend == ("ray" if tp > 1 else "mp")
        assert engine.max_model_len == resolved.max_model_len  # every role agrees


def test_the_cpu_kv_pool_is_checked_per_rank(make_checkpoint: Callable[..., Path]) -> None:
    """On CPU the default pool is at most 1 GiB per rank, of the rank's KV heads: a context
    one replica of TP 1 cannot hold fits on TP 2 (as `LLMEngine._size_kv_pool` sizes it)."""
    long = make_checkpoint(max_position_embeddings=1 << 22)
    # 2 layers x 2 KV heads x 16 dims x K,V x 4 bytes = 512 B a token: 1 GiB holds 2 Mi
    # tokens unsharded, 4 Mi on each of 2 ranks (one KV head each)
    max_len = 3 << 20
    with pytest.raises(ConfigError, match=r"^max_model_len: the KV pool"):
        ClusterConfig(model=str(long), max_model_len=max_len).preflight()
    ClusterConfig(model=str(long), max_model_len=max_len, prefill_tp=2, decode_tp=2).preflight()
    with pytest.raises(ConfigError, match=r"^max_model_len: the KV pool"):  # decode at TP 1
        ClusterConfig(model=str(long), max_model_len=max_len, prefill_tp=2).preflight()


# --- the values alone ---------------------------------------------------------------


def test_engine_config_takes_the_role() -> None:
    config = ClusterConfig(model="/m", prefill_tp=2, decode_tp=4)
    prefill, decode = config.engine_config("prefill"), config.engine_config("decode")
    assert (prefill.tensor_parallel_size, prefill.distributed_executor_backend) == (2, "ray")
    assert (decode.tensor_parallel_size, decode.distributed_executor_backend) == (4, "ray")
    assert config.engine_config().tensor_parallel_size == 4  # the default role: decode
    plain = ClusterConfig(model="/m").engine_config("prefill")
    assert (plain.tensor_parallel_size, plain.distributed_executor_backend) == (1, "mp")
    with pytest.raises(ValueError, match="role must be"):
        config.engine_config("router")


def test_sizes_below_one_are_refused() -> None:
    for field in ("prefill_tp", "decode_tp"):
        with pytest.raises(ValidationError, match=field):
            ClusterConfig(model="/m", **{field: 0})


def test_colocated_mode_has_no_prefill_pool_to_shard() -> None:
    with pytest.raises(ValidationError, match=r"prefill_tp: --prefill-tp 2: colocated mode"):
        ClusterConfig(model="/m", mode="colocated", prefill_tp=2)
    config = ClusterConfig(model="/m", mode="colocated", decode_tp=2)
    assert config.roles() == ("decode",)
    assert config.engine_config("decode").tensor_parallel_size == 2


def test_cuda_with_tp_needs_num_kv_blocks_and_a_gpu_per_rank() -> None:
    cuda: dict[str, Any] = {"model": "/m", "device": "cuda", "replica_num_gpus": 1}
    with pytest.raises(ValidationError, match=r"num_kv_blocks: --decode-tp 2: .*num_kv_blocks"):
        ClusterConfig(**cuda, decode_tp=2)
    with pytest.raises(ValidationError, match=r"num_kv_blocks: --prefill-tp 2"):
        ClusterConfig(**cuda, prefill_tp=2)
    with pytest.raises(ValidationError, match=r"replica_num_gpus: --decode-tp 2: .*GPU of its own"):
        ClusterConfig(**{**cuda, "replica_num_gpus": 0.5}, decode_tp=2, num_kv_blocks=64)
    ClusterConfig(**cuda, decode_tp=2, num_kv_blocks=64)
    ClusterConfig(**cuda)  # TP 1 measures its pool: no num_kv_blocks needed
    ClusterConfig(model="/m", decode_tp=2)  # CPU sizes its pool without measuring


def test_a_rank_must_ask_for_something() -> None:
    """Ray refuses a placement-group bundle of nothing but zeros."""
    with pytest.raises(ValidationError, match=r"decode_tp: --decode-tp 2: .*placement-group"):
        ClusterConfig(model="/m", decode_tp=2, replica_num_cpus=0)
    ClusterConfig(model="/m", decode_tp=2, replica_num_cpus=0, decode_resources={"pool": 1})
    ClusterConfig(model="/m", prefill_tp=1, replica_num_cpus=0)  # no placement group at TP 1


# --- build_app: placement groups ------------------------------------------------------


def test_a_tp2_pool_gets_two_strictly_packed_bundles() -> None:
    config = ClusterConfig(
        model="/m",
        max_model_len=64,
        prefill_tp=2,
        replica_num_cpus=1.5,
        prefill_resources={"prefill_pool": 1},
    )
    built = deployments(config)
    prefill = deployment_to_schema(built["Prefill"])
    assert prefill.placement_group_strategy == "STRICT_PACK"
    assert prefill.placement_group_bundles == [{"CPU": 1.5, "prefill_pool": 1.0}] * 2
    # the replica (rank 0) asks for exactly bundle 0
    actor = built["Prefill"].ray_actor_options or {}
    assert (actor["num_cpus"], actor["num_gpus"]) == (1.5, 0.0)
    assert actor["resources"] == {"prefill_pool": 1}
    # TP 1 pools ask for no placement group, as before
    for name in ("Decode", "Router"):
        replica = built[name]._replica_config
        assert replica.placement_group_bundles is None, name
        assert replica.placement_group_strategy is None, name


def test_gpu_ranks_get_a_gpu_each_and_no_zero_cpus() -> None:
    config = ClusterConfig(
        model="/m",
        max_model_len=64,
        device="cuda",
        num_kv_blocks=64,
        replica_num_cpus=0,
        replica_num_gpus=1,
        prefill_tp=2,
        decode_tp=4,
        decode_resources={"decode_pool": 0.5},
    )
    built = deployments(config)
    prefill = built["Prefill"]._replica_config
    decode = built["Decode"]._replica_config
    assert prefill.placement_group_bundles == [{"GPU": 1.0}] * 2
    assert decode.placement_group_bundles == [{"GPU": 1.0, "decode_pool": 0.5}] * 4
    assert prefill.placement_group_strategy == decode.placement_group_strategy == "STRICT_PACK"
    assert decode.ray_actor_options["num_gpus"] == 1
    assert decode.ray_actor_options["resources"] == {"decode_pool": 0.5}


def test_the_k8s_overrides_fit_bundle_0_with_tp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The RayService's `deployments` overrides replace `ray_actor_options` whole; with a
    pool at TP 2 Serve still finds them inside bundle 0 (the args name the same custom
    resources), so raising prefill_tp / decode_tp there needs no other Serve change."""
    text = yaml.safe_load(RAY_SERVICE.read_text())["spec"]["serveConfigV2"]
    (app,) = ServeDeploySchema.model_validate(yaml.safe_load(text)).applications
    for name in ("PDSERVE_REDIS_PASSWORD", "PDSERVE_CLUSTER_TOKEN"):
        monkeypatch.setenv(name, "x")
    args = {**app.args, "prefill_tp": 2, "decode_tp": 2, "num_kv_blocks": 1024}
    args.pop("kv_tls")  # its files are read only at preflight, which this skips
    # KV tiers do not serve tensor parallelism yet (docs/kv-tiers.md): raising the TP
    # there also means turning them off
    args.pop("kv_host_gib")
    args.pop("kv_disk_dir")
    config = ClusterConfig.from_serve_args(args).model_copy(update={"max_model_len": 64})
    built = deployments(config)
    for override in app.deployments:
        options = override.ray_actor_options.model_dump(exclude_unset=True)
        assert options["resources"] == config.pool_resources(override.name.lower())
        # what Serve's controller does with an override: ReplicaConfig validates the fit
        built[override.name].options(ray_actor_options=options)
        bundles = built[override.name]._replica_config.placement_group_bundles
        assert bundles is not None and len(bundles) == 2


def test_the_serve_configs_show_the_fields() -> None:
    (local,) = yaml.safe_load(SERVE_CONFIG.read_text())["applications"]
    text = yaml.safe_load(RAY_SERVICE.read_text())["spec"]["serveConfigV2"]
    (k8s,) = yaml.safe_load(text)["applications"]
    for args in (local["args"], k8s["args"]):
        assert {"prefill_tp", "decode_tp"} <= args.keys()
        assert set(args) <= ClusterConfig.model_fields.keys()


# --- the command line -----------------------------------------------------------------


def _up_config(model: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`pdserve up FLAGS` to the point where it would start the cluster (run_up faked)."""
    code = (
        "import sys\n"
        "from pdserve.deploy import cli\n"
        "import pdserve.deploy.up as up\n"
        "def fake_run_up(config, *args, **kw):\n"
        "    p, d = config.engine_config('prefill'), config.engine_config('decode')\n"
        "    print('tp', config.prefill_tp, config.decode_tp)\n"
        "    print('engine', p.tensor_parallel_size, p.distributed_executor_backend,\n"
        "          d.tensor_parallel_size, d.distributed_executor_backend)\n"
        "    return 0\n"
        "up.run_up = fake_run_up\n"
        "sys.exit(cli.main(['up', '--model', *sys.argv[1:]]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(model), *flags],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_the_flags_reach_the_config_and_a_bad_one_is_refused(model_dir: Path) -> None:
    result = _up_config(model_dir, "--prefill-tp", "2", "--decode-tp", "4")
    assert result.returncode == 0, result.stderr
    assert "tp 2 4" in result.stdout, result.stdout + result.stderr
    assert "engine 2 ray 4 ray" in result.stdout, result.stdout + result.stderr
    result = _up_config(model_dir)
    assert "tp 1 1" in result.stdout and "engine 1 mp 1 mp" in result.stdout, result.stderr
    result = _up_config(model_dir, "--decode-tp", "3")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "pdserve: error: decode_tp: --decode-tp 3: " in result.stderr, result.stderr
    assert "num_key_value_heads=2 neither divides it" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "tp " not in result.stdout, result.stderr


def test_the_parser_knows_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.deploy.cli import build_parser

    args = build_parser().parse_args(["up", "--prefill-tp", "2", "--decode-tp", "8"])
    assert (args.prefill_tp, args.decode_tp) == (2, 8)
    args = build_parser().parse_args(["up"])
    assert (args.prefill_tp, args.decode_tp) == (1, 1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    help_text = capsys.readouterr().out
    assert "--prefill-tp N" in help_text and "--decode-tp N" in help_text
