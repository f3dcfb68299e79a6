"""SGLang passthrough options: `--sglang-<field>` and `--sglang-router-<field>`, generated from data.

Every command-line field of the pinned SGLang `ServerArgs` (and of sglang-router's `RouterArgs`)
becomes one miles option, declared like any other (`option(...)`) on two dataclasses built here from
the checked-in snapshots (miles/sglang_spec/server_args.json, router_args.json). A field's
option is `sglang_<field>` (flag `--sglang-<field>`, e.g. `--sglang-mem-fraction-static`), its
default is SGLang's own, and only values that differ from SGLang's default reach the server's argv
(miles/rollout/sglang/launch.py), under SGLang's own flag name.

Fields miles sets itself are not options (`SERVER_SET_BY_MILES`, `ROUTER_SET_BY_MILES` say which
miles option or rule owns each). Flags that SGLang removed (`--enable-ep-moe`, ...) are rejected with
the flag that replaced them (`REMOVED`). These options take effect only with `--rollout-backend
sglang`; `check()` (called by `resolve()`) rejects them otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal, Optional

from miles.config.fields import option
from miles.errors import UserError
from miles.sglang_spec import SGLANG_ROUTER_VERSION, SGLANG_VERSION, router_fields, server_fields

SERVER_PREFIX = "sglang_"
GROUPS = ("sglang_launch", "sglang", "sglang_router")  # their attributes on EngineConfig
ROUTER_PREFIX = "sglang_router_"

# ServerArgs fields that are not options: what sets them instead.
SERVER_SET_BY_MILES: dict[str, str] = {
    "model_path": "--hf-checkpoint (then each weight update)",
    "host": "the engine's node address (Ray)",
    "port": "a free port per engine",
    "tp_size": "--rollout-num-gpus-per-engine",
    "random_seed": "--rollout-seed plus the engine index",
    "enable_memory_saver": "--offload-rollout",
    "skip_server_warmup": "always on: the engine is warmed by the first rollout",
    "nnodes": "--rollout-num-gpus-per-engine over the GPUs per node",
    "node_rank": "the engine's placement",
    "dist_init_addr": "the engine's first node",
    "base_gpu_id": "Ray's CUDA_VISIBLE_DEVICES (always 0)",
    "gpu_id_step": "Ray's CUDA_VISIBLE_DEVICES (always 1)",
    "nccl_port": "a free port per engine",
}
ROUTER_SET_BY_MILES: dict[str, str] = {
    "host": "the driver node's address",
    "port": "a free port",
    "worker_urls": "the engines miles starts (registered as they become healthy)",
    "pd_disaggregation": "prefill/decode disaggregation is not launched by miles",
    "prefill": "prefill/decode disaggregation is not launched by miles",
    "decode": "prefill/decode disaggregation is not launched by miles",
    "policy": "--sglang-router-policy (the rollout options), which also drives the built-in engine servers' router",
}
# Router fields whose default miles changes: (default, why). The launcher always passes them.
ROUTER_MILES_DEFAULTS: dict[str, tuple[Any, str]] = {
    "prometheus_host": ("127.0.0.1", "miles default 127.0.0.1, not the router's 0.0.0.0"),
    "prometheus_port": (None, "unset = a free port; the router's fixed 29000 makes a second router on the host panic"),
}
ROUTER_SECRETS = {"api_key", "oracle_password", "postgres_db_url", "redis_url", "control_plane_api_keys"}

# Flags recipes and users know that SGLang removed or renamed: what to write instead.
REMOVED: dict[str, str] = {
    "--sglang-enable-ep-moe": "--sglang-ep-size N (SGLang removed --enable-ep-moe; the expert-parallel size alone enables it)",
    "--sglang-enable-deepep-moe": "--sglang-moe-a2a-backend deepep (SGLang removed --enable-deepep-moe)",
    "--sglang-enable-overlap-schedule": (
        "no flag: SGLang runs the overlap scheduler by default (turn it off with --sglang-disable-overlap-schedule)"
    ),
    "--sglang-cuda-graph-max-bs": "--sglang-cuda-graph-max-bs-decode N (and --sglang-cuda-graph-max-bs-prefill N)",
    "--sglang-disable-cuda-graph": "--sglang-cuda-graph-backend-decode disabled and --sglang-cuda-graph-backend-prefill disabled",
    "--sglang-enable-dp-attention": "--sglang-attn-dp-size N",
    "--sglang-router-ip": "no flag: miles starts its own router (tune it with --sglang-router-* options)",
    "--sglang-router-port": "no flag: miles starts its own router on a free port",
}

_HELP_LIMIT = 240


def _miles_flags(text: str, prefix: str, names: set[str]) -> str:
    """SGLang's help names its own flags (`--lora-paths`); say the miles flag (`--sglang-lora-paths`) instead."""

    def swap(m: re.Match) -> str:
        name = m.group(1).replace("-", "_")
        return f"--{prefix}{m.group(1)}" if name in names else f"SGLang's {m.group(1)}"

    return re.sub(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", swap, text) if "--" in text else text


def _short_help(text: str) -> str:
    """SGLang's help, cut at a sentence end near _HELP_LIMIT characters (the full text is in SGLang's docs);
    never inside a sentence."""
    text = text.strip() or "(no help text in SGLang)"
    if len(text) <= _HELP_LIMIT:
        return text
    cut = text.rfind(". ", 0, _HELP_LIMIT)
    if cut <= 40:  # no sentence end early enough: the first whole sentence (help never cuts a sentence)
        cut = text.find(". ", _HELP_LIMIT)
    return text[: cut + 1] if cut > 0 else text


def _annotation(entry: dict[str, Any]) -> Any:
    kind = entry["kind"]
    if kind == "bool":
        return Optional[bool] if entry["default"] is None else bool
    if kind == "list":
        return Optional[list[str]]
    if kind == "str" and entry["choices"]:
        choices = list(dict.fromkeys(entry["choices"] + ([entry["default"]] if isinstance(entry["default"], str) else [])))
        lit = Literal[tuple(choices)]  # type: ignore[valid-type]
        return Optional[lit] if entry["default"] is None else lit
    base = {"int": int, "float": float, "str": str}[kind]
    if entry["default"] is not None and not isinstance(entry["default"], base):
        base = str  # e.g. a float field whose default is written as an int
    return Optional[base] if entry["default"] is None else base


def _default(entry: dict[str, Any]) -> Any:
    value = entry["default"]
    if entry["kind"] == "list":
        return None if not value else [str(v) for v in value]
    if entry["kind"] == "str" and value is not None and not isinstance(value, str):
        return str(value)
    if isinstance(value, (dict, list)):
        return None
    return value


def _make(
    name: str, prefix: str, entries: tuple[dict[str, Any], ...], skip: dict[str, str], tool: str, secrets=frozenset(), overrides=None
) -> type:
    fields = []
    option_names = {e["name"] for e in entries if e["name"] not in skip and not e.get("required")}
    for entry in entries:
        if entry["name"] in skip or entry.get("required"):
            continue
        own = _miles_flags(_short_help(entry["help"]), prefix.replace("_", "-"), option_names)
        help_text = f"{own} ({tool} {entry['cli']})"
        default = _default(entry)
        if overrides and entry["name"] in overrides:
            default, why = overrides[entry["name"]]
            entry = {**entry, "default": default}
            help_text = f"{own} ({tool} {entry['cli']}; {why})"
        if isinstance(default, list):
            f = option(default_factory=lambda d=tuple(default): list(d), help=help_text, secret=entry["name"] in secrets)
        else:
            f = option(default, help=help_text, secret=entry["name"] in secrets)
        fields.append((prefix + entry["name"], _annotation(entry), f))
    # dataclasses would generate and compile an __init__, __repr__ and __eq__ with one line per field:
    # for SGLang's ~600 fields that is most of `miles train --help`'s start-up (30 ms). The generic
    # methods below do the same from the field list (tests/sglang_backend/test_sglang_options.py).
    cls = dataclasses.make_dataclass(
        name, fields, init=False, repr=False, eq=False,
        namespace={"__init__": _generic_init, "__repr__": _generic_repr, "__eq__": _generic_eq},
    )  # fmt: skip
    cls.__module__ = __name__
    cls.__doc__ = f"{tool} options generated from the pinned snapshot; see the module docstring."
    cls._defaults = tuple(
        (f.name, f.default, None if f.default_factory is dataclasses.MISSING else f.default_factory)  # type: ignore[misc]
        for f in dataclasses.fields(cls)
    )
    return cls


def _generic_init(self: Any, **values: Any) -> None:
    """Each field from `values`, else its default (a fresh one from its factory), as a dataclass __init__."""
    for name, default, factory in self._defaults:
        if name in values:
            setattr(self, name, values.pop(name))
        else:
            setattr(self, name, default if factory is None else factory())
    if values:
        raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword argument {next(iter(values))!r}")


def _generic_repr(self: Any) -> str:
    return f"{type(self).__qualname__}(" + ", ".join(f"{name}={getattr(self, name)!r}" for name, _, _ in self._defaults) + ")"


def _generic_eq(self: Any, other: Any) -> Any:
    if other.__class__ is not self.__class__:
        return NotImplemented
    names = [name for name, _, _ in self._defaults]
    return tuple(getattr(self, n) for n in names) == tuple(getattr(other, n) for n in names)


@dataclasses.dataclass
class SGLangLaunchConfig:
    """How miles starts the SGLang processes (options of miles, not of SGLang)."""

    sglang_server_command: Optional[str] = option(
        None,
        help=(
            "Command that starts one SGLang server, e.g. \"/opt/sglang/bin/python -m sglang.launch_server\" for SGLang "
            f"{SGLANG_VERSION} in another environment; unset = this interpreter's `python -m sglang.launch_server`."
        ),
    )
    sglang_router_command: Optional[str] = option(
        None,
        help="Command that starts sglang-router; unset = this interpreter's `python -m sglang_router.launch_router`.",
    )
    sglang_server_start_timeout: float = option(
        600.0, help="Seconds each SGLang server may take from start to answering /health (model load included)."
    )


SGLangConfig = _make(
    "SGLangConfig", SERVER_PREFIX, server_fields(), SERVER_SET_BY_MILES, f"SGLang {SGLANG_VERSION}"
)
SGLangRouterConfig = _make(
    "SGLangRouterConfig",
    ROUTER_PREFIX,
    router_fields(),
    ROUTER_SET_BY_MILES,
    f"sglang-router {SGLANG_ROUTER_VERSION}",
    ROUTER_SECRETS,
    ROUTER_MILES_DEFAULTS,
)


def server_entry(option_name: str) -> dict[str, Any]:
    """The snapshot entry behind option `sglang_<field>`."""
    return _by_name(server_fields())[option_name[len(SERVER_PREFIX):]]


def router_entry(option_name: str) -> dict[str, Any]:
    return _by_name(router_fields())[option_name[len(ROUTER_PREFIX):]]


def _by_name(entries: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in entries}


def changed_values(group: Any) -> dict[str, Any]:
    """{option name: value} of every option in an SGLang group whose value differs from SGLang's default."""
    out = {}
    for f in dataclasses.fields(group):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        value = getattr(group, f.name)
        if value != default:
            out[f.name] = value
    return out


def removed_flag_error(flag: str) -> UserError | None:
    """The error for a flag SGLang removed (`--sglang-enable-ep-moe` ...), or None for any other flag."""
    name = flag.partition("=")[0]
    if name.startswith("--no-"):
        name = "--" + name[len("--no-"):]
    if name in REMOVED:
        return UserError(f"{name} does not exist in SGLang {SGLANG_VERSION}; did you mean {REMOVED[name]}?", option=name)
    # Upstream miles spells router options --router-<name>; here they are --sglang-router-<name>.
    if name.startswith("--router-"):
        field = name[len("--router-"):].replace("-", "_")
        if field in _by_name(router_fields()) and (field not in ROUTER_SET_BY_MILES or field == "policy"):
            return UserError(f"No such option {name}; did you mean --sglang-router-{name[len('--router-'):]}?", option=name)
    return None


def check_removed_flags(tokens: list[str]) -> None:
    """Raise the removed-flag error for the first such flag in `tokens` (before `--`, and after it)."""
    for token in tokens:
        if token.startswith("--"):
            err = removed_flag_error(token)
            if err is not None:
                raise err


def check(cfg: Any) -> None:
    """SGLang options only take effect with --rollout-backend sglang; bool flags SGLang cannot turn off."""
    server, router = changed_values(cfg.sglang), changed_values(cfg.sglang_router)
    launch = changed_values(cfg.sglang_launch)
    if cfg.rollout.rollout_backend != "sglang" and (server or router or launch):
        name = sorted(server or router or launch)[0]
        flag = "--" + name.replace("_", "-")
        raise UserError(
            f"{flag} configures SGLang servers, which run only with --rollout-backend sglang; add "
            "--rollout-backend sglang or drop the flag.",
            option=flag,
        )
    r = cfg.rollout
    if r.rollout_backend != "sglang" and r.sglang_server_concurrency != 512:
        raise UserError(
            "--sglang-server-concurrency limits requests per SGLang server, which run only with --rollout-backend sglang; "
            "add --rollout-backend sglang or drop the flag.",
            option="--sglang-server-concurrency",
        )
    if r.sglang_server_concurrency < 1:
        raise UserError("--sglang-server-concurrency must be at least 1.", option="--sglang-server-concurrency")
    for name, value in server.items():
        entry = server_entry(name)
        if entry["kind"] == "bool" and value is False:
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"--no-{flag[2:]} cannot be passed to SGLang {SGLANG_VERSION}: {entry['cli']} is an on-switch whose "
                "default SGLang decides; drop the flag.",
                option=flag,
            )

