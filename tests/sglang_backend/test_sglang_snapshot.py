"""The checked-in ServerArgs/RouterArgs snapshots: what they hold, that they regenerate from the pinned
wheels unchanged, and that they equal the installed SGLang's fields where SGLang is importable.

Run: `pytest tests/sglang/test_sglang_snapshot.py`. The regeneration test needs the two pinned wheels:
it uses MILES_SGLANG_WHEEL_DIR when set, else downloads them (marked slow, skipped without network).
The cross-check runs only where `import sglang` works (a GPU environment).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest

from miles.rollout.sglang import SGLANG_ROUTER_VERSION, SGLANG_VERSION
from miles.rollout.sglang.snapshot import ROUTER_ARGS_FILE, SERVER_ARGS_FILE, main, router_fields, server_fields, snapshot_version


def test_snapshot_versions_are_the_pins():
    assert snapshot_version(SERVER_ARGS_FILE) == SGLANG_VERSION
    assert snapshot_version(ROUTER_ARGS_FILE) == SGLANG_ROUTER_VERSION


def test_snapshot_holds_what_the_reference_lists():
    by = {e["name"]: e for e in server_fields()}
    # 546 ServerArgs fields in 0.5.23, of which these 526 have a flag (the rest are internal or no_cli).
    assert len(by) == 526
    assert by["mem_fraction_static"]["kind"] == "float" and by["mem_fraction_static"]["default"] is None
    assert by["chunked_prefill_size"]["kind"] == "int"
    assert by["ep_size"] == {**by["ep_size"], "cli": "--ep-size", "kind": "int", "default": 1}
    assert by["tp_size"]["cli"] == "--tp-size"
    assert by["host"]["default"] == "127.0.0.1" and by["port"]["default"] == 30000
    assert by["deepep_mode"]["choices"] == ["auto", "normal", "low_latency"]
    assert "reasoning_parser" in by and "sampling_backend" in by  # registered by hand in add_cli_args
    for gone in ("enable_ep_moe", "enable_deepep_moe", "enable_overlap_schedule", "cuda_graph_max_bs", "disable_cuda_graph"):
        assert gone not in by, gone
    router = {e["name"]: e for e in router_fields()}
    assert router["policy"]["choices"] == ["random", "round_robin", "cache_aware", "power_of_two", "manual"]
    assert router["prometheus_port"]["default"] == 29000
    assert router["disable_health_check"]["kind"] == "bool"


def _online() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
def test_snapshot_regenerates_unchanged_from_the_pinned_wheels():
    wheel_dir = os.environ.get("MILES_SGLANG_WHEEL_DIR")
    if not wheel_dir and not _online():
        pytest.skip("needs the pinned wheels: set MILES_SGLANG_WHEEL_DIR or run with network")
    args = ["--check"] + (["--wheel-dir", wheel_dir] if wheel_dir else [])
    assert main(args) == 0


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed here (GPU environments only)")
def test_snapshot_equals_the_installed_server_args():
    import msgspec.structs
    import sglang
    from sglang.srt.server_args import ServerArgs

    assert sglang.__version__ == SGLANG_VERSION
    installed = {f.name: f for f in msgspec.structs.fields(ServerArgs)}
    for e in server_fields():
        assert e["name"] in installed, e["name"]
        f = installed[e["name"]]
        if e["default"] is not None and f.default is not msgspec.NODEFAULT:
            assert f.default == e["default"], e["name"]


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed here")
def test_snapshot_equals_the_installed_router_args():
    import argparse

    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser)
    flags = {s: a for a in parser._actions for s in a.option_strings}
    for e in router_fields():
        assert e["cli"] in flags, e["cli"]
        if e["kind"] != "list":
            assert flags[e["cli"]].default == e["default"], e["cli"]


def test_regeneration_script_is_in_the_repository():
    assert Path(__file__).resolve().parents[2].joinpath("miles/rollout/sglang/snapshot.py").is_file()
