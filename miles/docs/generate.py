"""Every generated documentation file and block, written (`miles docs generate`) or compared (stale).

Generated files: `docs/reference/{cli,recipes,env-vars,hooks}.md`. Generated blocks inside
hand-written pages, between `<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED: name -->`:
`docker-variants` (`miles.docker_images.variants_markdown_table`), `metric-names`
(`miles.tracking.metric_names.metric_names_markdown`), `argument-groups`, `hooks-table`, the option
tables of `OPTION_TABLES` (`data-options`, `optimizer-options`, ...: declared defaults and help) and
`recipe-batch-<recipe>` (a recipe's batch arithmetic, from its defaults).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Callable

from miles.docs.cli_reference import argument_groups_block, cell, code, flag_anchor, render_cli, render_recipes
from miles.docs.envvars import render_env_vars
from miles.docs.hooks import render_hooks
from miles.docs.markdown import blocks_in, replace_block
from miles.docs.model import CliModel


def load_metric_names(root: Path) -> ModuleType | None:
    """`miles/tracking/metric_names.py`, loaded by path so the tracking package (and its sinks) is not imported."""
    path = root / "miles" / "tracking" / "metric_names.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("miles_docs_metric_names", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docker_variants(root: Path, model: CliModel) -> str:
    from miles.docker_images import variants_markdown_table

    return variants_markdown_table()


def _metric_names(root: Path, model: CliModel) -> str | None:
    module = load_metric_names(root)
    return module.metric_names_markdown() if module is not None and hasattr(module, "metric_names_markdown") else None


def _hooks_table(root: Path, model: CliModel) -> str:
    text = render_hooks(root, model)
    table = text[text.index("| Flag |"):]
    table = table.split("\n\n")[0] + "\n"
    return table.replace("(cli.md#", "(reference/cli.md#")


OPTION_TABLES: dict[str, tuple[str, ...] | str] = {
    # block name -> the flags of its table, or the help panel whose flags it lists
    "data-options": (
        "--prompt-data", "--input-key", "--label-key", "--metadata-key", "--tool-key", "--apply-chat-template",
        "--apply-chat-template-kwargs", "--rollout-max-prompt-len", "--rollout-shuffle", "--rollout-seed",
        "--rollout-batch-size", "--n-samples-per-prompt", "--num-rollout", "--num-epoch", "--over-sampling-batch-size",
        "--dynamic-sampling-filter-path",
    ),
    "optimizer-options": "Optimizer",
    "reward-options": "Reward",
    "algorithm-options": "Algorithm",
}


def option_table(model: CliModel, which: tuple[str, ...] | str) -> str:
    """Flag | Default | Meaning for some engine options, with their declared defaults (before any recipe)."""
    train = model.commands["train"]
    flags = [fd for fd in train.flags if fd.panel == which] if isinstance(which, str) else [train.flag(f) for f in which]
    lines = ["| Flag | Default | Meaning |", "|---|---|---|"]
    for fd in flags:
        assert fd is not None, which
        declared = model.declared_defaults.get(fd.flag, fd.default or "")
        # A rule declared on the engine option (its declared default is unset), not a recipe's rule for it.
        default = fd.derived if fd.derived is not None and declared in ("None", "") else ("unset" if declared == "None" else code(declared))
        shown = " / ".join(code(f) for f in fd.flags)
        link = f"[{shown}](reference/cli.md#{flag_anchor('train', fd.flag)})"
        meaning = [cell(fd.help)]
        if fd.choices:
            meaning.append("One of " + ", ".join(code(c) for c in fd.choices) + ".")
        for choice, why in fd.unavailable_choices:
            meaning.append(f"Not in this build: {code(choice)} ({cell(why)}).")
        if fd.unsupported:
            meaning.append(f"Not available in this build: {cell(fd.unsupported)}.")
        lines.append(f"| {link} | {cell(default)} | {' '.join(meaning)} |")
    return "\n".join(lines) + "\n"


def recipe_batch(model: CliModel, recipe: str) -> str | None:
    """One sentence with the batch arithmetic of a recipe's defaults (docs/concepts.md, docs/recipes.md)."""
    r = model.recipes.get(recipe)
    if r is None:
        return None
    get = lambda flag: int(r.engine_defaults.get(flag, (None, model.declared_defaults[flag]))[1])  # noqa: E731
    prompts, n, gbs = get("--rollout-batch-size"), get("--n-samples-per-prompt"), get("--global-batch-size")
    samples = prompts * n
    steps = samples // gbs
    return (
        f"The `{recipe}` recipe uses {prompts} prompts × {n} samples = {samples} samples = {steps} optimizer "
        f"step{'s' if steps != 1 else ''} of {gbs} per rollout step.\n"
    )


BLOCKS: dict[str, Callable[[Path, CliModel], str | None]] = {
    "docker-variants": _docker_variants,
    "metric-names": _metric_names,
    "argument-groups": lambda root, model: argument_groups_block(model),
    "hooks-table": _hooks_table,
    **{name: (lambda which: lambda root, model: option_table(model, which))(which) for name, which in OPTION_TABLES.items()},
}


def block_renderer(name: str) -> Callable[[Path, CliModel], str | None] | None:
    if name in BLOCKS:
        return BLOCKS[name]
    if name.startswith("recipe-batch-"):
        return lambda root, model: recipe_batch(model, name[len("recipe-batch-"):])
    return None

FILES: dict[str, Callable[[Path, CliModel], str]] = {
    "docs/reference/cli.md": lambda root, model: render_cli(model),
    "docs/reference/recipes.md": lambda root, model: render_recipes(model),
    "docs/reference/env-vars.md": render_env_vars,
    "docs/reference/hooks.md": render_hooks,
}


def expected(root: Path, model: CliModel, docs_dir: Path | None = None) -> tuple[dict[Path, str], list[str]]:
    """{path: the content it should have} for every generated file and every page with blocks; notes."""
    docs_dir = docs_dir or root / "docs"
    out: dict[Path, str] = {root / rel: render(root, model) for rel, render in FILES.items() if (root / rel).parent.is_dir()}
    notes: list[str] = []
    cache: dict[str, str | None] = {}
    for page in sorted(docs_dir.rglob("*.md")):
        text = out.get(page) or page.read_text()
        names = blocks_in(text)
        if not names:
            continue
        for name in names:
            render = block_renderer(name)
            if render is None:
                notes.append(f"{page}: unknown generated block {name!r} left as it is")
                continue
            if name not in cache:
                cache[name] = render(root, model)
            if cache[name] is None:
                notes.append(f"{page}: block {name!r} not refreshed: its generator is not in the code yet")
                continue
            text = replace_block(text, name, cache[name])  # type: ignore[arg-type]
        out[page] = text
    return out, notes


def write_all(root: Path, model: CliModel) -> list[Path]:
    """Write every generated file and block; the paths whose content changed."""
    changed = []
    contents, _ = expected(root, model)
    for path, text in contents.items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


def stale(root: Path, model: CliModel, docs_dir: Path | None = None) -> list[Path]:
    contents, _ = expected(root, model, docs_dir)
    return [p for p, text in contents.items() if not p.exists() or p.read_text() != text]
