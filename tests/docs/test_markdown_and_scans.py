"""Unit checks of the pieces the generators and checks stand on: anchors, blocks, env scan, signatures.

Run: pytest tests/docs/test_markdown_and_scans.py
"""

from __future__ import annotations

from pathlib import Path

from miles.docs import markdown
from miles.docs.envvars import scan_file
from miles.docs.hooks import signatures_in


def test_slugs_match_mkdocs_toc():
    # Expected values written by hand from Python-Markdown's toc slugify.
    assert markdown.slugify("Fault tolerance and determinism") == "fault-tolerance-and-determinism"
    assert markdown.slugify("Environment variables: `MILES_SCRIPT_<FIELD>`") == "environment-variables-miles_script_field"
    assert markdown.slugify("The `--extra-args` flag (and `--`)") == "the-extra-args-flag-and-"
    assert markdown.slugify("Qwen3-0.6B!") == "qwen3-06b"


def test_anchors_dedupe_and_read_explicit_ids():
    page = markdown.parse("# A\n## Options\n## Options\n### X {#run-x}\n<a id=\"row-1\"></a>\n```\n# not a heading\n```\n")
    assert markdown.anchors(page) == {"a", "options", "options_1", "run-x", "row-1"}


def test_code_blocks_and_line_numbers():
    page = markdown.parse("text `a`\n```bash\nmiles train\n```\nafter `b`\n")
    assert [(b.lang, b.start, b.lines) for b in page.blocks] == [("bash", 3, ("miles train",))]
    assert [(s.text, s.line) for s in page.spans()] == [("a", 1), ("b", 5)]


def test_generated_block_round_trip():
    text = "x\n<!-- BEGIN GENERATED: t -->\nold\n<!-- END GENERATED: t -->\ny\n"
    new = markdown.replace_block(text, "t", "| a |\n")
    assert new == "x\n<!-- BEGIN GENERATED: t -->\n| a |\n<!-- END GENERATED: t -->\ny\n"
    assert markdown.blocks_in(new) == {"t": "| a |\n"}
    assert markdown.replace_block(new, "t", "| a |\n") == new


def test_env_scan_finds_literal_and_loop_expanded_reads(tmp_path: Path):
    src = tmp_path / "m.py"
    src.write_text(
        "import os\nNAMES = ('A_PROXY', 'B_PROXY')\n"
        "def f(environ):\n"
        "    x = os.environ.get('FOO_BAR')\n"
        "    y = os.environ['BAZ_QUX'] if 'HAS_IT' in os.environ else os.getenv('GET_ENV')\n"
        "    for name in NAMES:\n"
        "        environ.get(name.lower()) or environ.get(name)\n"
        "    return environ.get(compute())\n"
    )
    found, computed = scan_file(src, "m.py")
    assert found == {
        "FOO_BAR": ["m.py:4"], "BAZ_QUX": ["m.py:5"], "HAS_IT": ["m.py:5"], "GET_ENV": ["m.py:5"],
        "a_proxy": ["m.py:7"], "b_proxy": ["m.py:7"], "A_PROXY": ["m.py:7"], "B_PROXY": ["m.py:7"],
    }  # fmt: skip
    assert computed == ["m.py:8"]


def test_signatures_from_help_backticks_and_indented_docstrings():
    assert signatures_in("Group filter `fn(args, group) -> FilterResult`, e.g. x.") == ["fn(args, group) -> FilterResult"]
    assert signatures_in("fn(args, samples) -> dict replacing the conversion.") == ["fn(args, samples) -> dict"]
    assert signatures_in("async fn(a, s) -> float | dict, or with --g async fn(a, ss) -> list; args is") == [
        "async fn(a, s) -> float | dict",
        "async fn(a, ss) -> list",
    ]
    doc = "Called as\n\n    fn(cfg, *, pg_loss)\n        -> (pg_loss, metrics)\n\nwith lists -> not a signature.\n"
    assert signatures_in(doc) == ["fn(cfg, *, pg_loss) -> (pg_loss, metrics)"]
    assert signatures_in("A YAML file of settings.") == []


def test_slugs_equal_python_markdown_toc_ids():
    import re

    import markdown as python_markdown

    for title in ["Hooks (`--*-path`)", "**Bold** and [link](x.md)", "miles full-train, train, eval", "A_b `c_d` <e>"]:
        html = python_markdown.markdown("# " + title, extensions=["toc"])
        assert markdown.slugify(title) == re.search(r'id="([^"]*)"', html).group(1), title
