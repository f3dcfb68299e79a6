"""Options of `miles docker-build`, declared like every other command's (one field per flag).

The variants, tag rules and the build argv live in `miles.docker_images`; this only declares what
the command accepts. Standard library only: `miles docker-build --help` imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.fields import option
from miles.docker_images import DEFAULT_DOCKERFILE, ImageTagMode, VariantName


@dataclass
class DockerBuildOptions:
    variant: VariantName = option(help="Which image to build (see docs/docker.md for each one).", required=True)
    image_tag: ImageTagMode = option(
        help="latest: <image>:latest<postfix>; dev: <image>:<prefix><postfix> plus a copy suffixed "
        "-<UTC YYYYmmddHHMM>; custom: <image>:<--custom-tag><postfix>.",
        required=True,
    )
    custom_tag: str = option("", help="The tag for --image-tag custom (required then, rejected otherwise).")
    build_arg: list[str] | None = option(
        None,
        metavar="KEY=VALUE",
        help="Extra Docker build arg; overrides the variant's and an earlier one with the same KEY.",
    )
    dockerfile: str | None = option(
        None,
        help=f"Dockerfile relative to the repository root (unset: {DEFAULT_DOCKERFILE}); "
        "ROCm variants always use their own docker/Dockerfile.rocm.",
    )
    push: bool = option(False, help="Push the tags to the registry when the build succeeds.")
    dry_run: bool = option(
        False, help="Print the exact `docker buildx build` command as one shell-quoted line and exit; needs no Docker."
    )
