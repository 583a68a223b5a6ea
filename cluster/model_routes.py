"""Routed model names: one name clients send (e.g. `auto`) mapped to served models by rules.

An operator writes, per routed name, an ordered list of rules and a default. The router
takes the first rule whose conditions all hold (`router/model_routing.py`); a rule with a
`fraction` is a canary: of the requests its other conditions match, it takes that share
(independently at random per request) and the rest go on to the next rule. Nothing
matched: the default model. Every decision is counted per route, rule and model
(`pdserve_model_route_decisions_total`), and the response names the rule in the
`X-Pdserve-Route-Rule` header, the model that served it in its `model` field.

Prompt length is counted in the tokens of the route's default model (a prompt of token
ids: their number), before the chosen model tokenizes the request itself.

Plain Python (pydantic): part of the cluster's configuration.
"""

from __future__ import annotations

from collections.abc import Collection

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$"


class RouteRule(BaseModel):
    """One rule: its conditions (all that are set must hold) and the model it picks."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=_NAME)
    model: str = Field(min_length=1, description="a served model id")
    min_prompt_tokens: int | None = Field(default=None, ge=0)
    max_prompt_tokens: int | None = Field(default=None, ge=0)
    # the request's max_tokens (max_completion_tokens for chat); a request without one
    # counts as asking for the longest output the model allows
    min_max_tokens: int | None = Field(default=None, ge=0)
    max_max_tokens: int | None = Field(default=None, ge=0)
    # HTTP headers (names case-insensitive) that must be present with exactly these values
    headers: dict[str, str] = Field(default_factory=dict)
    # tags of the request's `metadata` object that must be present with these values
    metadata: dict[str, str] = Field(default_factory=dict)
    # a canary: this share of the requests the conditions above match
    fraction: float | None = Field(default=None, gt=0, le=1)

    @field_validator("headers")
    @classmethod
    def _lower(cls, value: dict[str, str]) -> dict[str, str]:
        return {name.lower(): v for name, v in value.items()}

    @model_validator(mode="after")
    def _check(self) -> RouteRule:
        for low, high in (
            (self.min_prompt_tokens, self.max_prompt_tokens),
            (self.min_max_tokens, self.max_max_tokens),
        ):
            if low is not None and high is not None and high < low:
                raise ValueError(f"rule {self.name!r}: a maximum below its minimum")
        return self


class ModelRoute(BaseModel):
    """A routed model name: its rules, tried in order, and the model when none matches."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128, pattern=_NAME)
    rules: list[RouteRule] = Field(default_factory=list)
    default: str = Field(min_length=1, description="a served model id")

    @model_validator(mode="after")
    def _check(self) -> ModelRoute:
        names = [rule.name for rule in self.rules]
        if "default" in names or len(set(names)) != len(names):
            raise ValueError(
                f"route {self.name!r}: rule names must be unique and not 'default' "
                "(the name of the fallback)"
            )
        return self


def route_problems(routes: Collection[ModelRoute], served: Collection[str]) -> list[str]:
    """What is wrong with `routes` for a cluster serving the model ids `served`."""
    problems = []
    names = [route.name for route in routes]
    if len(set(names)) != len(names):
        problems.append("two routes have the same name")
    for route in routes:
        if route.name in served:
            problems.append(f"route {route.name!r} has the name of a served model")
        targets = [(f"default of route {route.name!r}", route.default)]
        targets += [(f"rule {r.name!r} of route {route.name!r}", r.model) for r in route.rules]
        for what, model in targets:
            if model not in served:
                problems.append(f"the {what} names {model!r}, which is not served")
    return problems
