"""The model's tokenizer (`tokenizers`) and chat template (jinja2), as HF defines them.

The router's tokens are the ones the workers run, so this is the only place that turns
text into token ids; it must agree with `transformers`' `AutoTokenizer` byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pdserve.common.errors import CheckpointError, InvalidRequestError

ChatMessage = dict[str, Any]


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return None if value is None else str(value)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # As transformers' filter: plain json.dumps, not jinja's HTML-escaping `tojson` (which
    # would turn a tool schema's "<" into "\u003c" and change the prompt's tokens).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


class Tokenizer:
    """Encodes prompts, decodes tokens incrementally, renders chat templates."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"model folder {model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.chat_template: str | None = cfg.get("chat_template")
        jinja_path = model_dir / "chat_template.jinja"  # transformers >= 4.50 saves it apart
        if self.chat_template is None and jinja_path.is_file():
            self.chat_template = jinja_path.read_text(encoding="utf-8")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")
        self._template: jinja2.Template | None = None  # compiled on first use
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = {
            self._tok.token_to_id(t.content)
            for t in self._tok.get_added_tokens_decoder().values()
            if t.special
        }

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """Render messages with the model's jinja chat template, as `transformers` does
        (the same environment: its `tojson`, `strftime_now`, loop controls), `tools`
        being the request's function definitions (`{"type": "function", "function":
        {...}}`) as `apply_chat_template(tools=...)` passes them.

        Raises:
            InvalidRequestError: the model has no chat template or the template rejects
                the messages (e.g. roles out of order).
        """
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use a completion")
        try:
            template = self._template or _ENV.from_string(self.chat_template)
            self._template = template
            return template.render(
                messages=list(messages),
                tools=None if tools is None else list(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        # NOTE: the rendered template already holds bos; HF tokenizes it without special tokens.
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Decodes a small window (tokens already shown + new ones) and emits the difference, so
    tokenizers whose pieces decode differently at the start of a string (Metaspace) still
    concatenate correctly. Text ending in an incomplete UTF-8 sequence (U+FFFD) is held
    back until a later token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this have been emitted

    def step(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Add tokens; return the new text they complete (possibly "").

        With `final`, nothing is held back: a trailing incomplete character is emitted as
        U+FFFD, exactly as a one-shot `decode` of all the tokens shows it.
        """
        self._token_ids.extend(token_ids)
        window = self._token_ids[self._prefix_offset :]
        shown = self._tokenizer.decode(
            self._token_ids[self._prefix_offset : self._read_offset], self._skip
        )
        text = self._tokenizer.decode(window, self._skip)
        if len(text) <= len(shown) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return text[len(shown) :]
