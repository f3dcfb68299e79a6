"""Options of `miles docs generate` and `miles docs check`, declared like every other command's
(one field per flag, help from the field). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.fields import option


@dataclass
class DocsGenerateOptions:
    root: str | None = option(None, metavar="DIR", help="Repository root (unset: this checkout).")


@dataclass
class DocsCheckOptions:
    root: str | None = option(None, metavar="DIR", help="Repository root (unset: this checkout).")
    docs_dir: str | None = option(None, metavar="DIR", help="Pages to check (unset: <root>/docs); must be a directory.")
