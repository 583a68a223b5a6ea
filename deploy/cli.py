"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.common.errors import EngineError

# `pdserve bench`'s parser and command (benchmarks/bench_args.py).
BENCH_ARGS = "pdserve.benchmarks.bench_args"

if TYPE_CHECKING:
    from pydantic import BaseModel

    from pdserve.cluster.config import KVTLS
    from pdserve.deploy.stopping import StopSignals


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF model folder (default: the built-in demo model, trained on first use)",
    )


def _generate(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
    )
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    (out,) = llm.generate([prompt], params)
    print(out.text)
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from pdserve.demo.model import EXPECTED_TRAIN_S, copy_demo_model, write_demo_model

    if args.seed is None:  # the demo every `--model` default serves: trained once, cached
        path = copy_demo_model(args.dir)
    else:
        print(
            f"training a demo model with seed {args.seed} (~{EXPECTED_TRAIN_S} s)", file=sys.stderr
        )
        path = write_demo_model(args.dir, seed=args.seed)
    print(f"wrote the demo model to {path}")
    return 0


def _routes_file(path: str | None) -> list[Any]:
    """The `routes` a YAML (or JSON) file lists: `[{name, default, rules: [...]}, ...]`."""
    if path is None:
        return []
    import yaml

    routes = yaml.safe_load(Path(path).read_text())
    if not isinstance(routes, list):
        raise ValueError(f"{path}: expected a list of routes, got {type(routes).__name__}")
    return routes


def _api_keys(path: str | None) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Keys from $PDSERVE_API_KEYS and the file (never from argv: `ps` shows argv), and
    each file key's defaults: a line is `KEY [priority=N] [cache_salt=S]`."""
    keys = [k.strip() for k in os.environ.get("PDSERVE_API_KEYS", "").split(",")]
    defaults: dict[str, dict[str, Any]] = {}
    if path is not None:
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            key, *settings = line.split() or [""]
            keys.append(key)
            for setting in settings:
                name, sep, value = setting.partition("=")
                if not sep or name not in ("priority", "cache_salt"):
                    raise SystemExit(
                        f"{path}:{number}: expected KEY [priority=N] [cache_salt=S], "
                        f"got a setting {name!r}"
                    )
                defaults.setdefault(key, {})[name] = value
    return [k for k in keys if k], defaults


def _up(args: argparse.Namespace) -> int:
    from pdserve.deploy.stopping import StartAborted, StopSignals, become_subreaper, finish
    from pdserve.deploy.up import say

    # First: Ctrl-C and SIGTERM stop every step from here on (deploy/stopping.py).
    signals = StopSignals(say)
    signals.install()
    become_subreaper()
    try:
        code = _up_with(args, signals)
    except StartAborted:
        say("stopped before the cluster was ready")
        code = 130
    finally:
        killed = finish()  # nothing it started may outlive it
        if killed:
            say(f"killed {len(killed)} processes left behind: " + "; ".join(killed))
    # All it started is stopped and the process exits next: out of the collector's sight,
    # the heap (torch, Ray, Serve) costs the interpreter's final collections nothing
    # (~2.5 s of every stop on a 2-core machine, to free memory the exit frees anyway).
    import gc

    gc.freeze()
    return code


def _lora_flags(given: list[str]) -> dict[str, str]:
    """`--lora NAME=PATH` flags as `lora_modules` (an absolute folder each: the workers
    run elsewhere)."""
    from pdserve.cluster.config import ConfigError

    adapters: dict[str, str] = {}
    for flag in given:
        name, sep, path = flag.partition("=")
        if not sep or not name or not path:
            raise ConfigError("lora_modules", f"--lora takes NAME=PATH, got {flag!r}")
        adapters[name] = str(Path(path).expanduser().resolve())
    return adapters


def _up_with(args: argparse.Namespace, signals: StopSignals) -> int:
    from pdserve.cluster.config import APIKeyDefaults, ClusterConfig, ConfigError
    from pdserve.deploy.flags import config_values
    from pdserve.deploy.serve_env import apply_serve_env, direct_ingress_env

    # Before anything imports ray.serve: the handles this process builds keep the
    # transport Serve chose at that import (gRPC only if the setting is there by then).
    apply_serve_env(os.environ)
    fields = config_values(args, ClusterConfig)
    if args.lora:
        fields["lora_modules"] = {**fields.get("lora_modules", {}), **_lora_flags(args.lora)}
    several = len(args.model or []) > 1
    ingress = args.ingress or ("proxy" if args.address is not None or several else "direct")
    if ingress == "direct" and several:
        raise ConfigError(
            "ingress",
            "several models are served through Serve's HTTP proxy (--ingress proxy): a "
            "redeploy replaces the router replicas, and a replaced direct-ingress replica "
            "could not take its port while the old one still drains its streams",
        )
    if ingress == "direct":
        # read by Serve at import too: the controller and replicas this process starts
        # inherit them (a joined cluster needs them in its nodes' environment instead)
        replicas = fields.get("router_replicas", _declared("router_replicas"))
        for name, value in direct_ingress_env(args.port, replicas, args.ingress_drain_s).items():
            os.environ.setdefault(name, value)

    from pdserve.demo.model import resolve_model
    from pdserve.deploy.stopping import stop_budget_s
    from pdserve.deploy.up import run_up

    external_redis = "redis_url" in fields
    fields.setdefault("redis_url", "")  # "": run_up starts an embedded one
    if fields.get("speculative") is not None:
        fields["speculative"] = _absolute_draft(fields["speculative"])
    api_keys, api_key_defaults = _api_keys(args.api_keys_file)
    fields |= {
        "api_keys": api_keys,
        "api_key_defaults": {
            k: APIKeyDefaults.model_validate(v) for k, v in api_key_defaults.items()
        },
        "routes": _routes_file(args.routes_file),
        "kv_tls": _kv_tls(args),
    }
    with signals.interruptible():  # the demo model trains here on first use
        specs = [_model_spec(value, resolve_model) for value in args.model or [None]]
    if len(specs) == 1:  # one model: its overrides are the cluster's fields
        fields |= specs[0]
    elif fields.get("served_model_name") is not None:
        raise ConfigError(
            "served_model_name",
            "--served-model-name names one model; with several --model, name each: "
            "--model PATH,served_model_name=NAME",
        )
    else:
        fields["models"] = specs
    config = ClusterConfig(**fields)
    # Everything a replica would trip over, before anything starts (seconds, not the
    # ready timeout). The embedded Redis is started by run_up, so only an external one
    # is pinged; joining a cluster on other nodes needs one they can all reach.
    if args.address is not None and not external_redis:
        raise ConfigError(
            "redis_url",
            "--address (joining a Ray cluster) needs --redis-url: the embedded Redis "
            "listens on this machine's loopback, which other nodes cannot reach",
        )
    signals.budget_s = stop_budget_s(config.shutdown_grace_s)
    with signals.interruptible():
        config.preflight(check_redis=external_redis)
    return run_up(
        config, args.host, args.port, address=args.address, ingress=ingress, signals=signals
    )


def _declared(name: str) -> Any:
    from pdserve.cluster.config import ClusterConfig

    return ClusterConfig.model_fields[name].default


def _model_spec(value: str | None, resolve: Any) -> dict[str, Any]:
    """`--model PATH[,FIELD=VALUE...]` as a `models` entry: the folder made absolute
    (None: the demo model), each FIELD one of `ModelSpec`'s, each VALUE JSON or text
    (no commas: the Serve config takes any value)."""
    from pdserve.cluster.config import ConfigError, ModelSpec

    path, _, rest = (value or "").partition(",")
    spec: dict[str, Any] = {"model": str(resolve(path or None).resolve())}
    for item in filter(None, rest.split(",")):
        key, eq, text = (part.strip() for part in item.partition("="))
        if not eq or key not in ModelSpec.model_fields or key == "model":
            fields = ", ".join(f for f in ModelSpec.model_fields if f != "model")
            raise ConfigError(
                "model", f"--model {value}: {item!r} is not FIELD=VALUE, FIELD one of: {fields}"
            )
        try:
            spec[key] = json.loads(text)
        except json.JSONDecodeError:
            spec[key] = text
    return spec


def _deploy(args: argparse.Namespace) -> int:
    """Apply a Serve config to a running cluster, or print the one it runs."""
    import ray
    import yaml

    from pdserve.deploy import declarative

    config = None
    if args.config is not None:
        config = yaml.safe_load(Path(args.config).read_text())
        declarative.validate(config)  # before joining: a bad config fails at once
    join_cluster(args.address)
    try:
        if config is None:
            print(yaml.safe_dump(declarative.current(), sort_keys=False), end="")
            return 0
        names = declarative.apply(config)
        print(f"pdserve: applied {args.config} ({', '.join(names)})", file=sys.stderr)
        return 0
    finally:
        ray.shutdown()


def _scale(args: argparse.Namespace) -> int:
    """Set a pool's replica count (the external scaler: `external_scaler`, or the planner)."""
    import ray

    from pdserve.cluster.settings import model_app_name
    from pdserve.deploy.app import APP_NAME
    from pdserve.router.models import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT
    from pdserve.router.scaler import set_replicas

    app = APP_NAME if args.model is None else model_app_name(args.model)
    deployment = PREFILL_DEPLOYMENT if args.pool == "prefill" else DECODE_DEPLOYMENT
    join_cluster(args.address)
    try:
        set_replicas(app, deployment, args.replicas)
    except Exception as exc:  # Serve's own errors say what is wrong (no such app, ...)
        print(f"pdserve scale: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(f"pdserve: {args.pool} pool of {app} set to {args.replicas} replicas", file=sys.stderr)
    return 0


def join_cluster(address: str) -> None:
    """Join the Ray cluster at `address` as a quiet driver."""
    import logging

    import ray

    # Ray turns token authentication on for a local cluster it finds itself (address
    # "auto"), never for an address it is given: do as it does for the former, so that
    # the cluster `pdserve up` started here (token in Ray's default place) answers.
    # RAY_AUTH_MODE set by the operator wins.
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    # no worker logs here: stdout may be the printed config
    ray.init(
        address=address,
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )


def _absolute_draft(spec: str | None) -> str | None:
    """`--speculative` with a draft model's folder made absolute, like `--model`'s: the
    replicas do not run in this directory. Anything else as given (the config checks it)."""
    if spec is None or spec.strip().partition(":")[0].strip() != "draft":
        return spec
    from pdserve.demo.model import resolve_model

    method, _, rest = spec.strip().partition(":")
    path, comma, options = rest.partition(",")
    if not path.strip() or "=" in path:
        return spec
    return f"{method}:{resolve_model(path.strip()).resolve()}{comma}{options}"


def _kv_tls(args: argparse.Namespace) -> KVTLS | None:
    """The `kv_tls` field from the --kv-tls-* flags: cert, key and CA come together."""
    from pdserve.cluster.config import KVTLS, ConfigError

    files = {"cert_file": args.kv_tls_cert, "key_file": args.kv_tls_key}
    files["ca_file"] = args.kv_tls_ca
    given = [name for name, path in files.items() if path]
    if not given:
        if args.kv_tls_mutual or args.kv_tls_server_name:
            raise ConfigError("kv_tls", "--kv-tls-mutual / --kv-tls-server-name need the files")
        return None
    if len(given) != len(files):
        missing = ", ".join("--kv-tls-" + n.split("_")[0] for n in files if n not in given)
        raise ConfigError(
            "kv_tls", f"TLS needs --kv-tls-cert, --kv-tls-key and --kv-tls-ca (missing: {missing})"
        )
    return KVTLS(**files, mutual=args.kv_tls_mutual, server_name=args.kv_tls_server_name)


def _add_bench_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`pdserve bench`, which lives in the benchmarks layer, above this one (pyproject's
    import contracts): its arguments and command come from there, loaded by name."""
    importlib.import_module(BENCH_ARGS).add_bench_parser(sub)


def build_parser(config_model: type[BaseModel] | None = None) -> argparse.ArgumentParser:
    """The command line; `config_model`: the configuration whose fields `up` takes as
    flags (ClusterConfig, or a subclass of it)."""
    from pdserve.cluster.config import ClusterConfig
    from pdserve.deploy.flags import add_config_flags

    config_model = config_model or ClusterConfig
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt offline and print the text")
    _add_model_arg(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: the usable CPUs)"
    )
    gen.set_defaults(func=_generate)

    up = sub.add_parser("up", help="start a serving cluster (OpenAI API) and run until Ctrl-C")
    up.add_argument(
        "--model",
        action="append",
        default=None,
        help="HF model folder (default: the built-in demo model, trained on first use). "
        "Repeat to serve several models, each as PATH[,FIELD=VALUE...] with a model's own "
        "fields (e.g. served_model_name=a,mode=colocated,decode_replicas=2)",
    )
    up.add_argument(
        "--routes-file",
        default=None,
        help="YAML list of routed model names and their rules (the `routes` field)",
    )
    up.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="a LoRA adapter (a PEFT folder) every worker loads, served as model NAME; "
        "repeat for several (the `lora_modules` field; docs/lora.md)",
    )
    up.add_argument("--host", default="127.0.0.1", help="HTTP address (default: loopback)")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument(
        "--ingress",
        choices=["direct", "proxy"],
        default=None,
        help="direct: the router replicas serve HTTP themselves, on --port, --port + 1, ... "
        "(one per router replica); proxy: through Serve's HTTP proxy on --port. Default: "
        "direct on a local cluster, proxy when joining one (--address)",
    )
    up.add_argument(
        "--ingress-drain-s",
        type=float,
        default=2.0,
        help="direct ingress: how long a stopping router replica still serves, so that a "
        "load balancer in front can take it out first",
    )
    up.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    up.add_argument(
        "--api-keys-file",
        default=None,
        help="file with one API key per line (KEY [priority=N] [cache_salt=S]); clients must "
        "send 'Authorization: Bearer KEY' (keys may also come from $PDSERVE_API_KEYS)",
    )
    tls = up.add_argument_group(
        "KV transfer TLS (gRPC transport only; PEM files at the same paths on every node)"
    )
    tls.add_argument("--kv-tls-cert", default=None, help="certificate decode receivers present")
    tls.add_argument("--kv-tls-key", default=None, help="its private key")
    tls.add_argument("--kv-tls-ca", default=None, help="CA that signed the receivers' certificates")
    tls.add_argument(
        "--kv-tls-mutual",
        action="store_true",
        help="mutual TLS: prefill senders present the certificate too, and receivers require it",
    )
    tls.add_argument(
        "--kv-tls-server-name",
        default=None,
        help="the name the certificate holds, if not the announced transfer address",
    )
    # Every other flag is a field of the cluster's configuration (deploy/flags.py).
    add_config_flags(
        up.add_argument_group("the cluster's configuration (docs/configuration.md)"),
        config_model,
        not_given={"redis_url": "an embedded one, on loopback with a generated password"},
    )
    up.set_defaults(func=_up)

    _add_bench_parser(sub)

    deploy = sub.add_parser(
        "deploy",
        help="apply a Serve config to a running cluster (as `serve deploy`, no dashboard "
        "needed): applications whose args did not change keep their replicas",
    )
    deploy.add_argument(
        "config", nargs="?", default=None, help="Serve config YAML; omit to print the current one"
    )
    deploy.add_argument(
        "--address", required=True, help="the Ray cluster (`pdserve up` prints its address)"
    )
    deploy.set_defaults(func=_deploy)

    scale = sub.add_parser(
        "scale",
        help="set a pool's replica count on a running cluster served with --external-scaler"
        " (or the planner): a scale-down drains the replicas it stops",
    )
    scale.add_argument("pool", choices=["prefill", "decode"])
    scale.add_argument("replicas", type=int)
    scale.add_argument(
        "--address", required=True, help="the Ray cluster (`pdserve up` prints its address)"
    )
    scale.add_argument("--model", default=None, help="the model, when the cluster serves several")
    scale.set_defaults(func=_scale)

    demo = sub.add_parser(
        "demo-model",
        help="write the built-in demo checkpoint to DIR (trained on first use, then cached)",
    )
    demo.add_argument("dir")
    demo.add_argument(
        "--seed", type=int, default=None, help="train a variant with this seed (not cached)"
    )
    demo.set_defaults(func=_demo_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pydantic import ValidationError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValidationError as exc:  # one line per field, without the input's values
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"])
            why = str(error["msg"]).removeprefix("Value error, ")
            print(f"pdserve: error: {where + ': ' if where else ''}{why}", file=sys.stderr)
        return 2
    except (EngineError, ValueError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
