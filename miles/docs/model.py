"""The CLI as plain data: what the generators print and what the checkers compare prose against.

`miles_cli/options.py` builds these from the option declarations; `--help` renders the same objects
(so a default here is, character for character, the one `--help` prints). Nothing here imports typer
or a recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from miles.docs.flag import FlagDoc  # noqa: F401  (here too: the model's flags are FlagDocs)


@dataclass(frozen=True)
class CommandDoc:
    name: str  # "train", "docs check", ...
    summary: str
    flags: tuple[FlagDoc, ...]
    has_dry_run: bool = False
    starts_work: bool = False  # running it for real would start work (a check appends --dry-run)

    def flag(self, flag: str) -> FlagDoc | None:
        for f in self.flags:
            if flag in f.flags:
                return f
        return None


@dataclass(frozen=True)
class RecipeDoc:
    """A recipe and what it changes relative to the shared recipe options and the engine defaults."""

    name: str
    summary: str
    module: str  # "recipes.tiny_qwen3"
    options: dict[str, str]  # recipe option flag -> default shown by --help under this recipe
    changed_options: dict[str, tuple[str, str]]  # flag -> (base default, this recipe's default)
    extra_options: tuple[str, ...]  # flags only this recipe has
    engine_defaults: dict[str, tuple[str, str]]  # flag -> (declared default, default under this recipe)
    env: dict[str, str]  # environment variables the run gets (with default recipe options)


@dataclass
class CliModel:
    """Everything the docs know about the CLI.

    `commands` are built for the default recipe (what `miles <command> --help` shows without
    --model-name); `recipe_flags[name]` lists every flag of the run commands under each recipe (a
    flag is real if any recipe has it). `invoke(argv, env)` runs the real app in-process and returns
    (exit code, output); `parse(argv, env)` only parses, returning an error message or None.
    """

    program: str
    summary: str
    commands: dict[str, CommandDoc]
    recipes: dict[str, RecipeDoc]
    default_recipe: str
    recipe_flags: dict[str, dict[str, FlagDoc]]
    env_prefix: str  # "MILES_SCRIPT_"
    groups: list[tuple[str, str, list[str]]] = field(default_factory=list)  # (panel, config class, flags)
    run_env: dict[str, tuple[str, str]] = field(default_factory=dict)  # variable -> (value, flag that turns it on)
    declared_defaults: dict[str, str] = field(default_factory=dict)  # engine flag -> its declared default (no recipe)
    invoke: Callable[[list[str], dict[str, str]], tuple[int, str]] | None = None
    parse: Callable[[list[str], dict[str, str]], str | None] | None = None

    def all_flags(self) -> set[str]:
        out = {f for c in self.commands.values() for fd in c.flags for f in fd.flags}
        for flags in self.recipe_flags.values():
            out |= {f for fd in flags.values() for f in fd.flags}
        return out

    def flag_docs(self, flag: str) -> list[tuple[str, FlagDoc]]:
        """Every (command, FlagDoc) that has `flag`, recipe-specific ones included."""
        found = [(c.name, fd) for c in self.commands.values() for fd in c.flags if flag in fd.flags]
        for recipe, flags in self.recipe_flags.items():
            for fd in flags.values():
                if flag in fd.flags and not any(flag in f.flags for _, f in found):
                    found.append((f"--model-name {recipe}", fd))
        return found
