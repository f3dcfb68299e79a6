"""The CPU-possible checks of scripts/gpu_smoke.sh, one line each: versions, a tiny Qwen3 built
locally, the SGLang server argv miles writes for a TP-2 engine (and that the built-in server takes
it), the HF bucket names a sync sends, and the broadcast rank layout of TP-sized engines."""

from __future__ import annotations

import importlib
import sys
import tempfile
from pathlib import Path

failures = 0


def check(name: str, fn) -> None:
    global failures
    try:
        detail = fn()
        print(f"ok    {name}{': ' + detail if detail else ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - every check reports, the summary counts
        failures += 1
        print(f"FAIL  {name}: {type(e).__name__}: {e}", flush=True)


def versions() -> str:
    out = []
    for mod in ("torch", "sglang", "sglang_router", "torch_memory_saver", "megatron.core", "transformer_engine", "flash_attn"):
        try:
            m = importlib.import_module(mod)
            out.append(f"{mod} {getattr(m, '__version__', '?')}")
        except Exception:  # noqa: BLE001 - absent is a fact to print, not a failure
            out.append(f"{mod} absent")
    import torch

    out.append(f"cuda {torch.version.cuda} ({torch.cuda.device_count()} GPU)")
    return ", ".join(out)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="miles-gpu-smoke-"))
    check("versions", versions)
    state: dict = {}

    def build() -> str:
        from miles.prepare.tiny_model import create_tiny_qwen3

        state["hf"] = create_tiny_qwen3(root / "hf", seed=0)
        return str(state["hf"])

    check("model build (tiny Qwen3)", build)

    def argv() -> str:
        from miles.config.resolve import build_config, resolve
        from miles.rollout.engine.server import parse_args
        from miles.rollout.sglang.launch import EngineSlot, server_argv

        values = {
            "rollout_backend": "sglang", "hf_checkpoint": str(state["hf"]), "prompt_data": "p.jsonl", "rollout_batch_size": 2,
            "global_batch_size": 2, "num_rollout": 1, "actor_num_gpus_per_node": 2, "rollout_num_gpus": 2,
            "rollout_num_gpus_per_engine": 2, "device": "cpu", "sglang_server_command": f"{sys.executable} -m miles.rollout.engine.server",
        }  # fmt: skip
        cfg = resolve(build_config(values, environ={}))
        a = server_argv(cfg, EngineSlot(index=0, host="127.0.0.1", port=0, nccl_port=1))
        assert a[a.index("--tp-size") + 1] == "2", a
        assert parse_args(a[3:]).tp_size == 2
        return " ".join(a[3:])

    check("SGLang server argv of a TP-2 engine (taken by the built-in server)", argv)

    def buckets() -> str:
        from transformers import AutoModelForCausalLM

        from miles.rollout.engine.base import iter_weight_buckets

        model = AutoModelForCausalLM.from_pretrained(state["hf"])
        bs = list(iter_weight_buckets(model.named_parameters(), 1 << 20))
        names = [n for b in bs for n, _ in b]
        assert names == [n for n, _ in model.named_parameters()] and all(n.startswith(("model.", "lm_head")) for n in names)
        return f"{len(bs)} buckets, {len(names)} HF names ({names[0]} ... {names[-1]})"

    check("weight bucket names", buckets)

    def ranks() -> str:
        from miles.rollout.engine.weight_transport import engines_of, group_backend, rank_offsets

        world, offsets = rank_offsets(engines_of(["a", "b"], [2, 2]))
        assert (world, offsets) == (5, [1, 3]) and group_backend("cuda") == "nccl" and group_backend("cpu") == "gloo"
        return f"two TP-2 engines: world {world}, rank offsets {offsets}; CUDA tensors over nccl, CPU over gloo"

    check("broadcast rank layout", ranks)
    print(f"summary: {failures} of 5 CPU checks failed" if failures else "summary: 5 CPU checks passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
