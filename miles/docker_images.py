"""Docker image variants of miles and the exact `docker buildx build` command that builds each one.

This module is the data and the pure logic behind `miles docker-build`:

- `VARIANTS`: the seven images we publish (CUDA 13 multi-arch and per-arch, CUDA 12 x86, three ROCm
  stacks), each with its image name, platforms, tag prefix/postfix, Dockerfile and build args;
- `image_tags()`: the tag rules (`latest`, `dev` plus a UTC-timestamped `dev`, `custom`);
- `buildx_argv()` / `plan_build()`: the argv list, in a fixed order, that the CLI runs or prints;
- `image_inputs_hash()`: a sha256 over the git-tracked files that go into an image, stored in the
  image as the label `miles.image-inputs`, so CI can skip a rebuild when the published label equals
  the hash of the current tree;
- `variants_markdown_table()`: the variants table of docs/docker.md, generated so the docs cannot drift.

It is not the CLI (that is `miles_cli/docker_build.py`) and it never runs Docker. It uses the standard
library only, so `miles docker-build --help` stays instant. Use it from Python:

    from miles.docker_images import plan_build
    plan = plan_build("cu12-x86", "latest", repo_root=Path("."), environ=os.environ, now=utc_now)
    print(plan.shell_line())
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
import re
import shlex
import subprocess
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal, Mapping, Sequence, get_args

from miles.errors import UserError
from miles.sglang_spec import SGLANG_VERSION

VariantName = Literal[
    "cu13", "cu13-x86", "cu13-aarch64", "cu12-x86", "rocm700-mi30x", "rocm700-mi35x", "rocm720-mi35x"
]
ImageTagMode = Literal["latest", "dev", "custom"]

DEFAULT_DOCKERFILE = "docker/Dockerfile"
LABEL_KEY = "miles.image-inputs"
NO_PROXY_VALUE = "localhost,127.0.0.1"
# The proxy variables passed through to the build, as build-arg names; each is read from the
# environment in lower case first (the form curl and pip prefer), then upper case.
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY")
GIT_TIMEOUT_S = 30.0

# What `pip install .` in the image needs: the files the Dockerfiles COPY into the image. Everything
# under docker/ counts except the Dockerfiles and their ignore files, which count only for the
# variants that build from them (a change to Dockerfile.rocm does not invalidate the CUDA images).
IMAGE_INPUT_ROOTS = ("pyproject.toml", "README.md", "miles/", "miles_cli/", "recipes/", "docker/")

_DOCKER_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_BUILD_ARG_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One published image: where it goes, for which platforms, built from which Dockerfile and args."""

    name: str
    image: str
    platforms: tuple[str, ...] = ()  # empty: buildx builds for the builder's own platform
    tag_postfix: str = ""
    tag_prefix: str | None = None  # None: dev tags start with "dev"
    dockerfile: str | None = None  # None: the --dockerfile option (default docker/Dockerfile)
    build_args: tuple[tuple[str, str], ...] = ()  # ordered; passed before the caller's --build-arg


_MILES = "radixark/miles"
# Every variant builds on SGLang's release image of the one pinned version (miles/sglang_spec), so the
# `--sglang-*` options generated from that version's ServerArgs are the flags its servers accept.
SGLANG_TAG = f"v{SGLANG_VERSION}"
_ROCM = "rocm/sgl-dev"
_ROCM_DOCKERFILE = "docker/Dockerfile.rocm"

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("cu13", _MILES, platforms=("linux/amd64", "linux/arm64")),
        Variant("cu13-x86", _MILES, platforms=("linux/amd64",)),
        Variant("cu13-aarch64", _MILES, platforms=("linux/arm64",)),
        Variant(
            "cu12-x86",
            _MILES,
            platforms=("linux/amd64",),
            tag_postfix="-cu12",
            build_args=(
                ("ENABLE_CUDA_13", "0"),
                ("SGLANG_IMAGE_TAG", f"{SGLANG_TAG}-cu129"),
                ("WHEELS_TAG_X86", "cu129-x86_64"),
            ),
        ),
        Variant(
            "rocm700-mi30x",
            _ROCM,
            tag_postfix="-rocm700-mi30x",
            tag_prefix="miles",
            dockerfile=_ROCM_DOCKERFILE,
            build_args=(
                ("GPU_ARCH", "gfx942"),
                ("SGLANG_IMAGE_TAG", f"{SGLANG_TAG}-rocm700-mi30x"),
                ("SGLANG_USE_ROCM700A", "1"),
            ),
        ),
        Variant(
            "rocm700-mi35x",
            _ROCM,
            tag_postfix="-rocm700-mi35x",
            tag_prefix="miles",
            dockerfile=_ROCM_DOCKERFILE,
            build_args=(
                ("GPU_ARCH", "gfx950"),
                ("SGLANG_IMAGE_TAG", f"{SGLANG_TAG}-rocm700-mi35x"),
                ("SGLANG_USE_ROCM700A", "1"),
            ),
        ),
        Variant(
            "rocm720-mi35x",
            _ROCM,
            tag_postfix="-rocm720-mi35x",
            tag_prefix="miles",
            dockerfile=_ROCM_DOCKERFILE,
            build_args=(
                ("GPU_ARCH", "gfx950"),
                ("SGLANG_IMAGE_TAG", f"{SGLANG_TAG}-rocm720-mi35x"),
                ("APPLY_ROCR_VMMFIX", "1"),
                ("TE_USE_WHEEL", "1"),
            ),
        ),
    )
}


def get_variant(name: str) -> Variant:
    """The variant called `name`; a UserError naming --variant and the valid names otherwise."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise UserError(
            f"Unknown --variant {name!r}; choose one of: {', '.join(VARIANTS)}.", option="--variant"
        ) from None


def image_tags(variant: Variant, mode: str, *, custom_tag: str = "", now: datetime) -> list[str]:
    """The full image references (`image:tag`) to tag the build with.

    `latest` -> `image:latest<postfix>`; `dev` -> `image:<prefix><postfix>` and the same with
    `-<UTC %Y%m%d%H%M>` appended (prefix = the variant's tag_prefix, else `dev`); `custom` ->
    `image:<custom_tag><postfix>`. `now` must be timezone-aware; it is converted to UTC.
    """
    if mode != "custom" and custom_tag:
        raise UserError(
            f"--custom-tag is only used with --image-tag custom (got --image-tag {mode}); "
            "drop --custom-tag or pass --image-tag custom.",
            option="--custom-tag",
        )
    if mode == "latest":
        return [f"{variant.image}:latest{variant.tag_postfix}"]
    if mode == "dev":
        if now.tzinfo is None or now.utcoffset() is None:
            raise ValueError("image_tags needs a timezone-aware `now` so the dev tag is in UTC")
        stamp = (now - (now.utcoffset() or timedelta(0))).strftime("%Y%m%d%H%M")
        base = f"{variant.image}:{variant.tag_prefix or 'dev'}{variant.tag_postfix}"
        return [base, f"{base}-{stamp}"]
    if mode == "custom":
        if not custom_tag:
            raise UserError(
                "--image-tag custom needs --custom-tag <tag>, e.g. --custom-tag v0.1.0.",
                option="--custom-tag",
            )
        tag = f"{custom_tag}{variant.tag_postfix}"
        if not _DOCKER_TAG.fullmatch(tag):
            raise UserError(
                f"--custom-tag {custom_tag!r} gives the Docker tag {tag!r}, which is not valid; use up "
                "to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'.",
                option="--custom-tag",
            )
        return [f"{variant.image}:{tag}"]
    raise UserError(
        f"Unknown --image-tag {mode!r}; choose one of: {', '.join(get_args(ImageTagMode))}.",
        option="--image-tag",
    )


def parse_build_arg(text: str) -> tuple[str, str]:
    """`KEY=VALUE` -> (KEY, VALUE). The value may be empty or contain '='; the key must be a name."""
    key, sep, value = text.partition("=")
    if not sep or not _BUILD_ARG_KEY.fullmatch(key):
        raise UserError(
            f"--build-arg {text!r} is not KEY=VALUE with KEY a name like SGLANG_IMAGE_TAG; "
            "write it as --build-arg KEY=VALUE.",
            option="--build-arg",
        )
    return key, value


def proxy_build_args(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """HTTP(S)_PROXY from the environment (lower case wins over upper case), then NO_PROXY, always."""
    args = []
    for name in PROXY_VARIABLES:
        value = environ.get(name.lower()) or environ.get(name)
        if value:
            args.append((name, value))
    # The build's own traffic to localhost (e.g. a local pip cache or registry) must never go
    # through the proxy, whatever the host's NO_PROXY says.
    args.append(("NO_PROXY", NO_PROXY_VALUE))
    return args


def merge_build_args(*groups: Sequence[tuple[str, str]]) -> dict[str, str]:
    """One value per key, later groups (and later pairs) win; a key keeps its first position."""
    merged: dict[str, str] = {}
    for group in groups:
        for key, value in group:
            merged[key] = value
    return merged


def resolve_dockerfile(variant: Variant, requested: str | None) -> str:
    """The Dockerfile to build: the variant's own wins, then --dockerfile, then docker/Dockerfile."""
    return variant.dockerfile or requested or DEFAULT_DOCKERFILE


def _relative_dockerfile(repo_root: Path, path: str) -> str:
    """`path` as a normalised posix path relative to `repo_root`; a UserError when it is not a file
    inside the repository (the hash and the build context only cover the repository)."""
    candidate = Path(path) if Path(path).is_absolute() else repo_root / path
    try:
        relative = candidate.resolve().relative_to(repo_root.resolve())
    except ValueError:
        relative = None
    if relative is None or not candidate.is_file():
        raise UserError(
            f"--dockerfile {path} is not a file inside the repository {repo_root}; give a path "
            "relative to the repository root, e.g. docker/Dockerfile.",
            option="--dockerfile",
        )
    return posixpath.normpath(relative.as_posix())


def _git(repo_root: Path, *args: str) -> bytes:
    cmd = ["git", "-C", str(repo_root), *args]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=GIT_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise UserError(
            "miles docker-build needs git to hash the image inputs, and no `git` is on PATH; install git."
        ) from None
    except subprocess.TimeoutExpired:
        raise UserError(
            f"`{shlex.join(cmd)}` did not answer within {GIT_TIMEOUT_S:.0f} s while listing the image "
            "inputs; check the repository is not locked or on a hung filesystem."
        ) from None
    if done.returncode != 0:
        raise UserError(
            f"{repo_root} is not a git checkout of miles (`git ls-files` failed: "
            f"{done.stderr.decode(errors='replace').strip()}); run miles docker-build from a git clone."
        )
    return done.stdout


def _is_dockerfile_or_ignore(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("Dockerfile") or name.endswith(".dockerignore")


def image_inputs(repo_root: Path, dockerfile: str) -> list[str]:
    """The sorted, git-tracked paths (posix, relative to `repo_root`) that an image built from
    `dockerfile` depends on: IMAGE_INPUT_ROOTS without other Dockerfiles, plus `dockerfile` and its
    `<dockerfile>.dockerignore` (BuildKit's per-Dockerfile ignore file) when tracked."""
    listed = _git(repo_root, "ls-files", "-z", "--", *IMAGE_INPUT_ROOTS).split(b"\0")
    own = {dockerfile, f"{dockerfile}.dockerignore"}
    paths = []
    for raw in listed:
        if not raw:
            continue
        path = raw.decode()
        if path.startswith("docker/") and _is_dockerfile_or_ignore(path):
            continue  # only the one being built from counts; it is added below
        paths.append(path)
    tracked_own = _git(repo_root, "ls-files", "-z", "--", *sorted(own)).split(b"\0")
    paths.extend(p.decode() for p in tracked_own if p)
    return sorted(set(paths))


def image_inputs_hash(repo_root: Path, dockerfile: str) -> str:
    """sha256 hex over `path \\0 sha256(content) \\n` for each input path in sorted order.

    Contents are read from the working tree (what the build context sends), so an uncommitted edit
    to a tracked input changes the hash; a tracked file deleted from the working tree is hashed as
    absent (`path \\0 - \\n`). Untracked files never count, even under miles/: commit them first.
    """
    outer = hashlib.sha256()
    for path in image_inputs(repo_root, dockerfile):
        file = repo_root / path
        digest = hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else "-"
        outer.update(f"{path}\0{digest}\n".encode())
    return outer.hexdigest()


def buildx_argv(
    *,
    dockerfile: str,
    platforms: Sequence[str],
    push: bool,
    build_args: Mapping[str, str],
    inputs_hash: str,
    tags: Sequence[str],
) -> list[str]:
    """`docker buildx build -f F [--platform a,b] [--push] --build-arg K=V... --label L -t T... .`"""
    argv = ["docker", "buildx", "build", "-f", dockerfile]
    if platforms:
        argv += ["--platform", ",".join(platforms)]
    if push:
        argv.append("--push")
    for key, value in build_args.items():
        argv += ["--build-arg", f"{key}={value}"]
    argv += ["--label", f"{LABEL_KEY}={inputs_hash}"]
    for tag in tags:
        argv += ["-t", tag]
    argv.append(".")  # the context is the repository root; the command runs from there
    return argv


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Everything `miles docker-build` decided, before anything runs."""

    variant: Variant
    dockerfile: str
    tags: list[str]
    build_args: dict[str, str]
    inputs_hash: str
    argv: list[str]
    repo_root: Path  # the directory to run `argv` from (its context is `.`)

    def shell_line(self) -> str:
        """The argv as one shell-quoted line a person can paste (from `repo_root`)."""
        return shlex.join(self.argv)


def find_repo_root() -> Path:
    """The source checkout this module lives in (the build context); a UserError for an installed copy."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file() or not (root / DEFAULT_DOCKERFILE).is_file():
        raise UserError(
            f"miles docker-build builds from a source checkout, and {root} has no pyproject.toml and "
            f"{DEFAULT_DOCKERFILE}; run it from a git clone of miles (pip install -e .)."
        )
    return root


def plan_build(
    variant_name: str,
    image_tag: str,
    *,
    repo_root: Path,
    environ: Mapping[str, str],
    now: datetime,
    custom_tag: str = "",
    build_args: Sequence[str] = (),
    dockerfile: str | None = None,
    push: bool = False,
) -> BuildPlan:
    """Validate the options and produce the argv. `build_args` are raw `KEY=VALUE` strings.

    Build args, in order, last wins per key: proxies from `environ`, NO_PROXY, the variant's, then
    the caller's. A relative `dockerfile` is relative to `repo_root`, which is the build context.
    """
    variant = get_variant(variant_name)
    tags = image_tags(variant, image_tag, custom_tag=custom_tag, now=now)
    caller_args = [parse_build_arg(text) for text in build_args]
    chosen = _relative_dockerfile(repo_root, resolve_dockerfile(variant, dockerfile))
    merged = merge_build_args(proxy_build_args(environ), variant.build_args, caller_args)
    inputs_hash = image_inputs_hash(repo_root, chosen)
    argv = buildx_argv(
        dockerfile=chosen,
        platforms=variant.platforms,
        push=push,
        build_args=merged,
        inputs_hash=inputs_hash,
        tags=tags,
    )
    return BuildPlan(variant, chosen, tags, merged, inputs_hash, argv, repo_root)


def variants_markdown_table() -> str:
    """The variants table of docs/docker.md (between its `docker-variants` GENERATED markers)."""

    def code(text: str) -> str:
        return f"`{text}`"

    rows = [
        "| Variant | Image | Platforms | `latest` tag | `dev` tags | Dockerfile | Build args |",
        "|---|---|---|---|---|---|---|",
    ]
    for v in VARIANTS.values():
        dev = f"{v.tag_prefix or 'dev'}{v.tag_postfix}"
        rows.append(
            "| "
            + " | ".join(
                [
                    code(v.name),
                    code(v.image),
                    ", ".join(map(code, v.platforms)) or "builder's own",
                    code(f"latest{v.tag_postfix}"),
                    f"{code(dev)}, {code(dev + '-<UTC YYYYmmddHHMM>')}",
                    code(v.dockerfile) if v.dockerfile else f"{code(DEFAULT_DOCKERFILE)} (or `--dockerfile`)",
                    "<br>".join(code(f"{k}={val}") for k, val in v.build_args) or "–",
                ]
            )
            + " |"
        )
    return "\n".join(rows) + "\n"
