"""The repository's own pages pass `miles docs check`, the site builds offline, and the CLI works.

Run: pytest tests/docs/test_repo_docs.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from miles.docs.check import check_all
from miles.docs.hooks import find_hooks


def test_repository_pages_pass_every_check(root, model):
    problems, _notes = check_all(root, model)
    assert [str(p) for p in problems] == []


def test_every_prose_page_links_to_the_cli_reference(root):
    pages = [p for p in sorted((root / "docs").glob("*.md"))]
    assert pages
    missing = [p.name for p in pages if "reference/cli.md" not in p.read_text()]
    assert missing == [], "link these pages to the CLI reference"


def test_every_hook_has_a_signature_read_from_the_code(root, model):
    hooks, _files = find_hooks(root, model)
    assert {h.flag for h in hooks} >= {"--custom-rm-path", "--dynamic-sampling-filter-path", "--custom-loss-function-path"}
    assert [h.flag for h in hooks if not h.signatures] == []


def test_site_builds_offline_with_strict(root, tmp_path):
    mkdocs = shutil.which("mkdocs") or str(__import__("pathlib").Path(sys.executable).parent / "mkdocs")
    done = subprocess.run(
        [mkdocs, "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=root, capture_output=True, text=True, timeout=120, env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


@pytest.mark.parametrize("argv, code", [(["docs", "check", "--help"], 0), (["docs", "generate", "--help"], 0)])
def test_docs_commands_are_registered(argv, code):
    from miles_cli.docs_cmd import invoke

    exit_code, output = invoke(argv, {})
    assert exit_code == code and "Usage: miles docs" in output


def test_docs_check_exits_1_and_names_the_line(root, tmp_path):
    from miles_cli.docs_cmd import invoke

    (tmp_path / "page.md").write_text("# P\n\nUse `--no-such-option`.\n")
    exit_code, output = invoke(["docs", "check", "--docs-dir", str(tmp_path)], {})
    assert exit_code == 1
    assert "page.md:3: --no-such-option is not an option of any miles command" in output
