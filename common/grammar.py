"""Structured output's request side: `GrammarSpec`, what a request asked for (kind and
source text), and its validation.

Small, frozen and picklable: it rides in `SamplingParams` to the prefill and decode
workers, never a compiled object. llguidance imports neither torch nor transformers, so
the router validates a grammar itself and answers a bad one with a 400 before any worker
sees it. The engine compiles specs into matchers (engine/grammar.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance

from pdserve.common.errors import InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_object", "json_schema", "regex", "choice"]
KINDS: tuple[GrammarKind, ...] = ("json_object", "json_schema", "regex", "choice")
MAX_SOURCE_CHARS = 64 * 1024  # a schema, regex or choice list, as text
MAX_CHOICES = 1024
DEFAULT_CACHE_SIZE = 128
# Compact JSON, as OpenAI returns it: a constrained model must not spend its tokens (or,
# on random weights, all of them) on whitespace. A schema's "x-guidance" overrides it.
_JSON_DEFAULTS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint: `kind` and its source text.

    json_object: any JSON object (`source` unused). json_schema: the schema as JSON text;
    `strict` (OpenAI's) refuses schema keywords the engine cannot enforce, where
    non-strict ignores them (llguidance's `lenient`). regex: a Rust-regex-syntax pattern
    the whole output matches. choice: a JSON list of strings; the output is one of them.
    """

    kind: GrammarKind
    source: str = ""
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"grammar kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(
                f"the {self.kind} is {len(self.source)} characters; at most {MAX_SOURCE_CHARS}"
            )

    @classmethod
    def json_schema(cls, schema: Any, strict: bool = False) -> GrammarSpec:
        """From a schema object (a dict, or True for any JSON value). Key order is kept:
        properties come out in the order the schema declares them, as OpenAI's do."""
        return cls("json_schema", json.dumps(schema), strict)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices)))

    def grammar(self) -> str:
        """llguidance's grammar text for this spec. Raises InvalidRequestError."""
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(_choices(self.source)))
        schema: Any = {"type": "object"} if self.kind == "json_object" else _schema(self.source)
        if isinstance(schema, bool):  # true: any JSON value; false: nothing
            schema = {} if schema else {"not": {}}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults=_JSON_DEFAULTS, overrides={"lenient": not self.strict}
            )
        except ValueError as exc:
            raise InvalidRequestError(f"invalid JSON schema: {exc}") from exc

    def check(self) -> None:
        """Raises InvalidRequestError (the router's 400) when the grammar is invalid:
        malformed, unsatisfiable, or (strict) using what the engine cannot enforce.
        Valid specs are remembered (LRU): a client repeating its schema pays once."""
        _check(self)


@functools.lru_cache(maxsize=DEFAULT_CACHE_SIZE)
def _check(spec: GrammarSpec) -> None:
    """`GrammarSpec.check`; only a valid spec's answer is cached (errors are raised)."""
    error = llguidance.LLMatcher.validate_grammar(spec.grammar())
    if error:
        raise InvalidRequestError(f"invalid {spec.kind.replace('_', ' ')}: {error}")


def _schema(source: str) -> Any:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the JSON schema is not JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError("a JSON schema must be an object (or a boolean)")
    return schema


def _choices(source: str) -> list[str]:
    try:
        choices = json.loads(source)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"the choices are not JSON: {exc}") from exc
    if (
        not isinstance(choices, list)
        or not 0 < len(choices) <= MAX_CHOICES
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise InvalidRequestError(f"choices must be 1 to {MAX_CHOICES} non-empty strings")
    return choices
