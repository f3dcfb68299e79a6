"""wandb sink without the wandb package: missing → UserError; a stand-in module records the calls."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from miles.config.tracking import TrackingConfig
from miles.errors import UserError
from miles.tracking import Tracker


class _FakeRun:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def log(self, data: dict, step: int) -> None:
        self.calls.append(("log", data, step))

    def finish(self, exit_code: int) -> None:
        self.calls.append(("finish", exit_code))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list[Any] = []
    module = types.ModuleType("wandb")

    def init(**kwargs: Any) -> _FakeRun:
        calls.append(("init", kwargs))
        return _FakeRun(calls)

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_missing_package_is_a_user_error(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(UserError) as info:
        Tracker(TrackingConfig(use_wandb=True), run_dir=run_dir, run_id="r", params={})
    assert str(info.value) == "--use-wandb needs the wandb package; install it with pip install 'miles[wandb]'."
    assert info.value.option == "--use-wandb"


def test_disabled_mode_needs_no_package(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    t = Tracker(TrackingConfig(use_wandb=True, wandb_mode="disabled"), run_dir=run_dir, run_id="r", params={})
    assert t.wandb is None
    t.finish()


def test_offline_defaults(run_dir: Path, fake_wandb: list) -> None:
    t = Tracker(TrackingConfig(use_wandb=True), run_dir=run_dir, run_id="2026-11-30 12:00", params={"a": {"b": 1}})
    t.log({"rollout/raw_reward": 0.5}, step=3)
    t.finish("FAILED")
    assert fake_wandb == [
        (
            "init",
            {
                "project": "miles",
                "group": "2026-11-30 12:00",
                "name": "2026-11-30 12:00",
                "id": "2026-11-30-12-00",  # wandb-safe and stable, so a resumed run continues it
                "resume": "allow",
                "dir": str(run_dir / "wandb"),
                "mode": "offline",
                "config": {"a.b": "1"},
            },
        ),
        ("log", {"rollout/raw_reward": 0.5}, 3),
        ("finish", 1),
    ]
    assert (run_dir / "wandb").is_dir()


def test_online_mode_and_explicit_flags(tmp_path: Path, fake_wandb: list) -> None:
    cfg = TrackingConfig(
        use_wandb=True, wandb_mode="online", wandb_project="proj", wandb_group="grp", wandb_dir=str(tmp_path / "wb")
    )
    Tracker(cfg, run_dir=tmp_path / "run", run_id="r", params={}).finish()
    init = fake_wandb[0][1]
    got = (init["mode"], init["project"], init["group"], init["dir"])
    assert got == ("online", "proj", "grp", str(tmp_path / "wb"))
    assert fake_wandb[-1] == ("finish", 0)
