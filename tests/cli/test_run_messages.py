"""Messages of a run that only claim what happened (issue 28), through the `miles` program:

- the path of `options.json` is printed once the file is written, never by a start that fails
  (the e2e run in tests/e2e/test_run_safety.py checks that a run that trains prints it);
- a missing input suggests `miles full-train` only when full-train's prepare steps would create it.

Run: pytest tests/cli/test_run_messages.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def miles(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_")}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="200", NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "miles_cli.main", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_start_that_fails_names_no_options_file(tmp_path):
    r = miles(["train", "--lr", "2e-5"], tmp_path)  # nothing prepared here: exit 2 before anything starts
    assert r.returncode == 2 and r.stderr.startswith("Error: --hf-checkpoint"), r.stdout + r.stderr
    assert "--lr 2e-05" in r.stdout  # the start did print what it was given
    assert "options.json" not in r.stdout + r.stderr
    assert list(tmp_path.iterdir()) == []


def test_missing_inputs_suggest_full_train_only_for_what_it_prepares(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    hint = "Run `miles full-train` to prepare it."
    # The recipe's own model and data: full-train prepares them, so it is the fix.
    r = miles(["train"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("Error: --hf-checkpoint runs/models/") and hint in r.stderr, r.stderr
    r = miles(["train", "--hf-checkpoint", str(model)], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("Error: --prompt-data runs/data/") and hint in r.stderr, r.stderr
    # The user's own files: full-train would not create them, so only the option and its fix.
    for argv, start in (
        (["--hf-checkpoint", str(tmp_path / "nope")], "Error: --hf-checkpoint"),
        (["--hf-checkpoint", str(model), "--prompt-data", "mine.jsonl"], "Error: --prompt-data mine.jsonl does not exist"),
        (["--hf-checkpoint", str(model), "--prompt-data", "mine.jsonl", "--eval-prompt-data", "x", "x.jsonl"], "Error: --prompt-data mine.jsonl"),
    ):
        r = miles(["train", *argv], tmp_path)
        assert r.returncode == 2 and r.stderr.startswith(start) and "full-train" not in r.stderr, (argv, r.stderr)
    (tmp_path / "mine.jsonl").write_text('{"input": "1+1=", "label": "2"}\n')
    r = miles(["train", "--hf-checkpoint", str(model), "--prompt-data", "mine.jsonl", "--eval-prompt-data", "x", "x.jsonl"], tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("Error: --eval-prompt-data x x.jsonl: no such file") and "full-train" not in r.stderr, r.stderr
