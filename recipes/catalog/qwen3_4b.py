"""Qwen3-4B: `miles full-train --model-name qwen3-4b` (values in recipes/catalog/models.py, plan in recipe.py)."""

from recipes.catalog.recipe import module_attrs

NAME, SUMMARY, SPEC, Options, plan = module_attrs("qwen3-4b")
