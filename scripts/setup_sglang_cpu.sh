#!/usr/bin/env bash
# Build a separate Python environment with the pinned SGLang that can serve a tiny model on a CPU, for
# the opt-in test tests/sglang_backend/test_sglang_cpu_server.py. Slow (SGLang's dependencies are several
# GB) and only for checking the launcher against a real server; GPU machines use requirements/gpu.txt.
#
#     bash scripts/setup_sglang_cpu.sh [ENV_DIR]          # default: .sglang-cpu (git-ignored)
#     MILES_SGLANG_CPU_PYTHON=ENV_DIR/bin/python pytest tests/sglang_backend/test_sglang_cpu_server.py
#
# What it does, and why each step:
# 1. a venv with sglang==0.5.23 and sglang-router==0.3.2, torch from PyTorch's CPU index at the version
#    SGLang pins (2.14.1), so no CUDA torch is pulled;
# 2. an import-only stand-in for `sgl_kernel` when the real one cannot load without a GPU: SGLang imports
#    it at start-up even on the CPU engine path (the stand-in makes every attribute raise if called);
# 3. prints the interpreter path to give the test.
# The server then runs with SGLANG_USE_CPU_ENGINE=1, --device cpu and an explicit --max-total-tokens
# (the test passes these as --sglang-* options). Not verified end to end on every SGLang release: the
# CPU path of SGLang is not one it supports officially.
set -euo pipefail
ENV_DIR="${1:-.sglang-cpu}"
SGLANG=$(python3 -c "import re,pathlib;print(re.search(r'^SGLANG_VERSION = \"(.+)\"',pathlib.Path('miles/rollout/sglang/__init__.py').read_text(),re.M).group(1))")
ROUTER=$(python3 -c "import re,pathlib;print(re.search(r'^SGLANG_ROUTER_VERSION = \"(.+)\"',pathlib.Path('miles/rollout/sglang/__init__.py').read_text(),re.M).group(1))")
python3.11 -m venv "$ENV_DIR"
PY="$ENV_DIR/bin/python"
"$PY" -m pip install --upgrade pip
CONSTRAINTS=$(mktemp)
echo "torch==2.14.1" > "$CONSTRAINTS"
timeout 7200 "$PY" -m pip install -c "$CONSTRAINTS" --extra-index-url https://download.pytorch.org/whl/cpu \
    "sglang==$SGLANG" "sglang-router==$ROUTER"
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
