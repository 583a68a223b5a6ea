"""End to end: the official `openai` client against `pdserve up` (2 prefill + 2 decode).

Every mode and transport must return exactly `transformers`' greedy tokens for a tiny
random float32 checkpoint. Placement and leases are checked on the disaggregated gRPC
cluster through what an operator sees: `/metrics`, `/workers` and `/health`. Every test
on a disaggregated cluster ends by checking that no decode worker prefilled a prompt
itself (`pdserve_decode_local_prefill_total` is 0 for every reason).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pdserve.benchmarks.bench_report import sample, scrape_metrics
from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.common.hashing import hash_block_chain, hash_namespace
from pdserve.deploy.redis_server import EmbeddedRedis

pytestmark = pytest.mark.redis  # starts its own redis-server to read the index

MAX_TOKENS = 8
SPEC = "ngram:k=4,adaptive=off"
BLOCK_SIZE = 8
LEASE_S = 3.0
CLUSTERS = {
    # First: its answers are the reference of the disaggregated clusters' logprobs.
    # API keys on (every client of this module sends API_KEY).
    # Speculation on (every proposal verified) in every cluster, prompt lookup in one of
    # each mode and a draft model (the model's first layer) in the third: every test here
    # then holds it to the reference tokens too, the draft's in disaggregated mode (its
    # KV built on the decode worker over prompt KV imported from a prefill worker).
    "colocated": ("--mode", "colocated", "--api-keys-file", "{keys}", "--speculative", SPEC),
    # Pinned pools: prefill on the first CPU, decode on the last (the same one on 1 CPU).
    # The result cache on: a request repeated here (the streamed half of a stream test) is
    # replayed from Redis; the other clusters serve every one on the workers.
    "disagg-grpc": (
        *("--mode", "disagg", "--transport", "grpc", "--result-cache-ttl-s", "600"),
        *("--speculative", "draft:{draft},k=4,adaptive=off"),
        *("--prefill-cpus", str(min(os.sched_getaffinity(0)))),
        *("--decode-cpus", str(max(os.sched_getaffinity(0)))),
    ),
    # Router limits, small enough to hit: 40 requests in flight (32 below priority 1),
    # 64 KiB bodies.
    "disagg-ucx": (
        *("--mode", "disagg", "--transport", "ucx", "--speculative", SPEC),
        *("--max-inflight-requests", "40", "--max-body-bytes", "65536"),
        *("--priority-headroom", "0.2"),
    ),
}
API_KEY = "sk-test-0123456789"
SALTED_KEY, KEY_SALT = "sk-tenant-0123456789", "key-tenant"  # a key with a default salt
REDIS_URLS: dict[str, str] = {}  # each cluster's Redis (the prefix index), by cluster name
COMMON = (
    *("--prefill-replicas", "2", "--decode-replicas", "2", "--dtype", "float32"),
    *("--block-size", str(BLOCK_SIZE), "--replica-cpus", "0", "--threads", "1"),
    *("--worker-lease-s", str(LEASE_S), "--heartbeat-s", "0.5"),
)


def make_prompts(seed: int, n: int = 8, prefix_blocks: int = 10) -> list[list[int]]:
    """n token-id prompts; the first half share a prefix of `prefix_blocks` full blocks."""
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(5, 512) for _ in range(k)]

    shared = ids(prefix_blocks * BLOCK_SIZE)
    half = n // 2
    return [shared + ids(3 + 5 * i) for i in range(half)] + [
        ids(4 + 9 * i) for i in range(n - half)
    ]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint: Any) -> Path:
    # 1024 positions: a prompt listing tools (test_tool_calls_...) takes about 550
    return Path(make_checkpoint(num_heads=4, num_kv_heads=2, max_position_embeddings=1024))


@pytest.fixture(scope="module", params=list(CLUSTERS))
def cluster(
    request: pytest.FixtureRequest,
    model_dir: Path,
    make_draft: Any,
    pdserve_up: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str]]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"{API_KEY}\n{SALTED_KEY} cache_salt={KEY_SALT}\n")
    draft = make_draft(model_dir, 1)
    flags = [flag.format(keys=keys, draft=draft) for flag in CLUSTERS[request.param]]
    redis = EmbeddedRedis().start()  # ours, so that tests can read the prefix index
    try:
        with pdserve_up(model_dir, *COMMON, *flags, "--redis-url", redis.url) as url:
            REDIS_URLS[request.param] = redis.url
            yield request.param, url
    finally:
        redis.stop()


@pytest.fixture(autouse=True)
def _split_held(request: pytest.FixtureRequest, api: Any) -> Iterator[None]:
    """Every test on a disaggregated cluster ends with no prompt prefilled on decode."""
    yield
    if "cluster" in request.fixturenames:
        name, url = request.getfixturevalue("cluster")
        if name.startswith("disagg"):
            assert api.local_prefills(url) == {}, f"{name}: a request bypassed the split"


def client(url: str, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=120, max_retries=0)


def get_json(url: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (0 if absent), matched by name and labels."""
    return sample(scrape_metrics(url), name, **labels)


def greedy(c: openai.OpenAI, model: str, prompt: list[int] | str, **kw: Any) -> Any:
    extra = {"ignore_eos": True, "return_token_ids": True, **kw.pop("extra_body", {})}
    kw.setdefault("max_tokens", MAX_TOKENS)
    return c.completions.create(model=model, prompt=prompt, temperature=0, extra_body=extra, **kw)


def assert_workers_idle(url: str) -> None:
    workers = get_json(f"{url}/workers")["workers"]
    assert workers, "no live worker"
    for w in workers:
        assert "error" not in w, w
        assert w["worker_id"] == w["answered_by"], w
        assert (w["running"], w["waiting"], w["kv_blocks_used"]) == (0, 0, 0), w
        assert w.get("pending_transfers", 0) == 0, w


def test_greedy_completions_equal_transformers(
    cluster: tuple[str, str], model_dir: Path, hf_greedy: Any
) -> None:
    name, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    prompts = make_prompts(seed=1)
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)
    for prompt, ref in zip(prompts, want, strict=True):
        out = greedy(c, model, prompt)
        assert out.choices[0].model_extra["token_ids"] == ref, name
        assert out.model_extra["prompt_token_ids"] == prompt
        assert out.usage.completion_tokens == MAX_TOKENS
        assert out.choices[0].finish_reason == "length"
    if name.startswith("disagg"):
        assert metric(url, "pdserve_kv_transfer_blocks_total") > 0
    else:
        assert metric(url, "pdserve_kv_transfer_blocks_total") == 0
    assert_workers_idle(url)


def test_stream_deltas_concatenate_to_the_text(cluster: tuple[str, str]) -> None:
    _, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    for prompt in ("The river", "Once upon a time there"):
        full = greedy(c, model, prompt)
        chunks = list(greedy(c, model, prompt, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
        assert text == full.choices[0].text
        assert ids == full.choices[0].model_extra["token_ids"]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_applies_the_template_like_transformers(
    cluster: tuple[str, str], model_dir: Path, hf_greedy: Any
) -> None:
    from transformers import AutoTokenizer

    _, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a river."},
    ]
    want_prompt = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    if hasattr(want_prompt, "keys"):  # transformers 5 returns a BatchEncoding
        want_prompt = want_prompt["input_ids"]
    out = c.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert out.model_extra["prompt_token_ids"] == list(want_prompt)
    (want_tokens,) = hf_greedy(model_dir, [list(want_prompt)], MAX_TOKENS)
    assert out.choices[0].model_extra["token_ids"] == want_tokens
    stream = c.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == out.choices[0].message.content


def test_32_concurrent_streams_then_nothing_held(
    cluster: tuple[str, str], model_dir: Path, hf_greedy: Any
) -> None:
    name, url = cluster
    prompts = make_prompts(seed=2, n=32, prefix_blocks=4)
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)

    async def one(c: openai.AsyncOpenAI, model: str, prompt: list[int]) -> list[int]:
        stream = await c.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return [t async for ch in stream for t in ch.choices[0].model_extra["token_ids"]]

    async def run() -> list[list[int]]:
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=300, max_retries=0)
        model = (await c.models.list()).data[0].id
        try:
            return list(await asyncio.gather(*(one(c, model, p) for p in prompts)))
        finally:
            await c.close()

    assert asyncio.run(run()) == want, name
    assert_workers_idle(url)


LOGPROBS = 2
# (prompt ids, token ids, each token's logprob, each token's top LOGPROBS logprobs; the
# top is [] where the API keys it by text: completions' dicts merge alternatives that
# decode to the same text, as OpenAI's format does)
Answer = tuple[list[int], list[int], list[float], list[list[float]]]
# The colocated cluster's answers, by (API, question index): the reference of the
# disaggregated clusters (filled when it runs first, as CLUSTERS orders it).
_colocated_answers: dict[tuple[str, int], Answer] = {}
PROMPTS = make_prompts(seed=5, n=4, prefix_blocks=2)
CHAT_QUESTIONS = ("Name a river.", "What is bread?")


def _completion_answer(c: openai.OpenAI, model: str, prompt: list[int]) -> Answer:
    """A greedy completion with `logprobs`: one logprob per generated token, streamed
    (in every chunk, the first one's too) and not, the same values both ways."""
    out = greedy(c, model, prompt, logprobs=LOGPROBS)
    ids = out.choices[0].model_extra["token_ids"]
    lps = out.choices[0].logprobs
    assert lps is not None and len(ids) == MAX_TOKENS
    assert len(lps.token_logprobs) == len(lps.top_logprobs) == len(lps.tokens) == MAX_TOKENS
    assert all(1 <= len(top) <= LOGPROBS for top in lps.top_logprobs), lps.top_logprobs
    streamed: list[float] = []
    for chunk in greedy(c, model, prompt, logprobs=LOGPROBS, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        got = choice.logprobs.token_logprobs if choice.logprobs is not None else []
        assert len(got) == len(choice.model_extra["token_ids"]), choice
        streamed += got
    assert streamed == pytest.approx(lps.token_logprobs, abs=1e-5)
    return prompt, ids, list(lps.token_logprobs), []


def _chat_answer(c: openai.OpenAI, model: str, question: str) -> Answer:
    """A greedy chat answer with `top_logprobs`: one entry and LOGPROBS alternatives
    per generated token, streamed and not."""
    args: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": LOGPROBS,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    out = c.chat.completions.create(**args)
    ids = out.choices[0].model_extra["token_ids"]
    content = out.choices[0].logprobs.content if out.choices[0].logprobs else None
    assert content is not None and len(content) == len(ids) == MAX_TOKENS
    assert all(len(entry.top_logprobs) == LOGPROBS for entry in content)
    streamed = []
    for chunk in c.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        entries = (choice.logprobs.content or []) if choice.logprobs is not None else []
        assert len(entries) == len(choice.model_extra.get("token_ids") or []), choice
        assert all(len(entry.top_logprobs) == LOGPROBS for entry in entries)
        streamed += [entry.logprob for entry in entries]
    chosen = [entry.logprob for entry in content]
    assert streamed == pytest.approx(chosen, abs=1e-5)
    tops = [[alt.logprob for alt in entry.top_logprobs] for entry in content]
    return out.model_extra["prompt_token_ids"], ids, chosen, tops


@functools.cache
def _offline_llm(model_dir: Path) -> Any:
    from pdserve.engine import LLM

    return LLM(model_dir, dtype="float32", block_size=BLOCK_SIZE)


def _offline_answer(model_dir: Path, prompt: list[int]) -> Answer:
    """The offline engine's answer: the reference when the colocated cluster did not run
    in this session (e.g. `-k "logprob and disagg"`)."""
    from pdserve.engine import SamplingParams

    llm = _offline_llm(model_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    (out,) = llm.generate([prompt], params)
    assert out.logprobs is not None
    tops = [[v for _, v in lp.top] for lp in out.logprobs]
    return prompt, out.token_ids, [lp.logprob for lp in out.logprobs], tops


def test_logprobs_one_per_token_equal_colocated_and_transformers(
    cluster: tuple[str, str], model_dir: Path
) -> None:
    """Every generated token has its logprob (and LOGPROBS alternatives), streamed or not:
    disaggregated, the first token's come from the prefill worker with its KV. They equal
    the colocated cluster's (float32) and `transformers`' log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    name, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    blocks0, local0 = metric(url, "pdserve_kv_transfer_blocks_total"), _local_prefills(url)
    answers = {
        **{("completions", i): _completion_answer(c, model, p) for i, p in enumerate(PROMPTS)},
        **{("chat", i): _chat_answer(c, model, q) for i, q in enumerate(CHAT_QUESTIONS)},
    }
    if name == "colocated":
        _colocated_answers.update(answers)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for key, (prompt, ids, chosen, tops) in answers.items():
        ref = _colocated_answers.get(key) or _offline_answer(model_dir, prompt)
        assert (ref[0], ref[1]) == (prompt, ids), (name, key)
        assert chosen == pytest.approx(ref[2], abs=1e-5), (name, key)
        for top, ref_top in zip(tops, ref[3], strict=False):  # [] for completions
            assert top == pytest.approx(ref_top, abs=1e-5), (name, key)
        with torch.inference_mode():  # position i's logits predict token i + 1
            logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        want = logits.float().log_softmax(dim=-1)
        want_chosen = want.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1).tolist()
        assert chosen == pytest.approx(want_chosen, abs=1e-4), (name, key)
        for top, want_top in zip(tops, want.topk(LOGPROBS).values.tolist(), strict=False):
            assert top == pytest.approx(want_top, abs=1e-4), (name, key)
    if name.startswith("disagg"):  # the split happened: KV crossed, no local prefill
        assert metric(url, "pdserve_kv_transfer_blocks_total") > blocks0
        assert _local_prefills(url) == local0
    assert_workers_idle(url)


def _local_prefills(url: str) -> float:
    """Local prefills of expected KV on decode workers, over every reason label."""
    return sum(
        value
        for (name, _), value in scrape_metrics(url).items()
        if name.startswith("pdserve_decode_local_prefill") and name.endswith("_total")
    )


def test_speculation_proposes_and_keeps_the_tokens(
    cluster: tuple[str, str], model_dir: Path, hf_greedy: Any
) -> None:
    """The decode pool speculates (`--speculative`): a prompt that repeats itself gets
    proposals from its own text (or the draft model's), verified in the running batch,
    and the tokens are still exactly `transformers`' greedy ones."""
    name, url = cluster
    rng = random.Random(9)
    part = [rng.randrange(5, 512) for _ in range(12)]
    prompt = part * 3
    (want,) = hf_greedy(model_dir, [prompt], 32)

    def counted(gauge: str) -> int:
        return sum(w.get(gauge, 0) for w in decode_workers(url))

    gauges = ("spec_proposed_tokens", "spec_accepted_tokens", "spec_draft_forwards")
    before = {g: counted(g) for g in gauges}
    c = client(url)
    out = greedy(c, c.models.list().data[0].id, prompt, max_tokens=32)
    assert out.choices[0].model_extra["token_ids"] == want, name
    assert counted("spec_proposed_tokens") > before["spec_proposed_tokens"], "nothing proposed"
    assert all("spec_proposed_tokens" in w for w in decode_workers(url))
    if name == "disagg-grpc":  # the draft model proposed, and its first layer agrees often
        assert counted("spec_draft_forwards") > before["spec_draft_forwards"]
        assert counted("spec_accepted_tokens") > before["spec_accepted_tokens"]
        deadline = time.monotonic() + 10.0  # /metrics shows the index's last snapshot
        while time.monotonic() < deadline and not metric_total(url, DRAFT_US):
            pass
        assert metric_total(url, DRAFT_US) > 0, "no draft time on /metrics"
    assert_workers_idle(url)


DRAFT_US = "pdserve_worker_spec_draft_forward_us"


def metric_total(url: str, name: str) -> float:
    """The sum of every series of `name` on /metrics."""
    return sum(v for (sample_name, _), v in scrape_metrics(url).items() if sample_name == name)


def decode_workers(url: str) -> list[dict[str, Any]]:
    return [w for w in get_json(f"{url}/workers")["workers"] if w["role"] == "decode"]


# Checked once, on the disaggregated gRPC cluster (the same module-scoped instance).
on_disagg_grpc = pytest.mark.parametrize("cluster", ["disagg-grpc"], indirect=True)


@on_disagg_grpc
def test_prefix_placement_and_only_missing_blocks_cross(
    cluster: tuple[str, str], model_dir: Path
) -> None:
    _, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    rng = random.Random(3)
    shared = [rng.randrange(5, 512) for _ in range(10 * BLOCK_SIZE)]
    first = shared + [rng.randrange(5, 512) for _ in range(13)]
    second = shared + [rng.randrange(5, 512) for _ in range(21)]

    def placements(role: str) -> dict[str, float]:
        ids = [w["worker_id"] for w in get_json(f"{url}/workers")["workers"] if w["role"] == role]
        return {i: metric(url, "pdserve_placements_total", role=role, worker=i) for i in ids}

    def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
        return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}

    p0, d0 = placements("prefill"), placements("decode")
    hits0 = metric(url, "pdserve_prefix_cache_hit_tokens_total", pool="prefill")
    bytes0 = metric(url, "pdserve_kv_transfer_bytes_total")
    greedy(c, model, first)
    p1, d1 = placements("prefill"), placements("decode")
    bytes1 = metric(url, "pdserve_kv_transfer_bytes_total")
    greedy(c, model, second)
    p2, d2 = placements("prefill"), placements("decode")
    bytes2 = metric(url, "pdserve_kv_transfer_bytes_total")

    (p_first,) = delta(p1, p0)
    assert delta(p2, p1) == {p_first: 1.0}, "the second request must go to the holder of its prefix"
    (d_first,) = delta(d1, d0)
    assert delta(d2, d1) == {d_first: 1.0}
    assert metric(url, "pdserve_prefix_cache_hit_tokens_total", pool="prefill") - hits0 == (
        10 * BLOCK_SIZE
    )
    # float32, 2 layers, K and V, 2 kv heads, head_dim 16 (hidden 64 / 4 heads)
    block_bytes = 2 * 2 * 2 * BLOCK_SIZE * 16 * 4
    blocks = [-(-len(p) // BLOCK_SIZE) for p in (first, second)]
    assert bytes1 - bytes0 == blocks[0] * block_bytes
    assert bytes2 - bytes1 == (blocks[1] - 10) * block_bytes, "only the missing blocks cross"
    assert metric(url, "pdserve_ttft_breakdown_seconds_count", stage="transfer") > 0


@on_disagg_grpc
def test_result_cache_answers_repeats_without_a_worker(
    cluster: tuple[str, str], model_dir: Path, hf_greedy: Any
) -> None:
    """A repeated greedy or seeded request is answered from the result cache, streamed
    or not: the same tokens, and no worker did anything (the router's per-worker
    counters and the decode workers' own speculation counters unchanged). A different
    seed, a changed parameter and an opt-out reach the workers."""
    _, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    prompt = make_prompts(seed=11, n=2)[0]  # 83 tokens: prefilled remotely
    (want,) = hf_greedy(model_dir, [prompt], MAX_TOKENS)

    def work() -> tuple[float, ...]:
        scrape = scrape_metrics(url)
        names = ("pdserve_placements_total", "pdserve_prompt_tokens_total")
        totals = [sum(v for (n, _), v in scrape.items() if n == name) for name in names]
        proposed = sum(w.get("spec_proposed_tokens", 0) for w in decode_workers(url))
        return (*totals, sample(scrape, "pdserve_kv_transfer_blocks_total"), proposed)

    def ask(headers: dict[str, str] | None = None, **kw: Any) -> tuple[list[int], str]:
        args = {"temperature": 0, "max_tokens": MAX_TOKENS, **kw}
        extra = {"ignore_eos": True, "return_token_ids": True, **args.pop("extra_body", {})}
        raw = c.completions.with_raw_response.create(
            model=model, prompt=prompt, extra_body=extra, extra_headers=headers, **args
        )
        tokens = raw.parse().choices[0].model_extra["token_ids"]
        return tokens, raw.headers["x-pdserve-result-cache"]

    hits0 = metric(url, "pdserve_result_cache_hits_total")
    before = work()
    assert ask() == (want, "miss")
    served = work()
    assert served[0] > before[0] and served[2] > before[2], "the first one reached workers"
    assert ask() == (want, "hit")
    assert work() == served, "a hit reached a worker"
    raw = c.completions.with_raw_response.create(
        model=model,
        prompt=prompt,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert raw.headers["x-pdserve-result-cache"] == "hit"
    chunks = list(raw.parse())
    streamed = [t for ch in chunks if ch.choices for t in ch.choices[0].token_ids]  # type: ignore[attr-defined]
    assert streamed == want
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert work() == served, "a streamed hit reached a worker"
    seeded, status = ask(temperature=1.0, seed=1234)
    assert status == "miss"
    after_seeded = work()
    assert ask(temperature=1.0, seed=1234) == (seeded, "hit")
    assert work() == after_seeded, "a seeded hit reached a worker"
    assert metric(url, "pdserve_result_cache_hits_total") - hits0 == 3
    changes: list[tuple[dict[str, Any], str]] = [
        ({"temperature": 1.0, "seed": 1235}, "miss"),
        ({"max_tokens": MAX_TOKENS - 1}, "miss"),
        ({"headers": {"Cache-Control": "no-store"}}, "bypass"),
        ({"extra_body": {"result_cache": False}}, "bypass"),
    ]
    for changed, want_status in changes:
        last = work()
        assert ask(**changed)[1] == want_status, changed
        assert work()[0] > last[0], f"{changed}: not served by the workers"


@on_disagg_grpc
def test_bad_requests_get_openai_errors_and_the_ttft_breakdown_is_complete(
    cluster: tuple[str, str],
) -> None:
    _, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    bad: list[tuple[dict[str, Any], type[openai.APIStatusError], str | None]] = [
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"temperature": 7}, openai.BadRequestError, "temperature"),
        ({"n": 17}, openai.BadRequestError, "n"),  # past MAX_N
        ({"max_tokens": 10_000}, openai.BadRequestError, "max_tokens"),
        ({"prompt": [5] * 1100}, openai.BadRequestError, "prompt"),  # > context
        ({"prompt": [5, 10**6]}, openai.BadRequestError, "prompt"),  # outside the vocab
    ]
    for override, error, param in bad:
        args: dict[str, Any] = {"model": model, "prompt": "The river", "max_tokens": 4}
        with pytest.raises(error) as info:
            c.completions.create(**{**args, **override})
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == param, body
        assert body["message"] and body["type"]
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=model, messages=[], max_tokens=4)
    for stage in ("router_queue", "prefill_queue", "prefill_compute", "transfer", "decode_queue"):
        assert metric(url, "pdserve_ttft_breakdown_seconds_count", stage=stage) > 0, stage
    assert get_json(f"{url}/health")["status"] == "ok"


@on_disagg_grpc
def test_pools_are_pinned_to_their_cpus(cluster: tuple[str, str]) -> None:
    _, url = cluster
    want = {"prefill": min(os.sched_getaffinity(0)), "decode": max(os.sched_getaffinity(0))}
    for w in get_json(f"{url}/workers")["workers"]:
        for task in Path(f"/proc/{w['pid']}/task").iterdir():  # every thread
            assert os.sched_getaffinity(int(task.name)) == {want[w["role"]]}, (w, task)


@on_disagg_grpc
def test_a_client_that_goes_away_frees_its_blocks(cluster: tuple[str, str]) -> None:
    _, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    stream = c.completions.create(
        model=model,
        prompt="The river",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )

    def aborted() -> int:
        return sum(w["aborted"] for w in get_json(f"{url}/workers")["workers"])

    before = aborted()
    for _, _ in zip(range(3), stream, strict=False):
        pass  # a few tokens in: the request is running on a decode worker
    busy = [w for w in get_json(f"{url}/workers")["workers"] if w["running"]]
    assert busy, "the request should still be running"
    stream.close()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # bounded wait for the cancellation to land
        workers = get_json(f"{url}/workers")["workers"]
        if not any(w["running"] or w["kv_blocks_used"] for w in workers):
            break
    assert_workers_idle(url)
    assert aborted() == before + 1, "the decode worker must abort it, not run it to the end"


@on_disagg_grpc
def test_a_removed_worker_leaves_placement_within_its_lease(
    cluster: tuple[str, str], model_dir: Path, hf_greedy: Any, api: Any, poll: Any
) -> None:
    _, url = cluster

    def a_decode_worker() -> dict[str, Any] | None:  # its own row: its pid, not another's
        return next((w for w in api.own_workers(url) if w["role"] == "decode"), None)

    victim = poll("a decode worker answers for itself", a_decode_worker, 20.0)
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + LEASE_S + 5.0
    while time.monotonic() < deadline:  # a bounded wait on the index, not a sleep
        live = {w["worker_id"] for w in get_json(f"{url}/workers")["workers"]}
        if victim["worker_id"] not in live:
            break
    gone_after = time.monotonic() - killed
    assert victim["worker_id"] not in live, f"still placed {gone_after:.1f}s after the kill"
    assert gone_after <= LEASE_S + 1.0
    before = metric(url, "pdserve_placements_total", role="decode", worker=victim["worker_id"])
    c = client(url)
    model = c.models.list().data[0].id
    prompts = make_prompts(seed=4, n=4)
    want = hf_greedy(model_dir, prompts, MAX_TOKENS)
    got = [greedy(c, model, p).choices[0].model_extra["token_ids"] for p in prompts]
    assert got == want
    after = metric(url, "pdserve_placements_total", role="decode", worker=victim["worker_id"])
    assert after == before, "a dead worker's index entries were used"


on_limited = pytest.mark.parametrize("cluster", ["disagg-ucx"], indirect=True)
on_keyed = pytest.mark.parametrize("cluster", ["colocated"], indirect=True)


@on_keyed
def test_api_keys_are_required_when_configured(cluster: tuple[str, str]) -> None:
    _, url = cluster
    model = client(url).models.list().data[0].id
    for key in ("sk-wrong", API_KEY[:-1], API_KEY + "0"):
        with pytest.raises(openai.AuthenticationError) as info:
            client(url, api_key=key).completions.create(model=model, prompt="x", max_tokens=1)
        assert info.value.response.headers["www-authenticate"] == "Bearer"
    body = json.dumps({"model": model, "prompt": "x"}).encode()
    no_key = urllib.request.Request(f"{url}/v1/completions", data=body)
    models = urllib.request.Request(f"{url}/v1/models")  # every /v1 route
    for req in (no_key, models, urllib.request.Request(f"{url}/workers")):  # operators' too
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(req, timeout=30)
        assert http.value.code == 401
    assert get_json(f"{url}/health")["status"] == "ok"  # probes need no key


@on_limited
def test_past_its_limits_the_router_sheds_load_with_429_and_413(cluster: tuple[str, str]) -> None:
    _, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    with pytest.raises(openai.APIStatusError) as info:
        c.completions.create(model=model, prompt="x " * 40_000, max_tokens=1)
    assert info.value.status_code == 413

    async def one(ac: openai.AsyncOpenAI, priority: int) -> str:
        try:
            stream = await ac.completions.create(
                model=model,
                prompt="The river",
                max_tokens=64,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True, "priority": priority},
            )
            # tokens, not chunks: a stream that falls behind carries several per chunk
            n = sum([len(ch.choices[0].token_ids) async for ch in stream])  # type: ignore[attr-defined]
            return "ok" if n == 64 else f"short:{n}"
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"] == "1"
            return "429"

    # Priorities: every 10th request of the flood is important (10). Below priority 1 at
    # most 32 requests are admitted (--priority-headroom 0.2), so the 8 important ones
    # always find a slot of the 40: none is shed, while low ones are admitted and shed.
    priorities = [10 if i % 10 == 0 else 0 for i in range(80)]

    async def flood() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        try:
            return list(await asyncio.gather(*(one(ac, p) for p in priorities)))
        finally:
            await ac.close()

    shed_before = metric(url, "pdserve_router_shed_requests_total", priority="0", reason="inflight")
    outcomes = asyncio.run(flood())
    low = [o for o, p in zip(outcomes, priorities, strict=True) if p == 0]
    high = [o for o, p in zip(outcomes, priorities, strict=True) if p == 10]
    assert set(low) == {"ok", "429"}, outcomes
    assert high == ["ok"] * 8, outcomes
    shed = metric(url, "pdserve_router_shed_requests_total", priority="0", reason="inflight")
    assert shed - shed_before == low.count("429")
    assert not metric(url, "pdserve_router_shed_requests_total", priority="10", reason="inflight")
    # Every slot comes back (a stream's slot is freed just after its last byte is sent,
    # so the client may see the end first: a bounded wait), then 40 are admitted again
    # (important ones: the whole limit) and 32 of the default priority.
    deadline = time.monotonic() + 10.0
    while metric(url, "pdserve_router_inflight_requests") and time.monotonic() < deadline:
        pass
    assert metric(url, "pdserve_router_inflight_requests") == 0
    assert asyncio.run(_n_ok(url, model, 40, priority=10)) == 40
    assert asyncio.run(_n_ok(url, model, 32)) == 32
    assert_workers_idle(url)


async def _n_ok(url: str, model: str, n: int, priority: int = 0) -> int:
    ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    extra = {"ignore_eos": True, "priority": priority}
    try:
        outs = await asyncio.gather(
            *(
                ac.completions.create(model=model, prompt="x", max_tokens=2, extra_body=extra)
                for _ in range(n)
            )
        )
        return sum(o.usage.completion_tokens == 2 for o in outs)
    finally:
        await ac.close()


def matched_blocks(name: str, model: str, prompt: list[int], salt: str | None) -> list[int]:
    """Per live worker, the leading blocks of `prompt` hashed under `salt` that the
    cluster's prefix index says it holds."""
    import redis.asyncio as aioredis

    chain = hash_block_chain(prompt, BLOCK_SIZE, hash_namespace(model, salt))

    async def match() -> list[int]:
        client = aioredis.Redis.from_url(REDIS_URLS[name])
        try:
            matches = await PrefixIndex(client, model, LEASE_S).match(chain)
            return [m.matched_blocks for m in matches.values()]
        finally:
            await client.aclose()

    return asyncio.run(match())


def held_by_some_worker(name: str, model: str, prompt: list[int], salt: str | None) -> int:
    """The most leading blocks of `prompt` under `salt` any worker holds, once it is every
    full block (a bounded wait: a worker publishes its events as a request ends, within
    `heartbeat_s`), else what the index says at the deadline."""
    want = len(prompt) // BLOCK_SIZE
    deadline = time.monotonic() + 10.0
    held = max(matched_blocks(name, model, prompt, salt))
    while held < want and time.monotonic() < deadline:
        held = max(matched_blocks(name, model, prompt, salt))
    return held


def cached_tokens(out: Any) -> int:
    """`usage.prompt_tokens_details.cached_tokens` of a response or a stream's last chunk."""
    assert out.usage is not None and out.usage.prompt_tokens_details is not None, out
    return int(out.usage.prompt_tokens_details.cached_tokens)


def test_cached_tokens_count_prefix_hits_and_salts_keep_tenants_apart(
    cluster: tuple[str, str],
) -> None:
    """`cached_tokens` is the prompt's full blocks found in the prefix cache of the
    engine that computed its KV (the prefill worker's when the split happened), never
    the block holding the prompt's last token (computed again to sample). The same
    prompt under two salts registers disjoint block hashes in the index, and neither
    tenant hits the other's blocks; an API key's default salt is a namespace too."""
    name, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    rng = random.Random(12)

    def ids(n: int) -> list[int]:
        return [rng.randrange(5, 512) for _ in range(n)]

    def full_hit(prompt: list[int]) -> int:  # what an engine may reuse of a cached prompt
        return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE

    def salted(salt: str | None) -> dict[str, Any]:
        # never a result-cache hit (one cluster has it on): the prefix caches are on test
        body: dict[str, Any] = {"result_cache": False}
        if salt is not None:
            body["cache_salt"] = salt
        return {"extra_body": body}

    def streamed_cached(prompt: list[int], salt: str | None) -> int:
        usage = {"stream_options": {"include_usage": True}}
        chunks = list(greedy(c, model, prompt, stream=True, **usage, **salted(salt)))
        return cached_tokens(chunks[-1])

    # a known shared prefix: 6 full blocks, then different tails
    shared = ids(6 * BLOCK_SIZE)
    first, second = shared + ids(5), shared + ids(3)
    assert cached_tokens(greedy(c, model, first, **salted("tenant-a"))) == 0
    # a hit needs the blocks in the index (placement reads it): published within a beat
    assert held_by_some_worker(name, model, first, "tenant-a") == 6
    assert cached_tokens(greedy(c, model, second, **salted("tenant-a"))) == 6 * BLOCK_SIZE
    # a prompt ending on a block boundary, under two salts: streamed usage too
    whole = ids(4 * BLOCK_SIZE)
    assert streamed_cached(whole, "tenant-a") == 0
    assert held_by_some_worker(name, model, whole, "tenant-a") == 4
    assert streamed_cached(whole, "tenant-a") == full_hit(whole) == 3 * BLOCK_SIZE
    assert held_by_some_worker(name, model, whole, "tenant-a") == 4
    assert max(matched_blocks(name, model, whole, "tenant-b")) == 0, "tenant-a's blocks leak"
    assert cached_tokens(greedy(c, model, whole, **salted("tenant-b"))) == 0
    assert held_by_some_worker(name, model, whole, "tenant-b") == 4
    assert cached_tokens(greedy(c, model, whole, **salted("tenant-b"))) == full_hit(whole)
    assert held_by_some_worker(name, model, whole, "tenant-b") == 4
    assert max(matched_blocks(name, model, whole, None)) == 0  # nothing under no salt
    chains = [hash_block_chain(whole, BLOCK_SIZE, hash_namespace(model, s)) for s in "ab"]
    assert not set(chains[0]) & set(chains[1])
    # chat, streamed and not: its own salt, so no earlier test's template prefix counts
    chat: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Which tenant am I?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True, "cache_salt": f"chat-{name}", "result_cache": False},
    }
    out = c.chat.completions.create(**chat)
    assert cached_tokens(out) == 0
    stream = c.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True})
    *_, last = stream
    assert out.usage is not None
    n = out.usage.prompt_tokens
    assert last.usage is not None and last.usage.prompt_tokens == n
    assert cached_tokens(last) == (n - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    if name == "colocated":  # API keys on: a key's default salt, a request's own wins
        keyed = ids(3 * BLOCK_SIZE + 2)
        tenant = client(url, api_key=SALTED_KEY)
        assert cached_tokens(greedy(tenant, model, keyed)) == 0
        assert cached_tokens(greedy(c, model, keyed)) == 0  # no salt: another namespace
        assert held_by_some_worker(name, model, keyed, KEY_SALT) == 3
        assert cached_tokens(greedy(c, model, keyed, **salted(KEY_SALT))) == 3 * BLOCK_SIZE
        assert held_by_some_worker(name, model, keyed, KEY_SALT) == 3
        # 4 blocks, not 2: placement's hit bonus (0.5 a block) must outweigh the one
        # running sequence a holder's last heartbeat may still report (weight 1); 2 blocks
        # tied with it and the placement was a coin flip (half the CI runs missed)
        other = ids(4 * BLOCK_SIZE + 1)
        assert cached_tokens(greedy(tenant, model, other, **salted("tenant-a"))) == 0
        assert held_by_some_worker(name, model, other, "tenant-a") == 4
        assert cached_tokens(greedy(c, model, other, **salted("tenant-a"))) == 4 * BLOCK_SIZE
    if name.startswith("disagg"):  # the prefill workers' hits, the split happened
        assert metric(url, "pdserve_kv_transfer_blocks_total") > 0
    assert_workers_idle(url)


def test_parallel_sampling_forks_one_prefill_into_seeded_choices(
    cluster: tuple[str, str],
) -> None:
    """`n=4, seed=S` returns the four choices that n=1 requests seeded S + i return
    (streamed or not, through the client's typed objects), from one prefill whose blocks
    cross once in disaggregated mode; every block is released afterwards."""
    name, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    n, seed = 4, 4242
    prompt = [random.Random(21).randrange(5, 512) for _ in range(2 * BLOCK_SIZE + 5)]
    extra = {"ignore_eos": True, "return_token_ids": True, "result_cache": False}
    args: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "temperature": 1.0,
        "max_tokens": MAX_TOKENS,
        "extra_body": extra,
    }
    counters = ("pdserve_kv_transfer_blocks_total", "pdserve_prompt_tokens_total")
    before = {m: metric_total(url, m) for m in counters}
    placed = {role: metric(url, "pdserve_placements_total", role=role) for role in ("prefill",)}
    out = c.completions.create(n=n, seed=seed, **args)
    # one prompt, prefilled once (on P in disaggregated mode, its 3 blocks sent once)
    prompt_tokens = metric_total(url, "pdserve_prompt_tokens_total") - before[counters[1]]
    blocks = metric_total(url, "pdserve_kv_transfer_blocks_total") - before[counters[0]]
    if name.startswith("disagg"):
        assert blocks == 3, f"{name}: the prompt's blocks crossed {blocks / 3:g} times"
        assert metric(url, "pdserve_placements_total", role="prefill") == placed["prefill"] + 1
        assert prompt_tokens == 2 * len(prompt)  # counted by P's pool and D's, once each
    else:
        assert blocks == 0 and prompt_tokens == len(prompt)
    assert [ch.index for ch in out.choices] == list(range(n))
    got = [ch.model_extra["token_ids"] for ch in out.choices]
    separate = [
        c.completions.create(seed=seed + i, **args).choices[0].model_extra["token_ids"]
        for i in range(n)
    ]
    assert got == separate, name
    assert len({tuple(t) for t in got}) > 1  # the derived seeds differ
    assert all(ch.finish_reason == "length" for ch in out.choices)
    assert out.usage is not None and out.usage.completion_tokens == n * MAX_TOKENS
    assert out.usage.prompt_tokens == len(prompt)

    chunks = list(
        c.completions.create(
            n=n, seed=seed, stream=True, stream_options={"include_usage": True}, **args
        )
    )
    streamed: list[list[int]] = [[] for _ in range(n)]
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for ch in chunk.choices:
            streamed[ch.index] += ch.model_extra["token_ids"]
            texts[ch.index] += ch.text
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert streamed == separate and texts == [ch.text for ch in out.choices]
    assert reasons == ["length"] * n
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == n * MAX_TOKENS
    # chat: each choice its own message, seeded alike
    chat = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the river"}],
        n=2,
        seed=seed,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        extra_body=extra,
    )
    assert [ch.index for ch in chat.choices] == [0, 1]
    for i, ch in enumerate(chat.choices):
        alone = c.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me about the river"}],
            seed=seed + i,
            temperature=1.0,
            max_tokens=MAX_TOKENS,
            extra_body=extra,
        )
        assert ch.message.content == alone.choices[0].message.content


STRUCTURED_PER_CLUSTER = 67  # x3 clusters: 201 requests, through the split and not


def _structured_answer(c: openai.OpenAI, model: str, i: int, schema: dict[str, Any]) -> Any:
    """Request i under `schema`: chat with response_format json_schema (strict) or a
    completion with guided_json, streamed or not, sampled with seed i; (text, finish)."""
    extra = {"result_cache": False}
    kw: dict[str, Any] = {"model": model, "max_tokens": 256, "seed": i, "extra_body": extra}
    stream = i % 2 == 1
    if i % 4 < 2:
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": schema, "strict": True},
        }
        messages = [{"role": "user", "content": f"Answer {i} in JSON"}]
        out = c.chat.completions.create(messages=messages, response_format=fmt, stream=stream, **kw)
        if not stream:
            return out.choices[0].message.content, out.choices[0].finish_reason
        chunks = [ch.choices[0] for ch in out if ch.choices]
        return "".join(ch.delta.content or "" for ch in chunks), chunks[-1].finish_reason
    extra["guided_json"] = schema
    out = c.completions.create(prompt=f"Answer {i} in JSON:", stream=stream, **kw)
    if not stream:
        return out.choices[0].text, out.choices[0].finish_reason
    chunks = [ch.choices[0] for ch in out if ch.choices]
    return "".join(ch.text for ch in chunks), chunks[-1].finish_reason


def test_structured_output_validates_and_the_first_token_is_constrained(
    cluster: tuple[str, str],
) -> None:
    """Assorted JSON schemas, chat (response_format) and completions (guided_json),
    streamed and not: a random model's output validates only under the grammar. Where
    the unconstrained first token is no JSON start, the constrained one is, and in
    disaggregated mode it came from the prefill worker: KV blocks crossed and no decode
    worker prefilled (a first token outside the grammar would make it prefill locally)."""
    import concurrent.futures

    import jsonschema

    from pdserve.benchmarks.structured_schemas import assorted_schemas

    name, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    free = greedy(c, model, "Answer in JSON:", max_tokens=1, extra_body={"result_cache": False})
    assert not free.choices[0].text.startswith("{")
    blocks0, local0 = metric(url, "pdserve_kv_transfer_blocks_total"), _local_prefills(url)
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    first = greedy(
        c,
        model,
        "Answer in JSON:",
        max_tokens=1,
        extra_body={"result_cache": False, "guided_json": schema},
    )
    assert first.choices[0].text.startswith("{"), first.choices[0].text
    seed = {"colocated": 1, "disagg-grpc": 2, "disagg-ucx": 3}[name]
    schemas = assorted_schemas(STRUCTURED_PER_CLUSTER, seed=seed)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda a: _structured_answer(c, model, *a), enumerate(schemas)))
    for s, (text, finish) in zip(schemas, answers, strict=True):
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), s)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(
            model=model, prompt="x", max_tokens=4, extra_body={"guided_json": {"type": "nope"}}
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "guided_json"
    if name.startswith("disagg"):
        assert metric(url, "pdserve_kv_transfer_blocks_total") > blocks0
        assert _local_prefills(url) == local0
    assert_workers_idle(url)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "label": {"enum": ["work", "gym"]},
            },
            "required": ["hour", "label"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ALARM]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# What a model that calls tools writes (hermes: JSON in <tool_call> tags), forced by a
# guided_choice of this one string: only then does a random model's output hold calls.
CRAFTED = (
    "Checking both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7, "label": "gym"}}\n</tool_call>'
)
TOOL_REQUESTS_PER_CLUSTER = 12


def _calls_of(out: Any, stream: bool) -> tuple[str | None, list[tuple[str, str, str]], Any]:
    """(content, [(id, name, arguments)], finish_reason) of a chat response through the
    client's typed objects, streamed deltas put together as a client does."""
    if not stream:
        message = out.choices[0].message
        calls = [(t.id, t.function.name, t.function.arguments) for t in message.tool_calls or []]
        return message.content, calls, out.choices[0].finish_reason
    content, finish = None, None
    parts: dict[int, list[str]] = {}
    for chunk in out:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for delta in choice.delta.tool_calls or []:
                if delta.index not in parts:  # a call's first piece: id and name
                    assert delta.id and delta.function and delta.function.name, delta
                    parts[delta.index] = [delta.id, delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function and not delta.function.name
                parts[delta.index][2] += delta.function.arguments or ""
    return content, [(p[0], p[1], p[2]) for _, p in sorted(parts.items())], finish


FORCED = ("required-one", "required-many", "named", "named")


def _forced_call(c: openai.OpenAI, model: str, i: int) -> tuple[Any, ...]:
    """Request i: tool_choice required (parallel_tool_calls false: one call; or several
    calls, cut at 160 tokens: a random model need not close its list) or a named
    function; streamed for i in 4..7, sampled with seed i."""
    kind = FORCED[i % 4]
    choice: Any = "required"
    kw: dict[str, Any] = {}
    if kind == "named":
        choice = {"type": "function", "function": {"name": TOOLS[i // 4 % 2]["function"]["name"]}}
    elif kind == "required-one":
        kw["parallel_tool_calls"] = False
    else:
        kw["max_tokens"] = 160
    stream = i // 4 == 1
    out = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Request {i}: weather, or an alarm?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        seed=i,
        temperature=1.0,
        stream=stream,
        extra_body={"result_cache": False},
        **kw,
    )
    return (kind, choice, *_calls_of(out, stream))


def test_tool_calls_are_forced_parsed_and_go_back_through_the_template(
    cluster: tuple[str, str], model_dir: Path
) -> None:
    """Tools through the cluster, read by the official client's typed objects:
    tool_choice required and a named function always give calls to declared functions
    whose arguments validate (a random model, so only the grammar makes them valid); auto
    parses calls out of an output that holds them (forced by a guided_choice), streamed
    and not alike; the calls and their results go back through the chat template exactly
    as transformers renders them."""
    import concurrent.futures

    import jsonschema
    from transformers import AutoTokenizer

    name, url = cluster
    c = client(url)
    model = c.models.list().data[0].id
    blocks0 = metric(url, "pdserve_kv_transfer_blocks_total")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(
            pool.map(lambda i: _forced_call(c, model, i), range(TOOL_REQUESTS_PER_CLUSTER))
        )
    ids: set[str] = set()
    for kind, choice, content, calls, finish in answers:
        assert content is None, (name, kind, choice, content, calls, finish)
        assert calls, (name, choice)
        if kind == "required-many" and finish == "length":
            calls = calls[:-1]  # cut short: the last call may be unfinished
        else:
            assert finish == ("stop" if kind == "named" else "tool_calls"), (name, kind, finish)
        if kind != "required-many":
            assert len(calls) == 1, (name, calls)
        for call_id, function, arguments in calls:
            if kind == "named":
                assert function == choice["function"]["name"]
            jsonschema.validate(json.loads(arguments), PARAMETERS[function])
            assert call_id.startswith("call_") and call_id not in ids
            ids.add(call_id)
    assert any(len(a[3]) > 1 for a in answers), "no request made parallel calls"

    # auto: the calls written in the model's format are parsed, streamed or not
    messages: list[Any] = [{"role": "user", "content": "Weather in Oslo, and wake me at 7"}]
    want_calls = [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("set_alarm", {"hour": 7, "label": "gym"}),
    ]
    answers = []
    for stream in (False, True):
        out = c.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            stream=stream,
            temperature=0,
            extra_body={"guided_choice": [CRAFTED], "result_cache": False},
        )
        content, calls, finish = _calls_of(out, stream)
        assert finish == "tool_calls" and content is not None, (name, finish, content)
        assert content.strip() == "Checking both."
        assert [(f, json.loads(a)) for _, f, a in calls] == want_calls
        answers.append((content, [(f, a) for _, f, a in calls]))
        if not stream:
            first = out.choices[0].message
    assert answers[0] == answers[1], "streamed and non-streamed calls differ"
    # auto on an output with no call is plain content; tool_choice none parses nothing
    for extra in ({}, {"tool_choice": "none"}):
        out = c.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,  # type: ignore[arg-type]
            temperature=0,
            extra_body={"guided_choice": [CRAFTED if extra else "No calls."]},
            **extra,
        )
        want = CRAFTED if extra else "No calls."
        assert out.choices[0].message.content == want and not out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "stop"

    # the next turn: the typed assistant message as the client hands it back, then results
    assert first.tool_calls
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": f"result {i}"}
        for i, call in enumerate(first.tool_calls)
    ]
    turn = c.chat.completions.create(
        model=model,
        messages=[*messages, first, *results],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    history = [
        *messages,
        {
            "role": "assistant",
            "content": first.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in first.tool_calls
            ],
        },
        *results,
    ]
    want_prompt = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        history, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert turn.model_extra["prompt_token_ids"] == list(want_prompt)
    assert turn.choices[0].message.content
    if name.startswith("disagg"):
        assert metric(url, "pdserve_kv_transfer_blocks_total") > blocks0
    assert_workers_idle(url)
