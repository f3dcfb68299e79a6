"""Recipes for real models (Qwen3-4B, Qwen3-30B-A3B, DeepSeek-V4-Flash-FP8, GLM-4.7-Flash, Kimi-K2).

Each is typed data (`models.RECIPES`, a `ModelRecipe` per model) turned into a recipe by
`recipe.build`; the five modules here (`qwen3_4b`, ...) expose it in the shape `recipes/__init__.py`
registers (`NAME`, `SUMMARY`, `Options`, `plan`, plus `SPEC` with the training layout `--dry-run` prints).

    miles full-train --model-name qwen3-30b-a3b --dry-run     # the whole plan, no GPU needed
"""

from __future__ import annotations

from recipes.catalog import deepseek_v4_flash_fp8, glm_47_flash, kimi_k2, qwen3_4b, qwen3_30b_a3b

MODULES = (qwen3_4b, qwen3_30b_a3b, deepseek_v4_flash_fp8, glm_47_flash, kimi_k2)
