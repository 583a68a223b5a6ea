"""The OpenAI request schema: validation errors, and the mapping to SamplingParams.

Plain Python: no model, no network, no Redis, no Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from pdserve.common.grammar import GrammarSpec
from pdserve.common.sampling_params import SamplingParams
from pdserve.router.protocol import (
    MAX_N,
    NO_EFFECT,
    NOT_IMPLEMENTED,
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    check_model,
    error_from_validation,
    parse_request,
    to_sampling_params,
)

MAX_MODEL_LEN = 128
UNKNOWN_MESSAGE = "unknown parameter; rejected, not ignored: this server does not implement it"


def completion(**fields: Any) -> CompletionRequest:
    return parse_request(CompletionRequest, {"model": "m", "prompt": "hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "hi"}]
    return parse_request(ChatCompletionRequest, {"model": "m", "messages": messages, **fields})


def rejection(call: Any, *args: Any, **kwargs: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        call(*args, **kwargs)
    return info.value


def test_completion_maps_to_sampling_params() -> None:
    req = completion(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=-1,
        seed=42,
        stop="END",
        stop_token_ids=[2, 3],
        ignore_eos=True,
        logprobs=3,
    )
    assert to_sampling_params(req, prompt_len=10, max_model_len=MAX_MODEL_LEN) == SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=0,
        seed=42,
        stop=("END",),
        stop_token_ids=(2, 3),
        ignore_eos=True,
        logprobs=3,
    )


def test_completion_defaults_and_nulls() -> None:
    params = to_sampling_params(completion(), prompt_len=10, max_model_len=MAX_MODEL_LEN)
    assert params == SamplingParams(max_tokens=16)
    req = completion(max_tokens=None, temperature=None, top_p=None, top_k=None, stop=None)
    params = to_sampling_params(req, prompt_len=10, max_model_len=MAX_MODEL_LEN)
    assert params == SamplingParams(max_tokens=MAX_MODEL_LEN - 10)
    assert to_sampling_params(completion(stop=["a", "b"]), 1, MAX_MODEL_LEN).stop == ("a", "b")


def test_chat_maps_to_sampling_params() -> None:
    req = chat(max_tokens=5, max_completion_tokens=9, temperature=0, logprobs=True, top_k=4)
    params = to_sampling_params(req, prompt_len=20, max_model_len=MAX_MODEL_LEN)
    assert params == SamplingParams(max_tokens=9, temperature=0, top_k=4, logprobs=0)
    assert to_sampling_params(chat(max_tokens=5), 20, MAX_MODEL_LEN).max_tokens == 5
    assert to_sampling_params(chat(), 20, MAX_MODEL_LEN).max_tokens == MAX_MODEL_LEN - 20
    assert to_sampling_params(chat(), 20, MAX_MODEL_LEN).logprobs is None
    req = chat(logprobs=True, top_logprobs=5)
    assert to_sampling_params(req, 20, MAX_MODEL_LEN).logprobs == 5


def test_chat_messages_join_text_parts() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": parts, "name": "ann"},
        {"role": "assistant", "content": None},
    ]
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": messages})
    assert req.add_generation_prompt
    assert req.chat_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", "hello"),
        ([5, 6, 7], [5, 6, 7]),
        (["hello"], "hello"),
        ([[5, 6]], [5, 6]),
    ],
)
def test_prompt_forms(prompt: Any, expected: str | list[int]) -> None:
    assert completion(prompt=prompt).prompt_input() == expected


def test_stream_options() -> None:
    req = completion(stream=True, stream_options={"include_usage": True})
    assert req.stream_options is not None and req.stream_options.include_usage
    req = chat(stream=True, stream_options={"include_usage": False, "include_obfuscation": True})
    assert req.stream_options is not None and not req.stream_options.include_usage


# Values clients send for the fields that cannot change the output (NO_EFFECT), and the
# no-op values of fields that otherwise would.
HARMLESS: dict[str, Any] = {
    "user": "u-1",
    "metadata": {"team": "search"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "n": None,
    "best_of": 1,
    "logit_bias": {},
    "presence_penalty": 0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,  # vLLM's benchmark client sends it
    "response_format": {"type": "text"},
    "modalities": ["text"],
    **dict.fromkeys(NOT_IMPLEMENTED),  # null means absent
}


@pytest.mark.parametrize("make", [completion, chat], ids=["completion", "chat"])
def test_harmless_fields_are_accepted_and_change_nothing(make: Any) -> None:
    assert set(NO_EFFECT) <= set(HARMLESS)
    fields = dict(HARMLESS)
    if make is chat:
        fields.pop("best_of")  # a completions field
    plain = to_sampling_params(make(), prompt_len=10, max_model_len=MAX_MODEL_LEN)
    for name, value in fields.items():
        req = make(**{name: value})
        assert to_sampling_params(req, 10, MAX_MODEL_LEN) == plain, name
    assert to_sampling_params(make(**fields), 10, MAX_MODEL_LEN) == plain


# What each field does. A field added to a request class must be put in one group here: the
# test below fails for one that is parsed and then silently ignored.
USED = {
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "stream",
    "stream_options", "ignore_eos", "return_token_ids", "add_generation_prompt",
    "cache_salt",
    "priority",
    "n",
}  # fmt: skip
USED |= {"result_cache"}  # the result cache's per-request opt-out (router/result_cache.py)
# Structured output (engine/grammar.py): the request's grammar.
USED |= {"response_format", "guided_json", "guided_regex", "guided_choice"}
# Tool calling (router/tool_calls.py): chat's; null-only in completions (REJECTED).
USED |= {"tools", "tool_choice", "parallel_tool_calls"}
# Supported only at their no-op value; any other is a 400 naming the field.
NO_OP_ONLY = {
    "best_of", "echo", "suffix", "presence_penalty", "frequency_penalty", "logit_bias",
    "modalities", "repetition_penalty",
}  # fmt: skip


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
def test_every_field_is_used_no_op_or_rejected(cls: type[Any]) -> None:
    groups = [USED, NO_OP_ONLY, set(NOT_IMPLEMENTED), set(NO_EFFECT)]
    assert sum(len(group) for group in groups) == len(set().union(*groups))  # disjoint
    assert set(cls.model_fields) <= set().union(*groups)
    assert set(NOT_IMPLEMENTED) | set(NO_EFFECT) <= set(cls.model_fields)


@pytest.mark.parametrize("name", NOT_IMPLEMENTED)
@pytest.mark.parametrize("make", [completion, chat], ids=["completion", "chat"])
def test_not_implemented_fields_are_rejected_by_name(make: Any, name: str) -> None:
    for value in ([{"type": "function", "function": {"name": "f"}}], "auto", False, {}, 0):
        error = rejection(make, **{name: value})
        assert (error.status_code, error.param, error.code) == (400, name, "unsupported_parameter")
        assert error.message == f"{name}: {name} is not supported"


@pytest.mark.parametrize(
    ("fields", "param", "where"),
    [
        ({"foo": 1}, "foo", ""),
        ({"Temperature": 0.5}, "Temperature", ""),  # a misspelling is not silently the default
        ({"stream": True, "stream_options": {"x": 1}}, "stream_options.x", ""),
        ({"messages": [{"role": "user", "content": "x", "weight": 0}]}, "messages[0].weight", ""),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
            "messages[0].content",  # a union's error names the field, then where in it
            " (at [0].y)",
        ),
    ],
)
def test_unknown_fields_are_rejected_by_name(
    fields: dict[str, Any], param: str, where: str
) -> None:
    error = rejection(chat, **fields)
    assert (error.status_code, error.param, error.code) == (400, param, "unknown_parameter")
    assert error.message == f"{param}: {UNKNOWN_MESSAGE}{where}"
    error = rejection(completion, foo=1)
    assert (error.param, error.code) == ("foo", "unknown_parameter")


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Today's weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
            "required": ["city"],
        },
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
NOT_JSON = {"name": "weather", "arguments": "[1]"}

# (request class, fields, param named, fragment of the message)
REJECTED = [
    (CompletionRequest, {"temperature": 2.5}, "temperature", "less than or equal to 2"),
    (CompletionRequest, {"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    (CompletionRequest, {"top_p": 0}, "top_p", "greater than 0"),
    (CompletionRequest, {"top_p": 1.5}, "top_p", "less than or equal to 1"),
    (CompletionRequest, {"top_k": -2}, "top_k", "greater than or equal to -1"),
    (CompletionRequest, {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    (CompletionRequest, {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    (CompletionRequest, {"n": 17}, "n", "less than or equal to 16"),
    (CompletionRequest, {"n": 0}, "n", "greater than or equal to 1"),
    (CompletionRequest, {"best_of": 2}, "best_of", "not supported"),
    (CompletionRequest, {"echo": True}, "echo", "echo is not supported"),
    (CompletionRequest, {"suffix": "x"}, "suffix", "suffix is not supported"),
    (CompletionRequest, {"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    (CompletionRequest, {"frequency_penalty": 1}, "frequency_penalty", "not supported"),
    (CompletionRequest, {"logit_bias": {"1": 2.0}}, "logit_bias", "not supported"),
    (CompletionRequest, {"presence_penalty": 5}, "presence_penalty", "not supported"),
    (CompletionRequest, {"repetition_penalty": 1.2}, "repetition_penalty", "not supported"),
    (ChatCompletionRequest, {"repetition_penalty": 0.5}, "repetition_penalty", "not supported"),
    (CompletionRequest, {"best_of": 1.5}, "best_of", "valid integer"),
    (CompletionRequest, {"echo": "yes"}, "echo", "Input should be False"),
    (
        CompletionRequest,
        {"response_format": {"type": "json_mode"}},
        "response_format.type",
        "'text', 'json_object' or 'json_schema'",
    ),
    (
        ChatCompletionRequest,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "needs json_schema.schema",
    ),
    (ChatCompletionRequest, {"response_format": {}}, "response_format.type", "Field required"),
    (ChatCompletionRequest, {"modalities": ["text", "audio"]}, "modalities", "not supported"),
    (
        ChatCompletionRequest,
        {"logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "less than or equal to 20",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        "messages[0].tool_calls[0].function",
        "Field required",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "42", "tool_call_id": "c"}]},
        "messages[0].tool_call_id",
        "only tool messages hold tool_call_id",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "tool_calls": [CALL]}]},
        "messages[0].tool_calls",
        "only assistant messages hold tool_calls",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": NOT_JSON}]}]},
        "messages[0].tool_calls",
        "the arguments of call 'call_1' are not a JSON object",
    ),
    (ChatCompletionRequest, {"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    (
        ChatCompletionRequest,
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
        "tool_choice",
        "names the function 'x', which is not in tools",
    ),
    (ChatCompletionRequest, {"tools": [WEATHER, WEATHER]}, "tools", "'weather' repeats"),
    (
        ChatCompletionRequest,
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
        "should match pattern",
    ),
    (CompletionRequest, {"tools": [WEATHER]}, "tools", "tools is not supported"),
    (CompletionRequest, {"tool_choice": "auto"}, "tool_choice", "tool_choice is not supported"),
    (ChatCompletionRequest, {"functions": [WEATHER["function"]]}, "functions", "not supported"),
    (CompletionRequest, {"stop": ["s"] * 17}, "stop", "at most 16 items"),
    (CompletionRequest, {"stop": ["ok", "x" * 257]}, "stop", "at most 256 characters"),
    (CompletionRequest, {"stop": ""}, "stop", "at least 1 character"),
    (CompletionRequest, {"stop": 3}, "stop", "must be a string or a list of strings"),
    (CompletionRequest, {"stop_token_ids": [-1]}, "stop_token_ids[0]", "greater than or equal"),
    (CompletionRequest, {"stream_options": {}}, "stream_options", "only allowed when stream"),
    (CompletionRequest, {"prompt": ["a", "b"]}, "prompt", "batched prompts are not supported"),
    (CompletionRequest, {"prompt": [[1], [2]]}, "prompt", "batched prompts are not supported"),
    (CompletionRequest, {"prompt": ""}, "prompt", "must not be empty"),
    (CompletionRequest, {"prompt": []}, "prompt", "must not be empty"),
    (CompletionRequest, {"prompt": [[]]}, "prompt", "must not be empty"),
    (CompletionRequest, {"prompt": [1, -1]}, "prompt", "token ids must be >= 0"),
    (CompletionRequest, {"prompt": 7}, "prompt", "must be a string, a list of token ids"),
    (CompletionRequest, {"prompt": None}, "prompt", "must be a string"),
    (CompletionRequest, {"model": None}, "model", "valid string"),
    (CompletionRequest, {"seed": 2**64}, "seed", "less than or equal to"),
    (ChatCompletionRequest, {"messages": []}, "messages", "at least 1 item"),
    (ChatCompletionRequest, {"top_logprobs": 2}, "top_logprobs", "requires logprobs to be true"),
    (ChatCompletionRequest, {"n": 17}, "n", "less than or equal to 16"),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "robot", "content": "x"}]},
        "messages[0].role",
        "Input should be 'system'",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content",
        "'image_url' is not supported",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages[0].content",
        "Field required",
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x"}] * 1025},
        "messages",
        "at most 1024 items",
    ),
]


@pytest.mark.parametrize(("cls", "fields", "param", "fragment"), REJECTED)
def test_rejected(cls: type[Any], fields: dict[str, Any], param: str, fragment: str) -> None:
    base: dict[str, Any] = {"model": "m"}
    base |= {"prompt": "hi"} if cls is CompletionRequest else {"messages": [{"role": "user"}]}
    error = rejection(parse_request, cls, {**base, **fields})
    assert error.status_code == 400
    assert error.err_type == "invalid_request_error"
    assert error.param == param
    assert error.message.startswith(f"{param}: ")
    assert fragment in error.message


def test_tools_render_and_their_grammars_hold_the_output_to_declared_calls() -> None:
    """tool_choice picks how the output holds calls; required and a named function get a
    grammar (engine/grammar.py) of exactly the declared calls; history turns go to the
    template as transformers documents them (arguments as objects)."""
    other = {"type": "function", "function": {"name": "time"}}  # no parameters: {}
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    req = chat(tools=[WEATHER, other], messages=history)
    assert req.tool_mode() == "auto" and req.grammar() is None
    assert req.template_tools() == [WEATHER, other]  # as sent: no nulls added
    assert req.chat_messages()[1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {}},
                }
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert chat(tools=[WEATHER], tool_choice="none").tool_mode() is None
    assert chat(tool_choice="none").tool_mode() is None

    required = chat(tools=[WEATHER, other], tool_choice="required", parallel_tool_calls=False)
    spec = required.grammar()
    assert spec is not None and required.tool_mode() == "required"
    schema = json.loads(spec.source)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    calls = schema["items"]["anyOf"]
    assert [c["properties"]["name"] for c in calls] == [{"const": "weather"}, {"const": "time"}]
    assert calls[0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert calls[1]["properties"]["arguments"]["additionalProperties"] is False
    assert "maxItems" not in json.loads(
        chat(tools=[WEATHER], tool_choice="required").grammar().source
    )

    named = chat(
        tools=[WEATHER, other], tool_choice={"type": "function", "function": {"name": "weather"}}
    )
    assert named.tool_mode() == "named" and named.named_function() == "weather"
    assert json.loads(named.grammar().source) == WEATHER["function"]["parameters"]
    params = to_sampling_params(named, prompt_len=4, max_model_len=64)
    assert params.grammar == named.grammar()

    # two constraints at once, and a parameters schema the grammar engine refuses
    both = chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    error = rejection(to_sampling_params, both, prompt_len=4, max_model_len=64)
    assert (error.param, error.status_code) == ("tool_choice", 400)
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
    error = rejection(chat(tools=[bad], tool_choice="required").grammar)
    assert error.param == "tools" and "invalid" in error.message
    chat(tools=[bad]).grammar()  # auto never compiles it: the model may still call it
    strict = {"type": "function", "function": {**bad["function"], "strict": True}}
    error = rejection(
        chat(
            tools=[strict, other], tool_choice={"type": "function", "function": {"name": "time"}}
        ).grammar
    )
    assert error.param == "tools" and error.message.startswith("tools: f: ")


def test_missing_field_and_several_errors() -> None:
    error = rejection(parse_request, CompletionRequest, {"model": "m"})
    assert (error.param, error.message) == ("prompt", "prompt: Field required")
    error = rejection(completion, temperature=9, top_p=9)
    assert "temperature: " in error.message and "; top_p: " in error.message


def test_unsupported_code() -> None:
    assert rejection(completion, best_of=2).code == "unsupported_parameter"
    assert rejection(completion, temperature=9).code is None


def _schema_format(schema: dict[str, Any], strict: bool = False) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": strict}}


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"response_format": _schema_format({"type": "nope"})}, "response_format", "Invalid type"),
        (
            {"response_format": _schema_format({"type": "string", "format": "x"}, strict=True)},
            "response_format",
            "Unknown format",
        ),
        ({"guided_json": {"minimum": 5, "maximum": 1, "type": "integer"}}, "guided_json", "5"),
        ({"guided_regex": "(a"}, "guided_regex", "regex"),
        ({"guided_choice": []}, "guided_choice", "at least 1"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "at most one"),
    ],
)
def test_invalid_grammars_are_400s_naming_the_field(
    fields: dict[str, Any], param: str, fragment: str
) -> None:
    # Checked with the sampling parameters, before the request reaches a worker.
    error = rejection(lambda: to_sampling_params(chat(**fields), 10, MAX_MODEL_LEN))
    assert (error.status_code, error.param) == (400, param), error.message
    assert fragment in error.message


def test_output_constraints_become_the_grammar() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = _schema_format(schema, strict=True)
    cases = [
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
        ({"response_format": fmt}, GrammarSpec.json_schema(schema, strict=True)),
        ({"guided_json": schema}, GrammarSpec.json_schema(schema)),
        ({"guided_regex": "[0-9]+"}, GrammarSpec("regex", "[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, GrammarSpec.choice(["yes", "no"])),
    ]
    for fields, want in cases:
        for make in (chat, completion):
            assert to_sampling_params(make(**fields), 10, MAX_MODEL_LEN).grammar == want


def test_body_shape() -> None:
    error = rejection(completion, best_of=2)
    assert error.body() == {
        "error": {
            "message": "best_of: best_of > 1 is not supported",
            "type": "invalid_request_error",
            "param": "best_of",
            "code": "unsupported_parameter",
        }
    }
    json.dumps(error.body())  # serializable as is


def test_unknown_model_is_404() -> None:
    check_model("m", {"m", "other"})
    error = rejection(check_model, "nope", {"m"})
    assert (error.status_code, error.err_type, error.param) == (404, "not_found_error", "model")
    assert error.body()["error"]["code"] == "model_not_found"
    assert "'nope'" in error.message


@pytest.mark.parametrize("body", [b"{not json", b"", b'{"model": "m",}', b"\xff\xfe"])
def test_malformed_json(body: bytes) -> None:
    error = rejection(parse_request, CompletionRequest, body)
    assert (error.status_code, error.message) == (400, "request body is not valid JSON")
    assert error.param is None


def test_json_body() -> None:
    body = json.dumps({"model": "m", "prompt": [1, 2], "temperature": 0})
    assert parse_request(CompletionRequest, body.encode()).prompt_input() == [1, 2]
    assert parse_request(CompletionRequest, body).temperature == 0
    error = rejection(parse_request, CompletionRequest, b"[1, 2]")
    assert error.message == "request body must be a JSON object"
    error = rejection(parse_request, CompletionRequest, b'{"model":"m","prompt":"x","top_p":NaN}')
    assert error.param == "top_p" and "finite number" in error.message


def test_fastapi_style_errors() -> None:
    errors = [{"type": "greater_than", "loc": ("body", "top_p"), "msg": "Input should be > 0"}]
    error = error_from_validation(errors)
    assert (error.param, error.message) == ("top_p", "top_p: Input should be > 0")
    error = error_from_validation([{"type": "json_invalid", "loc": ("body", 3), "msg": "x"}])
    assert error.message == "request body is not valid JSON"


def test_too_long_prompt() -> None:
    error = rejection(to_sampling_params, completion(), MAX_MODEL_LEN, MAX_MODEL_LEN)
    assert (error.status_code, error.param) == (400, "prompt")
    assert error.code == "context_length_exceeded"
    assert f"the prompt has {MAX_MODEL_LEN} tokens" in error.message
    assert f"context is {MAX_MODEL_LEN} tokens" in error.message
    error = rejection(to_sampling_params, chat(), MAX_MODEL_LEN + 5, MAX_MODEL_LEN)
    assert error.param == "messages"
    assert rejection(to_sampling_params, completion(), 0, MAX_MODEL_LEN).param == "prompt"


def test_prompt_plus_max_tokens_overflow() -> None:
    error = rejection(to_sampling_params, completion(max_tokens=30), 100, MAX_MODEL_LEN)
    assert (error.status_code, error.param) == (400, "max_tokens")
    for number in ("30", "100", str(MAX_MODEL_LEN), str(MAX_MODEL_LEN - 100)):
        assert number in error.message
    assert to_sampling_params(completion(max_tokens=28), 100, MAX_MODEL_LEN).max_tokens == 28
    error = rejection(to_sampling_params, chat(max_completion_tokens=30), 100, MAX_MODEL_LEN)
    assert error.param == "max_completion_tokens"


def test_max_tokens_below_one_after_construct() -> None:
    """model_construct skips validation; to_sampling_params still refuses."""
    req = CompletionRequest.model_construct(**{**completion().model_dump(), "max_tokens": 0})
    error = rejection(to_sampling_params, req, 10, MAX_MODEL_LEN)
    assert error.param == "max_tokens" and "must be >= 1" in error.message


def test_sampling_params_errors_become_protocol_errors() -> None:
    req = CompletionRequest.model_construct(**{**completion().model_dump(), "top_p": 2.0})
    error = rejection(to_sampling_params, req, 10, MAX_MODEL_LEN)
    assert (error.status_code, error.param) == (400, "top_p")
    assert "top_p must be in (0, 1]" in error.message


def test_json_schema_documents_bounds() -> None:
    props = CompletionRequest.model_json_schema()["properties"]
    temperature = next(s for s in props["temperature"]["anyOf"] if s["type"] == "number")
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    assert props["temperature"]["default"] == 1.0
    top_p = next(s for s in props["top_p"]["anyOf"] if s["type"] == "number")
    assert (top_p["exclusiveMinimum"], top_p["maximum"]) == (0, 1)
    stop_list = next(s for s in props["stop"]["anyOf"] if s["type"] == "array")
    assert stop_list["maxItems"] == 16 and stop_list["items"]["maxLength"] == 256
    chat_props = ChatCompletionRequest.model_json_schema()["properties"]
    assert chat_props["messages"]["maxItems"] == 1024


@pytest.mark.parametrize("make", [completion, chat], ids=["completion", "chat"])
def test_priority_reaches_the_engine_and_is_bounded(make: Any) -> None:
    assert to_sampling_params(make(), 3, MAX_MODEL_LEN).priority == 0
    assert make().priority is None  # absent: the router applies the API key's default
    for priority in (-1000, 0, 10, 1000):
        assert to_sampling_params(make(priority=priority), 3, MAX_MODEL_LEN).priority == priority
    for bad in (1001, -1001, 2**70, 1.5, "high"):
        error = rejection(make, priority=bad)
        assert (error.status_code, error.param) == (400, "priority"), bad
    props = CompletionRequest.model_json_schema()["properties"]
    bounds = _schema_of(props, "priority", "integer")
    assert (bounds["minimum"], bounds["maximum"]) == (-1000, 1000)
    assert "LARGER is MORE important" in props["priority"]["description"]


def _schema_of(props: dict[str, Any], name: str, kind: str) -> dict[str, Any]:
    return next(s for s in props[name].get("anyOf", [props[name]]) if s.get("type") == kind)


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest])
def test_json_schema_tells_what_is_rejected(cls: type[Any]) -> None:
    """/openapi.json is built from these schemas; the fuzz test sends what they allow."""
    schema = cls.model_json_schema()
    props = schema["properties"]
    assert schema["additionalProperties"] is False
    for name, model in schema["$defs"].items():
        assert model["additionalProperties"] is False, name
    for name in NOT_IMPLEMENTED:
        assert props[name]["type"] == "null", name
    assert _schema_of(props, "n", "integer")["maximum"] == MAX_N
    for penalty in ("presence_penalty", "frequency_penalty"):
        number = _schema_of(props, penalty, "number")
        assert (number["minimum"], number["maximum"]) == (0, 0)
    number = _schema_of(props, "repetition_penalty", "number")
    assert (number["minimum"], number["maximum"]) == (1, 1)
    assert _schema_of(props, "logit_bias", "object")["maxProperties"] == 0
    response_format = schema["$defs"]["ResponseFormat"]["properties"]["type"]
    assert response_format["enum"] == ["text", "json_object", "json_schema"]
    if cls is CompletionRequest:
        assert props["suffix"]["type"] == "null"
        assert _schema_of(props, "best_of", "integer")["maximum"] == 1
        assert _schema_of(props, "echo", "boolean")["const"] is False
    else:
        message = schema["$defs"]["ChatMessage"]["properties"]
        assert all(message[f]["type"] == "null" for f in ("function_call", "refusal"))
    if cls is CompletionRequest:  # tool calling is chat's
        assert all(props[f]["type"] == "null" for f in ("tools", "tool_choice"))


def test_import_does_not_pull_torch() -> None:
    code = "import sys, pdserve.router.protocol; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
