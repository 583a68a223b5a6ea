"""Fuzzing every endpoint of the router: no 5xx, no hang, OpenAI's error body on every 4xx.

One live cluster (`pdserve up`: a random-weights model, 1 prefill + 1 decode worker,
disaggregated, a 256-token context, 64 KiB bodies) takes requests from two generators:

- schemathesis, driven by the router's own ``/openapi.json``: bodies the schema allows
  and bodies it forbids, plus its boundary values, for every operation;
- hand-written hypothesis strategies for what a schema cannot say: nearly valid bodies
  with one or two fields broken, floats at float32's edges, token ids outside the
  vocabulary, lone surrogates, bodies that are not JSON, not UTF-8, nested 30,000 deep or
  over the size limit, and unknown paths and methods.

Every response must come back within `REQUEST_TIMEOUT_S` with a status below 500; every
4xx from the API carries ``{"error": {"message", "type", "param", "code"}}`` (FastAPI's
own 404/405 for unknown paths and methods excepted); every 200 stream ends in
``data: [DONE]`` without an error event. A field the router does not implement gets a
400 naming it, never a 200 that ignores it (through the official client too). The module
sends at least `MIN_REQUESTS` requests (the last test checks the count, so run the module
whole) and leaves the cluster healthy, idle and serving, with every request prefilled on
the prefill worker (no local prefill on decode).

NOTE: generation budget. A valid request costs ~3 ms per generated token on 2 CPU cores,
so every generated body asks for at most `FUZZ_MAX_TOKENS` tokens: `cap_generation`
lowers a valid larger max_tokens and fills in a missing or null one (which means "up to
the context"). Values the server must reject (0, negative, past the context, wrong type)
are sent as generated; `test_edge_cases` sends the defaults once.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.model_config import load_model_config
from pdserve.common.sampling_params import MAX_LOGPROBS, MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from pdserve.router.protocol import MAX_CHAT_MESSAGES, MAX_N

MODEL_ID = "fuzz-model"
VOCAB_SIZE = 512  # the random model's; checked against its config when the cluster starts
MAX_MODEL_LEN = 256
MAX_BODY_BYTES = 65536
FUZZ_MAX_TOKENS = 4
REQUEST_TIMEOUT_S = 30.0
MIN_REQUESTS = 2000
FLAGS = (
    *("--prefill-replicas", "1", "--decode-replicas", "1", "--replica-cpus", "0"),
    *("--threads", "1", "--served-model-name", MODEL_ID),
    *("--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", str(MAX_BODY_BYTES)),
)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
API_ROUTES = {
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/workers"),
    ("GET", "/v1/models"),
    ("POST", COMPLETIONS),
    ("POST", CHAT),
    ("POST", "/v1/load_lora_adapter"),  # 403 here: runtime LoRA is off by default
    ("POST", "/v1/unload_lora_adapter"),
}
ERROR_KEYS = {"message", "type", "param", "code"}
FUZZ_SETTINGS = settings(
    deadline=None,
    derandomize=True,  # the same requests on every run: a CI failure replays here
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)


# -- the cluster and what the module sent -------------------------------------------------


@dataclass
class Tally:
    """Every request the module sent, by (method, path, status)."""

    statuses: Counter[tuple[str, str, int]] = field(default_factory=Counter)

    @property
    def num_requests(self) -> int:
        return sum(self.statuses.values())

    def count(self, method: str, path: str, status: int) -> int:
        return self.statuses[method, path, status]


@pytest.fixture(scope="module")
def cluster_url(pdserve_up: Any, random_model_dir: Path) -> Iterator[str]:
    assert load_model_config(random_model_dir).vocab_size == VOCAB_SIZE
    with pdserve_up(random_model_dir, *FLAGS) as url:
        yield url


@pytest.fixture(scope="module")
def tally() -> Tally:
    return Tally()


@pytest.fixture(scope="module")
def http(cluster_url: str) -> Iterator[requests.Session]:
    with requests.Session() as session:  # keep-alive: the fuzzing is request-bound
        yield session


@pytest.fixture(scope="module")
def api_schema(cluster_url: str) -> Any:
    """The live `/openapi.json`, with `model` pinned to the served id.

    The served model id is configuration the published schema cannot know; without the
    pin nearly every generated body would stop at the 404 and never reach a worker.
    """
    raw = requests.get(f"{cluster_url}/openapi.json", timeout=REQUEST_TIMEOUT_S).json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = raw["components"]["schemas"][name]["properties"]
        properties["model"] = {"type": "string", "enum": [MODEL_ID]}
    return schemathesis.openapi.from_dict(raw)


# -- checks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """One request and its response, as the checks see it."""

    method: str
    path: str
    request_body: bytes
    status: int
    content_type: str
    content: bytes
    elapsed_s: float

    def __str__(self) -> str:
        return (
            f"{self.method} {self.path} {self.request_body[:300]!r} -> {self.status} "
            f"in {self.elapsed_s:.1f}s: {self.content[:300]!r}"
        )


def check_response(tally: Tally, ex: Exchange) -> None:
    """The module's oracle: fast, below 500, OpenAI's error body, complete streams."""
    tally.statuses[ex.method, ex.path, ex.status] += 1
    where = str(ex)
    assert ex.elapsed_s < REQUEST_TIMEOUT_S, where
    assert ex.status < 500, where
    if (ex.method, ex.path) not in API_ROUTES:
        assert ex.status in (404, 405), where  # FastAPI's own answer to an unknown route
        return
    status, content, content_type = ex.status, ex.content, ex.content_type
    if status >= 400:
        body = json.loads(content)
        assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, where
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert isinstance(error["type"], str), where
        assert error["param"] is None or isinstance(error["param"], str), where
        assert error["code"] is None or isinstance(error["code"], str), where
    elif ex.method == "POST" and content_type.startswith("text/event-stream"):
        check_stream(content, where)
    elif ex.method == "POST":
        body = json.loads(content)
        # one choice per `n` (parallel sampling: at most MAX_N)
        assert 1 <= len(body["choices"]) <= MAX_N, where
        assert body["usage"]["completion_tokens"] >= 0, where


def check_stream(content: bytes, where: str) -> None:
    events = [event for event in content.split(b"\n\n") if event]
    assert events and all(event.startswith(b"data: ") for event in events), where
    assert events[-1] == b"data: [DONE]", where
    for event in events[:-1]:
        payload = json.loads(event[len(b"data: ") :])
        assert "error" not in payload and "choices" in payload, where


def send(
    http: requests.Session,
    tally: Tally,
    url: str,
    path: str,
    body: bytes | Any,
    *,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> requests.Response:
    """Send one request (`body`: raw bytes, or a value sent as JSON) and check the reply."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **(headers or {})}
    start = time.monotonic()
    resp = http.request(method, url + path, data=data, headers=headers, timeout=REQUEST_TIMEOUT_S)
    elapsed = time.monotonic() - start  # `resp.content` is read: streams are read to the end
    content_type = resp.headers.get("content-type", "")
    check_response(
        tally, Exchange(method, path, data, resp.status_code, content_type, resp.content, elapsed)
    )
    return resp


def cap_generation(body: Any) -> None:
    """Keeps a generated body cheap (module docstring, "generation budget"); in place."""
    if not isinstance(body, dict):
        return
    fields = ("max_tokens", "max_completion_tokens")
    for name in fields:
        value = body.get(name)
        if type(value) is int and FUZZ_MAX_TOKENS < value < MAX_MODEL_LEN:
            body[name] = FUZZ_MAX_TOKENS
    if all(body.get(name) is None for name in fields):
        body["max_tokens"] = FUZZ_MAX_TOKENS


# -- schemathesis: the published schema ---------------------------------------------------

schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(FUZZ_SETTINGS, max_examples=120)
def test_openapi_schema(case: Any, cluster_url: str, http: requests.Session, tally: Tally) -> None:
    cap_generation(case.body)
    start = time.monotonic()
    resp = case.call(base_url=cluster_url, session=http, timeout=REQUEST_TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert not resp.stream_cut_short, f"{case.path}: stream not read to its end"
    content_type = (resp.headers.get("content-type") or [""])[0]
    sent = resp.request.body or b""
    sent = sent.encode() if isinstance(sent, str) else sent
    ex = Exchange(
        case.method.upper(), case.path, sent, resp.status_code, content_type, resp.content, elapsed
    )
    check_response(tally, ex)


# -- hand-written strategies: what a schema cannot say ------------------------------------

# Floats where float32 rounds to 0 or the sampler's division overflows.
TINY_FLOATS = st.sampled_from([5e-324, 1e-300, 1e-46, 1e-40, 1e-30, 1e-6])
TEXT = st.text(max_size=200)
LONE_SURROGATES = st.sampled_from(["\ud800", "a\udc00b", "\udfff" * 3])
TOKEN_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=200)
STOP = st.one_of(
    st.text(min_size=1, max_size=MAX_STOP_STRING_LEN),
    st.lists(st.text(min_size=1, max_size=8), max_size=MAX_STOP_STRINGS),
)

WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
}
CITY_TOOL = {
    "type": "function",
    "function": {
        "name": "city",
        "description": "A city's <facts>",
        "parameters": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"enum": [1, 2]}},
            "required": ["name"],
        },
    },
}
TOOL_FIELDS = {
    "tool_choice": st.sampled_from(
        ["auto", "none", "required", {"type": "function", "function": {"name": "city"}}]
    ),
    "parallel_tool_calls": st.booleans(),
}
# A history's calls and their results (assistant tool_calls, tool tool_call_id).
BAD_ARGUMENTS = {"name": "city", "arguments": "["}  # not JSON
CALL = {"id": "call_1", "type": "function", "function": {"name": "city", "arguments": '{"n": 1}'}}
TOOL_TURNS = [
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"name": "Oslo"}'},
]

VALID_COMMON = {
    "temperature": st.one_of(st.floats(0, 2), TINY_FLOATS, st.none()),
    "top_p": st.one_of(st.floats(0, 1, exclude_min=True), TINY_FLOATS, st.none()),
    "top_k": st.one_of(st.integers(-1, 2 * VOCAB_SIZE), st.just(2**63 - 1), st.none()),
    "seed": st.one_of(st.integers(-(2**63), 2**63 - 1), st.none()),
    "stop": st.one_of(STOP, st.none()),
    "stop_token_ids": st.lists(st.integers(0, 2**63), max_size=4),
    "n": st.just(1),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "user": TEXT,
    "metadata": st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    "store": st.booleans(),
    "presence_penalty": st.sampled_from([0, 0.0, None]),
    "logit_bias": st.sampled_from([{}, None]),
    "response_format": st.sampled_from([{"type": "text"}, None]),
    "tools": st.none(),  # null is absent (chat_bodies adds real tools)
}
# An invalid JSON schema: a 400 naming response_format (structured output, engine/grammar.py).
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
INVALID_COMMON = {
    "model": st.one_of(TEXT.filter(lambda m: m != MODEL_ID), st.integers(), st.none()),
    "temperature": st.one_of(
        st.floats(min_value=2, exclude_min=True), st.floats(max_value=0, exclude_max=True), TEXT
    ),
    "top_p": st.one_of(st.floats(max_value=0), st.floats(min_value=1, exclude_min=True)),
    "top_k": st.one_of(st.integers(max_value=-2), st.integers(min_value=2**63), st.floats()),
    "seed": st.one_of(st.integers(min_value=2**63), st.integers(max_value=-(2**63) - 1), TEXT),
    "stop": st.one_of(
        st.lists(st.text(min_size=1, max_size=2), min_size=MAX_STOP_STRINGS + 1),
        st.text(min_size=MAX_STOP_STRING_LEN + 1, max_size=2 * MAX_STOP_STRING_LEN),
        st.just([""]),
        st.just(""),
        st.lists(st.integers(), min_size=1, max_size=3),
        LONE_SURROGATES,
    ),
    "stop_token_ids": st.one_of(st.just([-1]), st.just(["1"]), st.integers()),
    "n": st.one_of(st.integers(min_value=MAX_N + 1), st.integers(max_value=0), st.just(10**30)),
    "stream": st.one_of(st.just("yes"), st.integers(2, 9)),
    "stream_options": st.one_of(st.just({"include_usage": "maybe"}), st.just([])),
    "presence_penalty": st.floats(-2, 2).filter(bool),
    "frequency_penalty": st.one_of(st.floats(-2, 2).filter(bool), st.floats(min_value=3)),
    "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(-100, 100), min_size=1),
    # Fields that would change the output, which the router does not implement.
    "response_format": st.sampled_from(
        [{"type": "json_mode"}, {"type": "json_schema", "json_schema": {"name": "x"}}, BAD_SCHEMA]
    ),
    # Tools: chat serves them (chat_bodies), completions has none (any non-null, a 400);
    # these are 400s in both.
    "tools": st.sampled_from(
        [
            [{"type": "function", "function": {"name": "bad name!"}}],
            [{"type": "retrieval"}],
            "f",
            [WEATHER_TOOL, WEATHER_TOOL],  # the same name twice
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
        ]
    ),
    "tool_choice": st.sampled_from(
        ["sometimes", 5, {"type": "function", "function": {"name": "no_such_function"}}]
    ),
    "unknown_field": st.one_of(st.integers(), TEXT, st.none()),  # unknown: a 400, not ignored
    "max_tokens": st.one_of(
        st.integers(max_value=0), st.integers(min_value=MAX_MODEL_LEN), st.just("16"), st.just(1.5)
    ),
}


PROMPTS = st.one_of(
    TEXT.filter(bool), TOKEN_IDS, TEXT.filter(bool).map(lambda t: [t]), TOKEN_IDS.map(lambda t: [t])
)


INVALID_PROMPTS = st.one_of(
    st.sampled_from(["", [], [[]], [""], [[1], [2]], ["a", "b"], [[[1]]], 5, None, {"a": 1}]),
    st.lists(st.integers(min_value=VOCAB_SIZE), min_size=1, max_size=3),  # outside the vocab
    st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
    st.just(list(range(1, MAX_MODEL_LEN + 1))),  # no room left for a new token
    st.text(alphabet="\x00\U0010ffff", min_size=MAX_MODEL_LEN, max_size=2 * MAX_MODEL_LEN),
    LONE_SURROGATES,
)
CONTENT_PARTS = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=3)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
            "content": st.one_of(TEXT, CONTENT_PARTS, st.none()),
        },
        optional={"name": st.text(max_size=10)},
    ),
    min_size=1,
    max_size=6,
)
INVALID_MESSAGES = st.one_of(
    st.sampled_from([[], "hello", [{}], [{"content": "x"}], [{"role": "wizard", "content": "x"}]]),
    st.just([{"role": "user", "content": "x"}] * (MAX_CHAT_MESSAGES + 1)),
    st.just([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    st.just([{"role": "user", "content": [{"type": "text"}]}]),
    st.just([{"role": "user", "content": 5}]),
    st.just([{"role": "user", "tool_calls": [CALL]}]),  # calls are an assistant's
    st.just([{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f"}}]}]),
    st.just([{"role": "user", "content": "x", "tool_call_id": "call_1"}]),
    st.just([{"role": "assistant", "tool_calls": [{**CALL, "function": BAD_ARGUMENTS}]}]),
    LONE_SURROGATES.map(lambda s: [{"role": "user", "content": s}]),
    st.just([{"role": "user", "content": "word " * MAX_MODEL_LEN}]),  # past the context
)


@st.composite
def stream_fields(draw: st.DrawFn) -> dict[str, Any]:
    if not draw(st.booleans()):
        return {}
    usage = draw(st.sampled_from([None, True, False]))
    return {"stream": True} | (
        {} if usage is None else {"stream_options": {"include_usage": usage}}
    )


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid completion body, then zero to two fields replaced by invalid values."""
    body = {"model": MODEL_ID, "prompt": draw(PROMPTS), "max_tokens": FUZZ_MAX_TOKENS}
    body |= draw(st.fixed_dictionaries({}, optional=VALID_COMMON))
    body |= draw(stream_fields())
    body |= draw(st.fixed_dictionaries({}, optional={"logprobs": st.integers(0, MAX_LOGPROBS)}))
    invalid = INVALID_COMMON | {
        "prompt": INVALID_PROMPTS,
        "logprobs": st.one_of(st.integers(min_value=MAX_LOGPROBS + 1), st.integers(max_value=-1)),
        "echo": st.just(True),
        "suffix": TEXT,
        "best_of": st.integers(min_value=2),
    }
    return break_fields(draw, body, invalid)


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A valid chat body, then zero to two fields replaced by invalid values."""
    tokens = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
    body = {"model": MODEL_ID, "messages": draw(MESSAGES), tokens: FUZZ_MAX_TOKENS}
    body |= draw(st.fixed_dictionaries({}, optional=VALID_COMMON))
    body |= draw(stream_fields())
    if draw(st.booleans()):
        body["logprobs"] = True
        body |= draw(st.fixed_dictionaries({}, optional={"top_logprobs": st.integers(0, 20)}))
    body |= draw(st.fixed_dictionaries({}, optional={"add_generation_prompt": st.booleans()}))
    if draw(st.booleans()):  # tools, with any tool_choice, and maybe calls in the history
        body["tools"] = [WEATHER_TOOL, CITY_TOOL]
        body |= draw(st.fixed_dictionaries({}, optional=TOOL_FIELDS))
        if draw(st.booleans()):
            body["messages"] = [body["messages"][0], *TOOL_TURNS]
    invalid = INVALID_COMMON | {
        "messages": INVALID_MESSAGES,
        "max_completion_tokens": INVALID_COMMON["max_tokens"],
        "top_logprobs": st.one_of(st.integers(min_value=MAX_LOGPROBS + 1), st.integers(0, 5)),
        "logprobs": st.just("yes"),
    }
    return break_fields(draw, body, invalid)


def break_fields(
    draw: st.DrawFn, body: dict[str, Any], invalid: dict[str, st.SearchStrategy[Any]]
) -> dict[str, Any]:
    num_broken = draw(st.sampled_from([0, 0, 1, 2]))  # about half the bodies stay valid
    for name in draw(st.lists(st.sampled_from(sorted(invalid)), max_size=num_broken)):
        body[name] = draw(invalid[name])
    if draw(st.booleans()) and "stream_options" in body:
        body.pop("stream", None)  # stream_options without stream: a 400
    return body


@pytest.mark.parametrize(
    ("path", "bodies"),
    [(COMPLETIONS, completion_bodies()), (CHAT, chat_bodies())],
    ids=["completions", "chat"],
)
def test_nearly_valid_bodies(
    path: str,
    bodies: st.SearchStrategy[dict[str, Any]],
    cluster_url: str,
    http: requests.Session,
    tally: Tally,
) -> None:
    @settings(FUZZ_SETTINGS, max_examples=450)
    @given(body=bodies)
    def run(body: dict[str, Any]) -> None:
        send(http, tally, cluster_url, path, body)

    served_before = tally.count("POST", path, 200)
    run()
    assert tally.count("POST", path, 200) - served_before >= 100, "too few reached a worker"


SMALL_BODIES = TEXT.map(
    lambda prompt: json.dumps({"model": MODEL_ID, "prompt": prompt, "max_tokens": 1}).encode()
)
TOO_LARGE = b'{"model": "x", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
# Bytes that are not a valid request: not JSON, not an object, not UTF-8, too deep, too large.
RAW_BODIES = st.one_of(
    st.binary(max_size=512),
    SMALL_BODIES.flatmap(lambda body: st.integers(0, len(body) - 1).map(lambda n: body[:n])),
    st.recursive(st.none() | st.booleans() | TEXT, st.lists).map(lambda v: json.dumps(v).encode()),
    st.integers(1, 30_000).map(lambda depth: (b"[" * depth + b"]" * depth)[:MAX_BODY_BYTES]),
    st.integers(1, 30_000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth),
    st.tuples(SMALL_BODIES, st.sampled_from(["utf-16", "utf-32", "utf-8-sig", "cp500"])).map(
        lambda pair: pair[0].decode().encode(pair[1])
    ),
    LONE_SURROGATES.map(lambda s: json.dumps({"model": MODEL_ID, "prompt": s}).encode()),
    LONE_SURROGATES.map(
        lambda s: json.dumps({"prompt": s}, ensure_ascii=False).encode("utf-8", "surrogatepass")
    ),
    st.just(TOO_LARGE),
)


@settings(FUZZ_SETTINGS, max_examples=450)
@given(
    path=st.sampled_from([COMPLETIONS, CHAT]),
    body=RAW_BODIES,
    content_type=st.sampled_from(["application/json", "text/plain", "", "multipart/form-data"]),
)
def test_raw_bodies(
    path: str,
    body: bytes,
    content_type: str,
    cluster_url: str,
    http: requests.Session,
    tally: Tally,
) -> None:
    resp = send(http, tally, cluster_url, path, body, headers={"Content-Type": content_type})
    if body == TOO_LARGE:
        assert resp.status_code == 413


# -- explicit cases: defaults, limits, routes, and the inputs that found bugs ----------------


def _chunks(size: int) -> Iterator[bytes]:
    """A body sent chunked (no Content-Length), so the router must count as it reads."""
    yield b'{"model": "' + MODEL_ID.encode() + b'", "prompt": "'
    for _ in range(size // 4096):
        yield b"a" * 4096
    yield b'"}'


def test_edge_cases(cluster_url: str, http: requests.Session, tally: Tally) -> None:
    ok, bad = 200, 400
    cases: list[tuple[str, Any, int]] = [
        # The defaults: max_tokens 16 (completions) and "up to the context" (chat).
        (COMPLETIONS, {"model": MODEL_ID, "prompt": "The river"}, ok),
        (CHAT, {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]}, ok),
        (COMPLETIONS, {"model": MODEL_ID, "prompt": [1] * 200, "max_tokens": None}, ok),
        # Each closed the workers' engines: a 503 for it and every later request until Serve
        # replaced the replicas (fixed in protocol.py).
        (COMPLETIONS, {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "top_k": 2**70}, bad),
        (
            COMPLETIONS,
            {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "temperature": 1e-300},
            ok,
        ),
        (COMPLETIONS, {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "top_p": 1e-300}, ok),
        # A 500 (fixed in protocol.py): a lone surrogate reached the tokenizer.
        (COMPLETIONS, b'{"model": "fuzz-model", "prompt": "a\\ud800b"}', bad),
        (
            CHAT,
            b'{"model": "fuzz-model", "messages": [{"role": "user", "content": "\\udc00"}]}',
            bad,
        ),
        # Limits.
        (COMPLETIONS, {"model": MODEL_ID, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, bad),
        (COMPLETIONS, {"model": MODEL_ID, "prompt": "hi", "n": MAX_N + 1}, bad),
        (COMPLETIONS, {"model": MODEL_ID, "prompt": "hi", "n": 2, "max_tokens": 2}, ok),
        (COMPLETIONS, {"model": MODEL_ID, "prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, bad),
        (
            COMPLETIONS,
            {"model": MODEL_ID, "prompt": "hi", "stop": ["s"] * (MAX_STOP_STRINGS + 1)},
            bad,
        ),
        (
            COMPLETIONS,
            {"model": MODEL_ID, "prompt": "hi", "stop": "s" * (MAX_STOP_STRING_LEN + 1)},
            bad,
        ),
        (COMPLETIONS, {"model": MODEL_ID, "prompt": [VOCAB_SIZE]}, bad),
        (COMPLETIONS, {"model": "nope", "prompt": "hi"}, 404),
        (COMPLETIONS, b"{" * (MAX_BODY_BYTES + 1), 413),
    ]
    for path, body, want in cases:
        resp = send(http, tally, cluster_url, path, body)
        assert resp.status_code == want, (path, body if not isinstance(body, bytes) else body[:80])
    # Chunked: no Content-Length to refuse up front.
    start = time.monotonic()
    resp = http.post(cluster_url + COMPLETIONS, data=_chunks(2 * MAX_BODY_BYTES), timeout=30)
    elapsed = time.monotonic() - start
    ex = Exchange("POST", COMPLETIONS, b"(chunked)", resp.status_code, "", resp.content, elapsed)
    check_response(tally, ex)
    assert resp.status_code == 413
    # What the router does not implement is a 400 naming it, never ignored.
    for path, body in [
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": BAD_SCHEMA}),
        (COMPLETIONS, {"prompt": "x", "suffix": "y"}),
        (COMPLETIONS, {"prompt": "x", "tools": [WEATHER_TOOL]}),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "functions": [WEATHER_TOOL]}),
        (CHAT, {"messages": [{"role": "user", "content": "x"}], "frobnicate": True}),
    ]:
        resp = send(http, tally, cluster_url, path, {"model": MODEL_ID, **body})
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == (set(body) - {"messages", "prompt"}).pop()
    # Unknown routes and methods: FastAPI's own 404 / 405.
    for method, path in [
        ("GET", COMPLETIONS),
        ("PUT", "/health"),
        ("GET", "/v1/nope"),
        ("POST", "/"),
    ]:
        send(http, tally, cluster_url, path, b"{}", method=method)


def test_official_client_gets_400_naming_what_is_not_implemented(
    cluster_url: str, tally: Tally
) -> None:
    """A client that asks for JSON must not get free text with a 200."""
    client = openai.OpenAI(base_url=f"{cluster_url}/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": "Reply in JSON."}]
    chat, completions = client.chat.completions, client.completions
    attempts: list[tuple[str, str, Any]] = [
        ("best_of", COMPLETIONS, lambda: completions.create(model=MODEL_ID, prompt="x", best_of=2)),
        (
            "functions",  # the legacy form of tools
            CHAT,
            lambda: chat.create(
                model=MODEL_ID, messages=messages, functions=[WEATHER_TOOL["function"]]
            ),
        ),
        (
            "logit_bias",
            COMPLETIONS,
            lambda: completions.create(model=MODEL_ID, prompt="x", logit_bias={"5": 100}),
        ),
    ]
    for param, path, create in attempts:
        with pytest.raises(openai.BadRequestError) as info:
            create()
        tally.statuses["POST", path, 400] += 1
        error = info.value
        assert (error.status_code, error.param) == (400, param), error.body
        assert isinstance(error.body, dict) and param in error.body["message"]
        assert error.code == "unsupported_parameter"
    # The same client, asking only for what the router implements, is served.
    out = client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=4, response_format={"type": "text"}, n=1
    )
    tally.statuses["POST", CHAT, 200] += 1
    assert out.choices[0].message.content is not None and out.usage is not None
    assert out.usage.completion_tokens >= 1


# -- after the storm ------------------------------------------------------------------------


def test_cluster_is_healthy_idle_and_serving(
    cluster_url: str, http: requests.Session, tally: Tally, api: Any, poll: Any
) -> None:
    assert tally.num_requests >= MIN_REQUESTS, tally.statuses
    assert http.get(f"{cluster_url}/health", timeout=REQUEST_TIMEOUT_S).status_code == 200
    body = {
        "model": MODEL_ID,
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    first = send(http, tally, cluster_url, COMPLETIONS, body).json()
    again = send(http, tally, cluster_url, COMPLETIONS, body).json()
    assert len(first["choices"][0]["token_ids"]) == 4
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]

    def idle() -> Any:  # a worker's state may trail the last reply briefly
        workers = http.get(f"{cluster_url}/workers", timeout=REQUEST_TIMEOUT_S).json()["workers"]
        busy = [
            w for w in workers if (w["running"], w["waiting"], w["kv_blocks_used"]) != (0, 0, 0)
        ]
        return None if busy else workers

    workers = poll("every worker idle after the last reply", idle, 10.0, 0.2)
    assert len(workers) == 2 and all("error" not in w for w in workers), workers
    # Disaggregated: every request the module sent was prefilled by the prefill worker;
    # none fell back to prefilling on decode, for any reason.
    assert tally.count("POST", COMPLETIONS, 200) + tally.count("POST", CHAT, 200) > 0
    assert api.local_prefills(cluster_url) == {}  # by reason; absent counts as 0
