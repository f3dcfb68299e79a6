"""How an engine or recipe option is declared: one dataclass field with its help and rules as data.

Every option of `miles` is a dataclass field created with `option(...)`. The field carries, as data:

- `help`: the one-line help shown by `--help`, the printed table and `docs/reference/cli.md`;
- `derived`: for options whose default depends on other options, a `Derived(text, rule)`; the field's
  default is `None` ("unset") and `resolve()` fills it with `rule(config)`; `text` is what help says,
  and a test checks the text and the rule agree on real configurations;
- `env`: an environment variable whose value, when set, replaces the default (e.g. PROMETHEUS_PORT);
- `unsupported`: why this option cannot take a non-default value yet (e.g. "needs the SGLang rollout
  backend"); setting it is rejected with that reason rather than silently ignored;
- `flag`: the flag's name when it is not the field name in kebab case (e.g. `--from` for `from_format`);
- `secret`: the value is masked in the printed options table (keys, tokens);
- `choices`: taken from a `Literal[...]` annotation, never written twice;
- `unavailable`: `{choice: reason}` for choices the type allows but this build rejects (a backend not
  built yet); help lists them as unavailable and `resolve()` rejects them with the reason;
- `in_eval`: `miles eval` reads this option (it is a flag of `eval`; every other option is not);
- `run_env`: `{VARIABLE: value}` the run's processes get when this (boolean) option is true;
- `required`: the flag must be given (shown as required in help; the command refuses to run without it);
- `engine` (recipe options only): the engine option this recipe option is the user-facing name of,
  with `to_engine` mapping its value; the engine option is then not a flag of its own, so the two
  cannot disagree (one setting, one flag).

Nothing here imports anything heavy: `miles --help` reads these declarations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Derived:
    """A derived default: `text` is shown to users, `rule(config)` computes the value in `resolve()`."""

    text: str
    rule: Callable[[Any], Any]


def option(
    default: Any = MISSING,
    *,
    help: str,
    default_factory: Callable[[], Any] | None = None,
    derived: Derived | None = None,
    env: str | None = None,
    unsupported: str | None = None,
    metavar: str | None = None,
    flag: str | None = None,
    secret: bool = False,
    unavailable: dict[Any, str] | None = None,
    in_eval: bool = False,
    required: bool = False,
    run_env: dict[str, str] | None = None,
    engine: str | None = None,
    to_engine: Callable[[Any], Any] | None = None,
) -> Any:
    """Declare an option. See the module docstring for what each piece of metadata means."""
    if derived is not None and default is not MISSING and default is not None:
        raise ValueError("a derived option has default None (unset); resolve() fills it")
    if derived is not None and default is MISSING:
        default = None
    metadata = {
        "help": help,
        "derived": derived,
        "env": env,
        "unsupported": unsupported,
        "metavar": metavar,
        "flag": flag,
        "secret": secret,
        "unavailable": dict(unavailable or {}),
        "in_eval": in_eval,
        "required": required,
        "run_env": dict(run_env or {}),
        "engine": engine,
        "to_engine": to_engine,
    }
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_name(f: dataclasses.Field) -> str:
    """The flag of a field: its declared `flag`, else `rollout_batch_size` -> `--rollout-batch-size`."""
    declared = f.metadata.get("flag")
    return declared or "--" + f.name.replace("_", "-")
