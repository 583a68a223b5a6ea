"""Threads by default: an engine told nothing uses the cores its process may run on.

`LLM(model)` once ran on one thread whatever torch was set to (`num_threads` defaulted to
1 and the engine applied it), so a user who called `torch.set_num_threads(2)` first got
half the speed. Now None means `OMP_NUM_THREADS` when set, otherwise the affinity mask
(common/engine_config.py, `default_num_threads`), shared among local tensor-parallel ranks; a
replica takes the CPUs its pool gives it (`ClusterConfig.threads`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.cluster.config import ClusterConfig
from pdserve.common.engine_config import default_num_threads, usable_cpus
from pdserve.engine import LLM


@pytest.fixture
def restore_threads() -> Iterator[None]:
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def test_default_is_omp_num_threads_else_the_affinity_mask(monkeypatch: Any) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_num_threads() == usable_cpus() == len(os.sched_getaffinity(0))
    assert default_num_threads(ranks=usable_cpus() + 1) == 1  # at least one each
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # set but empty: not a choice
    assert default_num_threads() == usable_cpus()


def test_the_mask_is_what_the_process_may_use() -> None:
    """`taskset -c 0` (a container's CPU limit, a pinned replica) means one thread."""
    code = (
        "from pdserve.common.engine_config import default_num_threads; print(default_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "1"


@pytest.mark.parametrize("torch_before", [1, None])
def test_llm_without_num_threads_uses_the_usable_cpus(
    random_model_dir: Path, monkeypatch: Any, restore_threads: None, torch_before: int | None
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if torch_before is not None:
        torch.set_num_threads(torch_before)
    with LLM(str(random_model_dir), dtype="float32", num_kv_blocks=16) as llm:
        assert llm.engine.config.num_threads == usable_cpus()
        assert torch.get_num_threads() == usable_cpus()


def test_an_explicit_count_wins(random_model_dir: Path, restore_threads: None) -> None:
    with LLM(str(random_model_dir), dtype="float32", num_kv_blocks=16, num_threads=1) as llm:
        assert (llm.engine.config.num_threads, torch.get_num_threads()) == (1, 1)


def test_a_replica_takes_the_cpus_its_pool_gives_it() -> None:
    base = {"model": "m", "mode": "disagg"}
    assert ClusterConfig(**base).threads("decode") == 1  # replica_num_cpus 1
    assert ClusterConfig(**base, replica_num_cpus=2.5).threads("prefill") == 2
    assert ClusterConfig(**base, replica_num_cpus=0.5).threads("prefill") == 1
    pinned = ClusterConfig(**base, prefill_cpus="0-3", decode_cpus="4")
    assert (pinned.threads("prefill"), pinned.threads("decode")) == (4, 1)
    told = ClusterConfig(**base, prefill_cpus="0-3", num_threads=2)
    assert (told.threads("prefill"), told.engine_config("prefill").num_threads) == (2, 2)
    assert pinned.engine_config("prefill").num_threads == 4


# Run in a fresh process: an OpenMP runtime that no thread has used yet. Prints the
# native threads (not Python's) started while an AsyncEngine is built and serves one
# request: libgomp's worker threads, `num_threads - 1` for each thread that ran torch's
# parallel work. Two other sources are kept out of the count:
# - torch.set_num_threads also sizes torch's pthreadpool (used by QNNPACK/XNNPACK), whose
#   threads belong to no thread; sizing it before `before` leaves the engine's call at the
#   same size, which starts nothing;
# - threads are counted while the engine still runs: a thread that has just been joined
#   (the engine thread after close, and its libgomp workers with it) can linger in /proc.
_TEAMS = """
import asyncio, os, sys, threading
import torch
from pdserve.common.engine_config import EngineConfig
from pdserve.engine import SamplingParams
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine

def native():
    python = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - python

def make():
    return LLMEngine(sys.argv[1], EngineConfig(num_threads=2, num_kv_blocks=64, dtype="float32"))

torch.set_num_threads(2)  # the pthreadpool's size, not an OpenMP team
before = native()
engine = AsyncEngine(make) if sys.argv[2] == "factory" else AsyncEngine(make())
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

def start(e):
    e.add_request("r", [5 + i % 500 for i in range(300)], params, stream=True)

async def serve():
    tokens = [t async for out in engine.stream("r", start) for t in out.new_token_ids]
    started = len(native() - before)
    await engine.close()
    return tokens, started

tokens, started = asyncio.run(serve())
assert len(tokens) == 4
print(started)
"""


@pytest.mark.parametrize("built", ["factory", "by the caller"])
def test_an_async_engine_built_on_its_thread_is_the_only_openmp_team(
    random_model_dir: Path, built: str
) -> None:
    """AsyncEngine(factory), as a replica builds it, keeps torch's OpenMP work on the
    engine thread: one team, one worker thread at num_threads=2. An engine built on the
    caller's thread and stepped on the engine thread makes two teams, and libgomp then
    throttles every team's spin-wait (engine/async_engine.py, AsyncEngine)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    mode = "factory" if built == "factory" else "caller"
    out = subprocess.run(
        [sys.executable, "-c", _TEAMS, str(random_model_dir), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    workers = int(out.stdout.strip().splitlines()[-1])
    assert workers == (1 if built == "factory" else 2)
