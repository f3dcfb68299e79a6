"""Kimi-K2-Instruct: `miles full-train --model-name kimi-k2` (values in recipes/catalog/models.py, plan in recipe.py)."""

from recipes.catalog.recipe import module_attrs

NAME, SUMMARY, SPEC, Options, plan = module_attrs("kimi-k2")
