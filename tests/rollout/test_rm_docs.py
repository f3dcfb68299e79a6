"""docs/rewards.md cannot drift from the code: every reward type and reward flag is documented, with
its declared default, and every `miles train` example parses and passes the reward checks.

Run: pytest tests/rollout/test_rm_docs.py
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from miles.config.fields import flag_name
from miles.config.values import format_value
from miles.config.reward import KNOWN_RM_TYPES, RewardConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"


def table_after(marker: str) -> dict[str, list[str]]:
    """The markdown table that follows `marker`: first-column code span -> the other cells."""
    lines = PAGE.read_text().split(marker, 1)[1].split("-->", 1)[1].strip().splitlines()
    rows = {}
    for line in lines[2:]:  # after the header row and the separator
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        names = re.findall(r"`([^`]+)`", cells[0])
        if names:
            rows[names[0]] = cells[1:]
    return rows


def documented_default(value) -> str:
    return "unset" if value is None else f"`{format_value(value)}`"


def test_every_reward_type_has_a_row():
    assert set(table_after("<!-- rm-types")) == set(KNOWN_RM_TYPES)


def test_every_reward_flag_is_listed_with_its_declared_default():
    rows = table_after("<!-- BEGIN GENERATED: reward-options")
    fields = dataclasses.fields(RewardConfig)
    assert list(rows) == [flag_name(f) for f in fields]
    for f in fields:
        default_cell = rows[flag_name(f)][0]
        derived = f.metadata["derived"]
        if derived is not None:
            assert default_cell.replace("`", "") == derived.text
        else:
            assert default_cell == documented_default(f.default), f.name


def test_examples_pass_the_reward_checks():
    commands = re.findall(r"^miles train (.+)$", PAGE.read_text(), flags=re.M)
    assert len(commands) >= 4
    names = {flag_name(f): f for f in dataclasses.fields(RewardConfig)}
    for command in commands:
        tokens = shlex.split(command)
        kwargs = {}
        for flag, value in zip(tokens, tokens[1:]):
            if flag in names:
                kwargs[names[flag].name] = type(names[flag].default)(value) if names[flag].default is not None else value
        assert kwargs, command
        RewardConfig(**kwargs).check()  # raises UserError on a wrong example


@pytest.mark.parametrize("name", KNOWN_RM_TYPES)
def test_each_type_is_in_the_rm_type_help(name):
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(RewardConfig)}["rm_type"]
    assert name in help_text
