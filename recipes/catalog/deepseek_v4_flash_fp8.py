"""DeepSeek-V4-Flash-FP8: `miles full-train --model-name deepseek-v4-flash-fp8` (values in recipes/catalog/models.py, plan in recipe.py)."""

from recipes.catalog.recipe import module_attrs

NAME, SUMMARY, SPEC, Options, plan = module_attrs("deepseek-v4-flash-fp8")
