"""`pdserve up`'s flags, generated from the configuration's fields.

Every field of `ClusterConfig` (or of a subclass: `add_config_flags` takes the model) is
a flag `--field-name` whose type, choices, help and default come from the field, stated
there once. A field whose default is derived from others (or that the command line
defaults otherwise, `not_given`) is passed only when its flag is given. A few flags keep
older names (`FLAG_NAMES`); a few fields are set otherwise (`NOT_FLAGS`: from files,
from flags of their own, or secrets no command line may show).

Values: a Literal gives choices; `int`/`float`/`str` parse as such; a number that may be
None takes `off` (or `none`) for None; a dict or a nested model (resources, autoscaling,
placement weights) is JSON; a bool is a switch (`--enforce-eager`).
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

# Flags named otherwise than their field, kept for the command lines people have.
FLAG_NAMES = {
    "num_threads": "--threads",
    "replica_num_cpus": "--replica-cpus",
    "replica_num_gpus": "--replica-gpus",
}
# Fields that are not flags: several models and the model folder (`--model`, which takes
# a model's own fields too), files (`--api-keys-file`, `--routes-file`), TLS (the
# `--kv-tls-*` flags), and the cluster token (a secret: `ps` shows command lines).
NOT_FLAGS = frozenset(
    {"model", "models", "routes", "api_keys", "api_key_defaults", "kv_tls", "cluster_token"}
)
_OFF = ("off", "none")


class _NotGiven:
    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()  # a flag left out whose field has no plain default


def flag_name(field: str) -> str:
    return FLAG_NAMES.get(field, "--" + field.replace("_", "-"))


def flag_fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """The model's fields that are flags, by field name."""
    return {n: f for n, f in model.model_fields.items() if n not in NOT_FLAGS}


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    not_given: dict[str, str] | None = None,
) -> None:
    """A flag per field of `model` (module docstring). `not_given`: fields the command
    line defaults otherwise, by what the help says their default is."""
    not_given = not_given or {}
    for name, field in flag_fields(model).items():
        derived = field.default_factory is not None and field.default_factory not in (list, dict)
        plain = not derived and name not in not_given
        default = field.get_default(call_default_factory=True) if plain else NOT_GIVEN
        parser.add_argument(
            flag_name(name), dest=name, default=default, **_spec(field, not_given.get(name))
        )


def config_values(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The fields' values on the command line (a field with no plain default: only if
    its flag was given)."""
    given = vars(args)
    return {
        name: given[name]
        for name in flag_fields(model)
        if name in given and given[name] is not NOT_GIVEN
    }


def _spec(field: FieldInfo, default_text: str | None = None) -> dict[str, Any]:
    annotation, optional = _unwrap(field.annotation)
    help_text = field.description or ""
    if "(default:" not in help_text:  # derived defaults say how, in their description
        help_text += f" (default: {default_text or _default_text(field)})"
    help_text = help_text.replace("%", "%%")  # argparse formats help
    if annotation is bool:
        action = "store_true" if field.default is False else argparse.BooleanOptionalAction
        return {"action": action, "help": help_text}
    choices = _literal_choices(annotation)
    if choices is not None:
        return {"choices": choices, "help": help_text}
    if annotation in (int, float):
        parse = _number(annotation, optional)
        metavar = "N|off" if optional else "N"
        return {"type": parse, "metavar": metavar, "help": help_text}
    if annotation is str:
        return {"help": help_text}
    return {"type": _json, "metavar": "JSON", "help": help_text}


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the annotation without None, whether None is allowed)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else annotation), True
    return annotation, False


def _literal_choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) is Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return None


def _number(kind: type, optional: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if optional and text.lower() in _OFF:
            return None
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None


def _default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        factory = field.default_factory
        if factory in (list, dict):
            return "none"
        return "derived" if getattr(factory, "__name__", "") != "<lambda>" else "generated"
    value = field.default
    if value is None:
        return "off" if _unwrap(field.annotation)[0] in (int, float) else "none"
    return str(value)


def documented_flags(model: type[BaseModel]) -> Iterable[tuple[str, str]]:
    """(field, flag) of each flag, for the docs' check."""
    return ((name, flag_name(name)) for name in flag_fields(model))
