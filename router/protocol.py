"""The OpenAI-compatible request schema of the router, and its validation.

`CompletionRequest` (``POST /v1/completions``) and `ChatCompletionRequest`
(``POST /v1/chat/completions``) are the request bodies; FastAPI shows their JSON schema,
bounds included, in ``/openapi.json``. `parse_request` validates a raw body and turns
every failure into a `ProtocolError` (HTTP 400 with an OpenAI error body naming the
field); `to_sampling_params` checks the tokenized prompt against the model's context and
builds the engine's `SamplingParams`. Plain Python: no torch (docs/architecture.md, "Layout").

Supported: one prompt per request (a string, token ids, or a list holding exactly one
of either); chat messages with string content or text parts, an assistant's tool_calls and
a tool's tool_call_id; tools with tool_choice none, auto, required or a named function,
and parallel_tool_calls (chat only: router/tool_calls.py); temperature, top_p, seed,
stop, max_tokens / max_completion_tokens, logprobs, streaming with
``stream_options.include_usage``. Extensions (as in vLLM): top_k, stop_token_ids,
ignore_eos, return_token_ids, add_generation_prompt, cache_salt (the prompt's prefix-cache
namespace: router/prefix_cache.py), priority (but larger is more important here, the
opposite of vLLM's order). Structured output: response_format json_object and json_schema
(strict or not), and vLLM's guided_json, guided_regex and guided_choice; one per request,
its grammar checked here (engine/grammar.py), a bad one a 400 naming the field.

A request never silently loses meaning: every field that would change what the output
is or means, and that the router does not implement, gets a 400 naming it (``param``),
never a 200 that ignores it. So a client that asks for what is not implemented never
receives free text it would take for an answer. Rejected with
``code: "unsupported_parameter"``: batched prompts, best_of > 1, echo, suffix,
non-zero presence/frequency penalties, a repetition_penalty other than 1 (vLLM's
extension), a non-empty logit_bias, modalities other than text, non-text content parts
(images, audio), and any non-null value of the `NOT_IMPLEMENTED` fields (functions,
function_call, prediction, audio, reasoning_effort, verbosity, web_search_options; tools,
tool_choice and parallel_tool_calls in completions; in messages: function_call, refusal).
logprobs beyond `MAX_LOGPROBS` fail the schema's bound. The schema says all of it
(null-only types, maximum 1, maxProperties 0, ...), so /openapi.json tells the truth.

Fields that cannot change the output are accepted and ignored (`NO_EFFECT`): user,
metadata, store (nothing is stored), service_tier, prompt_cache_key, safety_identifier,
and stream_options.include_obfuscation.

Fields the schema does not know at all get a 400 too (``extra="forbid"``, code
``unknown_parameter``), unlike vLLM, which ignores them. An unknown field is as likely to
be a newer OpenAI feature that changes the output (as response_format, prediction and
verbosity each were) as a harmless one, and ignoring it is the silent loss this module
exists to prevent; the official clients send only the fields a caller sets, so a
rejection names a field the caller chose and can drop. Harmless fields that clients
routinely send belong in `NO_EFFECT`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError, from_json

from pdserve.common.errors import InvalidRequestError
from pdserve.common.grammar import MAX_CHOICES, MAX_SOURCE_CHARS, GrammarSpec
from pdserve.common.sampling_params import (
    MAX_CACHE_SALT_LEN,
    MAX_LOGPROBS,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    SamplingParams,
)

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "ProtocolError",
    "StreamOptions",
    "check_model",
    "error_from_validation",
    "parse_request",
    "to_sampling_params",
]

MAX_CHAT_MESSAGES = 1024
MAX_TOOLS = 128  # OpenAI's own bound on `tools`
# `n` (parallel sampling): each choice is a sequence in the decode worker's batch and
# holds the prompt's last block of its own; a bound keeps one request from taking a batch
MAX_N = 16
MAX_PRIORITY = 1000  # `priority` lies in [-MAX_PRIORITY, MAX_PRIORITY] (a metric label)
# Below this a temperature means greedy, as in vLLM (`_SAMPLING_EPS`): the sampler divides
# float32 logits by it, and temperature=1e-300 (0 in float32) made inf/NaN probabilities.
_GREEDY_BELOW_TEMPERATURE = 1e-5
# The smallest normal float32. Any top_p > 0 keeps the top token, but float32 rounds
# top_p=1e-300 to 0, which dropped every token; clamping to this keeps the same filter.
_MIN_TOP_P = 1.1754943508222875e-38
_MAX_REPORTED_ERRORS = 5
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_UNSUPPORTED = "unsupported_parameter"  # OpenAI's own code for a parameter a model lacks
_UNKNOWN = "unknown_parameter"  # OpenAI's code for a parameter its API does not have
_NOT_SUPPORTED_DOC = "Not supported: any value but null is a 400 naming this field."
_NO_EFFECT_DOC = "Accepted and ignored: it has no effect on the output."


class ProtocolError(Exception):
    """A request the router rejects: the HTTP status and the OpenAI error body to send."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        fallback = "server_error" if status_code >= 500 else "invalid_request_error"
        self.err_type = _ERROR_TYPES.get(status_code, fallback)

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.err_type, "param": self.param}
        return {"error": {**error, "code": self.code}}


_UNKNOWN_MESSAGE = "unknown parameter; rejected, not ignored: this server does not implement it"
_PYDANTIC_EXTRA_MESSAGE = "Extra inputs are not permitted"
_CODES = {_UNSUPPORTED: _UNSUPPORTED, "extra_forbidden": _UNKNOWN}


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError(_UNSUPPORTED, "{what} is not supported", {"what": what})


def _path(loc: Sequence[int | str]) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else part
    return path


def _validate_union(value: Any, handler: ValidatorFunctionWrapHandler, expected: str) -> Any:
    """Validates a union field, replacing pydantic's one-error-per-branch with one error.

    The error comes from the only branch of the input's JSON kind (string or array) when
    there is exactly one, else it says what the field must be.
    """
    try:
        return handler(value)
    except ValidationError as exc:
        kind = "list" if isinstance(value, list) else "str" if isinstance(value, str) else None
        errors = [e for e in exc.errors() if e["loc"] and _branch_kind(e["loc"][0]) == kind]
        if not errors or len({e["loc"][0] for e in errors}) > 1:
            raise PydanticCustomError(
                "invalid_type", "must be {expected}", {"expected": expected}
            ) from None
        first = errors[0]
        at = f" (at {_path(first['loc'][1:])})" if len(first["loc"]) > 1 else ""
        context = {"msg": first["msg"], "at": at}
        raise PydanticCustomError(first["type"], "{msg}{at}", context) from None


def _branch_kind(tag: int | str) -> str | None:
    """A union branch's tag ("str", "constrained-str", "list[int]", ...) -> its JSON kind."""
    tag = str(tag)
    return "list" if tag.startswith("list[") else "str" if tag.endswith("str") else None


StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_STRING_LEN)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenId = Annotated[int, Field(ge=0)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
# NOTE: extra="forbid": an unknown field is a 400 naming it (the module docstring says why);
# the schema says so too ("additionalProperties": false).
_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)

# Fields of OpenAI's API that change what the output is or means and that this server does
# not implement: typed null (absent), any other value is a 400 naming the field.
NOT_IMPLEMENTED = (
    "functions",
    "function_call",
    "prediction",
    "audio",
    "reasoning_effort",
    "verbosity",
    "web_search_options",
)
# Fields that cannot change the output, accepted (and ignored) because clients send them.
NO_EFFECT = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
)


def _reject_unless_null(value: Any, info: ValidationInfo) -> Any:
    if value is not None:
        raise _unsupported(str(info.field_name))
    return value


class StreamOptions(BaseModel):
    model_config = _CONFIG

    include_usage: bool = False
    include_obfuscation: bool | None = Field(
        None, description="Accepted and ignored: streamed events carry no obfuscation padding."
    )


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`, as OpenAI defines it."""

    model_config = _CONFIG

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    # `schema` shadows a BaseModel attribute: aliased, as pydantic requires.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(
        None, description="true: schema keywords the grammar cannot enforce are a 400."
    )


class ResponseFormat(BaseModel):
    """`response_format`: text (the default), or JSON enforced by a grammar."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(BaseModel):
    """The fields `/v1/completions` and `/v1/chat/completions` share."""

    model_config = _CONFIG

    model: str
    temperature: float | None = Field(1.0, ge=0, le=2)
    top_p: float | None = Field(1.0, gt=0, le=1)
    # NOTE: bounded to int64: the sampler puts top_k in a torch tensor, and a larger value
    # (top_k=2**70) raised inside the engine's step, closing the worker's engine (503s for
    # every request there until Serve's health check replaced the replica).
    top_k: Int64 | None = Field(0, ge=-1, description="Extension: 0 or -1 disables top-k.")
    priority: int | None = Field(
        None,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="Extension: scheduling and shedding priority, LARGER is MORE important "
        "(unlike vLLM, where smaller goes first); null: the API key's default, else 0.",
    )
    seed: Int64 | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = Field(None, description="Extension.")
    n: int | None = Field(
        1,
        ge=1,
        le=MAX_N,
        description=f"Choices (at most {MAX_N}); with a seed S, choice i is seeded S + i.",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="Extension: keep going past EOS.")
    return_token_ids: bool = Field(False, description="Extension: include token ids.")
    result_cache: bool = Field(
        True,
        description="Extension: false: never answered from, nor stored in, the result cache "
        "(when the server has one on), like 'Cache-Control: no-store'.",
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT_LEN,
        description="Extension (as in vLLM): the tenant namespace of the prompt's KV blocks;"
        " requests with different salts never share a prefix-cache block. Default: the API"
        " key's.",
    )
    presence_penalty: float | None = Field(0.0, ge=0, le=0, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(0.0, ge=0, le=0, description="Only 0 is supported.")
    repetition_penalty: float | None = Field(
        None, ge=1, le=1, description="vLLM's extension (its benchmark client sends 1.0): only 1."
    )
    logit_bias: dict[str, float] | None = Field(
        None, max_length=0, description="Not supported: only null or {}."
    )
    response_format: ResponseFormat | None = Field(
        None,
        description="text, json_object or json_schema (strict or not): the output is held to"
        " the grammar token by token (engine/grammar.py).",
    )
    guided_json: dict[str, Any] | str | None = Field(
        None, description="Extension (vLLM's): a JSON schema the output follows."
    )
    guided_regex: str | None = Field(
        None,
        max_length=MAX_SOURCE_CHARS,
        description="Extension (vLLM's): a regular expression (Rust regex syntax) the whole"
        " output matches.",
    )
    guided_choice: list[Annotated[str, StringConstraints(min_length=1)]] | None = Field(
        None,
        min_length=1,
        max_length=MAX_CHOICES,
        description="Extension (vLLM's): the output is exactly one of these strings.",
    )
    modalities: list[Literal["text"]] | None = Field(None, description="Only text.")
    # NOT_IMPLEMENTED: null, or a 400 naming the field.
    functions: None = Field(None, description=_NOT_SUPPORTED_DOC)
    function_call: None = Field(None, description=_NOT_SUPPORTED_DOC)
    prediction: None = Field(None, description=_NOT_SUPPORTED_DOC)
    audio: None = Field(None, description=_NOT_SUPPORTED_DOC)
    reasoning_effort: None = Field(None, description=_NOT_SUPPORTED_DOC)
    verbosity: None = Field(None, description=_NOT_SUPPORTED_DOC)
    web_search_options: None = Field(None, description=_NOT_SUPPORTED_DOC)
    # NO_EFFECT: accepted, ignored.
    user: str | None = Field(None, description=_NO_EFFECT_DOC)
    metadata: dict[str, str] | None = Field(None, max_length=16, description=_NO_EFFECT_DOC)
    store: bool | None = Field(None, description="Accepted and ignored: nothing is stored.")
    service_tier: str | None = Field(None, description=_NO_EFFECT_DOC)
    prompt_cache_key: str | None = Field(None, description=_NO_EFFECT_DOC)
    safety_identifier: str | None = Field(None, description=_NO_EFFECT_DOC)

    @field_validator("stop", mode="wrap")
    @classmethod
    def _check_stop(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _validate_union(value, handler, "a string or a list of strings")

    _check_not_implemented = field_validator(*NOT_IMPLEMENTED, mode="before")(_reject_unless_null)

    # NOTE: mode="before" validators run ahead of the schema's bounds (le=1, le=0,
    # max_length=0), so an unsupported value is named as such, not as out of range.
    @field_validator("modalities", mode="before")
    @classmethod
    def _check_modalities(cls, value: Any) -> Any:
        if isinstance(value, list) and any(kind != "text" for kind in value):
            raise _unsupported("output other than text")
        return value

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: ResponseFormat | None) -> ResponseFormat | None:
        if value is None:
            return value
        if value.type == "json_schema" and (
            value.json_schema is None or value.json_schema.json_schema is None
        ):
            raise PydanticCustomError(
                "invalid_value", "type 'json_schema' needs json_schema.schema"
            )
        if value.type != "json_schema" and value.json_schema is not None:
            raise PydanticCustomError(
                "invalid_value", "json_schema is only allowed with type 'json_schema'"
            )
        return value

    def grammar(self) -> GrammarSpec | None:
        """The request's output constraint (response_format or one guided_* extension),
        None for free text. Raises ProtocolError (400) for two at once or an invalid one:
        the grammar is checked here, so a bad schema never reaches a worker."""
        specs: list[tuple[str, GrammarSpec]] = []
        fmt = self.response_format
        param = "response_format"
        try:
            if fmt is not None and fmt.type == "json_object":
                specs.append(("response_format", GrammarSpec("json_object")))
            if fmt is not None and fmt.json_schema is not None:
                strict = bool(fmt.json_schema.strict)
                spec = GrammarSpec.json_schema(fmt.json_schema.json_schema, strict)
                specs.append(("response_format", spec))
            if self.guided_json is not None:
                param = "guided_json"
                schema = self.guided_json
                spec = (
                    GrammarSpec("json_schema", schema)
                    if isinstance(schema, str)
                    else GrammarSpec.json_schema(schema)
                )
                specs.append(("guided_json", spec))
            if self.guided_regex is not None:
                param = "guided_regex"
                specs.append(("guided_regex", GrammarSpec("regex", self.guided_regex)))
            if self.guided_choice is not None:
                specs.append(("guided_choice", GrammarSpec.choice(self.guided_choice)))
        except InvalidRequestError as exc:
            raise ProtocolError(str(exc), param=param) from exc
        if not specs:
            return None
        if len(specs) > 1:
            raise ProtocolError(
                f"at most one output constraint per request, got {[n for n, _ in specs]}",
                param=specs[1][0],
            )
        param, spec = specs[0]
        try:
            spec.check()
        except InvalidRequestError as exc:
            raise ProtocolError(str(exc), param=param) from exc
        return spec

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "only allowed when stream is true")
        return value

    @field_validator("presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _check_penalty(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool) and value:
            raise _unsupported(f"{info.field_name} other than 0")
        return value

    @field_validator("repetition_penalty", mode="before")
    @classmethod
    def _check_repetition_penalty(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool) and value != 1:
            raise _unsupported("repetition_penalty other than 1")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> Any:
        if isinstance(value, dict) and value:
            raise _unsupported("logit_bias")
        return value


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body; docs/lora.md)."""

    model_config = _CONFIG

    lora_name: str = Field(
        min_length=1, max_length=MAX_CACHE_SALT_LEN, description="The name requests use"
    )
    lora_path: str = Field(
        min_length=1, max_length=4096, description="A PEFT folder every worker can read"
    )
    base_model_name: str | None = Field(
        None,
        description="Extension: the served model the adapter is for (needed only when the"
        " router serves several)",
    )


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body)."""

    model_config = _CONFIG

    lora_name: str = Field(min_length=1, max_length=MAX_CACHE_SALT_LEN)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. Unknown fields are a 400 (see the module docstring)."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="One prompt: text, token ids, or a list holding exactly one of either."
    )
    max_tokens: int | None = Field(16, ge=1, description="null: up to the model's context.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] | None = Field(False, description="Not supported: only false.")
    suffix: None = Field(None, description=_NOT_SUPPORTED_DOC)
    best_of: int | None = Field(None, ge=1, le=1, description="Only 1 is supported.")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        expected = "a string, a list of token ids, or a list of one string or one token-id list"
        prompt = _validate_union(value, handler, expected)
        single = prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise PydanticCustomError(
                    _UNSUPPORTED, "batched prompts are not supported; send one prompt per request"
                )
            single = prompt[0]
        if not single:
            raise PydanticCustomError("invalid_value", "must not be empty")
        if isinstance(single, list) and min(single) < 0:
            raise PydanticCustomError("invalid_value", "token ids must be >= 0")
        return prompt

    # Tool calling is a chat feature (OpenAI's completions API has none): null only here.
    tools: None = Field(None, description=_NOT_SUPPORTED_DOC)
    tool_choice: None = Field(None, description=_NOT_SUPPORTED_DOC)
    parallel_tool_calls: None = Field(None, description=_NOT_SUPPORTED_DOC)

    _check_suffix = field_validator(
        "suffix", "tools", "tool_choice", "parallel_tool_calls", mode="before"
    )(_reject_unless_null)

    @field_validator("echo", mode="before")
    @classmethod
    def _check_echo(cls, echo: Any) -> Any:
        if echo is True:
            raise _unsupported("echo")
        return echo

    @field_validator("best_of", mode="before")
    @classmethod
    def _check_best_of(cls, best_of: Any) -> Any:
        if _is_int(best_of) and best_of > 1:
            raise _unsupported("best_of > 1")
        return best_of

    def prompt_input(self) -> str | list[int]:
        """The one prompt: its text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        first = prompt[0]  # validation guarantees exactly one prompt, never empty
        if isinstance(first, str):
            return first
        return list(first) if isinstance(first, list) else list(cast(list[int], prompt))


class ContentPart(BaseModel):
    """One part of a chat message's content; only text parts are supported."""

    model_config = _CONFIG

    type: Literal["text"]
    text: str


# A function's name, as OpenAI bounds it: what a tool call's `name` must match exactly.
FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDefinition(BaseModel):
    model_config = _CONFIG

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments object; null: no arguments."
    )
    strict: bool | None = Field(
        None,
        description="true: schema keywords the grammar cannot enforce are a 400 (when the"
        " schema is enforced: tool_choice required or this function).",
    )

    def arguments_schema(self) -> dict[str, Any]:
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters


class Tool(BaseModel):
    """One entry of `tools`: a function the model may call."""

    model_config = _CONFIG

    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(BaseModel):
    model_config = _CONFIG

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the model must call."""

    model_config = _CONFIG

    type: Literal["function"]
    function: FunctionRef


class ToolCallFunction(BaseModel):
    model_config = _CONFIG

    name: str
    arguments: str = Field(description="The arguments object as JSON text.")


class ToolCallEntry(BaseModel):
    """A call in an assistant message of the history (as a response returned it)."""

    model_config = _CONFIG

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = _CONFIG

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # A history's calls go back through the template as the model wrote them (assistant)
    # and their results as `tool` turns naming the call they answer.
    tool_calls: list[ToolCallEntry] | None = Field(None, description="Assistant messages only.")
    tool_call_id: str | None = Field(None, description="Tool messages: the call answered.")
    refusal: None = Field(None, description="Null only (as an assistant message echoes it).")
    annotations: list[Any] | None = Field(None, description=_NO_EFFECT_DOC)
    function_call: None = Field(None, description=_NOT_SUPPORTED_DOC)

    _check_function_call = field_validator("function_call", "refusal", mode="before")(
        _reject_unless_null
    )

    @field_validator("content", mode="wrap")
    @classmethod
    def _check_content(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise PydanticCustomError(
                    _UNSUPPORTED,
                    "content part type '{kind}' is not supported; only 'text' parts are",
                    {"kind": kind},
                )
        return _validate_union(value, handler, "a string or a list of text parts")

    @field_validator("tool_calls")
    @classmethod
    def _check_tool_calls(
        cls, value: list[ToolCallEntry] | None, info: ValidationInfo
    ) -> list[ToolCallEntry] | None:
        if value is not None and info.data.get("role") != "assistant":
            raise PydanticCustomError("invalid_value", "only assistant messages hold tool_calls")
        for call in value or ():
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise PydanticCustomError(
                    "invalid_value",
                    "the arguments of call '{id}' are not a JSON object",
                    {"id": call.id},
                )
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _check_tool_call_id(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("role") != "tool":
            raise PydanticCustomError("invalid_value", "only tool messages hold tool_call_id")
        return value

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM does."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (as `transformers` documents it): calls'
        arguments as objects, not JSON text; `name`, `tool_calls` and `tool_call_id` only
        where given; an assistant's content None when it only called tools."""
        entry: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            entry["name"] = self.name
        if self.tool_calls:
            if self.content is None:
                entry["content"] = None
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": json.loads(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        return entry


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. Unknown fields are a 400 (see the module docstring)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI.")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Wins over max_tokens; null: up to the model's context."
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Needs logprobs.")
    add_generation_prompt: bool = Field(True, description="Extension, passed to the template.")
    tools: list[Tool] | None = Field(
        None,
        max_length=MAX_TOOLS,
        description="Functions the model may call, rendered by the model's chat template.",
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none: no calls parsed; auto (the default with tools): calls parsed from"
        " the output in the model's format; required, or a named function: the output is"
        " held by a grammar to valid calls of the declared functions.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description="false: at most one call (enforced under required)."
    )

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [tool.function.name for tool in value or ()]
        if len(set(names)) < len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise PydanticCustomError(
                "invalid_value", "function names must be unique; '{name}' repeats", {"name": dup}
            )
        return value

    @field_validator("tool_choice")
    @classmethod
    def _check_tool_choice(
        cls, value: str | NamedToolChoice | None, info: ValidationInfo
    ) -> str | NamedToolChoice | None:
        tools = info.data.get("tools")
        if value is None or value == "none":
            return value
        if not tools:
            raise PydanticCustomError("invalid_value", "only allowed when tools are given")
        if isinstance(value, NamedToolChoice) and value.function.name not in {
            tool.function.name for tool in tools
        }:
            raise PydanticCustomError(
                "invalid_value",
                "names the function '{name}', which is not in tools",
                {"name": value.function.name},
            )
        return value

    def tool_mode(self) -> Literal["auto", "required", "named"] | None:
        """How the output holds calls: None (no tools, or tool_choice none: plain
        content), "auto" (parsed in the model's format), "required" (a JSON array of
        calls, under a grammar) or "named" (the named function's arguments object, under
        a grammar)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    def named_function(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template takes them: as the client sent them."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_unset=True) for tool in self.tools]

    def tool_grammar(self) -> GrammarSpec | None:
        """The grammar that holds the output to valid calls (required, a named function),
        else None. Required: a JSON array of `{"name": ..., "arguments": {...}}` objects,
        each one declared function's name with arguments valid under its parameters (one
        element at most when parallel_tool_calls is false). Named: that function's
        arguments object itself. Raises ProtocolError (400, param "tools") for a
        parameters schema the grammar engine refuses."""
        mode = self.tool_mode()
        if mode not in ("required", "named"):
            return None
        tools = [tool.function for tool in self.tools or ()]
        try:  # a strict function's schema must be enforceable whole, each on its own
            for function in tools:
                if function.strict:
                    GrammarSpec.json_schema(function.arguments_schema(), strict=True).check()
        except InvalidRequestError as exc:
            raise ProtocolError(f"tools: {function.name}: {exc}", param="tools") from exc
        strict = all(f.strict for f in tools)
        if mode == "named":
            function = next(f for f in tools if f.name == self.named_function())
            schema: dict[str, Any] = function.arguments_schema()
            strict = bool(function.strict)
        else:
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": f.arguments_schema()},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in tools
            ]
            schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            if self.parallel_tool_calls is False:
                schema["maxItems"] = 1
        try:
            spec = GrammarSpec.json_schema(schema, strict)
            spec.check()
        except InvalidRequestError as exc:
            raise ProtocolError(f"tools: {exc}", param="tools") from exc
        return spec

    def grammar(self) -> GrammarSpec | None:
        """The output constraint: the tools' (required, a named function) or the one of
        response_format / guided_* (`_SamplingRequest.grammar`); both at once is a 400."""
        tool = self.tool_grammar()
        other = super().grammar()
        if tool is None:
            return other
        if other is not None:
            raise ProtocolError(
                "tool_choice required or a named function already constrains the output; "
                "it cannot be combined with response_format or guided_*",
                param="tool_choice",
            )
        return tool

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "requires logprobs to be true")
        return value

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them (`ChatMessage.for_template`)."""
        return [message.for_template() for message in self.messages]


RequestT = TypeVar("RequestT", bound=BaseModel)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def error_from_validation(errors: Sequence[Mapping[str, Any]]) -> ProtocolError:
    """A 400 naming the offending fields, from `ValidationError.errors()`.

    Also takes FastAPI's `RequestValidationError.errors()`, whose locations start with
    "body" (dropped here) and which reports a malformed body as a "json_invalid" error.
    """
    if any(e["type"] == "json_invalid" for e in errors):
        return ProtocolError("request body is not valid JSON")
    parts: list[str] = []
    for error in errors:
        loc = tuple(error["loc"])
        path = _path(loc[1:] if loc[:1] == ("body",) else loc)
        msg = str(error["msg"])
        if error["type"] == "extra_forbidden":  # nested in a union, it keeps its "(at ...)"
            msg = msg.replace(_PYDANTIC_EXTRA_MESSAGE, _UNKNOWN_MESSAGE)
        part = f"{path}: {msg}" if path else str(msg)
        if part not in parts:
            parts.append(part)
    message = "; ".join(parts[:_MAX_REPORTED_ERRORS])
    if len(parts) > _MAX_REPORTED_ERRORS:
        message += f" (and {len(parts) - _MAX_REPORTED_ERRORS} more errors)"
    first = errors[0] if errors else None
    loc = tuple(first["loc"]) if first else ()
    param = _path(loc[1:] if loc[:1] == ("body",) else loc) or None
    code = _CODES.get(first["type"]) if first else None
    return ProtocolError(message or "invalid request", param=param, code=code)


def parse_request(model_cls: type[RequestT], body: bytes | str | Mapping[str, Any]) -> RequestT:
    """Validates a request body (raw JSON or already decoded).

    Raises:
        ProtocolError: 400 when the body is not JSON, not an object, or fails validation.
    """
    if isinstance(body, bytes | str):
        # NOTE: not `json.loads`, which accepts lone surrogate escapes ("\ud800"): such a
        # string reached the tokenizer and failed there with a 500. pydantic's parser
        # rejects them (and non-UTF-8 bodies), and bounds nesting without a RecursionError.
        try:
            body = from_json(body)
        except (ValueError, TypeError) as exc:  # TypeError: a str holding a lone surrogate
            raise ProtocolError("request body is not valid JSON") from exc
    if not isinstance(body, Mapping):
        raise ProtocolError("request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise error_from_validation(exc.errors()) from exc


def check_model(model: str, served_models: Collection[str]) -> None:
    """Raises a 404 `ProtocolError` when `model` is not one this server serves."""
    if model not in served_models:
        served = ", ".join(sorted(served_models))
        raise ProtocolError(
            f"the model {model!r} does not exist; this server serves: {served}",
            status_code=404,
            param="model",
            code="model_not_found",
        )


def _max_tokens(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, int | None]:
    """The requested max_tokens and the name of the field it came from."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


def requested_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The output length the request asked for (None: as long as the model allows)."""
    return _max_tokens(req)[1]


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return (req.top_logprobs or 0) if req.logprobs else None


def _check_lengths(
    req: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int
) -> int:
    """The number of new tokens to allow, after checking prompt and max_tokens fit."""
    prompt_param = "prompt" if isinstance(req, CompletionRequest) else "messages"
    if prompt_len < 1:
        raise ProtocolError("the prompt has no tokens", param=prompt_param)
    if prompt_len >= max_model_len:
        raise ProtocolError(
            f"the prompt has {prompt_len} tokens; this model's context is {max_model_len} "
            "tokens (prompt + max_tokens must fit)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    param, max_tokens = _max_tokens(req)
    if max_tokens is None:
        return max_model_len - prompt_len
    if max_tokens < 1:
        raise ProtocolError(f"{param} must be >= 1, got {max_tokens}", param=param)
    if prompt_len + max_tokens > max_model_len:
        raise ProtocolError(
            f"{param} is {max_tokens} but the prompt has {prompt_len} tokens and this model's "
            f"context is {max_model_len} tokens; at most {max_model_len - prompt_len} new "
            "tokens fit",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int
) -> SamplingParams:
    """The engine's sampling parameters for a validated request whose prompt is tokenized.

    Raises:
        ProtocolError: 400 when the prompt, or the prompt plus max_tokens, does not fit
            the model's context, or when `SamplingParams` rejects a value.
    """
    max_tokens = _check_lengths(req, prompt_len, max_model_len)
    stop = req.stop if req.stop is not None else ()
    temperature = 1.0 if req.temperature is None else req.temperature
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < _GREEDY_BELOW_TEMPERATURE else temperature,
            top_p=1.0 if req.top_p is None else max(req.top_p, _MIN_TOP_P),
            top_k=0 if req.top_k is None or req.top_k == -1 else req.top_k,
            seed=req.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=_logprobs(req),
            cache_salt=req.cache_salt,
            priority=req.priority or 0,
            n=req.n or 1,
            grammar=req.grammar(),
        )
    except ValueError as exc:  # InvalidRequestError is a ValueError
        field = str(exc).split(" ", 1)[0]
        param = field if field in type(req).model_fields else None
        raise ProtocolError(str(exc), param=param) from exc
