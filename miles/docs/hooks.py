"""The `--*-path` hook flags and their signatures, for `docs/reference/hooks.md`.

A hook flag names a Python object (`package.module.fn` or `file.py:fn`) that miles calls. Its
signature is read from the code, first match wins:

1. the option's help text (`fn(args, group) -> FilterResult`, backticked or not);
2. the docstring of the function that calls `load_function(..., flag="--x")`;
3. a module docstring in `miles/` that mentions the flag (indented or backticked signature).

A `--*-path` option no code loads with `load_function` and whose help shows no signature is a file
option (e.g. a YAML path), listed separately. A hook without a signature is reported by the checks.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from miles.docs.cli_reference import GENERATED_NOTE, cell, code, flag_anchor
from miles.docs.model import CliModel, FlagDoc

_SIG_INLINE = re.compile(r"`((?:async\s+)?[A-Za-z_]\w*\([^`]*\)\s*->[^`]+)`")
_SIG_BARE = re.compile(r"((?:async\s+)?fn\([^)]*\)\s*->\s*.+?)(?=;|,\s+or\b|\.\s|\.$|\s+replacing\b|$)")


@dataclass(frozen=True)
class Hook:
    flag: str
    help: str
    signatures: tuple[str, ...]
    source: str  # where the signature was read ("help", "miles/algo/losses.py:get_loss_function", ...)
    loaded_at: tuple[str, ...]  # path:line of the load_function calls


def signatures_in(text: str) -> list[str]:
    """Signatures written in `text`: backticked `f(...) -> X`, bare `fn(...) -> X`, or indented blocks."""
    flat = re.sub(r"\s+", " ", text)
    found = [m.group(1).strip() for m in _SIG_INLINE.finditer(flat)]
    if not found:  # an indented signature block in a docstring, possibly over several lines
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s{4,}(async\s+)?\w+\(", line):
                block = [line.strip()]
                for nxt in lines[i + 1:]:
                    if not re.match(r"\s{4,}\S", nxt):  # the block ends where the indentation does
                        break
                    block.append(nxt.strip())
                sig = " ".join(block)
                if "->" in sig:
                    found.append(sig)
    if not found:
        found = [m.group(1).strip() for m in _SIG_BARE.finditer(flat.replace("`", ""))]
    return found


def _loads(root: Path) -> dict[str, list[tuple[str, str | None, str]]]:
    """flag -> [(path:line, docstring of the enclosing function, module docstring)] of load_function calls."""
    out: dict[str, list[tuple[str, str | None, str]]] = {}
    for path in sorted((root / "miles").rglob("*.py")):
        tree = ast.parse(path.read_text())
        module_doc = ast.get_docstring(tree) or ""
        rel = path.relative_to(root).as_posix()

        def visit(node: ast.AST, func_doc: str | None) -> None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                func_doc = ast.get_docstring(node)
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "load_function":
                for kw in node.keywords:
                    if kw.arg == "flag" and isinstance(kw.value, ast.Constant):
                        out.setdefault(kw.value.value, []).append((f"{rel}:{node.lineno}", func_doc, module_doc))
            for child in ast.iter_child_nodes(node):
                visit(child, func_doc)

        visit(tree, None)
    return out


def _module_docs_mentioning(root: Path, flag: str) -> list[tuple[str, str]]:
    out = []
    for path in sorted((root / "miles").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if re.search(re.escape(flag) + r"(?![\w-])", doc):
            out.append((path.relative_to(root).as_posix(), doc))
    return out


def path_flags(model: CliModel) -> list[FlagDoc]:
    seen: dict[str, FlagDoc] = {}
    for cmd in model.commands.values():
        for fd in cmd.flags:
            if fd.flag.endswith("-path"):
                seen.setdefault(fd.flag, fd)
    return list(seen.values())


def find_hooks(root: Path, model: CliModel) -> tuple[list[Hook], list[FlagDoc]]:
    """(hooks with their signatures, `--*-path` options that are files rather than functions)."""
    loads = _loads(root)
    hooks, files = [], []
    for fd in path_flags(model):
        where = tuple(w for w, _, _ in loads.get(fd.flag, []))
        sigs, source = signatures_in(fd.help), "help"
        if not sigs:
            for w, func_doc, _ in loads.get(fd.flag, []):
                if func_doc and signatures_in(func_doc):
                    sigs, source = signatures_in(func_doc), w.split(":")[0] + " (docstring)"
                    break
        if not sigs and where:  # only for flags the code loads as functions (not file options)
            for rel, doc in _module_docs_mentioning(root, fd.flag):
                if signatures_in(doc):
                    sigs, source = signatures_in(doc), rel + " (module docstring)"
                    break
        if sigs or where:
            hooks.append(Hook(fd.flag, fd.help, tuple(sigs), source if sigs else "", where))
        else:
            files.append(fd)
    return hooks, files


def render_hooks(root: Path, model: CliModel) -> str:
    hooks, files = find_hooks(root, model)
    lines = [
        "# Hooks (`--*-path`)",
        "",
        GENERATED_NOTE.rstrip(),
        "",
        "Each hook flag takes `package.module.function` (importable from the working directory or the "
        "installed packages) or `path/to/file.py:function`. A path that cannot be loaded stops the run with "
        "one sentence naming the flag. Signatures are read from the code (help text or docstrings); "
        "`args` is the option group the caller passes. Options: [CLI reference](cli.md).",
        "",
        "| Flag | Signature | Description | Read from |",
        "|---|---|---|---|",
    ]
    for h in hooks:
        sig = "<br>".join(code(s) for s in h.signatures) or "**not documented in the code**"
        lines.append(
            f"| [{code(h.flag)}](cli.md#{flag_anchor('train', h.flag)}) | {sig} "
            f"| {cell(h.help)} | {code(h.source) if h.source else '–'} |"
        )
    if files:
        lines += ["", "## File options {#file-options}", "", "`--*-path` options that name a file rather than a function:", ""]
        lines += [f"- [{code(f.flag)}](cli.md#{flag_anchor('train', f.flag)}): {cell(f.help)}" for f in files]
    return "\n".join(lines) + "\n"
