"""Benchmark `miles convert` on a ~1 GB fp32 checkpoint: time vs `cp`, peak RSS vs the largest tensor.

    python bench/convert.py [--size-gb 1.0] [--dir /tmp/miles-bench-convert]

Creates a random Qwen3-shaped HF checkpoint (written tensor by tensor, never a whole model in memory),
then in the same run measures: `cp -r` of the same bytes (the baseline), HF -> torch_dist, and
torch_dist -> HF, each in a fresh subprocess so its peak RSS (ru_maxrss) is its own (megatron's
writer helper processes are not included).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def make_checkpoint(d: Path, size_gb: float) -> int:
    import torch
    from safetensors.torch import save_file

    hidden, ffn, vocab = 1024, 4096, 32768
    per_layer = 4 * (hidden * 1024 * 2 + hidden * 512 * 2 + 3 * hidden * ffn + 2 * hidden)
    layers = max(1, int((size_gb * 1e9 - 2 * 4 * vocab * hidden) / per_layer))
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden, "intermediate_size": ffn,
           "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
           "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
           "max_position_embeddings": 4096, "torch_dtype": "float32"}
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    weight_map, largest = {}, 0
    names = [("model.embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden)), ("model.norm.weight", (hidden,))]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
                  (p + "self_attn.q_proj.weight", (1024, hidden)), (p + "self_attn.k_proj.weight", (512, hidden)),
                  (p + "self_attn.v_proj.weight", (512, hidden)), (p + "self_attn.o_proj.weight", (hidden, 1024)),
                  (p + "self_attn.q_norm.weight", (64,)), (p + "self_attn.k_norm.weight", (64,)),
                  (p + "mlp.gate_proj.weight", (ffn, hidden)), (p + "mlp.up_proj.weight", (ffn, hidden)),
                  (p + "mlp.down_proj.weight", (hidden, ffn))]
    shard, n = {}, 0
    for name, shp in names + [(None, None)]:
        if name is None or sum(t.numel() for t in shard.values()) * 4 > 2e8:
            file = f"model-{n:05d}.safetensors"
            save_file(shard, d / file, metadata={"format": "pt"})
            weight_map.update({k: file for k in shard})
            shard, n = {}, n + 1
        if name is not None:
            shard[name] = torch.randn(shp)
            largest = max(largest, shard[name].numel() * 4)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return largest


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and the peak RSS in bytes the child reports on its last stdout line (0 for cp)."""
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    return time.perf_counter() - t, int(out[-1]) if out else 0


def child(args: list[str]) -> None:
    from miles.ckpt.convert import run_convert
    from miles.config.convert import ConvertOptions

    src, dst, direction = args
    if direction == "to_td":
        run_convert(ConvertOptions(hf_checkpoint=src, save=dst), progress=False)
    else:
        run_convert(ConvertOptions(from_format="torch_dist", to_format="hf", load=src, save=dst), progress=False)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp/miles-bench-convert")
    a = ap.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    largest = make_checkpoint(root / "hf", a.size_gb)
    total = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors"))
    cp_s, _ = timed(["cp", "-r", str(root / "hf"), str(root / "hf_copy")])
    me = [sys.executable, __file__, "--child"]
    td_s, td_rss = timed(me + [str(root / "hf"), str(root / "td"), "to_td"])
    hf_s, hf_rss = timed(me + [str(root / "td"), str(root / "back"), "to_hf"])
    print(f"checkpoint: {total / 1e9:.2f} GB in safetensors, largest tensor {largest / 1e6:.0f} MB")
    print(f"cp -r (baseline):     {cp_s:6.2f} s  1.00x")
    print(f"hf -> torch_dist:     {td_s:6.2f} s  {td_s / cp_s:5.2f}x cp   peak RSS {td_rss / 1e9:.2f} GB = {td_rss / largest:.1f}x largest tensor")
    print(f"torch_dist -> hf:     {hf_s:6.2f} s  {hf_s / cp_s:5.2f}x cp   peak RSS {hf_rss / 1e9:.2f} GB = {hf_rss / largest:.1f}x largest tensor")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
