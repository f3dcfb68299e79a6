"""docs/python-api.md runs as written: every `>>>` example of the page, with the output it shows
(doctest over the Markdown), and its `api.run` block (slow: it trains the tiny debug run).

Run: pytest tests/docs/test_python_api_page.py   (add -m slow for the run block)
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "python-api.md"


def _clean_env(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(tmp_path)  # relative defaults (runs/...) never meet a real run
    for name in [k for k in os.environ if k.startswith("MILES_SCRIPT_")]:
        monkeypatch.delenv(name)


def test_every_example_prints_what_the_page_shows(tmp_path, monkeypatch):
    _clean_env(monkeypatch, tmp_path)
    # A fence ends an example's expected output, as a blank line does for doctest.
    text = re.sub(r"\n```", "\n\n```", PAGE.read_text())
    test = doctest.DocTestParser().get_doctest(text, {}, PAGE.name, str(PAGE), 0)
    assert len(test.examples) >= 10, "the page lost its examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out: list[str] = []
    result = runner.run(test, out=out.append)
    assert result.failed == 0, "".join(out)
    assert list(tmp_path.iterdir()) == [], "resolving writes nothing"


def test_the_page_is_in_the_site_navigation():
    assert "python-api.md" in (ROOT / "mkdocs.yml").read_text()
    assert "(python-api.md)" in (ROOT / "docs" / "index.md").read_text()


@pytest.mark.slow
def test_the_run_block_trains_the_debug_run(tmp_path):
    block = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.S).group(1)
    assert "api.run(" in block
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_SCRIPT_")}
    r = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.splitlines()[-1].startswith("3 runs/tiny-qwen3-debug_minimal {"), r.stdout[-2000:]
