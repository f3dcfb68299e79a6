"""docs/data.md cannot drift from the code: every data flag in its table exists in the engine
configuration with the default the page states, and its example error messages are the real ones.

Run: pytest tests/rollout/test_data_docs.py
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from miles.config.engine import GROUPS
from miles.config.fields import flag_name
from miles.config.values import format_value
from miles.errors import UserError
from miles.rollout.data_source import PromptDataset

PAGE = Path(__file__).resolve().parents[2] / "docs" / "data.md"
FIELDS = {flag_name(f): f for _, cls, _ in GROUPS for f in dataclasses.fields(cls)}


def options_table() -> dict[str, str]:
    lines = PAGE.read_text().split("<!-- BEGIN GENERATED: data-options", 1)[1].split("-->", 1)[1].strip().splitlines()
    rows = {}
    for line in lines[2:]:  # after the header row and the separator
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        flags = re.findall(r"`(--[a-z0-9-]+)`", cells[0])
        if flags:
            rows[flags[0]] = cells[1]
    return rows


def test_table_covers_the_data_flags():
    rows = options_table()
    for flag in ("--prompt-data", "--input-key", "--label-key", "--metadata-key", "--tool-key", "--apply-chat-template",
                 "--apply-chat-template-kwargs", "--rollout-max-prompt-len", "--rollout-shuffle", "--rollout-seed",
                 "--over-sampling-batch-size", "--dynamic-sampling-filter-path"):  # fmt: skip
        assert flag in rows, flag


@pytest.mark.parametrize("flag", list(options_table()))
def test_documented_default_is_the_declared_one(flag):
    assert flag in FIELDS, f"{flag} is documented but not declared in miles/config"
    f, cell = FIELDS[flag], options_table()[flag]
    derived = f.metadata["derived"]
    if derived is not None:
        assert cell.replace("`", "") == derived.text
    elif f.default is None:
        assert cell.startswith("unset")
    else:
        assert cell == f"`{format_value(f.default)}`"


def test_example_error_messages_are_the_real_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("data").mkdir()
    documented = re.findall(r"^Error: (.+)$", PAGE.read_text(), flags=re.M)
    rows = [{"prompt": "p", "answer": "a"}] * 16 + [{"question": "q", "answer": "a"}]
    Path("data/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path("data/bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": }\n')
    Path("data/empty.jsonl").write_text("")
    actual = []
    for path, key in (("data/train.jsonl", "prompt"), ("data/bad.jsonl", "prompt"), ("data/empty.jsonl", "input")):
        with pytest.raises(UserError) as e:
            PromptDataset(path, input_key=key)
        actual.append(str(e.value))
    assert actual[0] == documented[0]
    assert actual[1].replace("bad.jsonl", "train.jsonl") == documented[1]
    assert actual[2] == documented[2]
