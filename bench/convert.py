"""Benchmark `miles convert` on a ~1 GB fp32 checkpoint: time vs `cp`, peak RSS vs the largest tensor.

    python bench/convert.py [--size-gb 1.0] [--repeats 3] [--dir /tmp/miles-bench-convert] [--json out.json]
    python bench/convert.py --tiny            # a few MB, seconds: the smoke test's size

Times are medians of `--repeats` interleaved runs (cp, then each conversion, per repeat), because a
shared machine's noise moves single runs by 2x; `sync` runs before each step (untimed), so no step
pays for writing back the one before (cp never fsyncs). "start-up" is the wall time of a fresh
interpreter that only imports what a conversion imports (the converter; not torch, which converting
does not import): a fixed cost every conversion pays, whatever the size; the "minus start-up" ratio
is the per-byte speed against cp. The load average is printed with the numbers.

Creates a random Qwen3-shaped HF checkpoint (written tensor by tensor, never a whole model in memory),
then in the same run measures: `cp -r` of the same bytes (the time baseline), HF -> torch_dist with
the streaming writer (as `run_convert` in a fresh interpreter, and as the `miles convert` command),
the same with every fsync skipped (what durability costs: cp does not fsync; `bytecopy.DURABLE` is
switched off in that child only), the same conversion through megatron-core's own
`dist_checkpointing.save` of the whole mapped state dict (the memory baseline: what the converter did
before streaming), and torch_dist -> HF (with and without fsync). Each runs in a fresh subprocess and reports its own peak RSS (VmHWM: unlike ru_maxrss,
it is not inherited from the forking parent across exec); megatron-core's
writer helper process is not counted, so its row is a lower bound. `--skip-megatron` drops that row.
"above idle" subtracts the peak RSS of an interpreter that only imported what the conversion imports.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def make_checkpoint(d: Path, size_gb: float) -> int:
    import torch
    from safetensors.torch import save_file

    # Below 0.2 GB (the smoke test) a narrower model, so that a few layers fit.
    hidden, ffn, vocab = (1024, 4096, 32768) if size_gb >= 0.2 else (128, 512, 2048)
    heads = hidden // 64
    q, kv = heads * 64, max(1, heads // 2) * 64
    per_layer = 4 * (hidden * q * 2 + hidden * kv * 2 + 3 * hidden * ffn + 2 * hidden)
    layers = max(1, int((size_gb * 1e9 - 2 * 4 * vocab * hidden) / per_layer))
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden, "intermediate_size": ffn,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv // 64, "head_dim": 64,
           "vocab_size": vocab, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
           "max_position_embeddings": 4096, "torch_dtype": "float32"}
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(cfg))
    weight_map, largest = {}, 0
    names = [("model.embed_tokens.weight", (vocab, hidden)), ("lm_head.weight", (vocab, hidden)), ("model.norm.weight", (hidden,))]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
                  (p + "self_attn.q_proj.weight", (q, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                  (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, q)),
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


def peak_rss() -> int:
    """This process's peak resident set in bytes (Linux /proc VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and the peak RSS in bytes the child reports on its last stdout line (0 if none)."""
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout.split()
    return time.perf_counter() - t, int(out[-1]) if out and out[-1].isdigit() else 0


def child(args: list[str]) -> None:
    from miles.ckpt.convert import run_convert
    from miles.config.convert import ConvertOptions

    src, dst, direction = args
    if direction.endswith("_nosync"):
        # What durability costs: the same conversion with every fsync/fdatasync skipped (bench only).
        from miles.ckpt.convert import bytecopy

        bytecopy.DURABLE = False
        direction = direction.removesuffix("_nosync")
    if direction == "to_td":
        run_convert(ConvertOptions(hf_checkpoint=src, save=dst), progress=False)
    elif direction == "to_td_megatron":
        megatron_whole_state_dict_save(Path(src), Path(dst))
    else:
        run_convert(ConvertOptions(from_format="torch_dist", to_format="hf", load=src, save=dst), progress=False)
    print(peak_rss())


def megatron_whole_state_dict_save(src: Path, dst: Path) -> None:
    """The baseline: map every tensor into memory, then one megatron-core `dist_checkpointing.save`."""
    from datetime import timedelta

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from miles.ckpt.convert.families import ModelShape
    from miles.ckpt.convert.hf_io import HFReader, read_hf_config
    from miles.ckpt.convert.layout import sharded_key
    from miles.ckpt.convert.mapping import hf_to_megatron, rules_for
    from miles.ckpt.megatron_compat import cpu_compat

    shape = ModelShape.from_hf_config(read_hf_config(src))
    sharded = {}
    with HFReader(src, shape) as reader:
        for r in rules_for(shape):
            sk = sharded_key(r.megatron, shape)
            t = hf_to_megatron(r, [reader.get(n) for n in r.hf], shape)
            sharded[r.megatron] = ShardedTensor.from_rank_offsets(sk.key, t, *sk.prepend, replica_id=0,
                                                                  prepend_axis_num=len(sk.prepend))
    dst.mkdir(parents=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timedelta(seconds=600))
    with cpu_compat():
        dist_checkpointing.save(sharded, str(dst), sharded_strategy=("torch_dist", 1))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of each row; medians are reported")
    ap.add_argument("--dir", default="/tmp/miles-bench-convert")
    ap.add_argument("--tiny", action="store_true", help="a few-MB checkpoint, one repeat, no megatron row (the smoke test)")
    ap.add_argument("--skip-megatron", action="store_true", help="skip the megatron-core whole-state-dict baseline")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here (bench/run_all.py reads it)")
    a = ap.parse_args()
    if a.tiny:
        a.size_gb, a.repeats, a.skip_megatron = 0.01, 1, True
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    largest = make_checkpoint(root / "hf", a.size_gb)
    total = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors"))
    me = [sys.executable, __file__, "--child"]
    cli = [sys.executable, "-m", "miles_cli.main", "convert"]
    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in (
        "cp", "start-up", "to_td", "to_td_nosync", "cli", "to_td_megatron", "to_hf", "to_hf_nosync")}

    def step(key: str, cmd: list[str], *clean: str) -> None:
        for d in clean:
            shutil.rmtree(root / d, ignore_errors=True)
        # Each step starts with nothing left to write back from the one before (cp does not fsync,
        # and its dirty pages would otherwise be flushed during the next step).
        os.sync()
        runs[key].append(timed(cmd))

    for _ in range(a.repeats):
        step("cp", ["cp", "-r", str(root / "hf"), str(root / "hf_copy")], "hf_copy")
        step("start-up", [sys.executable, __file__, "--idle"])
        step("to_td", me + [str(root / "hf"), str(root / "td"), "to_td"], "td")
        step("to_td_nosync", me + [str(root / "hf"), str(root / "td_nosync"), "to_td_nosync"], "td_nosync")
        step("cli", cli + ["--hf-checkpoint", str(root / "hf"), "--save", str(root / "td_cli")], "td_cli")
        if not a.skip_megatron:
            step("to_td_megatron", me + [str(root / "hf"), str(root / "td_megatron"), "to_td_megatron"], "td_megatron")
        step("to_hf", me + [str(root / "td"), str(root / "back"), "to_hf"], "back")
        step("to_hf_nosync", me + [str(root / "td"), str(root / "back_nosync"), "to_hf_nosync"], "back_nosync")
    med = {k: (statistics.median(t for t, _ in v), max(r for _, r in v)) for k, v in runs.items() if v}
    cp_s = med["cp"][0]
    start_s, base_rss = med["start-up"]

    def row(label: str, s: float, rss: int) -> str:
        return (f"{label:<34}{s:6.2f} s {s / cp_s:5.2f}x cp  minus start-up {max(s - start_s, 0) / cp_s:5.2f}x   "
                f"peak RSS {rss / 1e9:.2f} GB, above idle {(rss - base_rss) / 1e9:.2f} GB = {(rss - base_rss) / largest:4.1f}x largest tensor")

    load = os.getloadavg()
    print(f"checkpoint: {total / 1e9:.2f} GB in safetensors, largest tensor {largest / 1e6:.0f} MB; medians of {a.repeats} interleaved runs; "
          f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs)")
    print(f"{'cp -r (time baseline)':<34}{cp_s:6.2f} s  1.00x")
    print(f"{'start-up (imports only)':<34}{start_s:6.2f} s {start_s / cp_s:5.2f}x cp   peak RSS {base_rss / 1e9:.2f} GB (the idle baseline)")
    print(row("hf -> torch_dist (streaming)", *med["to_td"]))
    print(f"{'  same, no fsync (bench only)':<34}{med['to_td_nosync'][0]:6.2f} s {med['to_td_nosync'][0] / cp_s:5.2f}x cp")
    print(f"{'  same, `miles convert` CLI':<34}{med['cli'][0]:6.2f} s {med['cli'][0] / cp_s:5.2f}x cp")
    if "to_td_megatron" in med:
        print(row("hf -> torch_dist (megatron save)", *med["to_td_megatron"]))
    print(row("torch_dist -> hf", *med["to_hf"]))
    print(f"{'  same, no fsync (bench only)':<34}{med['to_hf_nosync'][0]:6.2f} s {med['to_hf_nosync'][0] / cp_s:5.2f}x cp")
    if a.json:
        td_s, td_rss = med["to_td"]
        rss_goal = largest + 1e9
        a.json.write_text(json.dumps({"bench": "convert", "rows": [
            {"what": f"convert HF->torch_dist vs cp ({total / 1e9:.2f} GB)", "value": td_s / cp_s, "unit": "x cp", "goal": "<= 3", "met": td_s / cp_s <= 3},
            {"what": "  same, minus interpreter start-up", "value": max(td_s - start_s, 0) / cp_s, "unit": "x cp", "goal": "", "met": None},
            {"what": "convert peak RSS above idle vs largest tensor + 1 GB", "value": (td_rss - base_rss) / rss_goal, "unit": "x budget",
             "goal": "<= 1", "met": td_rss - base_rss <= rss_goal},
            {"what": "convert HF->torch_dist without fsync (cp does not fsync)", "value": med["to_td_nosync"][0] / cp_s, "unit": "x cp", "goal": "", "met": None},
            {"what": "convert HF->torch_dist through the `miles convert` CLI", "value": med["cli"][0] / cp_s, "unit": "x cp", "goal": "", "met": None},
            {"what": "convert torch_dist->HF vs cp", "value": med["to_hf"][0] / cp_s, "unit": "x cp", "goal": "", "met": None},
        ], "seconds": {k: v[0] for k, v in med.items()}}, indent=2))


def idle() -> None:
    """Peak RSS of an interpreter that imported what a conversion imports, and converted nothing."""
    import miles.ckpt.convert.dcp_stream  # noqa: F401
    import miles.ckpt.convert.run  # noqa: F401
    from miles.config.convert import ConvertOptions  # noqa: F401

    print(peak_rss())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == "--idle":
        idle()
    else:
        main()
