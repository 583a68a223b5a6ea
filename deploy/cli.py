"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from pdserve.engine.errors import EngineError


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF model folder (default: the built-in demo model, written on first use)",
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
    from pdserve.engine.demo_model import write_demo_model

    path = write_demo_model(args.dir, seed=args.seed)
    print(f"wrote the demo model to {path}")
    return 0


def _json_arg(text: str | None) -> Any:
    try:
        return None if text is None else json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {text!r} ({exc})") from exc


def _up(args: argparse.Namespace) -> int:
    from pdserve.deploy.config import ClusterConfig
    from pdserve.deploy.up import run_up
    from pdserve.engine.demo_model import resolve_model

    config = ClusterConfig(
        model=str(resolve_model(args.model).resolve()),
        served_model_name=args.served_model_name,
        mode=args.mode,
        transport=args.transport,
        placement=args.placement,
        prefill_replicas=args.prefill_replicas,
        decode_replicas=args.decode_replicas,
        router_replicas=args.router_replicas,
        redis_url=args.redis_url or "",
        transfer_host=args.transfer_host,
        dtype=args.dtype,
        num_threads=args.threads,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        replica_num_cpus=args.replica_cpus,
        worker_lease_s=args.worker_lease_s,
        heartbeat_s=args.heartbeat_s,
        kv_wait_timeout_s=args.kv_wait_timeout_s,
        prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus,
        prefill_autoscaling=_json_arg(args.prefill_autoscaling),
        decode_autoscaling=_json_arg(args.decode_autoscaling),
    )
    return run_up(config, args.host, args.port, address=args.address)


def build_parser() -> argparse.ArgumentParser:
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
    gen.add_argument("--threads", type=int, default=1, help="torch threads")
    gen.set_defaults(func=_generate)

    up = sub.add_parser("up", help="start a serving cluster (OpenAI API) and run until Ctrl-C")
    _add_model_arg(up)
    up.add_argument("--served-model-name", default=None, help="model id for clients")
    up.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    up.add_argument("--transport", choices=["grpc", "ucx"], default="grpc")
    up.add_argument(
        "--placement", choices=["prefix-aware", "round-robin", "random"], default="prefix-aware"
    )
    up.add_argument("--prefill-replicas", type=int, default=1)
    up.add_argument("--decode-replicas", type=int, default=1)
    up.add_argument("--router-replicas", type=int, default=1)
    up.add_argument("--host", default="127.0.0.1", help="HTTP address (default: loopback)")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument(
        "--transfer-host", default="127.0.0.1", help="address the KV receivers bind and announce"
    )
    up.add_argument("--redis-url", default=None, help="external Redis (default: embedded)")
    up.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    up.add_argument("--block-size", type=int, default=16)
    up.add_argument("--max-model-len", type=int, default=None)
    up.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker")
    up.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    up.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    up.add_argument("--worker-lease-s", type=float, default=10.0, help="index lease")
    up.add_argument("--heartbeat-s", type=float, default=1.0, help="worker heartbeat period")
    up.add_argument(
        "--kv-wait-timeout-s",
        type=float,
        default=10.0,
        help="how long decode waits for pushed KV before prefilling itself",
    )
    for pool in ("prefill", "decode"):
        up.add_argument(
            f"--{pool}-autoscaling",
            default=None,
            metavar="JSON",
            help=f"autoscale the {pool} pool: JSON of PoolAutoscaling, e.g. "
            '\'{"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 5}\'',
        )
    up.add_argument("--prefill-cpus", default=None, help="pin prefill replicas to these CPUs")
    up.add_argument("--decode-cpus", default=None, help="pin decode replicas to these CPUs")
    up.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per worker replica")
    up.set_defaults(func=_up)

    demo = sub.add_parser("demo-model", help="write the built-in demo checkpoint to DIR")
    demo.add_argument("dir")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (EngineError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
