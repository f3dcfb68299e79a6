"""The prose checks: every claim a page makes about the code is compared with the code.

    problems, notes = check_all(root, model)          # model: miles_cli.docs_cmd.cli_model()
    for p in problems: print(p)                       # docs/x.md:12: --foo is not an option of miles train

What is checked, per page under docs/ (fenced code = ```bash/sh/shell/console or unlabeled):

- each `miles ...` line in fenced code parses with the real app; commands that would start work
  (full-train, train, eval, docker-build) run in-process with `--dry-run` appended and must exit 0;
- each `--flag` in a code span exists for the command the span starts with (`miles train --x`), or for
  some command when the span has no command; a value after a flag with choices is one of them; a
  default stated right after it ("`--x` (default 5)", "`--x` defaults to `5`") equals the real one;
- each repository path (`miles/...`, `docs/...`, ...) and Python module (`miles.x.y[:attr]`) exists,
  read statically (nothing is imported);
- each environment variable is one the code reads, a recipe sets or an image declares
  (`miles.docs.envvars`), each docker variant is one `miles.docker_images.VARIANTS` builds, each metric
  name (`rollout/...`, `train/...`, `eval/...`, `perf/...`) is one the metric-names registry lists
  (skipped with a note while `miles/tracking/metric_names.py` does not exist);
- internal links resolve, to a file inside the docs directory and, with `#anchor`, to a heading;
- generated files and blocks are up to date (`miles docs generate`).

Code spans between `<!-- docs-check: off -->` and `<!-- docs-check: on -->` are not checked (for
examples that are not claims, such as made-up metric keys); links there still are.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from miles.docs import markdown
from miles.docs.envvars import ENV_NAME, inventory
from miles.docs.generate import load_metric_names, stale
from miles.docs.model import CliModel, FlagDoc

SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
REPO_DIRS = ("miles", "miles_cli", "recipes", "tests", "docs", "docker", "bench", ".ci")
ROOT_FILES = {"pyproject.toml", "README.md", "mkdocs.yml"}
# Flags of other programs that pages mention on their own (e.g. what `docker-build` passes to buildx).
EXTERNAL_FLAGS = {
    "--platform": "docker buildx",
    "--label": "docker buildx",
    "--ignore-requires-python": "pip",
    "--no-deps": "pip",
    "--backend-store-uri": "mlflow",
    "--strict": "mkdocs",
}
_PATH = re.compile(rf"(?:{'|'.join(re.escape(d) for d in REPO_DIRS)})/[\w./-]*")
_MODULE = re.compile(r"(?:miles|miles_cli|recipes)(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
_METRIC = re.compile(r"(?:rollout|train|eval|perf)/[\w/{}<>.-]+")
_VARIANT = re.compile(r"(?:cu\d+(?:-[a-z0-9_]+)?|rocm\d*(?:-[a-z0-9]+)*)")
_DEFAULT = re.compile(
    r"^\s*(?:\(|,|:)?\s*(?:defaults? to|default:|default is|default)\s+(`[^`]+`|[^\s,;)]+(?:\s*(?:KiB|MiB|GiB|KB|MB|GB)\b)?)",
    re.I,
)
_UNITS = {"kib": 2**10, "kb": 2**10, "mib": 2**20, "mb": 2**20, "gib": 2**30, "gb": 2**30}


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


def normalize(value: Any, flag: str = "") -> Any:
    """A comparable form of a default, whether written in prose, shown by help or held by the parser."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value) if value else None
    text = str(value).strip().strip("`").strip("'\"").strip().rstrip(":;,.")
    low = text.lower()
    if flag and low == flag.lstrip("-"):
        return True
    if flag and low == "no-" + flag.lstrip("-"):
        return False
    if low in {"true", "on", "yes", "enabled"}:
        return True
    if low in {"false", "off", "no", "disabled"}:
        return False
    if low in {"none", "unset", "null", "[]", '""', ""}:
        return None
    m = re.fullmatch(r"([-+]?[\d.]+(?:e[-+]?\d+)?)\s*(kib|kb|mib|mb|gib|gb)?", low)
    if m:
        try:
            return float(m.group(1)) * _UNITS.get(m.group(2) or "", 1)
        except ValueError:
            pass
    return text


def real_defaults(fds: list[FlagDoc], model: CliModel, flag: str) -> list[Any]:
    out = []
    for fd in fds:
        if fd.default is not None:
            out.append(normalize(fd.default, flag))
        out.append(normalize(fd.default_value, flag))
    for r in model.recipes.values():  # the engine's declared default, which a recipe may override
        if flag in r.engine_defaults:
            out.append(normalize(r.engine_defaults[flag][0], flag))
    return out


def _split(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:
        return text.split()


def _flags_in(tokens: list[str]) -> list[tuple[str, str | None]]:
    """(flag, value written after it) for every --flag token; `--x/--no-x` gives both."""
    out = []
    for i, tok in enumerate(tokens):
        if re.search(r"\s", tok):  # a quoted value such as --extra-args "--lr 1e-5": check its flags too
            out.extend(_flags_in(_split(tok)))
            continue
        if not tok.startswith("--") or tok == "--":
            continue
        value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("-") else None
        for part in tok.split("/"):
            if part.startswith("--"):
                name, eq, inline = part.partition("=")
                out.append((name.rstrip(".,:;)"), inline if eq else value))
    return out


def _placeholder(value: str) -> bool:
    return bool(re.search(r"[<>{}]|\.\.\.|^[A-Z][A-Z0-9_=]*$|\$", value))


class Checker:
    def __init__(self, root: Path, model: CliModel, docs_dir: Path):
        self.root, self.model, self.docs_dir = root, model, docs_dir
        self.problems: list[Problem] = []
        self.notes: list[str] = []
        self.env = inventory(root, model)
        self.known_env = self.env.known()
        self.all_flags = model.all_flags()
        try:
            from miles.docker_images import VARIANTS

            self.variants: set[str] | None = set(VARIANTS)
        except ImportError:
            self.variants = None
        self.metrics = self._metric_patterns()
        self._anchor_cache: dict[Path, set[str]] = {}

    # -- registries -------------------------------------------------------------------------------

    def _metric_patterns(self) -> list[tuple[str, re.Pattern]] | None:
        module = load_metric_names(self.root)
        if module is None or not hasattr(module, "metric_names"):
            self.notes.append(
                "metric names not checked: miles/tracking/metric_names.py (metric_names()) does not exist yet"
            )
            return None
        out = []
        for name, _meaning in module.metric_names():
            rx = re.sub(r"\\[<{][^/]*?\\[>}]|[<{][^/]*?[>}]", "[^/]+", re.escape(name))
            out.append((name, re.compile(rx)))
        return out

    def _metric_known(self, name: str) -> bool:
        assert self.metrics is not None
        generic = re.sub(r"[<{][^/]*?[>}]", "*", name)
        for template, rx in self.metrics:
            if name == template or rx.fullmatch(name) or generic == re.sub(r"[<{][^/]*?[>}]", "*", template):
                return True
        return False

    # -- helpers ----------------------------------------------------------------------------------

    def report(self, page: Path, line: int, message: str) -> None:
        base = self.root if self.root in page.parents else self.docs_dir.parent
        try:
            shown = page.relative_to(base).as_posix()
        except ValueError:
            shown = str(page)
        self.problems.append(Problem(shown, line, message))

    def command_of(self, tokens: list[str]) -> str | None:
        if len(tokens) > 2 and f"{tokens[1]} {tokens[2]}" in self.model.commands:
            return f"{tokens[1]} {tokens[2]}"
        if len(tokens) > 1 and tokens[1] in self.model.commands:
            return tokens[1]
        return None

    def flag_docs(self, flag: str, command: str | None) -> list[FlagDoc]:
        if command is None:
            return [fd for _, fd in self.model.flag_docs(flag)]
        cmd = self.model.commands[command]
        found = [fd for fd in cmd.flags if flag in fd.flags]
        if not found and command in ("full-train", "train", "eval"):
            found = [fd for flags in self.model.recipe_flags.values() for fd in flags.values() if flag in fd.flags][:1]
        return found

    # -- checks -----------------------------------------------------------------------------------

    def check_page(self, page: Path) -> None:
        parsed = markdown.parse(page.read_text())
        for block in parsed.blocks:
            if block.lang in SHELL_LANGS:
                self.check_block(page, block)
        off = _unchecked_lines(parsed)
        for span in parsed.spans():
            if span.line not in off:
                self.check_span(page, span)
        for line, target in parsed.links():
            self.check_link(page, line, target)
        self.check_default_tables(page, off)

    def check_default_tables(self, page: Path, off: set[int]) -> None:
        """In a table with a `default` column, a row whose first cell is one `--flag` and whose default
        cell is one code span must state the flag's real default (as prose defaults must)."""
        column = None
        for number, raw in enumerate(page.read_text().splitlines(), start=1):
            line = raw.strip()
            if not line.startswith("|"):
                column = None
                continue
            cells = [c.strip() for c in line.strip("|").split("|")]
            lowered = [c.lower() for c in cells]
            if "default" in lowered:
                column = lowered.index("default")
                continue
            if column is None or number in off or column >= len(cells) or set(line) <= set("|-: "):
                continue
            flags = re.findall(r"`(--[a-z0-9][a-z0-9-]*)`", cells[0])
            stated = re.fullmatch(r"`([^`]+)`", cells[column])
            if len(flags) != 1 or stated is None:
                continue
            fds = self.flag_docs(flags[0], None)
            if not fds or any(fd.derived for fd in fds):
                continue
            real = real_defaults(fds, self.model, flags[0])
            if normalize(stated.group(1), flags[0]) not in real:
                shown = fds[0].default if fds[0].default is not None else fds[0].default_value
                self.report(page, number, f"{flags[0]}: the table says the default is {stated.group(1)}, the code says {shown}")

    def check_block(self, page: Path, block: markdown.CodeBlock) -> None:
        logical: list[tuple[int, str]] = []
        pending, start = "", 0
        for offset, raw in enumerate(block.lines):
            if not pending:
                start = block.start + offset
            pending += raw.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            logical.append((start, pending))
            pending = ""
        for line, text in logical:
            text = text.strip()
            text = text[2:] if text.startswith("$ ") else text
            try:
                tokens = shlex.split(text, comments=True)
            except ValueError:
                continue
            env: dict[str, str] = {}
            while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
                key, _, value = tokens.pop(0).partition("=")
                env[key] = value
                self.check_env_name(page, line, key)
            if not tokens or tokens[0] != "miles":
                continue
            argv = [t for t in tokens[1:] if t != "..."]
            self.check_command(page, line, argv, env)

    def check_command(self, page: Path, line: int, argv: list[str], env: dict[str, str]) -> None:
        assert self.model.parse is not None and self.model.invoke is not None
        shown = "miles " + " ".join(argv)
        error = self.model.parse(argv, env)
        if error:
            self.report(page, line, f"`{shown}` does not parse: {error.splitlines()[0]}")
            return
        command = self.command_of(["miles", *argv])
        if command is None or "--help" in argv or not self.model.commands[command].starts_work:
            return
        run = argv if "--dry-run" in argv else _with_dry_run(argv)
        with _empty_cwd():
            code, output = self.model.invoke(run, env)
        if code != 0:
            last = [ln.strip() for ln in output.splitlines() if ln.strip()]
            self.report(page, line, f"`{shown}` fails with --dry-run (exit {code}): {last[-1] if last else 'no output'}")

    def check_span(self, page: Path, span: markdown.Span) -> None:
        tokens = _split(span.text)
        if not tokens:
            return
        head = tokens[0]
        if head == "miles" and len(tokens) > 1:
            command = self.command_of(tokens)
            if command is None and not tokens[1].startswith("-") and not _placeholder(tokens[1]):
                self.report(page, span.line, f"`{span.text}`: miles has no command {tokens[1]!r}")
                return
            self.check_flags(page, span, tokens, command)
        elif head.startswith("--"):
            self.check_flags(page, span, tokens, None)
        elif (m := re.fullmatch(r"\$?\{?([A-Z][A-Z0-9]*(?:_[A-Z0-9<>]+)+)\}?(?:=\S*)?", head)) and len(tokens) == 1:
            self.check_env_name(page, span.line, m.group(1))
        elif _METRIC.fullmatch(span.text):
            if self.metrics is not None and not self._metric_known(span.text):
                self.report(page, span.line, f"metric {span.text} is not emitted by miles (not in miles/tracking/metric_names.py)")
        elif _PATH.fullmatch(path := re.sub(r"(:\d+(-\d+)?|:\w+|#.*)$", "", head)) or path in ROOT_FILES:
            if not any(c in path for c in "*<>{}") and not (self.root / path).exists():
                self.report(page, span.line, f"path {path} does not exist in the repository")
        elif _MODULE.fullmatch(head.removesuffix("()")):
            problem = self.check_module(head.removesuffix("()"))
            if problem:
                self.report(page, span.line, problem)
        elif self.variants is not None and _VARIANT.fullmatch(head) and len(tokens) == 1:
            if head not in self.variants:
                self.report(page, span.line, f"docker variant {head} does not exist; variants: {', '.join(sorted(self.variants))}")

    def check_flags(self, page: Path, span: markdown.Span, tokens: list[str], command: str | None) -> None:
        where = f"miles {command}" if command else "any miles command"
        for flag, value in _flags_in(tokens):
            if any(c in flag for c in "*<>{}") or flag == "--help":  # a pattern (`--*-path`), or help
                continue
            if command is None and flag in EXTERNAL_FLAGS and flag not in self.all_flags:
                continue
            fds = self.flag_docs(flag, command)
            if not fds:
                self.report(page, span.line, f"{flag} is not an option of {where}")
                continue
            choices = {c for fd in fds for c in (*fd.choices, *(u for u, _ in fd.unavailable_choices))}
            if value is not None and choices and not _placeholder(value) and value not in choices:
                self.report(page, span.line, f"{flag} {value}: {value!r} is not a choice of {flag} ({', '.join(sorted(choices))})")
        flags = _flags_in(tokens)
        if len(flags) == 1 and (m := _DEFAULT.match(span.after)):
            flag = flags[0][0]
            fds = self.flag_docs(flag, command)
            if fds:
                stated = normalize(m.group(1), flag)
                real = real_defaults(fds, self.model, flag)
                # What an unset option means, as its help says ("unset = miles"), is a true default too.
                real += [normalize(u.strip(), flag) for fd in fds for u in re.findall(r"unset\s*[=:]\s*([^;,.]+)", fd.help)]
                if isinstance(stated, str) and not m.group(1).startswith("`") and None in real:
                    return  # a description of what the unset default means ("default: the run id")
                derived = [fd.derived for fd in fds if fd.derived]
                if derived and fds[0].default is None:
                    if not isinstance(stated, str):
                        self.report(page, span.line, f"{flag} has no fixed default ({derived[0]}), the page says {m.group(1)}")
                elif stated not in real:
                    shown = fds[0].default if fds[0].default is not None else fds[0].default_value
                    self.report(page, span.line, f"{flag}: the page says the default is {m.group(1)}, the code says {shown}")

    def check_env_name(self, page: Path, line: int, name: str) -> None:
        prefix = self.model.env_prefix
        if name.startswith(prefix):
            if name[len(prefix):] in ("<FIELD>", "<OPTION>") or name in self.env.script:
                return
            self.report(page, line, f"{name} is not a recipe option variable; recipe options: {', '.join(sorted(self.env.script))}")
            return
        if not ENV_NAME.fullmatch(name) or name in self.known_env:
            return
        self.report(page, line, f"environment variable {name} is not read by miles, set by a recipe or declared by an image")

    def check_module(self, dotted: str) -> str | None:
        target, _, attr_after_colon = dotted.partition(":")
        parts = target.split(".")
        for i in range(len(parts), 0, -1):
            base = self.root.joinpath(*parts[:i])
            file = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if file.is_file():
                attrs = parts[i:] + ([attr_after_colon] if attr_after_colon else [])
                return self._check_attrs(file, attrs, dotted)
        return f"module {dotted} does not exist"

    def _check_attrs(self, file: Path, attrs: list[str], dotted: str) -> str | None:
        if not attrs:
            return None
        body = ast.parse(file.read_text()).body
        for depth, attr in enumerate(attrs[:2]):
            names = {}
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names[node.name] = node
                elif isinstance(node, ast.Assign):
                    names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names[node.target.id] = node
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
            if attr not in names:
                return f"{dotted}: {file.relative_to(self.root).as_posix()} defines no {attr}"
            node = names[attr]
            if not isinstance(node, ast.ClassDef):
                return None
            body = node.body
        return None

    def anchors_of(self, path: Path) -> set[str]:
        if path not in self._anchor_cache:
            self._anchor_cache[path] = markdown.anchors(markdown.parse(path.read_text()))
        return self._anchor_cache[path]

    def check_link(self, page: Path, line: int, target: str) -> None:
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            return
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page.resolve()
        if file_part and not dest.exists():
            self.report(page, line, f"link {target}: {file_part} does not exist")
            return
        docs = self.docs_dir.resolve()
        if file_part and docs not in dest.parents and dest != docs:
            self.report(page, line, f"link {target} leaves the docs directory (the site cannot serve it); write the path as `code`")
            return
        if anchor and dest.suffix == ".md" and anchor not in self.anchors_of(dest):
            self.report(page, line, f"link {target}: no heading or anchor #{anchor} in {dest.name}")


def _unchecked_lines(page: markdown.Page) -> set[int]:
    """Lines between `<!-- docs-check: off -->` and `<!-- docs-check: on -->` (examples, not claims)."""
    off, skipping = set(), False
    for n, line in page.prose:
        if "<!-- docs-check: off -->" in line:
            skipping = True
        elif "<!-- docs-check: on -->" in line:
            skipping = False
        elif skipping:
            off.add(n)
    return off


@contextlib.contextmanager
def _empty_cwd() -> Iterator[None]:
    """Run a documented command from an empty directory: its verdict must not depend on what the
    checkout's `runs/` holds, or the README's two commands, run in order, fail (issue 28)."""
    saved = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="miles-docs-check-") as where:
        os.chdir(where)
        try:
            yield
        finally:
            os.chdir(saved)


def _with_dry_run(argv: list[str]) -> list[str]:
    # Before a `--` passthrough, so --dry-run stays a miles option.
    if "--" in argv:
        i = argv.index("--")
        return argv[:i] + ["--dry-run"] + argv[i:]
    return argv + ["--dry-run"]


def check_all(root: Path, model: CliModel, docs_dir: Path | None = None, progress: Any = None) -> tuple[list[Problem], list[str]]:
    """Every problem of every page under `docs_dir` (default root/docs), and notes on what was skipped."""
    docs_dir = docs_dir or root / "docs"
    checker = Checker(root, model, docs_dir)
    pages = sorted(docs_dir.rglob("*.md"))
    if progress is not None:
        from rich.progress import Progress

        with Progress(console=progress, transient=True) as bar:
            task = bar.add_task("checking pages", total=len(pages))
            for page in pages:
                checker.check_page(page)
                bar.advance(task)
    else:
        for page in pages:
            checker.check_page(page)
    for path in stale(root, model, docs_dir):
        checker.report(path, 1, "generated content is stale: run `miles docs generate`")
    return checker.problems, checker.notes
