"""SIGTERM to `pdserve up` drains: a stream in flight completes, then everything stops."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from pdserve.deploy.redis_server import drain, free_port, wait_for_line

pytestmark = pytest.mark.cluster  # tests/conftest.py, 'test tiers'

MAX_TOKENS = 600
START_TIMEOUT_S = 240.0
STOP_LIMIT_S = 30.0


def test_sigterm_lets_the_stream_in_flight_finish(
    api: Any, make_checkpoint: Any, hf_greedy: Any
) -> None:
    model_dir = Path(make_checkpoint(max_position_embeddings=1024))
    rng = random.Random(31)
    prompt = [rng.randrange(5, 512) for _ in range(24)]
    (want,) = hf_greedy(model_dir, [prompt], MAX_TOKENS)
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "up", "--model", str(model_dir)]
    argv += ["--port", str(free_port()), "--replica-cpus", "0", "--dtype", "float32"]
    argv += ["--disagg-policy", "always"]  # the 24-token prompt must cross as KV
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    try:
        url = wait_for_line(proc.stdout, "pdserve ready at ", START_TIMEOUT_S).split()[-1]
        drain(proc.stdout)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = api.greedy_stream(client, client.models.list().data[0].id, prompt, MAX_TOKENS)
        got: list[int] = []
        local = None
        for chunk in stream:
            got += chunk.choices[0].model_extra["token_ids"]
            if local is None and len(got) >= 8:  # a chunk may carry several tokens
                # counted before the first token left the router: read before draining
                local = api.local_prefills(url)
                proc.send_signal(signal.SIGTERM)  # mid-stream
        assert got == want, "the stream must finish, not break, when the cluster drains"
        assert local == {}, "the stream's prompt must have been prefilled by the prefill pool"
        assert proc.wait(STOP_LIMIT_S) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
