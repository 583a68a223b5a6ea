"""Structured output in the engine: a random-weights model (whose free output is never
valid JSON) under a grammar returns output that `jsonschema` validates, greedy and
sampled; the first token of an imported request continues the grammar where the
prefill worker left it; unconstrained neighbours are unaffected; bad grammars fail."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from pdserve.benchmarks.structured_schemas import assorted_schemas
from pdserve.common.errors import InvalidRequestError
from pdserve.common.grammar import GrammarSpec
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.worker.kv_handoff import KVImportError

PROMPT = "Answer in JSON: "


@pytest.fixture(scope="module")
def llm(random_model_dir: Path) -> LLM:
    return LLM(random_model_dir, dtype="float32", max_model_len=512, max_num_seqs=64)


def test_free_output_is_not_json(llm: LLM) -> None:
    """The premise: without a grammar the random model's output does not parse."""
    out = llm.generate(PROMPT, SamplingParams(max_tokens=32, temperature=0.0))[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_assorted_schemas_validate(llm: LLM) -> None:
    """200 schemas (nested objects, arrays, enums, required fields, bounded numbers), one
    batch, sampled: every output is complete JSON the schema accepts, ended by the grammar."""
    schemas = assorted_schemas(200)
    params = [
        SamplingParams(max_tokens=256, seed=i, grammar=GrammarSpec.json_schema(s, strict=True))
        for i, s in enumerate(schemas)
    ]
    outs = llm.generate([PROMPT] * len(params), params)
    for schema, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == "stop", (out.text, schema)
        jsonschema.validate(json.loads(out.text), schema)
    assert llm.engine.grammars.misses <= 200


def test_greedy_regex_choice_and_json_object(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=64, temperature=0.0)
    regex = r"[a-z]{2,5}-[0-9]{3}"
    outs = llm.generate(
        [PROMPT] * 4,
        [
            SamplingParams(max_tokens=64, temperature=0.0, grammar=GrammarSpec("regex", regex)),
            SamplingParams(
                max_tokens=64, temperature=0.0, grammar=GrammarSpec.choice(["yes", "no", "maybe"])
            ),
            SamplingParams(max_tokens=128, seed=3, grammar=GrammarSpec("json_object")),
            greedy,
        ],
    )
    assert re.fullmatch(regex, outs[0].text), outs[0].text
    assert outs[1].text in ("yes", "no", "maybe")
    assert outs[2].text.startswith("{")
    if outs[2].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].text), dict)
    # A constrained neighbour changes nothing for an unconstrained request.
    assert outs[3].token_ids == llm.generate(PROMPT, greedy)[0].token_ids


def test_compiled_grammar_is_cached(llm: LLM) -> None:
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"k": {"enum": [1, 2]}}})
    grammars = llm.engine.grammars
    llm.generate(PROMPT, SamplingParams(max_tokens=32, seed=1, grammar=spec))
    hits = grammars.hits
    llm.generate(PROMPT, SamplingParams(max_tokens=32, seed=2, grammar=spec))
    assert grammars.hits == hits + 1


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("regex", "(a"),
        GrammarSpec("json_schema", '{"type": "nope"}'),
        GrammarSpec("json_schema", "[1]"),
        GrammarSpec("choice", "[]"),
        GrammarSpec("json_schema", '{"type": "string", "format": "weird"}', strict=True),
    ],
)
def test_invalid_grammars_are_refused(llm: LLM, spec: GrammarSpec) -> None:
    with pytest.raises(InvalidRequestError):
        spec.check()
    with pytest.raises(InvalidRequestError):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, grammar=spec))
    assert not llm.engine.has_unfinished


def test_first_token_from_prefill_continues_on_decode(random_model_dir: Path) -> None:
    """The disaggregated handoff on two engines: the prefill engine samples the first
    token under the grammar (the unconstrained first token is not a JSON start), the
    decode engine imports it and continues the grammar from there to valid JSON; a first
    token the grammar forbids is refused (the decode worker then prefills locally)."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
        "additionalProperties": False,
    }
    spec = GrammarSpec.json_schema(schema, strict=True)
    prefill = LLM(random_model_dir, dtype="float32", max_model_len=256)
    decode = LLM(random_model_dir, dtype="float32", max_model_len=256)
    free = prefill.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert not free.text.startswith("{")
    params = SamplingParams(max_tokens=64, temperature=0.0, grammar=spec)
    engine = prefill.engine
    first_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, grammar=spec)
    seq = engine.add_request("r", PROMPT, first_params, hold_kv=True)
    while engine.has_unfinished:
        engine.step()
    first = seq.output_token_ids[0]
    assert prefill.tokenizer.decode([first], True).startswith("{")
    export = engine.export_kv("r")
    payload = export.wait()
    with pytest.raises(KVImportError):
        decode.engine.add_prefilled_request(
            "bad", seq.prompt_token_ids, free.token_ids[0], params, payload
        )
    decode.engine.add_prefilled_request("r", seq.prompt_token_ids, first, params, payload)
    engine.release_kv("r")
    text = ""
    while decode.engine.has_unfinished:
        for out in decode.engine.step():
            if out.finished:
                text = out.text
    jsonschema.validate(json.loads(text), schema)
