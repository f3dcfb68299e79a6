"""Tests of `miles docker-build` and `miles.docker_images`: argv per variant and tag mode, build-arg
and proxy rules, exit codes of bad invocations, the image-inputs hash over a temporary git repo,
Dockerfile/registry/docs consistency, and that the command stays free of heavy imports.

Run: `pytest tests/cli/test_docker_build.py` (a few seconds; needs git, no Docker engine: the real
build path is exercised against a fake `docker` executable on PATH).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import get_args

import pytest
import typer
from typer.testing import CliRunner

import miles_cli.docker_build as cli
from miles.docker_images import (
    IMAGE_INPUT_ROOTS,
    VARIANTS,
    VariantName,
    image_inputs,
    image_inputs_hash,
    image_tags,
    plan_build,
    variants_markdown_table,
)
from miles.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
FIXED_NOW = datetime(2026, 3, 4, 5, 6, 59, tzinfo=timezone.utc)
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy")


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> typer.Typer:
    """The command registered the way miles_cli.main registers it, with a fixed clock and no proxies."""
    for name in PROXY_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "_utc_now", lambda: FIXED_NOW)
    typer_app = typer.Typer(add_completion=False)
    typer_app.command("docker-build")(cli.docker_build)

    @typer_app.command("other")  # a second command, so "docker-build" stays a subcommand as in main
    def other() -> None:
        pass

    return typer_app


def invoke(app: typer.Typer, *args: str, env: dict[str, str | None] | None = None):
    return CliRunner().invoke(app, ["docker-build", *args], env=env)


def label(dockerfile: str) -> str:
    return f"miles.image-inputs={image_inputs_hash(ROOT, dockerfile)}"


# --- the exact argv, written out -------------------------------------------------------------------


def test_dry_run_cu13_dev_prints_exact_argv(app):
    result = invoke(app, "--variant", "cu13", "--image-tag", "dev", "--dry-run")
    assert result.exit_code == 0, result.output
    expected = [
        "docker", "buildx", "build",
        "-f", "docker/Dockerfile",
        "--platform", "linux/amd64,linux/arm64",
        "--build-arg", "NO_PROXY=localhost,127.0.0.1",
        "--label", label("docker/Dockerfile"),
        "-t", "radixark/miles:dev",
        "-t", "radixark/miles:dev-202603040506",
        ".",
    ]  # fmt: skip
    assert result.stdout == shlex.join(expected) + "\n"


def test_dry_run_cu12_x86_latest_with_push(app):
    result = invoke(app, "--variant", "cu12-x86", "--image-tag", "latest", "--push", "--dry-run")
    assert result.exit_code == 0, result.output
    expected = [
        "docker", "buildx", "build",
        "-f", "docker/Dockerfile",
        "--platform", "linux/amd64",
        "--push",
        "--build-arg", "NO_PROXY=localhost,127.0.0.1",
        "--build-arg", "ENABLE_CUDA_13=0",
        "--build-arg", "SGLANG_IMAGE_TAG=v0.5.23-cu129",
        "--build-arg", "WHEELS_TAG_X86=cu129-x86_64",
        "--label", label("docker/Dockerfile"),
        "-t", "radixark/miles:latest-cu12",
        ".",
    ]  # fmt: skip
    assert result.stdout == shlex.join(expected) + "\n"


def test_dry_run_rocm700_mi35x_custom_uses_its_own_dockerfile(app):
    result = invoke(
        app, "--variant", "rocm700-mi35x", "--image-tag", "custom", "--custom-tag", "v0.1.0",
        "--dockerfile", "docker/Dockerfile", "--dry-run",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    expected = [
        "docker", "buildx", "build",
        "-f", "docker/Dockerfile.rocm",
        "--build-arg", "NO_PROXY=localhost,127.0.0.1",
        "--build-arg", "GPU_ARCH=gfx950",
        "--build-arg", "SGLANG_IMAGE_TAG=v0.5.23-rocm700-mi35x",
        "--build-arg", "SGLANG_USE_ROCM700A=1",
        "--label", label("docker/Dockerfile.rocm"),
        "-t", "rocm/sgl-dev:v0.1.0-rocm700-mi35x",
        ".",
    ]  # fmt: skip
    assert result.stdout == shlex.join(expected) + "\n"
    assert "--dockerfile docker/Dockerfile is ignored" in result.stderr


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", ["latest", "dev", "custom"])
def test_every_variant_and_tag_mode(variant, mode):
    v = VARIANTS[variant]
    plan = plan_build(
        variant, mode, repo_root=ROOT, environ={}, now=FIXED_NOW, custom_tag="rc1" if mode == "custom" else ""
    )
    prefix = v.tag_prefix or "dev"
    expected_tags = {
        "latest": [f"{v.image}:latest{v.tag_postfix}"],
        "dev": [f"{v.image}:{prefix}{v.tag_postfix}", f"{v.image}:{prefix}{v.tag_postfix}-202603040506"],
        "custom": [f"{v.image}:rc1{v.tag_postfix}"],
    }[mode]
    dockerfile = "docker/Dockerfile.rocm" if variant.startswith("rocm") else "docker/Dockerfile"
    platform = ["--platform", ",".join(v.platforms)] if v.platforms else []
    build_args = [f"NO_PROXY=localhost,127.0.0.1"] + [f"{k}={val}" for k, val in v.build_args]
    expected = ["docker", "buildx", "build", "-f", dockerfile, *platform]
    expected += [x for arg in build_args for x in ("--build-arg", arg)]
    expected += ["--label", label(dockerfile)] + [x for t in expected_tags for x in ("-t", t)] + ["."]
    assert plan.argv == expected
    assert plan.tags == expected_tags


def test_variant_registry_matches_upstream_names_and_literal():
    assert tuple(VARIANTS) == get_args(VariantName)
    assert set(VARIANTS) == {
        "cu13", "cu13-x86", "cu13-aarch64", "cu12-x86", "rocm700-mi30x", "rocm700-mi35x", "rocm720-mi35x"
    }  # fmt: skip
    assert VARIANTS["cu13-aarch64"].platforms == ("linux/arm64",)
    assert dict(VARIANTS["rocm720-mi35x"].build_args) == {
        "GPU_ARCH": "gfx950",
        "SGLANG_IMAGE_TAG": "v0.5.23-rocm720-mi35x",
        "APPLY_ROCR_VMMFIX": "1",
        "TE_USE_WHEEL": "1",
    }
    assert dict(VARIANTS["rocm700-mi30x"].build_args)["GPU_ARCH"] == "gfx942"


def test_dev_tag_timestamp_is_utc_minutes():
    # 01:30 at +02:00 on Jan 2 is 23:30 UTC on Jan 1; seconds are dropped, not rounded.
    local = datetime(2026, 1, 2, 1, 30, 59, tzinfo=timezone(timedelta(hours=2)))
    assert image_tags(VARIANTS["rocm700-mi30x"], "dev", now=local) == [
        "rocm/sgl-dev:miles-rocm700-mi30x",
        "rocm/sgl-dev:miles-rocm700-mi30x-202601012330",
    ]
    with pytest.raises(ValueError, match="timezone-aware"):
        image_tags(VARIANTS["cu13"], "dev", now=datetime(2026, 1, 2))


# --- build args and proxies ------------------------------------------------------------------------


def build_arg_values(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == "--build-arg"]


def test_build_arg_last_wins_and_overrides_variant(app):
    result = invoke(
        app, "--variant", "cu12-x86", "--image-tag", "latest", "--dry-run",
        "--build-arg", "FOO=1", "--build-arg", "SGLANG_IMAGE_TAG=mine", "--build-arg", "FOO=a=b",
        "--build-arg", "EMPTY=",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert build_arg_values(shlex.split(result.stdout)) == [
        "NO_PROXY=localhost,127.0.0.1",
        "ENABLE_CUDA_13=0",
        "SGLANG_IMAGE_TAG=mine",
        "WHEELS_TAG_X86=cu129-x86_64",
        "FOO=a=b",
        "EMPTY=",
    ]


def test_proxies_pass_through_lower_case_first(app):
    env = {
        "HTTP_PROXY": "http://upper:1",
        "http_proxy": "http://lower:2",
        "HTTPS_PROXY": "http://secure:3",
        "NO_PROXY": "corp.example",  # the host's NO_PROXY never reaches the build
    }
    result = invoke(app, "--variant", "cu13-x86", "--image-tag", "latest", "--dry-run", env=env)
    assert result.exit_code == 0, result.output
    assert build_arg_values(shlex.split(result.stdout)) == [
        "HTTP_PROXY=http://lower:2",
        "HTTPS_PROXY=http://secure:3",
        "NO_PROXY=localhost,127.0.0.1",
    ]


def test_no_proxy_can_be_overridden_explicitly(app):
    result = invoke(
        app, "--variant", "cu13-x86", "--image-tag", "latest", "--dry-run", "--build-arg", "NO_PROXY=*"
    )
    assert build_arg_values(shlex.split(result.stdout)) == ["NO_PROXY=*"]


# --- bad invocations ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, option",
    [
        (["--image-tag", "dev"], "--variant"),
        (["--variant", "cu14", "--image-tag", "dev"], "--variant"),
        (["--variant", "cu13"], "--image-tag"),
        (["--variant", "cu13", "--image-tag", "nightly"], "--image-tag"),
        (["--variant", "cu13", "--image-tag", "custom"], "--custom-tag"),
        (["--variant", "cu13", "--image-tag", "dev", "--custom-tag", "x"], "--custom-tag"),
        (["--variant", "cu13", "--image-tag", "custom", "--custom-tag", "-x"], "--custom-tag"),
        (["--variant", "cu13", "--image-tag", "custom", "--custom-tag", "a/b"], "--custom-tag"),
        (["--variant", "cu13", "--image-tag", "latest", "--build-arg", "NOVALUE"], "--build-arg"),
        (["--variant", "cu13", "--image-tag", "latest", "--build-arg", "=x"], "--build-arg"),
        (["--variant", "cu13", "--image-tag", "latest", "--build-arg", "A B=x"], "--build-arg"),
        (["--variant", "cu13", "--image-tag", "latest", "--dockerfile", "docker/Nope"], "--dockerfile"),
        (["--variant", "cu13", "--image-tag", "latest", "--dockerfile", "/etc/hostname"], "--dockerfile"),
    ],
)
def test_bad_invocations_exit_2_naming_the_option(app, args, option):
    result = invoke(app, *args, "--dry-run")
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # Click's usage error, not a crash
    assert "Traceback" not in result.output
    assert option in result.output


# --- running the build (fake docker on PATH) ------------------------------------------------------

FAKE_DOCKER = """\
#!{python}
import json, os, sys, time
mode = os.environ["FAKE_DOCKER_MODE"]
with open(os.environ["FAKE_DOCKER_LOG"], "a") as log:
    log.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd()}}) + "\\n")
if sys.argv[1] == "info":
    if mode == "no-engine":
        print("Cannot connect to the Docker daemon at unix:///var/run/docker.sock.", file=sys.stderr)
        sys.exit(1)
    if mode == "hang":
        time.sleep(30)
    print("28.2.2")
elif sys.argv[1:3] == ["buildx", "version"]:
    if mode == "no-buildx":
        print("docker: unknown command: docker buildx", file=sys.stderr)
        sys.exit(1)
    print("github.com/docker/buildx v0.24.0")
elif sys.argv[1:3] == ["buildx", "build"]:
    sys.exit(17 if mode == "build-fails" else 0)
"""


@pytest.fixture
def fake_docker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A PATH with git and a scripted `docker`; returns (set_mode, read_calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").symlink_to(shutil.which("git"))
    docker = bin_dir / "docker"
    docker.write_text(FAKE_DOCKER.format(python=sys.executable))
    docker.chmod(0o755)
    log = tmp_path / "docker.log"
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.chdir(tmp_path)  # the command must run the build from the repository root, not here
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(log))

    def calls() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return (lambda mode: monkeypatch.setenv("FAKE_DOCKER_MODE", mode)), calls, docker


def assert_user_error(result, message: str) -> None:
    """Exit code 2, `Error: <sentence>` on stderr, no traceback (miles_cli.errors.user_errors_exit_2)."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert re.search("^Error: " + message, result.stderr), result.stderr


def test_build_runs_the_planned_argv_from_the_repo_root(app, fake_docker):
    set_mode, calls, _ = fake_docker
    set_mode("ok")
    result = invoke(app, "--variant", "cu13-x86", "--image-tag", "latest", "--build-arg", "X=1")
    assert result.exit_code == 0, result.output
    build = calls()[-1]
    plan = plan_build(
        "cu13-x86", "latest", repo_root=ROOT, environ={}, now=FIXED_NOW, build_args=["X=1"]
    )
    probes_then_build = [["info", "--format"], ["buildx", "version"], ["buildx", "build"]]
    assert [c["argv"][:2] for c in calls()] == probes_then_build
    assert ["docker", *build["argv"]] == plan.argv
    assert Path(build["cwd"]) == ROOT
    assert "built radixark/miles:latest" in result.stderr


def test_build_failure_exits_1_with_its_code(app, fake_docker):
    set_mode, _, _ = fake_docker
    set_mode("build-fails")
    result = invoke(app, "--variant", "cu13-x86", "--image-tag", "latest")
    assert result.exit_code == 1
    assert "failed with exit code 17" in result.stderr


@pytest.mark.parametrize(
    "mode, message",
    [
        ("no-engine", r"the Docker engine is not available \(Cannot connect to the Docker daemon"),
        ("no-buildx", r"docker buildx is not available \(docker: unknown command"),
    ],
)
def test_missing_engine_or_buildx_exits_2_and_never_builds(app, fake_docker, mode, message):
    set_mode, calls, _ = fake_docker
    set_mode(mode)
    result = invoke(app, "--variant", "cu13", "--image-tag", "dev")
    assert_user_error(result, message)
    assert "--dry-run" in result.stderr
    assert not any(c["argv"][:2] == ["buildx", "build"] for c in calls())


def test_hung_engine_times_out_with_what_it_waited_for(app, fake_docker, monkeypatch):
    set_mode, calls, _ = fake_docker
    set_mode("hang")
    monkeypatch.setattr(cli, "DOCKER_PROBE_TIMEOUT_S", 0.5)
    result = invoke(app, "--variant", "cu13", "--image-tag", "dev")
    assert_user_error(
        result,
        re.escape("`docker info --format {{.ServerVersion}}` did not answer within 0.5 s while checking "
                  "the Docker engine"),
    )
    assert [c["argv"][0] for c in calls()] == ["info"]


def test_no_docker_on_path_is_a_user_error_but_dry_run_works(app, fake_docker):
    _, calls, docker = fake_docker
    docker.unlink()
    result = invoke(app, "--variant", "cu13", "--image-tag", "latest")
    assert_user_error(result, "No `docker` command is on PATH")
    dry = invoke(app, "--variant", "cu13", "--image-tag", "latest", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.startswith("docker buildx build -f docker/Dockerfile ")
    assert calls() == []


# --- the image-inputs hash ------------------------------------------------------------------------


def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-C", str(repo), *args],
        check=True,
        capture_output=True,
        timeout=30,
    )


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    files = {
        "pyproject.toml": "[project]\nname='m'\n",
        "miles/a.py": "A = 1\n",
        "docker/Dockerfile": "FROM x\n",
        "docker/Dockerfile.rocm": "FROM y\n",
        "docker/helper.py": "pass\n",
        "tests/test_a.py": "def test(): pass\n",
    }
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "init")
    return root


def test_hash_format_is_pinned(repo):
    # sha256 over "path\0sha256hex(content)\n" per input, sorted by path; tests/ and the other
    # Dockerfile are not inputs.
    def entry(path: str, text: str) -> str:
        return f"{path}\0{hashlib.sha256(text.encode()).hexdigest()}\n"

    expected = hashlib.sha256(
        (
            entry("docker/Dockerfile", "FROM x\n")
            + entry("docker/helper.py", "pass\n")
            + entry("miles/a.py", "A = 1\n")
            + entry("pyproject.toml", "[project]\nname='m'\n")
        ).encode()
    ).hexdigest()
    assert image_inputs(repo, "docker/Dockerfile") == [
        "docker/Dockerfile", "docker/helper.py", "miles/a.py", "pyproject.toml"
    ]  # fmt: skip
    assert image_inputs_hash(repo, "docker/Dockerfile") == expected


def test_hash_follows_tracked_inputs_only(repo):
    cuda, rocm = (lambda: image_inputs_hash(repo, "docker/Dockerfile")), (
        lambda: image_inputs_hash(repo, "docker/Dockerfile.rocm")
    )
    c0, r0 = cuda(), rocm()
    assert c0 != r0

    (repo / "tests/test_a.py").write_text("changed\n")  # not in the image
    (repo / "miles/new.py").write_text("untracked\n")  # not tracked yet
    assert (cuda(), rocm()) == (c0, r0)

    (repo / "docker/Dockerfile.rocm").write_text("FROM z\n")  # only the ROCm images change
    assert cuda() == c0 and rocm() != r0
    r1 = rocm()

    (repo / "docker/Dockerfile.dockerignore").write_text("*\n")  # CUDA's own ignore file, once tracked
    git(repo, "add", "docker/Dockerfile.dockerignore")
    assert cuda() != c0 and rocm() == r1
    c1 = cuda()

    (repo / "miles/a.py").write_text("A = 2\n")  # an uncommitted edit of a tracked source
    c2 = cuda()
    assert c2 != c1 and rocm() != r1

    git(repo, "add", "miles/new.py")  # tracking a new source file changes it
    assert cuda() != c2

    (repo / "docker/helper.py").unlink()  # a tracked input deleted from the tree counts as a change
    assert cuda() not in (c0, c1, c2)


def test_registered_in_the_miles_app():
    from miles_cli.main import build_app

    args = ["docker-build", "--variant", "cu13-aarch64", "--image-tag", "latest", "--dry-run"]
    result = CliRunner().invoke(build_app(args), args, env={name: None for name in PROXY_VARS})
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        "docker buildx build -f docker/Dockerfile --platform linux/arm64 "
        "--build-arg NO_PROXY=localhost,127.0.0.1"
    )


def test_hash_outside_git_is_a_user_error(tmp_path):
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker/Dockerfile").write_text("FROM x\n")
    with pytest.raises(UserError, match="not a git checkout"):
        image_inputs_hash(tmp_path, "docker/Dockerfile")


# --- Dockerfiles, ignore files, registry and docs agree ----------------------------------------------


def dockerfile_instructions(path: Path) -> list[list[str]]:
    """Instructions as token lists, with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    return [line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("dockerfile", ["docker/Dockerfile", "docker/Dockerfile.rocm"])
def test_copied_sources_are_hashed_inputs_and_in_the_build_context(dockerfile):
    ignore = (ROOT / f"{dockerfile}.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    instructions = dockerfile_instructions(ROOT / dockerfile)
    copied = [src for ins in instructions if ins[0] == "COPY" for src in ins[1:-1]]
    assert "pyproject.toml" in copied and "miles" in copied
    for src in copied:
        assert any(src == root.rstrip("/") or src.startswith(root) for root in IMAGE_INPUT_ROOTS), src
        assert src in kept, f"{src} is copied but excluded from the build context by the .dockerignore"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_build_arg_is_declared_by_its_dockerfile(variant):
    v = VARIANTS[variant]
    dockerfile = ROOT / (v.dockerfile or "docker/Dockerfile")
    declared = {ins[1].split("=")[0] for ins in dockerfile_instructions(dockerfile) if ins[0] == "ARG"}
    assert {k for k, _ in v.build_args} <= declared


def test_docs_variants_table_is_generated():
    text = (ROOT / "docs/docker.md").read_text()
    match = re.search(
        r"<!-- BEGIN GENERATED: docker-variants -->\n(.*?)<!-- END GENERATED: docker-variants -->", text, re.S
    )
    assert match, "docs/docker.md lost its docker-variants markers"
    assert match.group(1) == variants_markdown_table()


def test_install_helper_keeps_base_image_packages():
    spec = importlib.util.spec_from_file_location("install_miles", ROOT / "docker/install_miles.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    reqs = helper.runtime_requirements(ROOT / "pyproject.toml")
    names = [helper.requirement_name(r) for r in reqs]
    assert "torch" not in names and "typer" in names and "megatron-core" in names
    assert helper.requirement_name("Flashinfer_Python>=0.6; python_version>'3.10'") == "flashinfer-python"
    assert helper.runtime_requirements(ROOT / "pyproject.toml", skip=("TYPER",))[0].startswith("rich")


# --- import weight --------------------------------------------------------------------------------


def test_import_does_not_pull_heavy_packages():
    code = textwrap.dedent(
        """
        import sys
        import miles_cli.docker_build
        print([m for m in ("torch", "ray", "transformers", "megatron") if m in sys.modules])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
