"""Tool calls in a model's output: its generated text, as OpenAI `tool_calls`.

A model calls a tool by writing it in its text; how depends on the model (`ToolMode`):

- `hermes` (Qwen 2.5, Hermes, NousResearch): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks, anywhere in the text; the text outside them is content.
- `json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`), maybe more such objects after `;` or whitespace; an output
  that does not start with `{` is plain content.
- `required` (tool_choice "required", under the server's grammar): a JSON array of
  `{"name": ..., "arguments": {...}}`.
- `named` (tool_choice naming a function, under a grammar): the output is that function's
  arguments object.

`ToolCallParser` reads the output as the workers stream it, one text delta at a time, and
says what to send now: content, and `ToolCallDelta`s (the call's id and name first, then
its arguments' text piece by piece, as OpenAI streams them). `parse_tool_calls` is the
same parser fed the whole text, so a streamed response and a non-streamed one always
agree, for any split of the text into deltas (tests/router/test_tool_calls.py checks it).

Design decisions:

- One pass, character by character (`_CallObject` is a small JSON scanner: string and
  escape state, nesting depth, the keys of the call object itself; a string's plain runs
  are read at once, as content up to the next `<` is), so a feed costs its own length,
  never the length of what came before. Text that cannot be decided yet (a
  partial tag, the start of an object whose first key is not read yet) is held, and
  sent as content if it turns out not to be a call, so no text is ever lost.
- An object is a call when its first key is "name" with a string value (after an
  optional `"type": "function"`); the call is sent as soon as the name's string closes.
  Its arguments are the first "arguments" (or "parameters") value's raw text, sent as it
  arrives (trailing whitespace held back, then dropped); a value that is a JSON string
  (some models encode the arguments) is held and sent decoded (and stripped) when it
  closes. Other keys are ignored. A call's arguments are never empty: a call that ends
  with none is "{}" (in named mode too, for an empty output).
- Past the decision the scanner is lenient: stray text in the call object is ignored, so a
  malformed call still ends, with the arguments it had. In hermes mode a `</tool_call>`
  outside a JSON string ends the call where it stands (models drop a closing brace), and
  a call's closing tag is optional (a new `<tool_call>` or content may follow its `}`).
- Whitespace around a call is not content: in hermes, whitespace-only runs next to a
  call's tags (a block that is no call is content whole, whitespace and tags included);
  in json and required, the whitespace and separators between calls. Text after the
  calls in json mode is content, without the separators before it.
- A feed's deltas are merged per call: one `ToolCallDelta` per call and feed, so a feed
  that completes a call's name and starts its arguments sends both in the call's first
  delta.
- Output cut short (finish_reason "length"): `finish` sends what is held; a call already
  started stays a call with the arguments received so far (a string value decoded as far
  as it goes); held text that never became a call is content, except an object cut
  before its name inside required's array or after calls (an unfinished call, dropped).
  A cut `</tool_call>` after a complete call is dropped as markup.
- Nothing raises on malformed text: at worst it is content. A decoded string never holds
  a lone UTF-16 surrogate (U+FFFD instead), so the response always encodes as UTF-8.

`tool_format` says which format a model's tool_choice "auto" reads: the operator's
`tool_call_parser`, or the one its chat template writes calls in.

Plain Python: no torch, the standard library only.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal, Protocol

__all__ = [
    "TOOL_MODES",
    "Parsed",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolMode",
    "parse_tool_calls",
    "tool_format",
]

ToolMode = Literal["hermes", "json", "required", "named"]
TOOL_MODES: tuple[ToolMode, ...] = ("hermes", "json", "required", "named")


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a call: its id and name come once, on its first delta."""

    index: int  # which call of this choice: 0, 1, ... in order of appearance
    id: str | None = None  # "call_" + 24 lowercase hex characters, on the first delta only
    name: str | None = None  # the function's name, on the first delta only
    arguments: str = ""  # the next piece of the call's arguments (JSON text)


@dataclass(frozen=True)
class ToolCall:
    """A whole call, as a non-streamed response holds it."""

    id: str
    name: str
    arguments: str  # the whole arguments JSON text


@dataclass
class Parsed:
    """What one feed (or `finish`) says to send now."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


# JSON's whitespace; content's whitespace rules use the same four characters
_WS = " \t\n\r"
_OPEN_TAG = "<tool_call>"
_CLOSE_TAG = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder(strict=False)  # models write raw newlines inside strings
_PLAIN = re.compile(r'[^"\\]+')  # a run inside a JSON string that neither ends nor escapes


def _new_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _decode(raw: str) -> str:
    """A JSON string's text (between its quotes); the raw text if it does not decode."""
    try:
        text: str = _DECODER.decode('"' + raw + '"')
    except ValueError:
        text = raw
    return _no_lone_surrogates(text)


def _decode_partial(raw: str) -> str:
    """A JSON string cut short: what decodes of it, dropping an escape cut in the middle."""
    for cut in range(min(len(raw), 5) + 1):  # "\" up to "\uXXX": 5 characters
        try:
            text: str = _DECODER.decode('"' + raw[: len(raw) - cut] + '"')
        except ValueError:
            continue
        if text and "\ud800" <= text[-1] <= "\udbff":  # a surrogate pair cut in half
            text = text[:-1]
        return _no_lone_surrogates(text)
    return raw  # an invalid escape earlier on: the text as the model wrote it


def _no_lone_surrogates(text: str) -> str:
    # "\ud83d" alone (or a pair cut short) decodes to a str that UTF-8 cannot encode
    if any("\ud800" <= ch <= "\udfff" for ch in text):
        return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in text)
    return text


class _Out:
    """What the current feed produced: content pieces and call deltas; numbers the calls."""

    def __init__(self) -> None:
        self.calls = 0  # calls started so far (the next call's index)
        self._content: list[str] = []
        # (index, id, name, argument pieces); a call's consecutive pieces share one entry
        self._deltas: list[tuple[int, str | None, str | None, list[str]]] = []

    def text(self, text: str) -> None:
        if text:
            self._content.append(text)

    def start_call(self, name: str) -> int:
        index = self.calls
        self.calls += 1
        self._deltas.append((index, _new_id(), name, []))
        return index

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if self._deltas and self._deltas[-1][0] == index:
            self._deltas[-1][3].append(text)
        else:
            self._deltas.append((index, None, None, [text]))

    def take(self) -> Parsed:
        parsed = Parsed(
            "".join(self._content),
            [ToolCallDelta(i, id_, name, "".join(pieces)) for i, id_, name, pieces in self._deltas],
        )
        self._content = []
        self._deltas = []
        return parsed


# _CallObject.status
_PENDING = 0  # the first key (or its value) is not read yet
_CALL = 1  # a call: its first delta was sent
_NOT_CALL = 2  # not a call: the text read so far is content (the caller holds it)
_DONE = 3  # a call, ended

# where _CallObject is at the call object's own level
_KEY_WAIT = 0  # before a key (or the closing brace)
_KEY = 1  # inside a key's string
_COLON = 2  # after a key
_VALUE_WAIT = 3  # after the colon
_VALUE = 4  # inside a value (or after it, before the comma)

# what the current value is to _CallObject
_SKIP = 0  # ignored
_NAME = 1  # the name's string (the first key)
_TYPE = 2  # "type": "function" before the name
_ARGS = 3  # the arguments, streamed as they come
_ARGS_STRING = 4  # the arguments as a JSON string: held, sent decoded


class _CallObject:
    """A candidate call object, read one character at a time from just after its `{`.

    Strict until it knows whether this is a call (the first key "name", or "type":
    "function" then "name", with a string value): anything else makes it `_NOT_CALL`.
    Lenient after: stray text is ignored, so it always reaches an end.
    """

    def __init__(self, out: _Out) -> None:
        self.status = _PENDING
        self.in_string = False
        self._out = out
        self._index = -1
        self._where = _KEY_WAIT
        self._kind = _SKIP
        self._depth = 1  # 1: the call object's own level
        self._escape = False
        self._buf: list[str] = []  # the key being read, or a string value held whole
        self._ws: list[str] = []  # whitespace inside the arguments, sent once more follows
        self._typed = False  # read "type": "function"
        self._args_started = False  # a second "arguments" value is ignored
        self._args_sent = False

    def step(self, c: str) -> bool:
        """Read `c`; False when `c` is not part of the object: it is not a call (status
        `_NOT_CALL`), or `c` is a `]` that ends an object never closed (status `_DONE`)."""
        if self.in_string:
            return self._string_char(c)
        if self._where == _VALUE:
            return self._value_char(c)
        if c in _WS:
            return True
        if self._where == _KEY_WAIT:
            if c == '"':
                self.in_string = True
                self._where = _KEY
                self._buf = []
                return True
            return self._structural(c)
        if self._where == _COLON:
            if c == ":":
                self._where = _VALUE_WAIT
                return True
            return self._structural(c)
        return self._value_start(c)

    def plain_run(self, text: str, i: int) -> int:
        """Inside a string, read the run from text[i] that holds no quote or backslash, at
        once (long arguments are mostly strings); returns where it ended."""
        if not self.in_string or self._escape:
            return i
        m = _PLAIN.match(text, i)
        if m is None:
            return i
        run = m.group()
        if self._where == _KEY or self._kind in (_NAME, _TYPE, _ARGS_STRING):
            self._buf.append(run)
        elif self._kind == _ARGS:
            self._argument_char(run)  # inside a string: sent as it is
        return m.end()

    def finish(self) -> None:
        """The output ended (or a `</tool_call>` did): a started call ends as it stands."""
        if self.status != _CALL:
            return
        if self._kind == _ARGS_STRING and self.in_string:
            self._send(_decode_partial("".join(self._buf)).strip(_WS))
        self._close()

    def _structural(self, c: str) -> bool:
        """A character where a key, colon or value was due."""
        if self.status == _PENDING:
            return self._reject()
        if c == ",":
            self._where = _KEY_WAIT
        elif c == "}":
            self._close()
        elif c == "]":  # an array's end: this object was never closed
            self._close()
            return False
        return True  # anything else is stray text: ignored

    def _value_start(self, c: str) -> bool:
        if self.status == _PENDING:  # the name's (or type's) value: a string, or no call
            if c != '"':
                return self._reject()
            self.in_string = True
            self._buf = []
            self._where = _VALUE
            return True
        if c in ",}]":  # a key without a value
            return self._structural(c)
        self._where = _VALUE
        if self._kind == _ARGS:
            self._args_started = True
            if c == '"':
                self._kind = _ARGS_STRING
                self.in_string = True
                self._buf = []
                return True
        return self._value_char(c)

    def _value_char(self, c: str) -> bool:
        """A character in a value, outside strings (or just after a string value)."""
        if self._depth == 1 and c in ",}]":  # the value's end
            self._ws.clear()  # the arguments' trailing whitespace
            self._kind = _SKIP
            if c == ",":
                self._where = _KEY_WAIT
                return True
            return self._structural(c)
        if self.status == _PENDING:  # after "type": "function", only a comma may follow
            return True if c in _WS else self._reject()
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
        if self._kind == _ARGS:
            self._argument_char(c)
        return True

    def _string_char(self, c: str) -> bool:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self.in_string = False
            return self._string_end()
        if self._where == _KEY or self._kind in (_NAME, _TYPE, _ARGS_STRING):
            self._buf.append(c)
        elif self._kind == _ARGS:
            self._argument_char(c)
        return True

    def _string_end(self) -> bool:
        if self._where == _KEY:
            self._where = _COLON
            return self._key(_decode("".join(self._buf)))
        kind = self._kind
        if kind == _ARGS:
            self._argument_char('"')
        if kind in (_SKIP, _ARGS):
            return True
        text = _decode("".join(self._buf))
        self._kind = _SKIP  # what follows until the comma is ignored
        if kind == _NAME:
            self.status = _CALL
            self._index = self._out.start_call(text)
        elif kind == _TYPE:
            if text != "function":
                return self._reject()
            self._typed = True
        else:  # _ARGS_STRING
            self._send(text.strip(_WS))
        return True

    def _key(self, key: str) -> bool:
        if self.status == _PENDING:
            if key == "name":
                self._kind = _NAME
            elif key == "type" and not self._typed:
                self._kind = _TYPE
            else:
                return self._reject()
        elif key in _ARGUMENT_KEYS and not self._args_started:
            self._kind = _ARGS
        else:
            self._kind = _SKIP
        return True

    def _argument_char(self, c: str) -> None:
        """One character of the arguments (or a run inside a string)."""
        if c in _WS and not self.in_string:
            self._ws.append(c)  # sent only if more of the value follows
            return
        if self._ws:
            self._send("".join(self._ws))
            self._ws.clear()
        self._send(c)

    def _send(self, text: str) -> None:
        if text:
            self._out.arguments(self._index, text)
            self._args_sent = True

    def _close(self) -> None:
        if not self._args_sent:
            self._send("{}")
        self.status = _DONE

    def _reject(self) -> bool:
        self.status = _NOT_CALL
        return False


class _Reader(Protocol):
    """One mode's reading of the output, into the parser's `_Out`."""

    def run(self, text: str) -> None: ...

    def finish(self) -> None: ...


# _Hermes states
_H_TEXT = 0  # content
_H_TAG = 1  # a partial "<tool_call>"
_H_HEAD = 2  # after "<tool_call>", before the object
_H_CALL = 3  # inside the object
_H_CLOSING = 4  # a partial "</tool_call>" inside a call object, outside strings
_H_AFTER = 5  # after the call object: whitespace, then its "</tool_call>"
_H_BLOCK = 6  # a block that is no call: content up to its "</tool_call>"


class _Hermes:
    """`<tool_call>` blocks in content."""

    def __init__(self, out: _Out) -> None:
        self._out = out
        self._state = _H_TEXT
        self._ws: list[str] = []  # content's trailing whitespace: dropped if a tag follows
        self._skip_ws = False  # just after a call's block: its whitespace is no content
        self._held: list[str] = []  # a block's text (and the whitespace before it), undecided
        self._match = 0  # characters of a tag matched
        self._call: _CallObject | None = None

    def run(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n:
            if self._state == _H_TEXT:
                i = self._content(text, i)
                continue
            if self._state == _H_CALL and self._call is not None:
                j = self._call.plain_run(text, i)
                if j > i:
                    if self._call.status == _PENDING:
                        self._held.append(text[i:j])
                    i = j
                    continue
            if self._step(text[i]):
                i += 1

    def finish(self) -> None:
        state = self._state
        if state == _H_TEXT:
            self._out.text("".join(self._ws))
        elif state == _H_TAG:
            self._out.text("".join(self._ws) + _OPEN_TAG[: self._match])
        elif state == _H_HEAD:
            self._out.text("".join(self._held))
        elif self._call is not None and state in (_H_CALL, _H_CLOSING):
            if state == _H_CLOSING:
                self._stray_tag()
            if self._call.status == _PENDING:
                self._out.text("".join(self._held))
            else:
                self._call.finish()
        # _H_AFTER: a cut "</tool_call>" is markup; _H_BLOCK's text was sent as it came
        self._ws, self._held, self._call = [], [], None
        self._state = _H_TEXT

    def _content(self, text: str, i: int) -> int:
        """Content from text[i] up to the next "<" (the whole run at once)."""
        j = text.find("<", i)
        seg = text[i:] if j < 0 else text[i:j]
        if self._skip_ws:
            seg = seg.lstrip(_WS)
            self._skip_ws = not seg
        core = seg.rstrip(_WS)
        if core:
            self._out.text("".join(self._ws) + core)
            self._ws = [seg[len(core) :]]
        else:
            self._ws.append(seg)
        if j < 0:
            return len(text)
        self._state = _H_TAG
        self._match = 1
        return j + 1

    def _step(self, c: str) -> bool:
        """Read `c` in any state but content; False to read it again in the new state."""
        state = self._state
        if state == _H_TAG:
            if c == _OPEN_TAG[self._match]:
                self._match += 1
                if self._match == len(_OPEN_TAG):
                    self._held = [*self._ws, _OPEN_TAG]
                    self._ws = []
                    self._state = _H_HEAD
                return True
            self._out.text("".join(self._ws) + _OPEN_TAG[: self._match])
            self._ws = []
            self._skip_ws = False
            self._state = _H_TEXT
            return False
        if state == _H_HEAD:
            if c in _WS:
                self._held.append(c)
                return True
            if c == "{":
                self._held.append(c)
                self._call = _CallObject(self._out)
                self._state = _H_CALL
                return True
            return self._not_a_call()
        if state == _H_CALL:
            return self._call_char(c)
        if state == _H_CLOSING:
            if c == _CLOSE_TAG[self._match]:
                self._match += 1
                if self._match == len(_CLOSE_TAG):
                    assert self._call is not None
                    self._call.finish()
                    self._call = None
                    self._state = _H_TEXT
                    self._skip_ws = True
                return True
            self._stray_tag()
            self._state = _H_CALL
            return False
        if state == _H_AFTER:
            if c == _CLOSE_TAG[self._match]:
                self._match += 1
                if self._match == len(_CLOSE_TAG):
                    self._state = _H_TEXT
                    self._skip_ws = True
                return True
            if self._match == 0 and c in _WS:
                return True
            # no closing tag: what follows is read as outside any block
            if self._match == 1:  # a "<" that may open the next block
                self._state = _H_TAG
                return False
            self._out.text(_CLOSE_TAG[: self._match])  # "</...": no "<tool_call>" in it
            self._skip_ws = self._match == 0
            self._state = _H_TEXT
            return False
        # _H_BLOCK: everything up to the closing tag is content, as it comes
        self._out.text(c)
        if c == _CLOSE_TAG[self._match]:
            self._match += 1
            if self._match == len(_CLOSE_TAG):
                self._state = _H_TEXT
        else:
            self._match = 1 if c == "<" else 0
        return True

    def _call_char(self, c: str) -> bool:
        call = self._call
        assert call is not None
        if c == "<" and call.status == _CALL and not call.in_string:
            self._state = _H_CLOSING
            self._match = 1
            return True
        pending = call.status == _PENDING
        consumed = call.step(c)
        if call.status == _NOT_CALL:
            return self._not_a_call()
        if pending:
            if call.status == _PENDING:
                self._held.append(c)
            else:
                self._held = []
        if call.status == _DONE:
            self._call = None
            self._state = _H_AFTER
            self._match = 0
        return consumed

    def _stray_tag(self) -> None:
        """A partial "</tool_call>" inside a call that was not one: the call's text."""
        assert self._call is not None
        for ch in _CLOSE_TAG[: self._match]:  # no quote, brace or comma: it cannot end it
            self._call.step(ch)

    def _not_a_call(self) -> bool:
        self._out.text("".join(self._held))
        self._held = []
        self._call = None
        self._state = _H_BLOCK
        self._match = 0
        return False  # the character that decided it is the block's text too


# _Sequence states
_S_LEAD = 0  # before the first object (json) or the array (required)
_S_ITEMS = 1  # before an object: whitespace, separators
_S_OBJECT = 2  # inside an object
_S_END = 3  # after the array (required)
_S_TEXT = 4  # content to the end


class _Sequence:
    """`json` (objects, `;` or whitespace between) and `required` (an array of objects)."""

    def __init__(self, out: _Out, array: bool) -> None:
        self._out = out
        self._array = array
        self._separator = "," if array else ";"
        self._state = _S_LEAD
        self._held: list[str] = []  # undecided text: since the start, or since an object's {
        self._marker = 0  # characters of "<|python_tag|>" matched
        self._call: _CallObject | None = None
        self._called = False

    def run(self, text: str) -> None:
        i, n = 0, len(text)
        while i < n:
            if self._state == _S_TEXT:
                self._out.text(text[i:])
                return
            if self._state == _S_OBJECT and self._call is not None:
                j = self._call.plain_run(text, i)
                if j > i:
                    if self._call.status == _PENDING:
                        self._held.append(text[i:j])
                    i = j
                    continue
            if self._step(text[i]):
                i += 1

    def finish(self) -> None:
        if self._call is not None and self._call.status == _CALL:
            self._call.finish()
        elif not self._unfinished_call():
            self._out.text("".join(self._held))
        self._held, self._call = [], None
        self._state = _S_TEXT

    def _unfinished_call(self) -> bool:
        """Whether the held text, cut short, is a call that never got its name: inside
        `required`'s array (the grammar allows nothing but calls there), or an object
        after calls. Dropped: it is neither a call nor the model's prose."""
        if self._array:
            return self._state in (_S_ITEMS, _S_OBJECT)
        return self._called and self._state == _S_OBJECT

    def _step(self, c: str) -> bool:
        state = self._state
        if state == _S_LEAD:
            return self._lead(c)
        if state == _S_ITEMS:
            if c in _WS or c == self._separator:
                if not self._called:  # before the first call, kept in case none comes
                    self._held.append(c)
                return True
            if c == "{":
                return self._object()
            if c == "]" and self._array:
                if not self._called:  # "[]": no call, so it was content
                    self._held.append(c)
                    self._to_text()
                    return True
                self._state = _S_END
                return True
            return self._to_text()
        if state == _S_OBJECT:
            call = self._call
            assert call is not None
            pending = call.status == _PENDING
            consumed = call.step(c)
            if call.status == _NOT_CALL:
                return self._to_text()
            if pending:
                if call.status == _PENDING:
                    self._held.append(c)
                else:
                    self._held = []
                    self._called = True
            if call.status == _DONE:
                self._call = None
                self._state = _S_ITEMS
            return consumed
        # _S_END: the array's trailing whitespace is dropped, anything else is content
        return True if c in _WS else self._to_text()

    def _lead(self, c: str) -> bool:
        if self._array:
            if c in _WS or c == "[":
                self._held.append(c)
                if c == "[":
                    self._state = _S_ITEMS
                return True
            return self._to_text()
        m = self._marker
        if 0 < m < len(_PYTHON_TAG):  # inside the marker
            if c != _PYTHON_TAG[m]:
                return self._to_text()
            self._held.append(c)
            self._marker += 1
            return True
        if c in _WS:
            self._held.append(c)
            return True
        if c == "{":
            return self._object()
        if m == 0 and c == "<":
            self._held.append(c)
            self._marker = 1
            return True
        return self._to_text()

    def _object(self) -> bool:
        self._held.append("{")
        self._call = _CallObject(self._out)
        self._state = _S_OBJECT
        return True

    def _to_text(self) -> bool:
        """No (more) calls: the held text and the rest of the output are content."""
        self._out.text("".join(self._held))
        self._held = []
        self._call = None
        self._state = _S_TEXT
        return False


class _Named:
    """The whole output is the arguments of the one function the request forced."""

    def __init__(self, out: _Out, name: str) -> None:
        self._out = out
        self._name = name
        self._index: int | None = None
        self._sent = False

    def run(self, text: str) -> None:
        if self._index is None:
            self._index = self._out.start_call(self._name)
        if text:
            self._out.arguments(self._index, text)
            self._sent = True

    def finish(self) -> None:
        self.run("")
        if not self._sent:
            assert self._index is not None
            self._out.arguments(self._index, "{}")
            self._sent = True


class ToolCallParser:
    """One choice's output, delta by delta: what to send as content and as tool calls."""

    def __init__(self, mode: ToolMode, function_name: str | None = None) -> None:
        self._out = _Out()
        self._reader: _Reader
        if mode == "named":
            if not function_name:
                raise ValueError('tool mode "named" needs the function_name')
            self._reader = _Named(self._out, function_name)
        elif mode == "hermes":
            self._reader = _Hermes(self._out)
        elif mode in ("json", "required"):
            self._reader = _Sequence(self._out, array=mode == "required")
        else:
            raise ValueError(f"unknown tool mode {mode!r}; one of {TOOL_MODES}")

    def feed(self, text: str) -> Parsed:
        """The next text delta of the model's output: what to send for it now."""
        self._reader.run(text)
        return self._out.take()

    def finish(self) -> Parsed:
        """The output ended (or was cut short): send what was held back."""
        self._reader.finish()
        return self._out.take()

    @property
    def called(self) -> bool:
        """Whether a call was sent so far (finish_reason "tool_calls")."""
        return self._out.calls > 0


def parse_tool_calls(
    mode: ToolMode, text: str, function_name: str | None = None
) -> tuple[str | None, list[ToolCall]]:
    """Non-streaming: the whole output -> (content or None, calls).

    The streaming parser fed `text` at once, its deltas merged, so streamed and
    non-streamed responses always agree. content is None when it is empty or whitespace
    and there are calls; otherwise it is every piece of content, unstripped.
    """
    parser = ToolCallParser(mode, function_name)
    content: list[str] = []
    ids: list[str] = []
    names: list[str] = []
    arguments: list[list[str]] = []
    for parsed in (parser.feed(text), parser.finish()):
        content.append(parsed.content)
        for delta in parsed.calls:
            if delta.id is not None:  # a call's first delta: the calls come in index order
                ids.append(delta.id)
                names.append(delta.name or "")
                arguments.append([])
            arguments[delta.index].append(delta.arguments)
    calls = [
        ToolCall(id_, name, "".join(pieces))
        for id_, name, pieces in zip(ids, names, arguments, strict=True)
    ]
    joined = "".join(content)
    if calls and not joined.strip():
        return None, calls
    return joined, calls


def tool_format(parser: str, chat_template: str | None) -> Literal["hermes", "json"] | None:
    """The format `tool_choice: "auto"` parses calls from: the configured one
    (`ClusterConfig.tool_call_parser`), or with "auto" the one the chat template writes
    calls in: <tool_call> tags (Qwen 2.5, Hermes) -> "hermes"; Llama 3.x's <|python_tag|>
    -> "json". None: no format known ("none", or a template that shows none); auto is
    then a 400 and required and named functions still work (the grammar writes them)."""
    if parser == "hermes":
        return "hermes"
    if parser == "json":
        return "json"
    if parser == "none" or not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    return "json" if "<|python_tag|>" in chat_template else None
