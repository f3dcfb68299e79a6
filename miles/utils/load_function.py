"""Resolve the `--*-path` hook flags (`--custom-rm-path`, `--custom-loss-function-path`, ...) to objects.

A hook path is `package.module.attr` (importable from the working directory or the installed
packages) or `path/to/file.py:attr`. A path that cannot be resolved is a user error naming the flag.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from miles.errors import UserError


def load_function(path: str | None, *, flag: str) -> Any:
    """Return the object named by `path`, or None when `path` is empty. `flag` names the option in errors."""
    if not path:
        return None
    if ":" in path:
        file_part, _, attr = path.rpartition(":")
        file = Path(file_part)
        if not file.is_file():
            raise UserError(f"{flag} {path!r}: file {file} does not exist; give an existing .py file or a module path.", option=flag)
        module_name = f"_miles_hook_{abs(hash(str(file.resolve())))}"
        spec = importlib.util.spec_from_file_location(module_name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        module_path, _, attr = path.rpartition(".")
        if not module_path:
            raise UserError(f"{flag} {path!r} is not a dotted path; write it as package.module.function.", option=flag)
        if str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_path)
        except ModuleNotFoundError as e:
            raise UserError(f"{flag} {path!r}: module {module_path!r} cannot be imported ({e}); check the spelling and PYTHONPATH.", option=flag) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UserError(f"{flag} {path!r}: {module.__name__} has no attribute {attr!r}.", option=flag) from None
