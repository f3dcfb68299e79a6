"""The engine configuration: one typed dataclass per option group, and the index of all options.

`EngineConfig` is the single source of truth for every engine option. The CLI flags, `--help`, the
printed options table and `docs/reference/cli.md` are all generated from the declarations collected
here by `option_specs()`; `resolve()` (miles/config/resolve.py) fills derived defaults and rejects
contradictions. Importing this module is cheap (no torch, ray or transformers).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from miles.config.algo import AlgoConfig
from miles.config.asynchrony import AsyncConfig
from miles.config.ckpt import CheckpointConfig
from miles.config.cluster import ClusterConfig
from miles.config.critic import CriticConfig
from miles.config.data import DataConfig
from miles.config.debug import DebugConfig
from miles.config.eval import EvalConfig
from miles.config.fault_tolerance import FaultToleranceConfig
from miles.config.fields import Derived, flag_name
from miles.config.lora import LoraConfig
from miles.config.opd import OpdConfig
from miles.config.optimizer import OptimizerConfig
from miles.config.reward import RewardConfig
from miles.config.rollout import RolloutConfig
from miles.config.sglang import SGLangConfig, SGLangLaunchConfig, SGLangRouterConfig
from miles.config.tracking import TrackingConfig
from miles.config.train import TrainConfig

# (attribute on EngineConfig, dataclass, help panel title) in the order help and docs show them.
GROUPS: tuple[tuple[str, type, str], ...] = (
    ("cluster", ClusterConfig, "Cluster"),
    ("train", TrainConfig, "Training"),
    ("lora", LoraConfig, "LoRA"),
    ("rollout", RolloutConfig, "Rollout"),
    ("data", DataConfig, "Data"),
    ("eval", EvalConfig, "Eval"),
    ("algo", AlgoConfig, "Algorithm"),
    ("critic", CriticConfig, "PPO critic"),
    ("opd", OpdConfig, "On-policy distillation"),
    ("reward", RewardConfig, "Reward"),
    ("optimizer", OptimizerConfig, "Optimizer"),
    ("ckpt", CheckpointConfig, "Checkpoint"),
    ("tracking", TrackingConfig, "Tracking"),
    ("fault_tolerance", FaultToleranceConfig, "Fault tolerance"),
    ("asynchrony", AsyncConfig, "Asynchronous training"),
    ("debug", DebugConfig, "Debug"),
    ("sglang_launch", SGLangLaunchConfig, "SGLang launch"),
    ("sglang", SGLangConfig, "SGLang server"),
    ("sglang_router", SGLangRouterConfig, "SGLang router"),
)


@dataclass
class RunContext:
    """Which run this configuration is for; not an option. The CLI and `miles_cli.api` set it from the
    recipe options before `resolve()`, so derived defaults can name the run (tracking sinks)."""

    run_id: str | None = None
    run_dir: str | None = None


@dataclass
class EngineConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    opd: OpdConfig = field(default_factory=OpdConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    asynchrony: AsyncConfig = field(default_factory=AsyncConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    run: RunContext = field(default_factory=RunContext)
    sglang_launch: SGLangLaunchConfig = field(default_factory=SGLangLaunchConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # type: ignore[valid-type]
    sglang_router: SGLangRouterConfig = field(default_factory=SGLangRouterConfig)  # type: ignore[valid-type]

    def get(self, name: str) -> Any:
        return getattr(getattr(self, spec(name).group), name)

    def set(self, name: str, value: Any) -> None:
        setattr(getattr(self, spec(name).group), name, value)

    def flat(self) -> dict[str, Any]:
        """Every option as `{field_name: value}` in help order (for tables, MLflow params, dumps)."""
        return {s.name: self.get(s.name) for s in option_specs()}

    @property
    def layout(self) -> Any:
        """The run's derived layout (`miles.config.layout.RunLayout`): the one `resolve()` stored, or,
        for a configuration made without it (tests, in-process use), the layout of its current values."""
        stored = self.__dict__.get("_layout")
        if stored is not None:
            return stored
        from miles.config.layout import run_layout

        return run_layout(self)

    @layout.setter
    def layout(self, value: Any) -> None:
        self.__dict__["_layout"] = value


@dataclass(frozen=True)
class OptionSpec:
    """Everything the CLI, the docs and resolve() need to know about one option."""

    name: str  # field name, unique across all groups (and across recipe options)
    group: str  # attribute of EngineConfig (or "recipe")
    panel: str
    field: dataclasses.Field
    kind: Literal["bool", "tristate", "int", "float", "str", "choice", "list"]
    base_type: type  # element type for lists; the scalar type otherwise
    choices: tuple[Any, ...] | None
    optional: bool  # None is a legal value

    @property
    def flag(self) -> str:
        return flag_name(self.field)

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def derived(self) -> Derived | None:
        return self.field.metadata.get("derived")

    @property
    def env(self) -> str | None:
        return self.field.metadata.get("env")

    @property
    def unsupported(self) -> str | None:
        return self.field.metadata.get("unsupported")

    @property
    def unavailable(self) -> dict[Any, str]:
        """Choices the type allows but this build rejects, each with the reason."""
        return self.field.metadata.get("unavailable") or {}

    @property
    def available_choices(self) -> tuple[Any, ...] | None:
        if self.choices is None:
            return None
        return tuple(c for c in self.choices if c not in self.unavailable)

    @property
    def required(self) -> bool:
        return bool(self.field.metadata.get("required"))

    @property
    def in_eval(self) -> bool:
        return bool(self.field.metadata.get("in_eval"))

    @property
    def run_env(self) -> dict[str, str]:
        return self.field.metadata.get("run_env") or {}

    @property
    def engine(self) -> str | None:
        """For a recipe option: the engine option it is the user-facing name of."""
        return self.field.metadata.get("engine")

    def to_engine(self, value: Any) -> Any:
        convert = self.field.metadata.get("to_engine")
        return convert(value) if convert is not None else value

    @property
    def secret(self) -> bool:
        return bool(self.field.metadata.get("secret"))

    @property
    def default(self) -> Any:
        """The declared default (before environment variables and recipes)."""
        if self.field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            return self.field.default_factory()  # type: ignore[misc]
        return None if self.field.default is dataclasses.MISSING else self.field.default


def describe_type(annotation: Any) -> tuple[str, type, tuple[Any, ...] | None, bool]:
    """(kind, base type, choices, optional) of a field annotation such as `int | None` or `Literal[...]`."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"unsupported option type {annotation!r}")
        annotation = args[0]
        origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        return "choice", type(choices[0]), choices, optional
    if origin in (list, tuple):
        (elem,) = typing.get_args(annotation)[:1]
        return "list", elem, None, optional
    if annotation is bool:
        return ("tristate" if optional else "bool"), bool, None, optional
    if annotation in (int, float, str):
        return annotation.__name__, annotation, None, optional
    raise TypeError(f"unsupported option type {annotation!r}")


def specs_of(cls: type, group: str, panel: str) -> list[OptionSpec]:
    return list(_specs_of(cls, group, panel))


@functools.cache
def _specs_of(cls: type, group: str, panel: str) -> tuple[OptionSpec, ...]:
    # Cached: `get_type_hints` compiles every string annotation again on each call, and building one
    # command's help asks for the same recipe's specs hundreds of times (seconds on a loaded machine).
    hints = None
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        annotation = f.type
        if isinstance(annotation, str):  # generated classes (SGLang's) annotate with the types themselves
            hints = hints or typing.get_type_hints(cls)
            annotation = hints[f.name]
        kind, base, choices, optional = describe_type(annotation)
        out.append(OptionSpec(f.name, group, panel, f, kind, base, choices, optional))
    return tuple(out)


@functools.cache
def option_specs() -> tuple[OptionSpec, ...]:
    specs: list[OptionSpec] = []
    for group, cls, panel in GROUPS:
        specs.extend(specs_of(cls, group, panel))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dupes = {n for n in names if names.count(n) > 1}
        raise AssertionError(f"option names must be unique across groups: {sorted(dupes)}")
    return tuple(specs)


@functools.cache
def _index() -> dict[str, OptionSpec]:
    return {s.name: s for s in option_specs()}


def spec(name: str) -> OptionSpec:
    return _index()[name]


def spec_by_flag(flag: str) -> OptionSpec | None:
    for s in option_specs():
        if s.flag == flag:
            return s
    return None
