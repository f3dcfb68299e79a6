"""The registry of recipes: `--model-name` → recipe module (with `NAME`, `SUMMARY`, `Options`, `plan`)."""

from __future__ import annotations

from types import ModuleType

from miles.errors import UserError
from recipes import qwen3_hf, tiny_qwen3

from recipes.catalog import MODULES as CATALOG  # noqa: E402  (real models, as data)

RECIPES: dict[str, ModuleType] = {m.NAME: m for m in (tiny_qwen3, qwen3_hf, *CATALOG)}
DEFAULT_RECIPE = tiny_qwen3.NAME


def get_recipe(name: str) -> ModuleType:
    try:
        return RECIPES[name]
    except KeyError:
        raise UserError(
            f"--model-name {name!r} is not a recipe; choose one of: {', '.join(RECIPES)}.", option="--model-name"
        ) from None
