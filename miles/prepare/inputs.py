"""Checks that inputs a recipe cannot create (models, datasets on disk) are where the user said."""

from __future__ import annotations

from pathlib import Path

from miles.errors import UserError


def require_hf_dir(path: str, flag: str) -> None:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise UserError(
            f"{p} is not a Hugging Face model directory (no config.json); place the model there or point {flag} at its parent.",
            option=flag,
        )
