"""Benchmark: the memory plan's trainer estimate (miles/config/memory_plan.py) against the measured peak on CPU.

For each small Qwen3 model, one fresh interpreter builds `TorchBackend` (fp32, one worker) and runs
one `train_step` (GRPO policy loss, one micro-batch of the whole batch); the measured number is the
process's peak resident memory (`ru_maxrss`) minus its resident memory just before the trainer was
built (torch and transformers already imported). The plan is computed for the same configuration
(`plan_memory` on the resolved config, without the CUDA context a CPU does not have). The row is
plan / measured: 1.0 is exact; above 1 the plan is conservative.

What it is not: a GPU measurement. Resident memory counts the allocator's slack and the checkpoint
bytes read while loading, which a GPU's `max_memory_allocated` would not, and the torch backend's
attention here is transformers' eager kernel on padded rows (the plan's "no flash kernel" case).

    python bench/memory_plan.py                 # three models, hidden 256-768, about a minute
    python bench/memory_plan.py --tiny          # the smoke size
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, tempfile
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
hidden, layers, vocab, batch, seq, response = map(int, sys.argv[1:7])
torch.set_num_threads(1)
heads = max(1, hidden // 64)
cfgd = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads, max_position_embeddings=4096,
            tie_word_embeddings=False)
d = tempfile.mkdtemp()
torch.manual_seed(0)
Qwen3ForCausalLM(Qwen3Config(**cfgd)).save_pretrained(d)
import gc; gc.collect()
from miles.backends.torch import TorchBackend
from miles.train.step import train_rollout
from miles.config.memory_plan import plan_memory
from miles.config.model_size import ModelSize, read_config
from miles.config.resolve import build_config, resolve
values = dict(hf_checkpoint=d, prompt_data="p.jsonl", rollout_batch_size=batch, n_samples_per_prompt=1, global_batch_size=batch,
              num_rollout=1, actor_num_gpus_per_node=1, micro_batch_size=batch, rollout_max_prompt_len=seq - response,
              rollout_max_response_len=response, device="cpu")
cfg = resolve(build_config(values, environ={}))
plan = plan_memory(cfg, ModelSize.from_hf_config(read_config(d)), None)
before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
trainer = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
g = torch.Generator().manual_seed(0)
data = {"tokens": torch.randint(vocab, (batch, seq), generator=g).tolist(), "response_lengths": [response] * batch,
        "rewards": [float(i % 2) * 2 - 1 for i in range(batch)], "loss_masks": [[1] * response for _ in range(batch)],
        "rollout_log_probs": [[-1.0] * response for _ in range(batch)]}
train_rollout(trainer, data, rollout_id=0)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
planned = plan.trainer_total - plan.trainer["CUDA context"]
print(json.dumps({"planned": planned, "measured": peak - before, "params": ModelSize.from_hf_config(read_config(d)).total,
                  "parts": {k: v for k, v in plan.trainer.items()}}))
"""

SIZES = [(256, 4, 8192), (512, 4, 16384), (768, 6, 32000)]


def measure(hidden: int, layers: int, vocab: int, batch: int, seq: int, response: int) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, *map(str, (hidden, layers, vocab, batch, seq, response))],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"the measurement of hidden {hidden} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--response", type=int, default=384)
    ap.add_argument("--tiny", action="store_true", help="one small model (the smoke test)")
    ap.add_argument("--json", default=None, help="also write the rows here (bench/run_all.py reads it)")
    a = ap.parse_args()
    sizes = [(128, 2, 4096)] if a.tiny else SIZES
    if a.tiny:
        a.batch, a.seq, a.response = 2, 64, 32
    rows = []
    print(f"batch {a.batch} x {a.seq} tokens ({a.response} response), fp32, torch backend, 1 worker")
    print(f"{'model':28s} {'params':>10s} {'planned MiB':>12s} {'measured MiB':>13s} {'plan/measured':>14s}")
    for hidden, layers, vocab in sizes:
        m = measure(hidden, layers, vocab, a.batch, a.seq, a.response)
        ratio = m["planned"] / m["measured"]
        name = f"hidden {hidden}, {layers} layers, vocab {vocab}"
        print(f"{name:28s} {m['params'] / 1e6:9.1f}M {m['planned'] / 2**20:12.0f} {m['measured'] / 2**20:13.0f} {ratio:14.2f}")
        rows.append({"what": f"memory plan / measured peak ({name})", "value": ratio, "unit": "x measured",
                     "goal": "0.8-1.5", "met": 0.8 <= ratio <= 1.5})
    if a.json:
        Path(a.json).write_text(json.dumps({"bench": "memory_plan", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
