"""`miles docker-build`: build (or print the command that builds) one of the miles Docker images.

    miles docker-build --variant cu13 --image-tag dev --dry-run          # print the argv, run nothing
    miles docker-build --variant cu12-x86 --image-tag latest --push
    miles docker-build --variant rocm700-mi35x --image-tag custom --custom-tag v0.1.0

The variants, tag rules and the argv come from `miles.docker_images` (standard library only, so
this module never imports torch, ray or transformers). Without --dry-run it checks that a Docker
engine and buildx answer (each within DOCKER_PROBE_TIMEOUT_S), then runs `docker buildx build` as
an argv list from the repository root, streaming buildx's own progress display. It is not a CI
pipeline: it builds one variant per call and never decides whether a rebuild is needed (compare the
published `miles.image-inputs` label with `miles.docker_images.image_inputs_hash` for that).
"""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timezone
from typing import Any

import typer

from miles.config.docker_build import DockerBuildOptions
from miles.config.engine import specs_of
from miles.docker_images import find_repo_root, plan_build
from miles.errors import UserError
from miles_cli.errors import user_errors_exit_2
from miles_cli.params import make_parameter, with_signature

DOCKER_PROBE_TIMEOUT_S = 20.0
# A cold multi-arch build compiles for hours; this only catches a build that hangs forever.
BUILD_TIMEOUT_S = 8 * 3600.0


def _utc_now() -> datetime:
    """The clock for dev tags (tests replace it to get a fixed timestamp)."""
    return datetime.now(timezone.utc)


def _probe(argv: list[str], what: str) -> None:
    """Run a quick Docker command; a UserError saying what did not answer when it fails."""
    hint = "or pass --dry-run to only print the build command"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=DOCKER_PROBE_TIMEOUT_S)
    except FileNotFoundError:
        raise UserError(f"No `docker` command is on PATH; install Docker with buildx, {hint}.") from None
    except subprocess.TimeoutExpired:
        raise UserError(
            f"`{' '.join(argv)}` did not answer within {DOCKER_PROBE_TIMEOUT_S:g} s while checking "
            f"{what}; start or repair the Docker engine, {hint}."
        ) from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        reason = lines[-1] if lines else f"exit code {done.returncode}"
        raise UserError(f"{what} is not available ({reason}); start it or install it, {hint}.")


def check_docker() -> None:
    """Fail with a UserError unless a Docker engine and the buildx plugin both answer."""
    _probe(["docker", "info", "--format", "{{.ServerVersion}}"], "the Docker engine")
    _probe(["docker", "buildx", "version"], "docker buildx")


def build_docker_build_command():
    """The `docker-build` command function, its options generated from `DockerBuildOptions`."""
    specs = specs_of(DockerBuildOptions, "docker_build", "Build")
    params = [make_parameter(s, s.default) for s in specs]

    def docker_build(**kwargs: Any) -> None:
        with user_errors_exit_2():
            o = DockerBuildOptions(**kwargs)
            _docker_build(o.variant, o.image_tag, o.custom_tag, o.build_arg or [], o.dockerfile, o.push, o.dry_run)

    docker_build.__doc__ = "Build a miles Docker image (SGLang base image + this checkout) with docker buildx."
    return with_signature(docker_build, params)


docker_build = build_docker_build_command()


def _docker_build(
    variant: str,
    image_tag: str,
    custom_tag: str,
    build_arg: list[str],
    dockerfile: str | None,
    push: bool,
    dry_run: bool,
) -> None:
    repo_root = find_repo_root()
    plan = plan_build(
        variant,
        image_tag,
        repo_root=repo_root,
        environ=os.environ,
        now=_utc_now(),
        custom_tag=custom_tag,
        build_args=build_arg,
        dockerfile=dockerfile,
        push=push,
    )
    if dockerfile is not None and plan.dockerfile != dockerfile and plan.variant.dockerfile:
        typer.echo(
            f"note: variant {variant} always builds from {plan.dockerfile}; "
            f"--dockerfile {dockerfile} is ignored.",
            err=True,
        )
    if dry_run:
        typer.echo(plan.shell_line())
        typer.echo(f"(run from {plan.repo_root})", err=True)
        return
    check_docker()
    typer.echo(f"+ {plan.shell_line()}", err=True)
    try:
        done = subprocess.run(plan.argv, cwd=plan.repo_root, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        hours = BUILD_TIMEOUT_S / 3600
        typer.echo(f"docker buildx build of {variant} did not finish within {hours:g} h; stopped it.",
                   err=True)
        raise typer.Exit(1) from None
    if done.returncode != 0:
        typer.echo(
            f"docker buildx build of {variant} failed with exit code {done.returncode} "
            "(its output is above).",
            err=True,
        )
        raise typer.Exit(1)
    typer.echo(f"built {', '.join(plan.tags)}" + (" and pushed" if push else ""), err=True)

