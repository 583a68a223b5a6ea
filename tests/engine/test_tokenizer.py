"""The tokenizer must agree with `transformers` byte for byte; streamed text must add up.

`transformers.AutoTokenizer` on the demo model folder is the reference for encoding and
chat templates. `IncrementalDecoder` deltas must concatenate to `decode(all ids)`, also
when a multi-byte UTF-8 character is split across tokens.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.errors import InvalidRequestError
from pdserve.common.tokenizer import IncrementalDecoder, Tokenizer

ENCODE_TEXTS = [
    "The river winds across the valley.",
    "café ☕ naïve",
    "a   b\n\n\t  c  \r\n  ",
    "",
    "漢字 🙂👍🏽 Zürich, 東京",
]
# Texts whose byte-level tokens split multi-byte characters (CJK, emoji, accents).
DECODE_TEXTS = [
    "漢字",
    "🙂👍🏽 emoji 🎉",
    "café naïve Zürich, ñandú",
    "mixed 東京 and ascii ☕ text",
    "  spaces\tand\nnewlines  ",
]
CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "user": [{"role": "user", "content": "Hi there"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a river."},
    ],
    "multi-turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello ☕"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me about 漢字."},
    ],
}


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> Tokenizer:
    return Tokenizer(demo_model_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(demo_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


def _copy_tokenizer(demo_model_dir: Path, out: Path, **config_updates: Any) -> Path:
    """The demo tokenizer files in `out`, with tokenizer_config.json keys replaced (None drops)."""
    out.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copyfile(demo_model_dir / name, out / name)
    config = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    config.update(config_updates)
    config = {k: v for k, v in config.items() if v is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _hf_chat_ids(hf_tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _stream(tokenizer: Tokenizer, groups: Sequence[Sequence[int]], skip: bool = True) -> str:
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
    last = len(groups) - 1
    return "".join(decoder.step(group, final=i == last) for i, group in enumerate(groups))


def _random_groups(ids: list[int], rng: random.Random) -> list[list[int]]:
    groups, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        groups.append(ids[i : i + n])
        i += n
    return groups


# -- encoding and chat templates ------------------------------------------------------


@pytest.mark.parametrize("text", ENCODE_TEXTS)
def test_encode_equals_transformers(tokenizer: Tokenizer, hf_tokenizer: Any, text: str) -> None:
    assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"]
    assert (
        tokenizer.encode(text, add_special_tokens=False)
        == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_encode_chat_equals_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, name: str
) -> None:
    messages = CONVERSATIONS[name]
    ids = tokenizer.encode_chat(messages)
    assert ids == _hf_chat_ids(hf_tokenizer, messages)
    assert ids.count(tokenizer.token_to_id("<s>")) == 1  # bos comes from the template only


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather <now> & 'later', in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "time"}},
]
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Köln?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "a",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            },
            {
                "id": "b",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Köln", "days": 2}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "b", "content": "rain"},
]


@pytest.mark.parametrize("turns", [2, 3, 5])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_tools_and_calls_render_like_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, turns: int, tools: Any
) -> None:
    """`tools` and a history of calls and results, through the template as
    `apply_chat_template(tools=...)` renders them: its `tojson` (no HTML escaping, so
    "<", "&" and "'" stay as written), the same ids."""
    messages = TOOL_TURNS[:turns]
    text = tokenizer.apply_chat_template(messages, tools=tools)
    want = hf_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert text == want
    if tools:
        assert "Weather <now> & 'later', in °C" in text and "<tool_call>" in text
    assert tokenizer.encode_chat(messages, tools=tools) == hf_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_no_chat_template_is_an_invalid_request(demo_model_dir: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer(_copy_tokenizer(demo_model_dir, tmp_path / "tok", chat_template=None))
    with pytest.raises(InvalidRequestError, match="chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS["user"])
    with pytest.raises(InvalidRequestError):
        tokenizer.encode_chat(CONVERSATIONS["user"])


def test_template_rejection_is_an_invalid_request(demo_model_dir: Path, tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    folder = _copy_tokenizer(demo_model_dir, tmp_path / "tok", chat_template=template)
    with pytest.raises(InvalidRequestError, match="user first"):
        Tokenizer(folder).apply_chat_template(CONVERSATIONS["system"])


def test_chat_template_jinja_file_is_read(demo_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    saved = tmp_path / "saved"
    hf_tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    hf_tokenizer.save_pretrained(saved)
    assert (saved / "chat_template.jinja").is_file()
    messages = CONVERSATIONS["multi-turn"]
    assert Tokenizer(saved).encode_chat(messages) == _hf_chat_ids(hf_tokenizer, messages)


# -- incremental decoding -------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
@pytest.mark.parametrize("text", DECODE_TEXTS)
def test_incremental_decode_of_text_ids(tokenizer: Tokenizer, text: str, skip: bool) -> None:
    ids = tokenizer.encode(text)
    if not text.isascii():  # the case under test: some token is a piece of a character
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    full = tokenizer.decode(ids, skip)
    assert _stream(tokenizer, [[i] for i in ids], skip) == full
    rng = random.Random(text)
    for _ in range(5):
        assert _stream(tokenizer, _random_groups(ids, rng), skip) == full


def test_split_characters_are_held_back_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("漢字", add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.step([i]) for i in ids]
    assert "".join(deltas) == "漢字"
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) == 2  # one delta per completed character


def test_chat_ids_with_special_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode_chat(CONVERSATIONS["multi-turn"])
    for skip in (True, False):
        assert _stream(tokenizer, [[i] for i in ids], skip) == tokenizer.decode(ids, skip)


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_incremental_decode_of_random_ids(tokenizer: Tokenizer, skip: bool) -> None:
    """Random ids break UTF-8 sequences everywhere, including mid-stream lone bytes.

    NOTE: each sequence ends with "." so a trailing incomplete character is terminated;
    a stream ending mid-character is `test_stream_ending_mid_character`.
    """
    rng = random.Random(0)
    (dot,) = tokenizer.encode(".", add_special_tokens=False)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))] + [dot]
        full = tokenizer.decode(ids, skip)
        assert _stream(tokenizer, [[i] for i in ids], skip) == full, ids
        assert _stream(tokenizer, _random_groups(ids, rng), skip) == full, ids


def test_stream_ending_mid_character_is_a_prefix(tokenizer: Tokenizer) -> None:
    """What is emitted is always a prefix of the full text; only the tail is held back."""
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        full = tokenizer.decode(ids)
        streamed = _stream(tokenizer, _random_groups(ids, rng))
        assert full.startswith(streamed), ids
        assert full[len(streamed) :].endswith("\ufffd") or streamed == full, ids


def test_stream_ending_mid_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("漢字", add_special_tokens=False)[:-1]
    full = tokenizer.decode(ids)
    assert full == "漢\ufffd"
    assert _stream(tokenizer, [[i] for i in ids]) == full
