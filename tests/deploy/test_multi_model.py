"""Several models behind one router: `pdserve up --model A --model B,...` (one cluster).

Two random checkpoints of different shapes and different tokenizers (vocabularies of 512
and 1024, trained apart: the same text encodes to other ids): A disaggregated, B
colocated. Each request must return its own model's `transformers` tokens, tokenized by
its own model's tokenizer; `/v1/models` lists both; an unknown model is a 404.

Then the cluster is redeployed without B (`pdserve deploy`, from the Serve config the
cluster runs, B's application and entry taken out) and streams on A are started before
the router is replaced (its args list the models): its old replica serves them to the
end while the new one takes over, A's pools keep their replicas (their application's
args did not change), and B is gone.

Routed model names (`--routes-file`): three rules of route `auto` send each request where
the rule says, and route `canary` sends 10% of its traffic to B.

One cluster for the module (`multi_cluster`); tests that need both models must come
before `test_removing_a_model_keeps_the_other_models_streams`, which runs last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from pdserve.cluster.config import model_app_name

MAX_TOKENS = 8
BLOCK_SIZE = 8
B_ID = "model-b"
COMMON = (
    *("--mode", "disagg", "--dtype", "float32", "--block-size", str(BLOCK_SIZE)),
    *("--replica-cpus", "0", "--threads", "1", "--num-kv-blocks", "2048"),
)
TEXT = "The river bends where the old mill stands"


@dataclass(frozen=True)
class MultiCluster:
    url: str
    ray_address: str
    a_dir: Path  # disaggregated, vocabulary 512
    b_dir: Path  # colocated, vocabulary 1024, another shape
    a_id: str
    b_id: str


CANARY_SHARE = 0.1


def routes(a_id: str) -> list[dict[str, Any]]:
    """`auto`: three rules to B, else A; `canary`: 10% of its traffic to B."""
    to_b = [
        {"name": "tagged", "model": B_ID, "metadata": {"workload": "batch"}},
        {"name": "team-b", "model": B_ID, "headers": {"X-Team": "b"}},
        {"name": "short-answer", "model": B_ID, "max_max_tokens": 2},
    ]
    canary = [{"name": "b-canary", "model": B_ID, "fraction": CANARY_SHARE}]
    return [
        {"name": "auto", "default": a_id, "rules": to_b},
        {"name": "canary", "default": a_id, "rules": canary},
    ]


@pytest.fixture(scope="module")
def multi_cluster(
    make_checkpoint: Any, pdserve_up: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MultiCluster]:
    a_dir = Path(make_checkpoint(max_position_embeddings=4096))
    b_dir = Path(
        make_checkpoint(
            hidden_size=128,
            num_layers=3,
            num_heads=4,
            num_kv_heads=4,
            intermediate_size=256,
            vocab_size=1024,
            seed=1,
            max_position_embeddings=512,
        )
    )
    b_flag = f"{b_dir},served_model_name={B_ID},mode=colocated"
    routes_file = tmp_path_factory.mktemp("routes") / "routes.yaml"
    routes_file.write_text(yaml.safe_dump(routes(a_dir.name)))
    with pdserve_up(a_dir, "--model", b_flag, "--routes-file", str(routes_file), *COMMON) as url:
        assert url.ray_address, "pdserve up printed no Ray address"
        yield MultiCluster(url, url.ray_address, a_dir, b_dir, a_dir.name, B_ID)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def prompts(seed: int, vocab: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(6 + 7 * i)] for i in range(n)]


def test_each_model_serves_its_own_tokens(
    multi_cluster: MultiCluster, hf_greedy: Any, api: Any
) -> None:
    from transformers import AutoTokenizer

    c, url = client(multi_cluster.url), multi_cluster.url
    a, b = multi_cluster.a_id, multi_cluster.b_id
    a_dir, b_dir = multi_cluster.a_dir, multi_cluster.b_dir
    assert {m.id for m in c.models.list().data} == {a, b, "auto", "canary"}
    before = api.metric(url, "pdserve_kv_transfer_blocks_total", model=a)
    for model, folder, vocab in ((a, a_dir, 512), (b, b_dir, 1024)):
        ids = prompts(7, vocab)
        want = hf_greedy(folder, ids, MAX_TOKENS)
        assert [api.greedy(c, model, p, MAX_TOKENS) for p in ids] == want, model
        # text: tokenized by this model's own tokenizer, answered by this model
        out = c.completions.create(
            model=model,
            prompt=TEXT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert out.model == model
        prompt_ids = out.model_extra["prompt_token_ids"]
        assert prompt_ids == AutoTokenizer.from_pretrained(folder)(TEXT)["input_ids"]
        assert out.choices[0].model_extra["token_ids"] == hf_greedy(folder, [prompt_ids], 8)[0]
    encoded = [AutoTokenizer.from_pretrained(d)(TEXT)["input_ids"] for d in (a_dir, b_dir)]
    assert encoded[0] != encoded[1]  # two tokenizers indeed
    # A token of B's vocabulary beyond A's is A's 400, not B's
    with pytest.raises(openai.BadRequestError):
        api.greedy(c, a, [5, 900], 1)
    assert len(api.greedy(c, b, [5, 900], 1)) == 1
    with pytest.raises(openai.NotFoundError):
        api.greedy(c, "no-such-model", [5, 6], 1)
    # A's split happened (KV blocks sent, nothing prefilled on its decode worker); each
    # request counted under its own model
    assert api.metric(url, "pdserve_kv_transfer_blocks_total", model=a) > before
    assert api.local_prefills(url) == {}
    for model in (a, b):
        ok = api.metric(url, "pdserve_requests_total", model=model, endpoint="completions")
        assert ok >= 4, model
    assert api.metric(url, "pdserve_kv_transfer_blocks_total", model=b) == 0
    health = api.get_json(f"{url}/health")
    assert health["status"] == "ok"
    assert health["models"][a]["workers"] == {"prefill": 1, "decode": 1}
    assert health["models"][b]["workers"] == {"prefill": 0, "decode": 1}


def test_routed_names_go_where_their_rules_say(multi_cluster: MultiCluster, api: Any) -> None:
    c, url = client(multi_cluster.url), multi_cluster.url
    a, b = multi_cluster.a_id, multi_cluster.b_id

    def routed(model: str, max_tokens: int = MAX_TOKENS, **kw: Any) -> tuple[str, str, Any]:
        """(the model that served, the rule header, its token ids) of one request."""
        extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
        raw = c.completions.with_raw_response.create(
            model=model, prompt=TEXT, max_tokens=max_tokens, temperature=0, extra_body=extra, **kw
        )
        out = raw.parse()
        tokens = out.choices[0].model_extra["token_ids"]
        return out.model, raw.headers.get("x-pdserve-route-rule"), tokens

    def direct(model: str, max_tokens: int = MAX_TOKENS) -> Any:
        return routed(model, max_tokens)[2]

    def decisions(rule: str, model: str, route: str = "auto") -> float:
        return api.metric(
            url, "pdserve_model_route_decisions_total", route=route, rule=rule, model=model
        )

    cases = [  # (request, the rule that must pick it, the model it must pick)
        ({"extra_body": {"metadata": {"workload": "batch"}}}, "tagged", b),
        ({"extra_headers": {"X-Team": "b"}}, "team-b", b),
        ({"max_tokens": 2}, "short-answer", b),
        ({"extra_body": {"metadata": {"workload": "chat"}}}, "default", a),
    ]
    for request, rule, model in cases:
        max_tokens = request.pop("max_tokens", MAX_TOKENS)
        assert decisions(rule, model) == 0
        served, header, tokens = routed("auto", max_tokens, **request)
        assert (served, header) == (model, rule), request
        # served as if the model were named directly: its tokenizer, its tokens
        assert tokens == direct(model, max_tokens), request
        assert decisions(rule, model) == 1
    assert routed(a)[1] is None  # a model named directly: no rule

    # the canary: 10% of 400 requests to B, within binomial bounds (4 sigma)
    n = 400

    async def flood() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        gate = asyncio.Semaphore(16)

        async def one() -> str:
            async with gate:
                out = await ac.completions.create(
                    model="canary", prompt=[5, 6, 7], max_tokens=1, temperature=0
                )
                return out.model

        try:
            return await asyncio.gather(*(one() for _ in range(n)))
        finally:
            await ac.close()

    served_by = asyncio.run(flood())
    to_b = served_by.count(b)
    assert to_b + served_by.count(a) == n
    bound = 4 * math.sqrt(n * CANARY_SHARE * (1 - CANARY_SHARE))
    assert abs(to_b - n * CANARY_SHARE) <= bound, f"{to_b} of {n} to the canary"
    assert decisions("b-canary", b, "canary") == to_b
    assert decisions("default", a, "canary") == n - to_b
    assert api.local_prefills(url) == {}


def _pdserve_deploy(*args: str) -> subprocess.Popen[str]:
    """`pdserve deploy ARGS` as a user runs it, started."""
    argv = [sys.executable, "-m", "pdserve.deploy.cli", "deploy", *args]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finished(proc: subprocess.Popen[str]) -> str:
    """Its stdout, once it exited with 0."""
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out


def _workers(url: str) -> set[tuple[str, str]]:
    with urllib.request.urlopen(f"{url}/workers", timeout=30) as resp:
        return {(w["model"], w["worker_id"]) for w in json.loads(resp.read())["workers"]}


def _model_ids(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as resp:
        return {card["id"] for card in json.loads(resp.read())["data"]}


# Streams long enough to outlast the router's replacement: its app's build and its new
# replica's start (~6 s on 2 busy cores; a stream runs at ~300 tokens/s).
LONG_TOKENS = 4000
STREAMS = 2


def test_removing_a_model_keeps_the_other_models_streams(
    multi_cluster: MultiCluster, hf_greedy: Any, api: Any, tmp_path: Path, poll: Any
) -> None:
    url, a, b = multi_cluster.url, multi_cluster.a_id, multi_cluster.b_id
    address = multi_cluster.ray_address
    workers = _workers(url)
    assert {m for m, _ in workers} == {a, b}
    # the config the cluster runs, without B: its app and its entry in the router's
    running = yaml.safe_load(_finished(_pdserve_deploy("--address", address)))
    apps = running["applications"]
    assert {app["name"] for app in apps} == {"pdserve", model_app_name(a), model_app_name(b)}
    assert _model_ids(url) == {a, b, "auto", "canary"}
    apps = [app for app in apps if app["name"] != model_app_name(b)]
    (router,) = [app for app in apps if app["name"] == "pdserve"]
    router["args"]["models"] = [
        m for m in router["args"]["models"] if m.get("served_model_name") != b
    ]
    router["args"]["routes"] = []  # they route to B
    without_b = tmp_path / "without-b.yaml"
    without_b.write_text(yaml.safe_dump({**running, "applications": apps}))

    prompt = prompts(11, 512, 1)[0]
    got: list[list[int]] = [[] for _ in range(STREAMS)]
    ended: list[float] = [0.0] * STREAMS
    errors: list[BaseException] = []
    started = threading.Barrier(STREAMS + 1, timeout=60)

    def stream(i: int) -> None:
        try:
            for n, chunk in enumerate(api.greedy_stream(client(url), a, prompt, LONG_TOKENS)):
                got[i] += chunk.choices[0].model_extra["token_ids"]
                if n == 0:
                    started.wait()
            ended[i] = time.monotonic()
        except BaseException as exc:  # reported by the test below
            errors.append(exc)
            started.abort()

    # The controller takes the config at once and replaces the router in the background
    # (the new router app's build, then its replica's start: seconds): streams started
    # now run on the old router replica, which keeps serving until the new one is ready,
    # and then has to drain them.
    _finished(_pdserve_deploy(str(without_b), "--address", address))
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first token
    first = time.monotonic()
    assert b in _model_ids(url), "the new router was up before the streams: they prove nothing"
    swapped: list[float] = []  # when the proxy first answered from the new router replica

    def watch() -> None:  # polling: the swap has no event to wait on
        with contextlib.suppress(AssertionError):  # not swapped: the test's asserts say so
            poll("the new router answering", lambda: b not in _model_ids(url), 120, 0.1)
        swapped.append(time.monotonic())

    watcher = threading.Thread(target=watch)
    watcher.start()
    # the reference meanwhile (its CPU time only slows the streams down)
    (want,) = hf_greedy(multi_cluster.a_dir, [prompt], LONG_TOKENS)
    watcher.join(timeout=130)
    assert _model_ids(url) == {a}, "B is still served 120 s after the redeploy"
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert got == [want] * STREAMS
    # the streams spanned the router's replacement (served by the old replica, which
    # drained them), not finished before it
    spans = [round(end - first, 1) for end in ended]
    assert min(ended) > swapped[0], (
        f"streams ended {spans} s after their first token, the new router served "
        f"{swapped[0] - first:.1f} s after it: too short to span the redeploy"
    )
    with pytest.raises(openai.NotFoundError):
        api.greedy(client(url), b, [5, 6], 1)
    # A's pools were not restarted: the same workers
    assert _workers(url) == {(m, w) for m, w in workers if m == a}
    assert api.greedy(client(url), a, prompt, MAX_TOKENS) == want[:MAX_TOKENS]
    assert api.local_prefills(url) == {}
