"""Install this checkout of miles into an SGLang base image without replacing what the image built.

Run inside `docker/Dockerfile` and `docker/Dockerfile.rocm` (standard library only, Python >= 3.8, so
it runs on whatever Python the base image ships):

    python3 docker/install_miles.py check --cuda-major 13      # the base torch is a CUDA 13 build
    python3 docker/install_miles.py check --gpu-arch gfx950    # the base torch is a ROCm build for gfx950
    python3 docker/install_miles.py check --sglang-pins miles/sglang_spec/__init__.py  # sglang/router = miles' pins
    python3 docker/install_miles.py deps /root/miles           # pyproject dependencies, base pins kept
    python3 docker/install_miles.py package /root/miles        # `pip install --no-deps` of the checkout

Why not a plain `pip install .`: pyproject.toml pins the CPU development stack (torch==2.13.0,
Python 3.11). In the image, torch, sglang, sgl-kernel, flashinfer and triton come from the base
image, built for its CUDA/ROCm; letting pip resolve our pins would download a different torch build
over them. So `deps` installs every other dependency under a constraints file that freezes the base
image's versions of those packages, then verifies they did not move. It is not a general installer.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

# Provided by the base image, built against its accelerator stack: never replaced, never installed.
BASE_PACKAGES = (
    "torch", "torchvision", "torchaudio", "triton", "sglang", "sgl-kernel", "flashinfer-python"
)
PIP_TIMEOUT_S = 3600


def normalize(name: str) -> str:
    """PEP 503 name normalisation: `Flashinfer_Python` -> `flashinfer-python`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The distribution name at the start of a PEP 508 requirement string."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return normalize(match.group(1))


def load_pyproject(path: Path) -> dict:
    try:
        import tomllib  # Python >= 3.11
    except ImportError:  # older base images: pip vendors a TOML parser
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
    with path.open("rb") as f:
        return tomllib.load(f)


def runtime_requirements(pyproject: Path, skip=BASE_PACKAGES) -> list:
    """`[project].dependencies` minus the packages the base image provides, in file order."""
    skipped = {normalize(name) for name in skip}
    deps = load_pyproject(pyproject)["project"]["dependencies"]
    return [req for req in deps if requirement_name(req) not in skipped]


def installed_versions(names=BASE_PACKAGES) -> dict:
    """{normalised name: version} of the installed packages among `names`."""
    from importlib import metadata

    found = {}
    for name in names:
        try:
            found[normalize(name)] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--no-cache-dir", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=PIP_TIMEOUT_S)


def install_deps(checkout: Path) -> None:
    before = installed_versions()
    constraints = Path("/tmp/miles-base-constraints.txt")
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(before.items())))
    router = f"sglang-router=={pinned_versions(checkout / PINS_IN_CHECKOUT)['sglang-router']}"
    pip("-c", str(constraints), *runtime_requirements(checkout / "pyproject.toml"), router)
    after = installed_versions()
    moved = {
        name: (before.get(name), after.get(name))
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    }
    if moved:
        raise SystemExit(
            f"installing miles' dependencies changed base-image packages (before, after): {moved}; "
            "a dependency in pyproject.toml needs a version the base image does not have"
        )


def install_package(checkout: Path) -> None:
    # requires-python in pyproject.toml is the CPU development pin (megatron-core 0.16.1 on 3.11);
    # the image runs on the base image's Python, whose packages the `deps` step already resolved.
    pip("--no-deps", "--ignore-requires-python", str(checkout))


def pinned_versions(pins_file: Path) -> dict:
    """{"sglang": "0.5.23", "sglang-router": "0.3.2"} from miles/sglang_spec/__init__.py."""
    text = pins_file.read_text()
    found = {}
    for key, dist in (("SGLANG_VERSION", "sglang"), ("SGLANG_ROUTER_VERSION", "sglang-router")):
        match = re.search(rf'^{key} = "([^"]+)"', text, re.M)
        if not match:
            raise SystemExit(f"{pins_file} has no {key}")
        found[dist] = match.group(1)
    return found


PINS_IN_CHECKOUT = "miles/sglang_spec/__init__.py"


def check_pins(pins_file: Path) -> None:
    """The base image's SGLang is the version miles generates its --sglang-* options from.

    (sglang-router has no torch and is installed at its pin by `deps`, whatever the image had.)
    """
    have = installed_versions(("sglang",))
    for dist, want in pinned_versions(pins_file).items():
        if dist == "sglang" and have.get(dist) != want:
            raise SystemExit(
                f"the base image has {dist} {have.get(dist, '(not installed)')}, miles is pinned to {want}; "
                "build from the SGLang image of that version (SGLANG_IMAGE_TAG)"
            )


def check_base(cuda_major: int | None, gpu_arch: str | None) -> None:
    import torch

    if cuda_major is not None:
        built = torch.version.cuda or ""
        if built.split(".")[0] != str(cuda_major):
            raise SystemExit(
                f"the base image's torch {torch.__version__} is built for CUDA {built or 'none'}, "
                f"expected CUDA {cuda_major}; fix SGLANG_IMAGE_TAG or ENABLE_CUDA_13"
            )
    if gpu_arch is not None:
        if not getattr(torch.version, "hip", None):
            raise SystemExit(
                f"the base image's torch {torch.__version__} is not a ROCm build; "
                "fix SGLANG_IMAGE_REPO/SGLANG_IMAGE_TAG"
            )
        archs = torch._C._cuda_getArchFlags() or ""
        if gpu_arch not in archs:
            raise SystemExit(
                f"the base image's torch is built for {archs!r}, not GPU_ARCH={gpu_arch}; "
                "pick the variant that matches the base image"
            )
    hip = getattr(torch.version, "hip", None)
    print(f"base image ok: torch {torch.__version__} cuda={torch.version.cuda} hip={hip}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="verify the base image's torch matches the variant")
    check.add_argument("--cuda-major", type=int)
    check.add_argument("--gpu-arch")
    check.add_argument("--sglang-pins", type=Path, help="miles/sglang_spec/__init__.py: fail unless the image has those versions")
    for name in ("deps", "package"):
        sub.add_parser(name).add_argument("checkout", type=Path)
    args = parser.parse_args(argv)
    if args.command == "check":
        check_base(args.cuda_major, args.gpu_arch)
        if args.sglang_pins is not None:
            check_pins(args.sglang_pins)
    elif args.command == "deps":
        install_deps(args.checkout)
    else:
        install_package(args.checkout)


if __name__ == "__main__":
    main()
