"""Resolves a routed model name to a served model (`cluster/model_routes.py` says how).

`ModelRouter.pick` is called once per request naming a route, before the request is
tokenized for the model it picks. It never awaits and allocates little: the rules are
plain comparisons over what the request already carries.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import NamedTuple

from pdserve.cluster.model_routes import ModelRoute, RouteRule

DEFAULT_RULE = "default"
RULE_HEADER = "X-Pdserve-Route-Rule"


class RouteFacts(NamedTuple):
    """What rules look at: computed once per request."""

    prompt_tokens: int
    max_tokens: int  # what the request asked for (the model's limit when it named none)
    headers: Mapping[str, str]  # lower-case names (Starlette's Headers are)
    metadata: Mapping[str, str]


class Picked(NamedTuple):
    route: str
    rule: str  # a rule's name, or DEFAULT_RULE
    model: str


def _between(value: int, low: int | None, high: int | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def matches(rule: RouteRule, facts: RouteFacts) -> bool:
    """Whether `rule`'s conditions (canary share aside) hold for the request."""
    if not _between(facts.prompt_tokens, rule.min_prompt_tokens, rule.max_prompt_tokens):
        return False
    if not _between(facts.max_tokens, rule.min_max_tokens, rule.max_max_tokens):
        return False
    if any(facts.headers.get(name) != value for name, value in rule.headers.items()):
        return False
    return all(facts.metadata.get(tag) == value for tag, value in rule.metadata.items())


class ModelRouter:
    """The routes of one cluster, by routed name.

    Args:
        routes: The configured routes.
        draw: Uniform [0, 1) draws for canary shares (tests pass a seeded one).
    """

    def __init__(self, routes: list[ModelRoute], draw: Callable[[], float] = random.random) -> None:
        self.routes = {route.name: route for route in routes}
        self._draw = draw

    def __contains__(self, name: str) -> bool:
        return name in self.routes

    def default_model(self, name: str) -> str:
        """The model whose tokenizer measures a prompt for route `name`."""
        return self.routes[name].default

    def pick(self, name: str, facts: RouteFacts) -> Picked:
        """The first rule of route `name` that matches (a canary: and wins its draw)."""
        route = self.routes[name]
        for rule in route.rules:
            if matches(rule, facts) and (rule.fraction is None or self._draw() < rule.fraction):
                return Picked(name, rule.name, rule.model)
        return Picked(name, DEFAULT_RULE, route.default)
