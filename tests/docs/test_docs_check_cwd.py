"""`miles docs check` gives the same verdict whatever the working directory holds (issue 28, item 0).

The README's two commands run in order: `miles full-train` prepares `runs/` in the checkout, then
`python -m pytest -q` runs the docs check. A documented dry run must not get further (and fail on a
file the page only names) because the default run's inputs happen to exist.

Run: pytest tests/docs/test_docs_check_cwd.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = """# Rewards

```bash
miles train --custom-rm-path my_rewards.py:length_penalty --dry-run
```
"""


def _default_run_inputs(where: Path) -> None:
    """What `miles full-train` leaves for the default recipe: the model directory and the prompt files."""
    from miles_cli import api

    cfg = api.resolve().config
    model = where / cfg.rollout.hf_checkpoint
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    pairs = cfg.eval.eval_prompt_data or []
    for path in [cfg.data.prompt_data, *pairs[1::2]]:
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        (where / path).write_text(json.dumps({cfg.data.input_key: "1+1=", cfg.data.label_key or "label": "2"}) + "\n")


def _miles(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "miles_cli.main", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_docs_check_passes_where_the_default_run_was_prepared(tmp_path):
    _default_run_inputs(tmp_path)
    # The precondition that made the README's second command fail: with the inputs present the dry run
    # gets past the model check and stops on the page's example file.
    direct = _miles(["train", "--custom-rm-path", "my_rewards.py:length_penalty", "--dry-run"], tmp_path)
    assert direct.returncode == 2 and "my_rewards.py does not exist" in direct.stdout + direct.stderr
    docs = tmp_path / "pages"
    docs.mkdir()
    (docs / "page.md").write_text(PAGE)
    done = _miles(["docs", "check", "--docs-dir", str(docs)], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
