"""GLM-4.7-Flash: `miles full-train --model-name glm-4.7-flash` (values in recipes/catalog/models.py, plan in recipe.py)."""

from recipes.catalog.recipe import module_attrs

NAME, SUMMARY, SPEC, Options, plan = module_attrs("glm-4.7-flash")
