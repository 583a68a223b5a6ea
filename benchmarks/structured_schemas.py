"""Assorted JSON schemas for structured-output tests and benchmarks.

Random but reproducible (one seed each): nested objects, arrays, enums, required and
optional fields, integers and numbers with bounds, strings with bounded lengths. Every
schema's output is bounded except numbers' fractions, so even a random-weights model
under the grammar finishes in a few dozen tokens: only the constraint can make its
output valid, which is what the tests check with `jsonschema`.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("alpha", "beta", "gamma", "delta", "red", "green", "x", "y_z", "id", "n")


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("string", "integer", "number", "boolean", "enum", "null"))
    if kind == "string":
        low = rng.randint(0, 2)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        bottom = round(rng.uniform(-10, 10), 2)
        return {"type": "number", "minimum": bottom, "maximum": round(bottom + 5, 2)}
    if kind == "enum":
        return {"enum": rng.sample(["a", "b", "on", "off", 1, 2, None, True], rng.randint(1, 4))}
    return {"type": kind}


def _node(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth > 0 and roll < 0.3:
        return object_schema(rng, depth - 1)
    if depth > 0 and roll < 0.5:
        return {
            "type": "array",
            "items": _node(rng, depth - 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    return _leaf(rng)


def object_schema(rng: random.Random, depth: int = 2) -> dict[str, Any]:
    """An object of 1 to 3 properties, some required, no others allowed."""
    names = rng.sample(_WORDS, rng.randint(1, 3))
    props = {name: _node(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def assorted_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """`count` object schemas, the same for the same seed."""
    rng = random.Random(seed)
    return [object_schema(rng, depth=rng.randint(0, 2)) for _ in range(count)]


def largest_schema() -> dict[str, Any]:
    """A wide, deep schema (about 12 KB of JSON): what a compile costs at the high end."""
    rng = random.Random(1234)
    return {
        "type": "object",
        "properties": {f"field_{i}": object_schema(rng, depth=3) for i in range(40)},
        "required": [f"field_{i}" for i in range(0, 40, 3)],
        "additionalProperties": False,
    }
