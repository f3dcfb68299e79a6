"""Qwen3-30B-A3B: `miles full-train --model-name qwen3-30b-a3b` (values in recipes/catalog/models.py, plan in recipe.py)."""

from recipes.catalog.recipe import module_attrs

NAME, SUMMARY, SPEC, Options, plan = module_attrs("qwen3-30b-a3b")
