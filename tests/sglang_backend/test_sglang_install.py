"""One SGLang version everywhere, and a GPU install that resolves.

- the pins in miles/sglang_spec/__init__.py are the ones in requirements/gpu.txt, in both field
  snapshots, in every Docker variant's base image tag and in the Dockerfile's default;
- requirements/gpu.txt holds exactly pyproject.toml's dependencies minus torch (which SGLang pins);
- pyproject.toml has no extra that cannot resolve (the old `sglang` extra fought the CPU torch pin);
- with network (`-m slow`), `pip install --dry-run -r requirements/gpu.txt` resolves in a fresh venv
  to sglang 0.5.23, sglang-router 0.3.2 and SGLang's torch, and the CPU extras still resolve to the
  CPU torch 2.13.0.

Run: `pytest tests/sglang_backend/test_sglang_install.py` (instant); the resolution checks:
`pytest -m slow tests/sglang_backend/test_sglang_install.py` (about 4 minutes, network).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from miles.docker_images import VARIANTS
from miles.sglang_spec import ROUTER_ARGS_FILE, SERVER_ARGS_FILE, SGLANG_ROUTER_VERSION, SGLANG_VERSION, snapshot_version

ROOT = Path(__file__).resolve().parents[2]
GPU_REQUIREMENTS = ROOT / "requirements/gpu.txt"
# Packages SGLang pins for its CUDA build: left to SGLang's resolution in the GPU install.
LEFT_TO_SGLANG = {"torch"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def gpu_requirements() -> list[str]:
    return [line.strip() for line in GPU_REQUIREMENTS.read_text().splitlines() if line.strip() and not line.startswith("#")]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_one_sglang_version_everywhere():
    reqs = gpu_requirements()
    assert f"sglang=={SGLANG_VERSION}" in reqs
    assert f"sglang-router=={SGLANG_ROUTER_VERSION}" in reqs
    assert snapshot_version(SERVER_ARGS_FILE) == SGLANG_VERSION
    assert snapshot_version(ROUTER_ARGS_FILE) == SGLANG_ROUTER_VERSION
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert f"ARG SGLANG_IMAGE_TAG=v{SGLANG_VERSION}\n" in dockerfile  # the cu13 variants build on the default
    for name, variant in VARIANTS.items():
        tag = dict(variant.build_args).get("SGLANG_IMAGE_TAG", f"v{SGLANG_VERSION}")
        assert tag == f"v{SGLANG_VERSION}" or tag.startswith(f"v{SGLANG_VERSION}-"), (name, tag)
    extras = pyproject()["project"]["optional-dependencies"]
    assert extras["router"] == [f"sglang-router=={SGLANG_ROUTER_VERSION}"]


def test_gpu_requirements_are_pyprojects_dependencies_minus_torch():
    deps = pyproject()["project"]["dependencies"]
    expected = [d for d in deps if _name(d) not in LEFT_TO_SGLANG]
    rest = [r for r in gpu_requirements() if _name(r) not in {"sglang", "sglang-router"}]
    assert rest == expected


def test_no_extra_pulls_sglang_against_the_cpu_torch_pin():
    extras = pyproject()["project"]["optional-dependencies"]
    assert not any(_name(r) == "sglang" for reqs in extras.values() for r in reqs)
    assert "torch==2.13.0" in pyproject()["project"]["dependencies"]


def test_the_images_check_the_pins():
    for dockerfile in ("docker/Dockerfile", "docker/Dockerfile.rocm"):
        text = (ROOT / dockerfile).read_text()
        assert "--sglang-pins /root/miles/miles/sglang_spec/__init__.py" in text, dockerfile
        assert "COPY miles/sglang_spec/__init__.py" in text, dockerfile
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        import install_miles
    finally:
        sys.path.pop(0)
    assert install_miles.pinned_versions(ROOT / "miles/sglang_spec/__init__.py") == {
        "sglang": SGLANG_VERSION, "sglang-router": SGLANG_ROUTER_VERSION,
    }  # fmt: skip


def _online() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
        return True
    except OSError:
        return False


def _dry_run(tmp_path: Path, *args: str) -> dict[str, str]:
    """`pip install --dry-run --report` in a fresh venv, ignoring this machine's pip config."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    report = tmp_path / "report.json"
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}
    env.pop("PIP_CONSTRAINT", None)
    cmd = [str(venv / "bin/python"), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=2300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}


@pytest.mark.slow
@pytest.mark.timeout(2400)  # resolving SGLang's ~260 packages: 4 min on a quiet machine, much more on a busy one
def test_gpu_install_resolves(tmp_path):
    if not _online():
        pytest.skip("needs network to resolve against PyPI")
    got = _dry_run(tmp_path, "-r", str(GPU_REQUIREMENTS))
    assert got["sglang"] == SGLANG_VERSION and got["sglang-router"] == SGLANG_ROUTER_VERSION
    assert got["torch"].split("+")[0] != "2.13.0"  # SGLang's torch, not the CPU pin
    assert got["megatron-core"] == "0.16.1" and got["transformers"].startswith("5.")
