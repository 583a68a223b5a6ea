"""Shared fixtures: the demo model, random Hugging Face checkpoints built on the spot, and
`pdserve up` as a user runs it.

Checkpoints come from `transformers` (a dev dependency: the reference our tokens must
equal), imported lazily so tests of the plain-Python packages do not pay for it.

`pdserve_up` (tests/deploy, tests/benchmarks): `start_cluster(...)` runs the CLI as a real
subprocess (a real Ray cluster and Redis), reads its stdout until `pdserve ready at URL`,
and on exit sends SIGTERM and checks that it stops within its drain deadline, leaving no
process behind.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import inspect
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from pdserve.benchmarks.bench_report import sample, scrape_metrics
from pdserve.demo.model import CACHE_DIR_ENV, default_model_dir, write_random_model
from pdserve.deploy.redis_server import (
    drain,
    session_members,
    wait_for_line,
    wait_session_empty,
)

# NOTE: `triton.jit` decides when a kernel module is imported whether kernels are compiled
# or interpreted, so the switch is set here, before any test module can import
# `pdserve.kernels`. Without a GPU the kernels run in Triton's interpreter (docs/architecture.md,
# "Kernels"); TRITON_INTERPRET=1 set by the caller still forces it on a GPU machine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Large enough that random models do not greedily repeat one token; small enough to stay sane.
CHECKPOINT_INIT_RANGE = 0.1
QWEN2_BIAS_STD = 0.1

MakeCheckpoint = Callable[..., Path]
HFGreedy = Callable[..., list[list[int]]]


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> Iterator[None]:
    """Keeps the run's final exit status (after every plugin's say) for `pytest_unconfigure`."""
    yield
    session.config.stash[_EXIT_STATUS] = int(session.exitstatus)


_EXIT_STATUS = pytest.StashKey[int]()
# Set to 1 to let the interpreter tear itself down as usual (to debug that teardown).
FULL_TEARDOWN_ENV = "PDSERVE_TEST_FULL_TEARDOWN"


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The run is over, its summary printed: exit with pytest's status, skipping the
    interpreter's teardown of native modules.

    That teardown is not ours and not safe. With Triton's interpreter, torch, gRPC and
    UCX loaded in one process for a whole session, a CI run (36 min, the whole suite's
    length) ended in SIGSEGV (exit 139) just after nanobind's report of Triton's leaked
    objects, which it prints during that teardown, and so failed. The exit handlers
    (`atexit`: Ray's shutdown, logging's flush) still run first; only the native
    modules' destructors are skipped, and the process's memory goes back to the OS at
    once (the interpreter's final collections would also walk the whole session's heap,
    ~2 s on 2 cores).
    Each `pdserve up` or `serve run` a test starts is a process of its own, whose exit
    that test checks; this shortcut is the test runner's only."""
    if os.environ.get(FULL_TEARDOWN_ENV) == "1" or _EXIT_STATUS not in config.stash:
        gc.freeze()
        return
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels_built() -> None:
    """Build the CPU decode kernel once, up front: every engine process (Ray replicas
    included) then loads it from the cache instead of each compiling it at start."""
    from pdserve.engine.cpu import kernels as cpu_kernels

    cpu_kernels.load()


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Explicit thread counts (docs/architecture.md, "Processes"): 2 OpenMP threads stall
    a busy 2-core box. OMP_NUM_THREADS=1 is what an engine told no count takes here
    (common/engine_config.py, `default_num_threads`), in this process and in the commands tests
    start; tests/engine/test_threads.py unsets it to test the default itself."""
    import torch

    previous, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(previous)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weights Llama in the demo's format (vocabulary 512, seed 0), written once
    per session in well under a second: for tests that need a checkpoint and a tokenizer,
    not sensible text (`write_random_model`)."""
    return write_random_model(tmp_path_factory.mktemp("random") / "random-model")


@pytest.fixture(scope="session")
def demo_model_dir(random_model_dir: Path) -> Path:
    """The name `random_model_dir` had while the demo model had random weights."""
    return random_model_dir


class DemoRebuild:
    """The demo's second build: `pdserve generate` on an empty cache, in a process of its
    own (tests/engine/test_demo_model.py checks it announces itself and writes the very
    bytes of the session's build). Output goes to files, so it never waits on a pipe."""

    ARGV = ("-m", "pdserve.deploy.cli", "generate", "--prompt", "The river")

    def __init__(self, folder: Path) -> None:
        self.cache = folder / "cache"
        self._stdout, self._stderr = folder / "stdout.txt", folder / "stderr.txt"
        env = {**os.environ, CACHE_DIR_ENV: str(self.cache), "OMP_NUM_THREADS": "1"}
        with self._stdout.open("w") as out, self._stderr.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *self.ARGV], stdout=out, stderr=err, env=env, text=True
            )

    def result(self, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Wait for it (raises subprocess.TimeoutExpired); its exit status and output."""
        code = self.proc.wait(timeout_s)
        stdout, stderr = self._stdout.read_text(), self._stderr.read_text()
        return subprocess.CompletedProcess(self.proc.args, code, stdout, stderr)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


DEMO_REBUILD_TEST = "test_demo_build_is_deterministic_and_announced"


@pytest.fixture(scope="session")
def demo_rebuild(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DemoRebuild | None]:
    """Started with the session's build (`trained_demo_dir`) when the determinism test is
    selected, None otherwise: each training runs on one thread (~40 s), so on two cores the
    two run side by side instead of one after the other."""
    if not any(item.name == DEMO_REBUILD_TEST for item in request.session.items):
        yield None
        return
    rebuild = DemoRebuild(tmp_path_factory.mktemp("rebuild"))
    yield rebuild
    rebuild.stop()


@pytest.fixture(scope="session")
def trained_demo_dir(
    tmp_path_factory: pytest.TempPathFactory, demo_rebuild: DemoRebuild | None
) -> Path:
    """The built-in demo model (trained: about 40 s), for tests whose subject it
    is; built once per session the way `pdserve up` builds it, in a cache folder: pass
    `trained_demo_dir.parent` as $PDSERVE_CACHE_DIR to find it there. (`demo_rebuild`,
    the second build, is started first: it trains meanwhile, in its own process.)"""
    return default_model_dir(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def make_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, random_model_dir: Path
) -> MakeCheckpoint:
    """Factory of random `transformers` checkpoints using the random model's tokenizer
    (vocab 512).

    `make(arch="llama" | "mistral" | "qwen2", *, hidden_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=None, intermediate_size=128, tie_word_embeddings=False,
    rope_scaling=None, dtype="float32", seed=0, max_position_embeddings=1024, shard=False,
    vocab_size=512)` returns the folder; equal arguments return the same folder within a
    session. `shard=True` saves several shards plus `model.safetensors.index.json`.
    Another `vocab_size` gives the checkpoint a tokenizer of its own, trained the same way
    to that size (other merges: the same text encodes to other ids).
    """
    built: dict[str, Path] = {}

    def make(
        arch: str = "llama",
        *,
        hidden_size: int = 64,
        num_layers: int = 2,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int | None = None,
        intermediate_size: int = 128,
        tie_word_embeddings: bool = False,
        rope_scaling: dict[str, Any] | None = None,
        dtype: str = "float32",
        seed: int = 0,
        max_position_embeddings: int = 1024,
        shard: bool = False,
        vocab_size: int = 512,
    ) -> Path:
        args = {
            "arch": arch,
            "hidden_size": hidden_size,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "intermediate_size": intermediate_size,
            "tie_word_embeddings": tie_word_embeddings,
            "rope_scaling": rope_scaling,
            "dtype": dtype,
            "seed": seed,
            "max_position_embeddings": max_position_embeddings,
            "shard": shard,
            "vocab_size": vocab_size,
        }
        key = json.dumps(args, sort_keys=True)  # rope_scaling is a dict: not hashable as is
        if key not in built:
            out = tmp_path_factory.mktemp(f"ckpt-{arch}")
            _build_checkpoint(out, random_model_dir, **args)
            built[key] = out
        return built[key]

    return make


@pytest.fixture(scope="session")
def make_draft(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, int], Path]:
    """`make_draft(model_dir, layers)`: the checkpoint cut to its first `layers` layers
    (embedding, final norm, LM head and tokenizer kept), a draft model for speculative
    decoding that agrees with its target often but not always. Cached per session."""
    built: dict[tuple[Path, int], Path] = {}

    def make(model_dir: Path, layers: int = 1) -> Path:
        from pdserve.benchmarks.speculative import first_layers

        if (model_dir, layers) in built:
            return built[model_dir, layers]
        out = tmp_path_factory.mktemp("draft") / f"{model_dir.name}-{layers}-layers"
        first_layers(model_dir, out, layers)
        built[model_dir, layers] = out
        return out

    return make


def _build_checkpoint(out: Path, demo_dir: Path, **args: Any) -> None:
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }
    if args["arch"] not in classes:
        raise ValueError(f"unknown arch {args['arch']!r}; expected one of {sorted(classes)}")
    config_cls, model_cls = classes[args["arch"]]
    demo_config = json.loads((demo_dir / "config.json").read_text())
    demo_generation = json.loads((demo_dir / "generation_config.json").read_text())
    if args["vocab_size"] != demo_config["vocab_size"]:  # a tokenizer of its own
        from pdserve.demo.model import write_random_tokenizer

        out.mkdir(parents=True, exist_ok=True)
        write_random_tokenizer(out, args["vocab_size"])
        demo_dir = out  # its tokenizer files and special ids are copied from there
        demo_generation = json.loads((out / "generation_config.json").read_text())
        demo_config = {**demo_config, **demo_generation, "vocab_size": args["vocab_size"]}
    config = config_cls(
        vocab_size=demo_config["vocab_size"],
        hidden_size=args["hidden_size"],
        intermediate_size=args["intermediate_size"],
        num_hidden_layers=args["num_layers"],
        num_attention_heads=args["num_heads"],
        num_key_value_heads=args["num_kv_heads"],
        max_position_embeddings=args["max_position_embeddings"],
        initializer_range=CHECKPOINT_INIT_RANGE,
        tie_word_embeddings=args["tie_word_embeddings"],
        bos_token_id=demo_config["bos_token_id"],
        eos_token_id=demo_config["eos_token_id"],
        **_rope_kwargs(config_cls, args["rope_scaling"]),
        **({} if args["head_dim"] is None else {"head_dim": args["head_dim"]}),
    )
    torch.manual_seed(args["seed"])
    model = model_cls(config).eval()
    _check_head_dim(model, args)
    if args["arch"] == "qwen2":
        _randomize_qkv_biases(model)
    model.to(getattr(torch, args["dtype"]))
    shard_kwargs = {"max_shard_size": "200KB"} if args["shard"] else {}
    model.save_pretrained(out, **shard_kwargs)
    for name in TOKENIZER_FILES:
        if demo_dir != out:
            shutil.copyfile(demo_dir / name, out / name)
    generation = {key: demo_generation[key] for key in ("bos_token_id", "eos_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _rope_kwargs(config_cls: type, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict."""
    if "rope_parameters" not in inspect.signature(config_cls.__init__).parameters:
        return {"rope_theta": 10000.0, "rope_scaling": rope_scaling}  # transformers 4
    params = {"rope_type": "default", "rope_theta": 10000.0, **(rope_scaling or {})}
    if "type" in params:  # the legacy spelling of rope_type
        params["rope_type"] = params.pop("type")
    return {"rope_parameters": params}


def _check_head_dim(model: Any, args: dict[str, Any]) -> None:
    head_dim = args["head_dim"] or args["hidden_size"] // args["num_heads"]
    q_proj = model.model.layers[0].self_attn.q_proj
    if q_proj.out_features != args["num_heads"] * head_dim:
        raise ValueError(f"{args['arch']} ignored head_dim={head_dim}")


def _randomize_qkv_biases(model: Any) -> None:
    """HF zero-initialises biases; non-zero ones make tests really exercise the bias path."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, QWEN2_BIAS_STD)


# A reference of more prompt-tokens than this runs in processes, a share of the prompts
# each (one per usable CPU): minutes of `generate` otherwise use one core of two.
HF_PARALLEL_TOKENS = 4096
HF_REFERENCE = Path(__file__).with_name("hf_reference.py")
HF_PROCESS_TIMEOUT_S = 1800.0


def _hf_reference_module() -> Any:
    """tests/hf_reference.py, imported by path (the tests folder is no package)."""
    spec = importlib.util.spec_from_file_location("pdserve_tests_hf_reference", HF_REFERENCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _folder_digest(folder: Path) -> str:
    """A checkpoint folder's identity by content: equal folders share references, and a
    folder rewritten in place (or a new one at a reused path) gets its own."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _hf_in_processes(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, kv_cache_dtype: str
) -> list[list[int]]:
    """`hf_reference.generate` over `prompts`, a share in each of several processes (one
    per usable CPU); the shares' tokens back in the prompts' order."""
    from pdserve.common.engine_config import usable_cpus

    shares = min(usable_cpus(), len(prompts))
    procs, outs = [], []
    with tempfile.TemporaryDirectory(prefix="pdserve-hf-") as tmp:
        try:
            for k in range(shares):
                job, out = Path(tmp) / f"job{k}.json", Path(tmp) / f"out{k}.json"
                job.write_text(
                    json.dumps(
                        {
                            "model_dir": str(model_dir),
                            "prompts": prompts[k::shares],
                            "max_new_tokens": max_new_tokens,
                            "kv_cache_dtype": kv_cache_dtype,
                        }
                    )
                )
                argv = [sys.executable, str(HF_REFERENCE), str(job), str(out)]
                with open(Path(tmp) / f"err{k}.txt", "w") as err:  # no pipe to fill
                    procs.append(subprocess.Popen(argv, stdout=err, stderr=err))
            for k, proc in enumerate(procs):
                proc.wait(timeout=HF_PROCESS_TIMEOUT_S)
                assert proc.returncode == 0, (Path(tmp) / f"err{k}.txt").read_text()[-3000:]
                outs.append(json.loads((Path(tmp) / f"out{k}.json").read_text()))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    tokens: list[list[int]] = [[] for _ in prompts]
    for k, share in enumerate(outs):
        tokens[k::shares] = share
    return tokens


def _hold_to_reference(
    reference: Any,
    model_dir: Path,
    keys: list[tuple[int, ...]],
    candidates: list[list[int]],
    max_new_tokens: int,
    done: dict[tuple[int, ...], list[int]],
) -> None:
    """Record in `done` each candidate that is transformers' greedy continuation of its
    prompt (`hf_greedy(..., candidates=)`); leave the others for `generate`."""
    todo = {
        k: [int(t) for t in c]
        for k, c in zip(keys, candidates, strict=True)
        if len(c) == max_new_tokens and len(done.get(k, ())) < max_new_tokens
    }
    along = reference.greedy_along(model_dir, [list(k) for k in todo], list(todo.values()))
    for (key, tokens), picked in zip(todo.items(), along, strict=True):
        if picked == tokens:
            done[key] = tokens


@pytest.fixture(scope="session")
def hf_greedy() -> HFGreedy:
    """`transformers`' greedy tokens: `hf_greedy(model_dir, prompts, max_new_tokens)`.

    Runs without any eos (our requests set ignore_eos), in float32: the reference that
    every serving path's tokens must equal (docs/architecture.md, "The engine").
    `kv_cache_dtype="int8"` or `"fp8"`: with every K and V rounded through that 8-bit
    format (`engine/modeling/kv_quant.py`) before attention, the model an 8-bit KV cache serves.
    The code is tests/hf_reference.py's.

    Each prompt's tokens are computed once per session and checkpoint content: greedy
    decoding's first n tokens do not depend on how many follow, so a shorter request is
    a prefix of the longest one computed. A long reference runs in processes, a share
    of the prompts each (HF_PARALLEL_TOKENS; `processes=True` or False decides).

    `candidates=got` (the tokens a test was served, `max_new_tokens` each): a prompt
    whose candidate is, position by position, the token transformers picks after the
    prefix before it (`hf_reference.greedy_along`, one forward pass) is its greedy
    continuation and is taken as the reference without `generate`; every other prompt
    (a difference, a short candidate, an 8-bit KV cache) runs `generate` as above.
    """
    reference = _hf_reference_module()
    known: dict[tuple[str, str], dict[tuple[int, ...], list[int]]] = {}

    def generate(
        model_dir: Path,
        prompts: list[list[int]],
        max_new_tokens: int,
        kv_cache_dtype: str = "auto",
        *,
        processes: bool | None = None,
        candidates: list[list[int]] | None = None,
    ) -> list[list[int]]:
        done = known.setdefault((_folder_digest(model_dir), kv_cache_dtype), {})
        keys = [tuple(int(t) for t in p) for p in prompts]
        if candidates is not None and kv_cache_dtype == "auto":
            _hold_to_reference(reference, model_dir, keys, candidates, max_new_tokens, done)
        todo = [list(k) for k in dict.fromkeys(keys) if len(done.get(k, ())) < max_new_tokens]
        got: list[list[int]] = []
        if processes is None:
            processes = len(todo) > 1 and len(todo) * max_new_tokens > HF_PARALLEL_TOKENS
        if todo and processes:
            got = _hf_in_processes(model_dir, todo, max_new_tokens, kv_cache_dtype)
        elif todo:
            got = reference.generate(model_dir, todo, max_new_tokens, kv_cache_dtype)
        for prompt, tokens in zip(todo, got, strict=True):
            done[tuple(prompt)] = tokens
        return [done[k][:max_new_tokens] for k in keys]

    return generate


# -- `pdserve up` as a subprocess ---------------------------------------------------------

START_TIMEOUT_S = 240.0
STOP_LIMIT_S = 30.0  # every stop of a cluster, in every state (docs/failures.md, "Stopping")


class ClusterURL(str):
    """The base URL `pdserve_up` yields; `ray_address` is the address of its Ray cluster
    (what `pdserve deploy --address` takes), from the line `pdserve up` prints."""

    ray_address: str | None = None
    # the pid of `pdserve up`, which started a session of its own: each process of this
    # cluster (Ray's daemons, the replicas) is in that session, whatever else runs here
    session: int | None = None


def _read_until_ready(proc: subprocess.Popen[str], log: list[str]) -> str:
    assert proc.stdout is not None
    try:
        line = wait_for_line(proc.stdout, "pdserve ready at ", START_TIMEOUT_S, log)
    except EOFError:
        raise RuntimeError(f"pdserve up exited with {proc.wait(10)}:\n" + "\n".join(log)) from None
    except TimeoutError:
        raise TimeoutError(
            f"pdserve up not ready in {START_TIMEOUT_S}s:\n" + "\n".join(log)
        ) from None
    drain(proc.stdout)  # Ray writes to stdout too: a full pipe would stall pdserve up
    url = ClusterURL(line.split("pdserve ready at ", 1)[1].strip())
    url.session = proc.pid
    for earlier in log:
        if earlier.startswith("pdserve ray address "):
            url.ray_address = earlier.removeprefix("pdserve ray address ").strip()
    return url


# Where a test cluster's HTTP ports come from: below Linux's ephemeral range (32768 up).
# A port bound to 0 and released (`free_port`) is an ephemeral one, which the cluster's
# own processes (Ray's workers, Redis, KV receivers, all binding port 0) may be handed
# before the router binds it: Serve then finds its only direct-ingress port taken and
# the router never starts (seen once as `NoAvailablePortError`).
HTTP_PORTS = range(20000, 32000)


def cluster_port(count: int = 1) -> int:
    """A port P outside the ephemeral range with P .. P + count - 1 free on loopback."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(HTTP_PORTS.start, HTTP_PORTS.stop - count)
        socks = [socket.socket() for _ in range(count)]
        try:
            for i, sock in enumerate(socks):
                sock.bind(("127.0.0.1", port + i))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return port
    raise RuntimeError(f"no {count} consecutive free ports in {HTTP_PORTS}")


@pytest.fixture(scope="session")
def free_cluster_port() -> Callable[[int], int]:
    """`free_cluster_port(count)`: `cluster_port` for tests that pass their own --port."""
    return cluster_port


@contextlib.contextmanager
def start_cluster(model_dir: Path, *args: str) -> Iterator[str]:
    """Run `pdserve up --model model_dir ARGS` on a free port; yield its base URL.

    Unless ARGS say otherwise, `--disagg-policy always`: a disaggregated test proves the
    split for every request (conditional disaggregation would prefill short prompts on
    the decode worker, on purpose); tests/router/test_conditional_cluster.py runs the
    default policy. And `--ingress-drain-s 0` (see below).
    """
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--model", str(model_dir)]
    argv += ["--port", str(cluster_port()), *args]
    if "--disagg-policy" not in args:
        argv += ["--disagg-policy", "always"]
    if "--ingress-drain-s" not in args:
        # no load balancer in front to take a stopping router out first: its 2 s of
        # draining would only add to every stop (tests/faults/test_graceful_shutdown.py
        # stops with the default)
        argv += ["--ingress-drain-s", "0"]
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONUNBUFFERED": "1"}
    # stderr (Ray's and the replicas' logs) goes to ours, so a failure shows it.
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    log: list[str] = []
    try:
        yield _read_until_ready(proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)  # ready and idle: a stop in STOP_LIMIT_S
        try:
            code = proc.wait(STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            stacks = _py_spy(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(
                f"pdserve up did not stop within {STOP_LIMIT_S:g}s:\n{stacks}"
            ) from None
        assert code == 0, f"pdserve up exited with {code}"
        left = wait_session_empty(proc.pid, timeout_s=5.0)
        assert not left, f"pdserve up left processes behind: {left}"


@pytest.fixture(scope="session")
def pdserve_up() -> Callable[..., AbstractContextManager[str]]:
    """`with pdserve_up(model_dir, *flags) as url:` runs `pdserve up` for the block."""
    return start_cluster


T = TypeVar("T")


def poll(what: str, check: Callable[[], T], timeout_s: float, interval_s: float = 0.1) -> T:
    """Call `check()` until it returns a truthy value (an external condition: a cluster's
    state, a process gone, a span exported); return that value. AssertionError naming
    `what` once `timeout_s` has passed. The suite's one poll loop (the `poll` fixture)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)  # the poll period of an external condition


@pytest.fixture(scope="session", name="poll")
def poll_fixture() -> Callable[..., Any]:
    """`poll(what, check, timeout_s, interval_s=0.1)`: see `poll` above."""
    return poll


class Api:
    """HTTP helpers for tests against a running cluster (the `api` fixture)."""

    @staticmethod
    def get_json(url: str, any_status: bool = False) -> Any:
        """GET a JSON body; with any_status, an error status's body too (e.g. /health 503)."""
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            if not any_status:
                raise
            return json.loads(exc.read())

    @staticmethod
    def metric(url: str, name: str, **labels: str) -> float:
        """One sample of the router's /metrics (0 if absent), matched by name and labels."""
        return sample(scrape_metrics(url), name, **labels)

    @staticmethod
    def own_workers(url: str) -> list[dict[str, Any]]:
        """`/workers` rows that each worker answered itself, those with an error left out.

        A worker's state is asked with Serve's `target_replica`; a call for a replica
        that Serve's router cannot reach yet (right after start-up, or under load) is
        answered by another replica of the pool, whose state and pid then appear in that
        row (`answered_by` says so). A test that signals a worker's pid takes its row
        from here. Seen in CI: one prefill worker frozen twice, the other not at all;
        two decode workers each "running" one stream.
        """
        rows = Api.get_json(f"{url}/workers")["workers"]
        return [w for w in rows if "error" not in w and w.get("answered_by") == w["worker_id"]]

    @staticmethod
    def local_prefills(url: str) -> dict[str, float]:
        """`pdserve_decode_local_prefill_total` by reason, reasons still at 0 left out.

        A disaggregated test ends with `assert api.local_prefills(url) == {}` (the split
        happened for every request), or names the failure it injected.
        """
        return {
            dict(labels)["reason"]: value
            for (name, labels), value in scrape_metrics(url).items()
            if name == "pdserve_decode_local_prefill_total" and value
        }

    @staticmethod
    def greedy(client: Any, model: str, prompt: list[int], max_tokens: int) -> list[int]:
        """A greedy completion's token ids (eos ignored), through the official client."""
        out = client.completions.create(**_greedy_args(model, prompt, max_tokens))
        return list(out.choices[0].model_extra["token_ids"])

    @staticmethod
    def greedy_stream(client: Any, model: str, prompt: list[int], max_tokens: int) -> Any:
        """The same request, streamed: chunks carry `model_extra["token_ids"]`."""
        return client.completions.create(**_greedy_args(model, prompt, max_tokens), stream=True)


def _greedy_args(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }


@pytest.fixture(scope="session")
def api() -> type[Api]:
    return Api


# -- a cluster command stopped by a signal ------------------------------------------------


class Stoppable:
    """A command that runs a cluster (`pdserve up`, `serve run`), run as a user runs it:
    a session of its own, its stdout and stderr read by a thread, every line kept.

    `wait_for(text)` waits for a line containing `text`; `stop(sig)` sends the signal and
    asserts the command exits within STOP_LIMIT_S and leaves no process of its session.
    """

    def __init__(self, argv: list[str], env: dict[str, str | None] | None = None) -> None:
        self.argv = argv
        self.lines: list[str] = []
        self._seen = threading.Condition()
        merged: dict[str, str | None] = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={name: value for name, value in merged.items() if value is not None},
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name="stoppable-read", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._seen:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._seen.notify_all()
        with self._seen:
            self.lines.append("")  # EOF: wakes the waiters to see the process ended
            self._seen.notify_all()

    def tail(self, num_lines: int = 60) -> str:
        return "\n".join(self.lines[-num_lines:])

    def wait_for(self, text: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """The first line containing `text` (waiting for it up to `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        with self._seen:
            start = 0
            while True:
                for line in self.lines[start:]:
                    if text in line:
                        return line
                start = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"no line with {text!r} from {self.argv[:4]} "
                        f"(exit {self.proc.poll()}):\n{self.tail()}"
                    )
                self._seen.wait(remaining)

    def stop(self, sig: signal.Signals, within_s: float = STOP_LIMIT_S) -> tuple[int, float]:
        """Send `sig`; (the exit code, seconds to exit). Asserts the exit within `within_s`
        and that nothing of the command's session is left."""
        started = time.monotonic()
        self.proc.send_signal(sig)
        return self.wait_stopped(started, within_s)

    def wait_stopped(self, started: float, within_s: float = STOP_LIMIT_S) -> tuple[int, float]:
        try:
            code = self.proc.wait(max(0.0, started + within_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            stacks = _py_spy(self.proc.pid)
            self.kill()
            raise AssertionError(
                f"{self.argv[:4]} did not stop within {within_s:g}s:\n{self.tail()}\n{stacks}"
            ) from None
        elapsed = time.monotonic() - started
        left = wait_session_empty(self.proc.pid, timeout_s=5.0)
        if left:
            self.kill()
        assert not left, f"{self.argv[:4]} left processes behind: {left}"
        return code, elapsed

    def kill(self) -> None:
        """Kill what is left of the session (a failed test's cleanup)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for line in session_members(self.proc.pid):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        self.proc.wait()


def _py_spy(pid: int) -> str:
    """Where each thread of a hung process is (py-spy), for the failure's message."""
    try:
        dump = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(no py-spy dump: {exc!r})"
    return dump.stdout + dump.stderr


@pytest.fixture
def stoppable() -> Iterator[Callable[..., Stoppable]]:
    """`stoppable(argv, env=None)` starts a `Stoppable` (`env` adds to this process's
    environment; a None value removes the name); whatever is left is killed at the end
    of the test."""
    started: list[Stoppable] = []

    def start(argv: list[str], env: dict[str, str | None] | None = None) -> Stoppable:
        started.append(Stoppable(argv, env))
        return started[-1]

    yield start
    for command in started:
        if command.proc.poll() is None or session_members(command.proc.pid):
            command.kill()


# -- test tiers ---------------------------------------------------------------------------
#
# `python -m pytest -m "not cluster"` is the fast tier: it leaves out every test that
# starts a Ray cluster (`pdserve up`, `serve run`, `ray.init`, a benchmark that runs
# one), a redis-server (`redis`, which is `cluster` too), network namespaces
# (`multinode`, also `cluster`) or trains the built-in demo model (`demo`, also
# `cluster`: ~40 s). A test gets its markers from the fixtures it uses (TIER_FIXTURES)
# or from `pytest.mark`s in its module; one that starts a cluster or a Redis its markers
# do not say fails (`_TierGuard`), so the tiers cannot drift.

TIER_FIXTURES = {
    "cluster": {"pdserve_up", "stoppable", "serve_run", "make_topology"},
    "redis": {"redis_server", "redis_url"},
    "demo": {"trained_demo_dir", "demo_rebuild"},
}
UMBRELLA = ("redis", "multinode", "demo")  # each is `cluster` too


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in TIER_FIXTURES.items():
            if names & fixtures and item.get_closest_marker(marker) is None:
                item.add_marker(marker)
        umbrella = any(item.get_closest_marker(name) for name in UMBRELLA)
        if umbrella and item.get_closest_marker("cluster") is None:
            item.add_marker("cluster")


class _TierGuard:
    """Fails a test that starts a Ray cluster or a redis-server without its marker."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None

    def require(self, marker: str, what: str) -> None:
        item = self.item
        if item is not None and item.get_closest_marker(marker) is None:
            raise RuntimeError(
                f"{item.nodeid} {what} but is not marked `{marker}`: add "
                f"`pytestmark = pytest.mark.{marker}` (tests/conftest.py, 'test tiers')"
            )

    def install(self) -> None:
        import ray

        from pdserve.deploy.redis_server import EmbeddedRedis

        guard = self
        ray_init, redis_start, popen_init = ray.init, EmbeddedRedis.start, subprocess.Popen.__init__

        def init(*args: Any, **kwargs: Any) -> Any:
            guard.require("cluster", "starts a Ray cluster (ray.init)")
            return ray_init(*args, **kwargs)

        def start(self: EmbeddedRedis) -> EmbeddedRedis:
            guard.require("redis", "starts a redis-server")
            return redis_start(self)

        def popen(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
            argv = [str(a) for a in args] if isinstance(args, list | tuple) else [str(args)]
            if _starts_a_cluster(argv):
                guard.require("cluster", f"runs {' '.join(argv[1:4])}")
            popen_init(self, args, *rest, **kwargs)

        ray.init = init
        EmbeddedRedis.start = start  # type: ignore[method-assign]
        subprocess.Popen.__init__ = popen  # type: ignore[method-assign]


def _starts_a_cluster(argv: list[str]) -> bool:
    """`pdserve up` or `serve run` (a benchmark module that runs a cluster in a process of
    its own cannot be told from one that does not: its test says so with its marker)."""
    if "pdserve.deploy.cli up" in " ".join(argv):
        return True
    command = argv[0] if argv else ""
    return (command.endswith("pdserve") and argv[1:2] == ["up"]) or (
        command.endswith("serve") and argv[1:2] == ["run"]
    )


_TIERS = _TierGuard()


def pytest_configure(config: pytest.Config) -> None:
    _TIERS.install()
    _terminal_sigint()


def _terminal_sigint() -> None:
    """The commands tests start get SIGINT as a terminal gives it, whatever this process
    inherited. A background job of a non-interactive shell (`cmd &` in a script, `nohup`,
    some CI runners) starts with SIGINT ignored, every child inherits that, and Python
    keeps an inherited SIG_IGN: `serve run` (Ray's CLI, which sets no handler of its
    own) then ignored the tests' Ctrl-C and never stopped, and nothing was logged after
    the signal. A Python handler here is reset to the default in every child at exec, so
    each command starts as it would from a terminal. (`pdserve up` installs handlers of
    its own and stops either way; docs/failures.md, "Stopping".)"""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_setup(item: pytest.Item) -> None:
    _TIERS.item = item
