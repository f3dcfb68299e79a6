"""The SGLang option groups behave as the dataclasses `dataclasses` would generate for the same fields.

miles/config/sglang.py builds `SGLangConfig` and `SGLangRouterConfig` (~600 fields) without the
per-field `__init__`, `__repr__` and `__eq__` that `dataclasses` compiles (most of their start-up
cost); the generic methods it uses instead must be indistinguishable from those.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from miles.config import sglang as sg

GROUPS = [sg.SGLangConfig, sg.SGLangRouterConfig]


def _reference(cls: type) -> type:
    """The same fields through dataclasses' own generated methods."""
    fields = [
        (f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
        for f in dataclasses.fields(cls)
    ]
    ref = dataclasses.make_dataclass(cls.__name__, fields)
    ref.__qualname__ = cls.__qualname__
    return ref


def _some_values(cls: type) -> dict:
    """A changed value for a few fields of each kind (bool, number, text, list)."""
    out = {}
    for f in dataclasses.fields(cls):
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if isinstance(value, bool):
            out[f.name] = not value
        elif isinstance(value, (int, float)):
            out[f.name] = value + 1
        elif isinstance(value, str):
            out[f.name] = value + "x"
        elif isinstance(value, list):
            out[f.name] = value + ["x"]
        if len(out) >= 12:
            break
    return out


@pytest.mark.parametrize("cls", GROUPS, ids=lambda c: c.__name__)
def test_generic_methods_equal_dataclass_generated_ones(cls):
    ref = _reference(cls)
    assert len(dataclasses.fields(cls)) > 90
    assert repr(cls()) == repr(ref())
    values = _some_values(cls)
    assert repr(cls(**values)) == repr(ref(**values))
    assert cls() == cls() and not (cls() != cls())
    assert cls(**values) != cls() and cls(**values) == cls(**values)
    assert cls().__eq__(ref()) is NotImplemented  # another class: not equal, as a dataclass says
    nan_field = next(f.name for f in dataclasses.fields(cls) if isinstance(f.default, float))
    nan = float("nan")  # one NaN object equals itself inside a tuple comparison; two NaNs do not
    assert (cls(**{nan_field: nan}) == cls(**{nan_field: nan})) is (ref(**{nan_field: nan}) == ref(**{nan_field: nan})) is True
    assert (cls(**{nan_field: nan}) == cls(**{nan_field: float("nan")})) is (ref(**{nan_field: nan}) == ref(**{nan_field: float("nan")})) is False
    assert cls.__hash__ is None and ref.__hash__ is None  # mutable: unhashable, like a dataclass
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_an_option'"):
        cls(not_an_option=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_an_option'"):
        ref(not_an_option=1)


@pytest.mark.parametrize("cls", GROUPS, ids=lambda c: c.__name__)
def test_copies_replace_and_fresh_defaults(cls):
    values = _some_values(cls)
    obj = cls(**values)
    assert pickle.loads(pickle.dumps(obj)) == obj
    assert copy.deepcopy(obj) == obj
    name = next(iter(values))
    assert getattr(dataclasses.replace(obj, **{name: getattr(cls(), name)}), name) == getattr(cls(), name)
    assert dataclasses.asdict(obj) == {f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:  # a list default: each instance gets its own
            assert getattr(cls(), f.name) is not getattr(cls(), f.name)
    assert sg.changed_values(obj) == values


def test_a_list_default_is_fresh_per_instance():
    """No pinned field has a non-empty list default today; the generic __init__ still calls the factory."""
    entry = {"name": "xs", "kind": "list", "default": ["a", 1], "help": "Some values.", "cli": "--xs", "choices": None}
    cls = sg._make("T", "t_", (entry,), {}, "Tool 1.0")
    a, b = cls(), cls()
    assert a.t_xs == ["a", "1"] and a.t_xs is not b.t_xs
    a.t_xs.append("z")
    assert cls().t_xs == ["a", "1"] and a != b
