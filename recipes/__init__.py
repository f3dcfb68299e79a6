"""The registry of recipes: `--model-name` → recipe module (with `NAME`, `SUMMARY`, `Options`, `plan`).

A recipe module is imported when it is first looked up, so `miles train --help` imports only the
recipe it shows (each one builds its `Options` dataclass; the catalog's five also their model data).
tests/cli/test_fast_help.py checks that every name here is its module's `NAME` and that the catalog
(recipes/catalog/models.py) lists exactly the catalog names here.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Iterator, Mapping

from miles.errors import UserError

RECIPE_MODULES: dict[str, str] = {
    "tiny-qwen3": "recipes.tiny_qwen3",
    "tiny-qwen3-moe": "recipes.tiny_qwen3_moe",
    "tiny-qwen3-tools": "recipes.tiny_qwen3_tools",
    "qwen3-0.6b": "recipes.qwen3_hf",
    # real models, as data (recipes/catalog)
    "qwen3-4b": "recipes.catalog.qwen3_4b",
    "qwen3-30b-a3b": "recipes.catalog.qwen3_30b_a3b",
    "deepseek-v4-flash-fp8": "recipes.catalog.deepseek_v4_flash_fp8",
    "glm-4.7-flash": "recipes.catalog.glm_47_flash",
    "kimi-k2": "recipes.catalog.kimi_k2",
}
"""{recipe name: its module}, in the order errors and docs list them."""


class _Registry(Mapping[str, ModuleType]):
    """{name: recipe module}; a module is imported when first looked up."""

    def __getitem__(self, name: str) -> ModuleType:
        return importlib.import_module(RECIPE_MODULES[name])

    def __iter__(self) -> Iterator[str]:
        return iter(RECIPE_MODULES)

    def __len__(self) -> int:
        return len(RECIPE_MODULES)


RECIPES: Mapping[str, ModuleType] = _Registry()
DEFAULT_RECIPE = "tiny-qwen3"


def get_recipe(name: str) -> ModuleType:
    try:
        return RECIPES[name]
    except KeyError:
        raise UserError(
            f"--model-name {name!r} is not a recipe; choose one of: {', '.join(RECIPES)}.", option="--model-name"
        ) from None
