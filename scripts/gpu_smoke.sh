#!/usr/bin/env bash
# The first thing to run on a GPU machine (offline, one GPU is enough for most of it):
#   bash scripts/gpu_smoke.sh             CPU checks, then the GPU-only tests: a tensor (CUDA IPC) sync
#                                         into an engine server in another process, a broadcast over
#                                         NCCL (2 GPUs), a memory release that frees GPU memory, the
#                                         trainer's GPU tests; then the TP-2 and colocated-order checks
#   bash scripts/gpu_smoke.sh --cpu-only  only the CPU-possible part (runs in the default test suite)
# One line per check, a summary last; exit status 0 only when every check passed.
set -u
cd "$(dirname "$0")/.."
cpu_only=0
[ "${1:-}" = "--cpu-only" ] && cpu_only=1
fail=0
line() { printf '%-6s %s\n' "$1" "$2"; }

python3 scripts/gpu_smoke.py || fail=1

# TP-2 engines and the colocated memory order, on CPU for real (built-in servers of --tp-size 2).
if CUDA_VISIBLE_DEVICES="" timeout 600 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_weight_sync_tp.py >/tmp/miles-gpu-smoke-tp.log 2>&1; then
  line ok "TP-2 broadcast and tensor sync, memory tags in the colocated order (tests/rollout/test_weight_sync_tp.py)"
else
  line FAIL "TP-2 broadcast and tensor sync (see /tmp/miles-gpu-smoke-tp.log)"; fail=1
fi

if [ "$cpu_only" = 0 ]; then
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    line FAIL "no GPU visible (nvidia-smi); run with --cpu-only on a CPU machine"; fail=1
  else
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader | sed 's/^/info   gpu /'
    # tests/conftest.py hides GPUs unless CUDA_VISIBLE_DEVICES is set: name them all.
    export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)}"
    if timeout 900 python3 -m pytest -q -p no:cacheprovider -m "gpu or not slow" -rs \
        tests/rollout/test_weight_sync_gpu.py tests/rollout/test_weight_tensor_path.py >/tmp/miles-gpu-smoke-gpu.log 2>&1; then
      line ok "GPU weight sync: CUDA IPC to another process, NCCL broadcast, release frees memory ($(grep -c SKIPPED /tmp/miles-gpu-smoke-gpu.log) skipped, see /tmp/miles-gpu-smoke-gpu.log)"
    else
      line FAIL "GPU weight sync (see /tmp/miles-gpu-smoke-gpu.log)"; fail=1
    fi
    if ls tests/backends/*gpu* >/dev/null 2>&1; then
      if timeout 900 python3 -m pytest -q -p no:cacheprovider -m gpu tests/backends >/tmp/miles-gpu-smoke-train.log 2>&1; then
        line ok "trainer GPU tests (tests/backends -m gpu)"
      else
        line FAIL "trainer GPU tests (see /tmp/miles-gpu-smoke-train.log)"; fail=1
      fi
    fi
  fi
fi
[ "$fail" = 0 ] && echo "summary: every check passed" || echo "summary: some checks FAILED"
exit "$fail"
