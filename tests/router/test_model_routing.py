"""Routed model names: rule matching, order, canary shares and the configuration's checks."""

from __future__ import annotations

import math
import random

import pytest
from pydantic import ValidationError

from pdserve.cluster.model_routes import ModelRoute, route_problems
from pdserve.router.model_routing import DEFAULT_RULE, ModelRouter, RouteFacts


def facts(prompt: int = 10, max_tokens: int = 16, **kw: dict[str, str]) -> RouteFacts:
    return RouteFacts(prompt, max_tokens, kw.get("headers", {}), kw.get("metadata", {}))


ROUTE = ModelRoute.model_validate(
    {
        "name": "auto",
        "default": "big",
        "rules": [
            {"name": "vip", "model": "big", "headers": {"X-Tier": "gold"}},
            {"name": "short", "model": "small", "max_prompt_tokens": 64, "max_max_tokens": 32},
            {"name": "batch", "model": "small", "metadata": {"workload": "batch"}},
            {"name": "canary", "model": "big-v2", "fraction": 0.1},
        ],
    }
)


def test_the_first_matching_rule_wins_and_nothing_matched_is_the_default() -> None:
    router = ModelRouter([ROUTE], draw=lambda: 0.99)  # every canary draw loses
    assert router.pick("auto", facts(headers={"x-tier": "gold"})).rule == "vip"
    assert router.pick("auto", facts(10, 16)) == ("auto", "short", "small")
    assert router.pick("auto", facts(10, 33)).rule == DEFAULT_RULE  # asks for too many
    assert router.pick("auto", facts(65, 16)).model == "big"  # prompt too long
    batch = facts(500, 500, metadata={"workload": "batch"})
    assert router.pick("auto", batch) == ("auto", "batch", "small")
    assert router.pick("auto", facts(500, 500, metadata={"workload": "chat"})).rule == "default"
    assert "auto" in router and "big" not in router
    assert router.default_model("auto") == "big"


def test_a_canary_takes_its_share_and_the_rest_fall_through() -> None:
    rng = random.Random(7)
    router = ModelRouter([ROUTE], draw=rng.random)
    n, p = 400, 0.1
    won = sum(router.pick("auto", facts(500, 500)).rule == "canary" for _ in range(n))
    bound = 4 * math.sqrt(n * p * (1 - p))  # 4 sigma: a miss means a broken share
    assert abs(won - n * p) <= bound, won
    # the canary's draw is spent only on requests its conditions match
    draws: list[float] = []

    def draw() -> float:
        draws.append(0.0)
        return 0.0

    counted = ModelRouter([ROUTE], draw=draw)
    assert counted.pick("auto", facts(10, 16)).rule == "short"
    assert draws == []
    assert counted.pick("auto", facts(500, 500)).rule == "canary"
    assert draws == [0.0]


def test_routes_are_checked_against_the_served_models() -> None:
    assert route_problems([ROUTE], ["big", "small", "big-v2"]) == []
    problems = route_problems([ROUTE], ["big", "small"])
    assert problems == ["the rule 'canary' of route 'auto' names 'big-v2', which is not served"]
    clash = ModelRoute(name="small", default="big")
    assert "has the name of a served model" in route_problems([clash], ["big", "small"])[0]
    with pytest.raises(ValidationError, match="unique"):
        ModelRoute.model_validate(
            {"name": "a", "default": "m", "rules": [{"name": "default", "model": "m"}]}
        )
    inverted = {"name": "r", "model": "m", "min_prompt_tokens": 9, "max_prompt_tokens": 3}
    with pytest.raises(ValidationError, match="maximum below its minimum"):
        ModelRoute.model_validate({"name": "a", "default": "m", "rules": [inverted]})
