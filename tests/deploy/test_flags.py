"""deploy/flags.py: `pdserve up`'s flags come from the configuration's fields.

A field added to the model (here in a subclass, as a new field of ClusterConfig would be)
becomes a flag with its type, default and help, with nothing written in deploy/cli.py; a
flag left out gives the model's own default (or, for a derived one, none at all, so the
model derives it); the docs test (tests/test_docs.py) then asks for its documentation.
"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import Field

from pdserve.cluster.config import ClusterConfig
from pdserve.deploy.cli import build_parser
from pdserve.deploy.flags import NOT_GIVEN, config_values, flag_fields, flag_name


class WithNewFields(ClusterConfig):
    new_wait_s: float | None = Field(default=2.5, gt=0, description="a wait added later")
    new_mode: Literal["fast", "safe"] = Field(default="safe", description="a choice added later")


def test_a_new_field_is_a_flag_without_touching_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser(WithNewFields)
    args = parser.parse_args(["up", "--new-wait-s", "7", "--new-mode", "fast"])
    assert config_values(args, WithNewFields) == {
        **config_values(parser.parse_args(["up"]), WithNewFields),
        "new_wait_s": 7.0,
        "new_mode": "fast",
    }
    assert parser.parse_args(["up"]).new_wait_s == 2.5  # the field's own default
    assert parser.parse_args(["up", "--new-wait-s", "off"]).new_wait_s is None
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--new-mode", "slow"])
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--new-wait-s N|off a wait added later (default: 2.5)" in help_text
    assert "--new-mode {fast,safe} a choice added later (default: safe)" in help_text
    assert "--new-wait-s" not in " ".join(build_parser().format_help().split())


def test_every_flag_says_what_it_sets_and_derived_defaults_stay_derived() -> None:
    fields = flag_fields(ClusterConfig)
    assert not [name for name, field in fields.items() if not field.description]
    args = build_parser().parse_args(["up"])
    assert args.kv_wait_timeout_s is NOT_GIVEN and args.redis_url is NOT_GIVEN
    values = config_values(args, ClusterConfig)
    assert "kv_wait_timeout_s" not in values and "redis_url" not in values
    config = ClusterConfig(model="m", **values)
    assert config == ClusterConfig(model="m", cluster_token=config.cluster_token)
    raised = ClusterConfig(**config_values(build_parser().parse_args(
        ["up", "--max-prefill-queue-s", "600"]), ClusterConfig), model="m")  # fmt: skip
    assert raised.kv_wait_timeout_s == 1202.0  # derived from the bound, as without flags
    assert flag_name("num_threads") == "--threads"  # the names people's command lines have
