#!/usr/bin/env bash
# Build a separate Python environment with the pinned SGLang that can serve a tiny model on a CPU, for
# the opt-in test tests/sglang_backend/test_sglang_cpu_server.py. Slow (a few minutes, ~2 GB) and only
# for checking miles' SGLang backend against a real server; GPU machines use requirements/gpu.txt.
#
#     bash scripts/setup_sglang_cpu.sh [ENV_DIR]          # default: .sglang-cpu (git-ignored)
#     MILES_SGLANG_CPU_PYTHON=ENV_DIR/bin/python pytest -m slow tests/sglang_backend/test_sglang_cpu_server.py
#
# What it does, and why each step:
# 1. a venv with a CPU torch: SGLANG_CPU_TORCH (a requirement or a wheel path) if set, else torch from
#    PyTorch's CPU index at the version SGLang pins. sglang's own metadata pins a CUDA torch and about
#    ten CUDA-only kernel packages (several GB), so
# 2. sglang and sglang-router are installed without dependencies, then sglang's declared dependencies
#    minus torch and the CUDA-only kernel packages listed in GPU_ONLY below;
# 3. torchvision (pulled by timm) made importable without its CUDA-built ops, see below;
# 4. an import-only stand-in for `sgl_kernel` when the real one cannot load without a GPU: SGLang imports
#    it at start-up even on the CPU engine path (the stand-in makes every attribute raise if called);
# 5. prints the interpreter path to give the test.
# The server then runs with SGLANG_USE_CPU_ENGINE=1, --device cpu and an explicit --max-total-tokens
# (the test passes these as --sglang-* options). SGLang's CPU path is not one it supports officially.
set -euo pipefail
ENV_DIR="${1:-.sglang-cpu}"
SGLANG=$(python3 -c "import re,pathlib;print(re.search(r'^SGLANG_VERSION = \"(.+)\"',pathlib.Path('miles/sglang_spec/__init__.py').read_text(),re.M).group(1))")
ROUTER=$(python3 -c "import re,pathlib;print(re.search(r'^SGLANG_ROUTER_VERSION = \"(.+)\"',pathlib.Path('miles/sglang_spec/__init__.py').read_text(),re.M).group(1))")
python3.11 -m venv "$ENV_DIR"
PY="$ENV_DIR/bin/python"
"$PY" -m pip install --upgrade pip packaging
if [ -n "${SGLANG_CPU_TORCH:-}" ]; then
    timeout 3600 "$PY" -m pip install "$SGLANG_CPU_TORCH"
else
    timeout 3600 "$PY" -m pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.14.1"
fi
timeout 3600 "$PY" -m pip install --no-deps "sglang==$SGLANG" "sglang-router==$ROUTER"
REQS=$(mktemp)
"$PY" - "$REQS" <<'PYEOF'
"""Write sglang's declared dependencies that can install on a CPU-only machine to the file argv[1]."""
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

# CUDA-only kernels and media codecs that the text-generation CPU path never loads; torch is already
# installed (a CPU build) and must not be replaced.
GPU_ONLY = {
    "torch", "torchaudio", "torchvision", "torchcodec", "cuda-python", "flash-attn-4", "flashinfer-python",
    "humming-kernels", "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels",
    "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla", "sglang-kernel", "tilelang", "torch-memory-saver",
    "apache-tvm-ffi", "deepseek-recipe", "kernels",
}
keep = []
for line in requires("sglang") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower().replace("_", "-") in GPU_ONLY:
        continue
    req.marker = None
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
print(f"{len(keep)} of sglang's dependencies install on CPU")
PYEOF
TORCH_PIN=$("$PY" -c "import torch; print(torch.__version__)")
CONSTRAINTS=$(mktemp)
echo "torch==$TORCH_PIN" > "$CONSTRAINTS"
timeout 3600 "$PY" -m pip install -c "$CONSTRAINTS" -r "$REQS"
# timm pulls torchvision from PyPI, whose compiled ops need a CUDA torch; SGLang imports
# torchvision.transforms (multimodal helpers) at start-up but never calls those ops for text. Skip the
# two fake-kernel registrations that fail without them (torchvision's other registrations already check).
if ! "$PY" -c "import torchvision" 2>/dev/null; then
    TV=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/torchvision/_meta_registrations.py
    sed -i -E 's/^@torch\.library\.register_fake\("torchvision::([a-z_]+)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda fn: fn))/' "$TV"
    "$PY" -c "import torchvision.transforms"
fi
if ! "$PY" -c "import sgl_kernel" 2>/dev/null; then
    SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$SITE/sgl_kernel"
    cat > "$SITE/sgl_kernel/__init__.py" <<'PYEOF'
"""Import-only stand-in for sgl_kernel on a CPU-only machine (scripts/setup_sglang_cpu.sh).

SGLang imports sgl_kernel at start-up; the CPU engine never calls its CUDA kernels. Any attribute is a
function that raises, so a kernel that is really reached fails loudly instead of computing garbage.
"""


def __getattr__(name):
    def _missing(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name} is not available on this CPU-only SGLang environment")

    return _missing
PYEOF
fi
"$PY" -c "import sglang, sglang_router; print('sglang', sglang.__version__)"
echo "MILES_SGLANG_CPU_PYTHON=$(cd "$ENV_DIR" && pwd)/bin/python"
