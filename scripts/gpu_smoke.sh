#!/usr/bin/env bash
# The first thing to run on a GPU machine (offline, one GPU is enough for most of it):
#   bash scripts/gpu_smoke.sh             the GPU-only tests first (each skips what this machine lacks;
#                                         the 2-GPU ones need two), then the CPU checks:
#     weight sync   tests/rollout/test_weight_sync_gpu.py, test_weight_tensor_path.py: a tensor (CUDA
#                   IPC) sync into an engine server in another process, a broadcast over NCCL (2 GPUs),
#                   a memory release that frees GPU memory
#     torch/fsdp    tests/backends/test_bf16_gpu.py: a --bf16 step on one GPU (bf16 matmuls from fp32
#                   parameters, bf16 CUDA weights for the engines), offload frees the weights and Adam
#                   state (torch.cuda.memory_allocated before/after), onload trains on
#     megatron      tests/backends/megatron/test_megatron_gpu.py: a --bf16 step with the distributed
#                   optimizer on one GPU (model on the GPU, losses near the CPU reference), offload
#                   frees parameters + gradient buffers + fp32 main params + Adam (>= 18 B/param
#                   measured) and training continues identically; PP=2 and DP=2 over NCCL (2 GPUs)
#                   match the CPU reference; with TransformerEngine installed, packed micro-batches
#                   (PackedSeqParams, thd) score like padded rows (samples do not attend to each other)
#     NCCL metrics  tests/backends/test_nccl_reductions_gpu.py (2 GPUs): metric sums/max/min and a CPU
#                   statistic reduced over NCCL to hand-computed values; DDP on two GPUs agrees
#     CPU checks    versions, a tiny Qwen3 built locally, the SGLang argv of a TP-2 engine, bucket
#                   names, broadcast rank layout; the TP-2 and colocated-order checks on built-in servers
#   bash scripts/gpu_smoke.sh --cpu-only  only the CPU-possible part (runs in the default test suite)
# One line per check, a summary last; exit status 0 only when every check passed.
set -u
cd "$(dirname "$0")/.."
cpu_only=0
[ "${1:-}" = "--cpu-only" ] && cpu_only=1
fail=0
line() { printf '%-6s %s\n' "$1" "$2"; }

# One pytest run of GPU-only tests: "ok" with its skip count, or FAIL with the log to read.
gpu_tests() {  # name, log, files...
  local name="$1" log="$2"; shift 2
  timeout 1200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs "$@" >"$log" 2>&1
  local rc=$?
  if [ "$rc" = 0 ]; then
    line ok "$name ($(grep -c SKIPPED "$log") skipped, see $log)"
  elif [ "$rc" = 5 ]; then  # pytest: nothing collected (no such tests left)
    line ok "$name (none)"
  else
    line FAIL "$name (see $log)"; fail=1
  fi
}

if [ "$cpu_only" = 0 ]; then
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    line FAIL "no GPU visible (nvidia-smi); run with --cpu-only on a CPU machine"; fail=1
  else
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader | sed 's/^/info   gpu /'
    # tests/conftest.py hides GPUs unless CUDA_VISIBLE_DEVICES is set: name them all.
    export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,)}"
    gpu_tests "GPU weight sync: CUDA IPC to another process, NCCL broadcast, release frees memory" /tmp/miles-gpu-smoke-gpu.log \
      -m "gpu or not slow" tests/rollout/test_weight_sync_gpu.py tests/rollout/test_weight_tensor_path.py
    gpu_tests "torch/fsdp --bf16 step on a GPU, offload frees memory" /tmp/miles-gpu-smoke-torch.log tests/backends/test_bf16_gpu.py
    gpu_tests "megatron --bf16 step on a GPU, offload frees memory, PP2/DP2/TP2 (vocab-parallel log-probs) over NCCL, TE packing" /tmp/miles-gpu-smoke-megatron.log \
      tests/backends/megatron/test_megatron_gpu.py
    gpu_tests "NCCL metric reductions and DDP on 2 GPUs" /tmp/miles-gpu-smoke-nccl.log tests/backends/test_nccl_reductions_gpu.py
    gpu_tests "every other GPU-marked trainer test (tests/backends -m gpu)" /tmp/miles-gpu-smoke-train.log tests/backends \
      --deselect tests/backends/test_bf16_gpu.py --deselect tests/backends/megatron/test_megatron_gpu.py \
      --deselect tests/backends/test_nccl_reductions_gpu.py
  fi
fi

python3 scripts/gpu_smoke.py || fail=1

# TP-2 engines and the colocated memory order, on CPU for real (built-in servers of --tp-size 2).
if CUDA_VISIBLE_DEVICES="" timeout 600 python3 -m pytest -q -p no:cacheprovider tests/rollout/test_weight_sync_tp.py >/tmp/miles-gpu-smoke-tp.log 2>&1; then
  line ok "TP-2 broadcast and tensor sync, memory tags in the colocated order (tests/rollout/test_weight_sync_tp.py)"
else
  line FAIL "TP-2 broadcast and tensor sync (see /tmp/miles-gpu-smoke-tp.log)"; fail=1
fi

[ "$fail" = 0 ] && echo "summary: every check passed" || echo "summary: some checks FAILED"
exit "$fail"
