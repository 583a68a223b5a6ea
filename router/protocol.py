"""The OpenAI-compatible request schema of the router, and its validation.

`CompletionRequest` (``POST /v1/completions``) and `ChatCompletionRequest`
(``POST /v1/chat/completions``) are the request bodies; FastAPI shows their JSON schema,
bounds included, in ``/openapi.json``. `parse_request` validates a raw body and turns
every failure into a `ProtocolError` (HTTP 400 with an OpenAI error body naming the
field); `to_sampling_params` checks the tokenized prompt against the model's context and
builds the engine's `SamplingParams`. Plain Python: no torch (docs/architecture.md, "Layout").

Supported: one prompt per request (a string, token ids, or a list holding exactly one
of either); chat messages with string content or text parts; temperature, top_p, seed,
stop, max_tokens / max_completion_tokens, logprobs, streaming with
``stream_options.include_usage``. Extensions (as in vLLM): top_k, stop_token_ids,
ignore_eos, return_token_ids, add_generation_prompt.

Rejected with a 400 that says so: batched prompts, n > 1, best_of > 1, echo, suffix,
non-zero presence/frequency penalties, logit_bias, and non-text content parts (images,
audio). Fields this schema does not know (tools, response_format, metadata, ...) are
ignored, not rejected (``extra="ignore"``): OpenAI clients send some of them by default,
and a server that rejected them would break those clients.
"""

from __future__ import annotations

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

from pdserve.engine.sampling_params import (
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
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_UNSUPPORTED = "unsupported_parameter"  # OpenAI's own code for a parameter a model lacks


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
_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _CONFIG

    include_usage: bool = False


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
    seed: Int64 | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = Field(None, description="Extension.")
    n: int = Field(1, ge=1, description="Only 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="Extension: keep going past EOS.")
    return_token_ids: bool = Field(False, description="Extension: include token ids.")
    user: str | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported.")

    @field_validator("stop", mode="wrap")
    @classmethod
    def _check_stop(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _validate_union(value, handler, "a string or a list of strings")

    @field_validator("n")
    @classmethod
    def _check_n(cls, n: int) -> int:
        if n > 1:
            raise _unsupported("n > 1")
        return n

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "only allowed when stream is true")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _check_penalty(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value:
            raise _unsupported(f"{info.field_name} other than 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise _unsupported("logit_bias")
        return value


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. Unknown fields are ignored (see the module docstring)."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="One prompt: text, token ids, or a list holding exactly one of either."
    )
    max_tokens: int | None = Field(16, ge=1, description="null: up to the model's context.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="Not supported.")
    suffix: str | None = Field(None, description="Not supported.")
    best_of: int | None = Field(None, ge=1, description="Only 1 is supported.")

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

    @field_validator("echo")
    @classmethod
    def _check_echo(cls, echo: bool) -> bool:
        if echo:
            raise _unsupported("echo")
        return echo

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, suffix: str | None) -> str | None:
        if suffix is not None:
            raise _unsupported("suffix")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, best_of: int | None) -> int | None:
        if best_of is not None and best_of > 1:
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


class ChatMessage(BaseModel):
    model_config = _CONFIG

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

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

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, as vLLM does."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. Unknown fields are ignored (see the module docstring)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI.")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="Wins over max_tokens; null: up to the model's context."
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Needs logprobs.")
    add_generation_prompt: bool = Field(True, description="Extension, passed to the template.")

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "requires logprobs to be true")
        return value

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (`name` only where given)."""
        messages = []
        for message in self.messages:
            entry = {"role": message.role, "content": message.text()}
            messages.append(entry if message.name is None else {**entry, "name": message.name})
        return messages


RequestT = TypeVar("RequestT", bound=BaseModel)


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
        part = f"{path}: {error['msg']}" if path else str(error["msg"])
        if part not in parts:
            parts.append(part)
    message = "; ".join(parts[:_MAX_REPORTED_ERRORS])
    if len(parts) > _MAX_REPORTED_ERRORS:
        message += f" (and {len(parts) - _MAX_REPORTED_ERRORS} more errors)"
    first = errors[0] if errors else None
    loc = tuple(first["loc"]) if first else ()
    param = _path(loc[1:] if loc[:1] == ("body",) else loc) or None
    code = _UNSUPPORTED if first and first["type"] == _UNSUPPORTED else None
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
        )
    except ValueError as exc:  # InvalidRequestError is a ValueError
        field = str(exc).split(" ", 1)[0]
        param = field if field in type(req).model_fields else None
        raise ProtocolError(str(exc), param=param) from exc
