"""Tool calls read out of generated text (router/tool_calls.py), streamed and whole.

Every text here is checked for the invariant the router relies on (`check`): fed whole,
one character at a time and in random chunks (with empty feeds between), the streamed
content concatenates to `parse_tool_calls`'s content, each call's argument pieces to its
arguments, and each call's id and name come once, on its first delta. Then the expected
content and calls: for a complete call, its arguments parse (`json.loads`) to what the
model wrote. Hypothesis fuzzes the same invariant over texts made of the markup's pieces,
and the round trip over generated arguments. Plain Python, well under 10 s.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router.tool_calls import (
    TOOL_MODES,
    Parsed,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolMode,
    parse_tool_calls,
    tool_format,
)

ID = re.compile(r"call_[0-9a-f]{24}")
WEATHER = {"city": "Paris", "unit": "celsius"}
# braces, brackets, commas and escaped quotes inside strings; unicode; nesting
TRICKY = {
    "code": "if (a) { b[0] = \"}\"; } else { c = '{'; }",
    "path": "C:\\temp\\new",
    "list": [[1, {"x": "]", "y": None}], [], {}],
    "text": "Zürich, 東京, 😀, tab\there, newline\nthere",
    "n": -1.5e3,
    "ok": True,
}


def hermes_block(name: str, args: Any, key: str = "arguments", **dumps: Any) -> str:
    body = json.dumps({"name": name, key: args}, **dumps)
    return f"<tool_call>\n{body}\n</tool_call>"


def stream(
    mode: ToolMode, chunks: list[str], function_name: str | None = None
) -> tuple[str, list[ToolCall]]:
    """Feed `chunks`, check every delta's shape, and merge them as a client does."""
    parser = ToolCallParser(mode, function_name)
    content: list[str] = []
    calls: list[tuple[str, str, list[str]]] = []
    outputs = [parser.feed(chunk) for chunk in chunks]
    outputs.append(parser.finish())
    for parsed in outputs:
        assert isinstance(parsed, Parsed)
        content.append(parsed.content)
        seen = [d.index for d in parsed.calls]
        assert seen == sorted(set(seen)), "one delta per call and feed, in order"
        for delta in parsed.calls:
            assert isinstance(delta, ToolCallDelta)
            if delta.index == len(calls):  # a new call: its first delta
                assert delta.id is not None and ID.fullmatch(delta.id), delta
                assert delta.name is not None, delta
                calls.append((delta.id, delta.name, [delta.arguments]))
            else:
                assert delta.index < len(calls), "calls are numbered in order"
                assert delta.id is None and delta.name is None, "id and name come once"
                calls[delta.index][2].append(delta.arguments)
    assert parser.called == bool(calls)
    assert len({id_ for id_, _, _ in calls}) == len(calls), "ids differ"
    return "".join(content), [ToolCall(i, n, "".join(a)) for i, n, a in calls]


def splits(text: str, seeds: int = 4) -> Iterator[list[str]]:
    yield [text]
    yield list(text)
    for seed in range(seeds):
        rng = random.Random(seed)
        chunks: list[str] = []
        i = 0
        while i < len(text):
            if rng.random() < 0.1:
                chunks.append("")  # an empty delta (a token that decodes to nothing yet)
            n = rng.randint(1, 8)
            chunks.append(text[i : i + n])
            i += n
        yield chunks


def check(
    mode: ToolMode, text: str, function_name: str | None = None, seeds: int = 4
) -> tuple[str | None, list[ToolCall]]:
    """`parse_tool_calls`'s result, after checking that every split streams the same."""
    content, calls = parse_tool_calls(mode, text, function_name)
    assert content is not None or calls, "content is None only beside calls"
    for chunks in splits(text, seeds):
        streamed, streamed_calls = stream(mode, chunks, function_name)
        if content is None:
            assert not streamed.strip(), (chunks, streamed)
        else:
            assert streamed == content, chunks
        assert [(c.name, c.arguments) for c in streamed_calls] == [
            (c.name, c.arguments) for c in calls
        ], chunks
    return content, calls


def assert_calls(calls: list[ToolCall], expected: list[tuple[str, Any]]) -> None:
    """Complete calls: names, and arguments that parse to what was written."""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert all(ID.fullmatch(c.id) for c in calls)


# -- hermes ---------------------------------------------------------------------------


def test_hermes_one_call() -> None:
    content, calls = check("hermes", hermes_block("get_weather", WEATHER))
    assert content is None
    assert_calls(calls, [("get_weather", WEATHER)])
    assert calls[0].arguments == json.dumps(WEATHER)  # the raw text, as written


def test_hermes_several_calls() -> None:
    text = "\n".join(hermes_block(f"f{i}", {"i": i}) for i in range(3)) + "\n"
    content, calls = check("hermes", text)
    assert content is None
    assert_calls(calls, [(f"f{i}", {"i": i}) for i in range(3)])
    assert len({c.id for c in calls}) == 3


def test_hermes_content_before_and_after() -> None:
    block = hermes_block("get_weather", WEATHER)
    content, calls = check("hermes", f"Let me look that up.\n\n{block}\n\nDone, see above.")
    assert content == "Let me look that up.Done, see above."
    assert_calls(calls, [("get_weather", WEATHER)])
    # whitespace not next to a tag is content, verbatim
    assert check("hermes", "  two  spaces \n")[0] == "  two  spaces \n"


def test_hermes_content_only() -> None:
    text = "No tools needed: 1 < 2 and <b>bold</b>, <tool_calls> is not the tag."
    assert check("hermes", text) == (text, [])
    assert check("hermes", "") == ("", [])
    assert check("hermes", " \n ") == (" \n ", [])


@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("indent", [None, 2])
def test_hermes_tricky_arguments(ensure_ascii: bool, indent: int | None) -> None:
    text = hermes_block("run", TRICKY, ensure_ascii=ensure_ascii, indent=indent)
    content, calls = check("hermes", text)
    assert content is None
    assert_calls(calls, [("run", TRICKY)])
    # from its first character to its last: no whitespace around it
    assert calls[0].arguments == calls[0].arguments.strip()


def test_hermes_tag_inside_a_string_is_text() -> None:
    args = {"doc": "write </tool_call> and <tool_call> literally"}
    content, calls = check("hermes", hermes_block("echo", args))
    assert content is None
    assert_calls(calls, [("echo", args)])


def test_hermes_string_arguments_are_decoded() -> None:
    text = hermes_block("f", json.dumps({"a": [1, "x"]}))
    content, calls = check("hermes", text)
    assert content is None
    assert calls[0].arguments == '{"a": [1, "x"]}'


def test_hermes_missing_arguments_and_other_keys() -> None:
    text = (
        '<tool_call>{"name": "now"}</tool_call>'
        '<tool_call>{"name": "g", "id": 7, "extra": {"arguments": 1}, "parameters": {"p": 1},'
        ' "arguments": {"ignored": true}}</tool_call>'
    )
    content, calls = check("hermes", text)
    assert content is None
    # "parameters" is a synonym; the first arguments value wins; other keys are ignored
    assert_calls(calls, [("now", {}), ("g", {"p": 1})])
    assert calls[0].arguments == "{}"


def test_hermes_type_function_prefix() -> None:
    text = '<tool_call>{"type": "function", "name": "f", "arguments": {"a": 1}}</tool_call>'
    content, calls = check("hermes", text)
    assert content is None
    assert_calls(calls, [("f", {"a": 1})])


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"foo": 1, "name": "f"}</tool_call>',
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        '<tool_call>{"type": "other", "name": "f"}</tool_call>',
        '<tool_call>{"type": "function", "function": {"name": "f"}}</tool_call>',
        "<tool_call>{}</tool_call>",
        "<tool_call> not json </tool_call>",
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"name" "f"}</tool_call>',
        '<tool_call>{"na</tool_call>',  # the tag inside an unclosed key: held, then content
    ],
)
def test_hermes_non_call_block_is_content(block: str) -> None:
    text = f"Before \n{block}\n after"
    content, calls = check("hermes", text)
    assert calls == []
    assert content == text  # the whole block, and the whitespace around it


def test_hermes_non_call_beside_calls() -> None:
    call = hermes_block("f", {"a": 1})
    content, calls = check("hermes", f'{call}\n<tool_call>{{"x": 1}}</tool_call>\n{call}')
    assert content == '<tool_call>{"x": 1}</tool_call>'
    assert_calls(calls, [("f", {"a": 1}), ("f", {"a": 1})])


def test_hermes_unclosed_and_partial_tags() -> None:
    # a call's closing tag is optional: the object's end ends it
    content, calls = check("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert content is None
    assert_calls(calls, [("f", {"a": 1})])
    content, calls = check(
        "hermes", '<tool_call>{"name": "f", "arguments": {}}<tool_call>{"name": "g"} tail'
    )
    assert content == "tail"
    assert_calls(calls, [("f", {}), ("g", {})])
    # a tag that never became a call is content
    assert check("hermes", "Hi <tool_call>") == ("Hi <tool_call>", [])
    assert check("hermes", "Hi <tool_call>\n") == ("Hi <tool_call>\n", [])
    assert check("hermes", "Hi <tool_ca") == ("Hi <tool_ca", [])
    assert check("hermes", "Hi <tool_call>{") == ("Hi <tool_call>{", [])
    assert check("hermes", 'Hi <tool_call>{"name": "f') == ('Hi <tool_call>{"name": "f', [])
    # a closing tag cut after a complete call is markup
    content, calls = check("hermes", '<tool_call>{"name": "f", "arguments": {}}\n</tool_')
    assert content is None
    assert_calls(calls, [("f", {})])


def test_hermes_closing_tag_ends_a_malformed_call() -> None:
    # a model that drops the object's closing brace: the tag ends the call
    text = '<tool_call>{"name": "f", "arguments": {"a": [1, 2]}</tool_call>\nok'
    content, calls = check("hermes", text)
    assert content == "ok"
    assert_calls(calls, [("f", {"a": [1, 2]})])
    text = '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>'
    content, calls = check("hermes", text)
    assert content is None
    assert calls[0].arguments == '{"a": 1'  # as received, as a cut call


def test_hermes_truncated() -> None:
    content, calls = check("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"q": "Par')
    assert content == "Sure."
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"q": "Par')]
    # the name complete, no arguments yet: a call, with "{}"
    for cut in ['{"name": "f"', '{"name": "f", "argu', '{"name": "f", "arguments": ']:
        content, calls = check("hermes", "<tool_call>" + cut)
        assert content is None
        assert [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    # string arguments cut short: decoded as far as they go (a cut escape dropped)
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": \\"caf\\u00e9 \\ud83d\\ude0'
    content, calls = check("hermes", text)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": "café')]


def test_hermes_holds_back_only_what_could_be_a_tag() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed("Hello <b") == Parsed("Hello <b")
    assert parser.feed("> there\n<tool") == Parsed("> there")  # "\n<tool" held
    assert parser.feed("box>") == Parsed("\n<toolbox>")
    assert parser.feed(" <tool_call>{") == Parsed()
    assert not parser.called
    first = parser.feed('"name": "f"')  # the name complete: the call's first delta
    assert first.content == ""
    assert len(first.calls) == 1
    assert (first.calls[0].index, first.calls[0].name, first.calls[0].arguments) == (0, "f", "")
    assert parser.called
    piece = parser.feed(', "arguments": {"a": ')  # the trailing space is held
    assert piece == Parsed(calls=[ToolCallDelta(0, None, None, '{"a":')])
    assert parser.feed("1} ") == Parsed(calls=[ToolCallDelta(0, None, None, " 1}")])
    assert parser.feed("}</tool_call>") == Parsed()
    assert parser.finish() == Parsed()


# -- json (Llama 3.x) -------------------------------------------------------------------


def test_json_one_call() -> None:
    text = json.dumps({"name": "get_weather", "parameters": WEATHER})
    content, calls = check("json", text)
    assert content is None
    assert_calls(calls, [("get_weather", WEATHER)])


@pytest.mark.parametrize("lead", ["<|python_tag|>", "  <|python_tag|>\n", "\n", ""])
def test_json_python_tag_and_leading_whitespace(lead: str) -> None:
    text = lead + json.dumps({"name": "f", "arguments": TRICKY}, ensure_ascii=False)
    content, calls = check("json", text)
    assert content is None
    assert_calls(calls, [("f", TRICKY)])


@pytest.mark.parametrize("separator", ["; ", ";", "\n", " ;\n "])
def test_json_several_calls(separator: str) -> None:
    objects = [{"name": f"f{i}", "parameters": {"i": i}} for i in range(3)]
    text = separator.join(json.dumps(o) for o in objects) + separator
    content, calls = check("json", text)
    assert content is None
    assert_calls(calls, [(f"f{i}", {"i": i}) for i in range(3)])


def test_json_type_function_string_and_missing_arguments() -> None:
    text = (
        '{"type": "function", "name": "f", "parameters": {"a": 1}}; '
        '{"name": "g", "parameters": "{\\"b\\": [2]}"}; {"name": "h"}'
    )
    content, calls = check("json", text)
    assert content is None
    assert_calls(calls, [("f", {"a": 1}), ("g", {"b": [2]}), ("h", {})])


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        '  Sure: {"name": "f"}',  # not at the start: content
        '{"answer": 42, "name": "f"}',
        '{"name": ["f"]}',
        '<|python_tag|>brave_search.call(query="paris")',
        "<|python_tag|> plain",
        "<|python_ta",
        "<b>bold</b>",
        '{"name": "f',  # cut before the name is complete
        "{",
        "   ",
        "",
    ],
)
def test_json_content(text: str) -> None:
    assert check("json", text) == (text, [])


def test_json_text_after_calls() -> None:
    call = json.dumps({"name": "f", "parameters": {}})
    content, calls = check("json", f"{call};\n Thanks!")
    assert content == "Thanks!"
    assert_calls(calls, [("f", {})])
    content, calls = check("json", f'{call}; {{"x": 1}}; {call}')
    assert content == f'{{"x": 1}}; {call}'  # a non-call object: it and the rest are content
    assert_calls(calls, [("f", {})])


def test_json_truncated() -> None:
    content, calls = check("json", '<|python_tag|>{"name": "f", "parameters": {"a": [1, 2')
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": [1, 2')]
    # a second object cut before its name is an unfinished call, not content
    content, calls = check("json", '{"name": "f", "parameters": {}}; {"na')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", "{}")]


# -- required (the server's grammar) ----------------------------------------------------


def test_required_calls() -> None:
    items = [{"name": "f", "arguments": WEATHER}, {"name": "g", "arguments": TRICKY}]
    styles: list[dict[str, Any]] = [
        {},
        {"indent": 2},
        {"ensure_ascii": False, "separators": (",", ":")},
    ]
    for style in styles:
        content, calls = check("required", json.dumps(items, **style))
        assert content is None
        assert_calls(calls, [("f", WEATHER), ("g", TRICKY)])


def test_required_string_missing_and_typed() -> None:
    text = (
        '[{"name": "f", "arguments": "{\\"a\\": 1}"}, {"name": "g"},'
        ' {"type": "function", "name": "h", "arguments": {}}]'
    )
    content, calls = check("required", text)
    assert content is None
    assert_calls(calls, [("f", {"a": 1}), ("g", {}), ("h", {})])


def test_required_truncated_and_malformed() -> None:
    content, calls = check("required", '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "ar')
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", "{}")]
    # an object never closed ends at the array's end
    content, calls = check("required", '[{"name": "f", "arguments": {"a": 1}]')
    assert content is None
    assert_calls(calls, [("f", {"a": 1})])
    for text in ["[]", "no array", '{"name": "f"}', '[{"x": 1}]', ""]:
        assert check("required", text) == (text, [])
    # cut short inside the array before a call's name: an unfinished call, not content
    content, calls = check("required", '[{"name": "f", "arguments": {}}, {"')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    for text in ["[", '[{"na', "[ "]:
        assert check("required", text) == ("", [])


# -- named (a forced function) ----------------------------------------------------------


def test_named() -> None:
    text = json.dumps(TRICKY, indent=1)
    content, calls = check("named", text, "run")
    assert content is None
    assert_calls(calls, [("run", TRICKY)])
    assert calls[0].arguments == text  # exactly the output
    content, calls = check("named", "", "run")
    assert (content, [(c.name, c.arguments) for c in calls]) == (None, [("run", "{}")])


def test_named_first_feed_sends_the_call() -> None:
    parser = ToolCallParser("named", "run")
    first = parser.feed("")
    assert first.content == "" and len(first.calls) == 1
    delta = first.calls[0]
    assert (delta.index, delta.name, delta.arguments) == (0, "run", "")
    assert delta.id is not None and ID.fullmatch(delta.id)
    assert parser.called
    assert parser.feed('{"a"') == Parsed(calls=[ToolCallDelta(0, None, None, '{"a"')])
    assert parser.feed(": 1}") == Parsed(calls=[ToolCallDelta(0, None, None, ": 1}")])
    assert parser.finish() == Parsed()


def test_bad_modes() -> None:
    with pytest.raises(ValueError):
        ToolCallParser("named")
    with pytest.raises(ValueError):
        parse_tool_calls("named", "{}")
    with pytest.raises(ValueError):
        ToolCallParser("xml")  # type: ignore[arg-type]
    assert ToolCallParser("hermes", "ignored").feed("x") == Parsed("x")
    assert set(TOOL_MODES) == {"hermes", "json", "required", "named"}


def test_long_arguments_stream_in_pieces() -> None:
    """A long argument streams as it comes: each feed sends its own text, nothing more."""
    args = {"content": 'line of a file with {braces} and "quotes"\n' * 2000}
    text = hermes_block("write", args)
    parser = ToolCallParser("hermes")
    sent = 0
    for i in range(0, len(text), 7):
        for delta in parser.feed(text[i : i + 7]).calls:
            assert len(delta.arguments) <= 7 + 1  # and a space held from the feed before
            sent += len(delta.arguments)
    parser.finish()
    assert sent == len(json.dumps(args))


# -- fuzzing ----------------------------------------------------------------------------

PIECES = [
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "<|python_tag|>", "<", ">",
    "{", "}", "[", "]", ":", ",", ";", " ", "\n", '"', "\\", '\\"', "\\u00e9", "\\ud83d",
    '"name"', '"arguments"', '"parameters"', '"type"', '"function"', '"f"', '"x"',
    "1", "null", "a", "é", "😀",
]  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["hermes", "json", "required"]),
    pieces=st.lists(st.sampled_from(PIECES), max_size=40),
)
def test_fuzz_any_split_agrees(mode: ToolMode, pieces: list[str]) -> None:
    """Markup in any order: nothing raises, every split agrees, no text is lost (but
    what `required` drops on purpose: an array cut short before a call's name, which
    is an unfinished call, not content)."""
    text = "".join(pieces)
    content, calls = check(mode, text, seeds=2)
    if not calls:
        unfinished = mode == "required" and text.lstrip().startswith("[")
        assert content == text or (unfinished and content == ""), (content, text)
    content, calls = check("named", text, "f", seeds=1)
    assert content is None and calls[0].arguments == (text or "{}")


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    args=st.lists(st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3), max_size=3),
    ensure_ascii=st.booleans(),
    indent=st.sampled_from([None, 0, 2]),
    as_string=st.booleans(),
)
def test_fuzz_arguments_round_trip(
    args: list[dict[str, Any]], ensure_ascii: bool, indent: int | None, as_string: bool
) -> None:
    """What the model wrote is what the client parses, in every mode."""

    def value(a: dict[str, Any]) -> Any:
        return json.dumps(a) if as_string else a

    def dumps(v: Any) -> str:
        return json.dumps(v, ensure_ascii=ensure_ascii, indent=indent)

    names = [f"fn_{i}" for i in range(len(args))]
    expected = list(zip(names, args, strict=True))
    texts: dict[ToolMode, str] = {
        "hermes": "\n".join(
            f"<tool_call>\n{dumps({'name': n, 'arguments': value(a)})}\n</tool_call>"
            for n, a in expected
        ),
        "json": "; ".join(dumps({"name": n, "parameters": value(a)}) for n, a in expected),
        "required": dumps([{"name": n, "arguments": value(a)} for n, a in expected]),
    }
    for mode, text in texts.items():
        content, calls = check(mode, text, seeds=1)
        if mode == "required" and not args:
            assert (content, calls) == (text, [])  # "[]": no call
            continue
        if not args:
            assert calls == []
            continue
        assert content is None, (mode, text)
        assert_calls(calls, expected)
    for a in args:
        content, calls = check("named", dumps(a), "f", seeds=1)
        assert_calls(calls, [("f", a)])


def test_the_format_comes_from_the_configuration_or_the_template() -> None:
    from pdserve.demo.model import CHAT_TEMPLATE

    assert tool_format("auto", CHAT_TEMPLATE) == "hermes"  # the demo's: <tool_call> tags
    assert tool_format("auto", "{{ '<|python_tag|>' }}{{ tools | tojson }}") == "json"
    assert tool_format("auto", "{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_format("auto", None) is None
    assert tool_format("json", CHAT_TEMPLATE) == "json"  # the operator's word wins
    assert tool_format("none", CHAT_TEMPLATE) is None
