"""Benchmark: generated tokens/s of the built-in rollout engine vs Hugging Face `model.generate`.

Baseline: `model.generate(do_sample=True, temperature=1)` on the same model, the same batch of random
prompts (rollout cases repeat each prompt `n_samples_per_prompt` times, as a rollout does) and the
same number of new tokens, measured in the same run. Our requests carry per-request seeds and ask
for log-probs, as the rollout manager's do. Neither side may stop early (the
models have no eos), so both produce exactly batch x new_tokens tokens. Reported: median of `--repeats`
timed runs (ours and generate alternating) after three warm-ups, tokens/s for each, and ours / generate (> 1 means we are faster).

Models (random init, created in a temp dir, nothing downloaded):
- tiny: the embedded default (hidden 64, 2 layers, ~124k params, vocab 19);
- 15M:  hidden 384, 8 layers, 6 heads / 2 kv heads, MLP 1024, vocab 8192 (~15.7M params).

A second table (continuous batching) times the engine alone on rollout-like work where lengths
differ: 256 requests, each with its own max_new_tokens drawn from 1..64, through 64 batch slots. It
reports generated tokens/s; run it against an older checkout (PYTHONPATH) for a before/after.

Run (about 1-2 minutes on 2 CPU cores):

    python bench/rollout_engine.py                 # all cases, 1 torch thread
    python bench/rollout_engine.py --threads 2 --only tiny
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from miles.prepare.tiny_model import create_tiny_qwen3
from miles.rollout.engine.base import GenerateRequest, SamplingParams
from miles.rollout.engine.builtin import BuiltinEngine

# (model, distinct prompts, samples per prompt, prompt_len, new_tokens, what it stands for)
CASES = [
    ("tiny", 32, 8, 4, 4, "rollout: 32 prompts x 8 samples, ~4 new tokens"),
    ("tiny", 64, 8, 4, 8, "rollout: 64 prompts x 8 samples, 8 new tokens"),
    ("tiny", 32, 1, 16, 64, "stack-facts shape, batch 32"),
    ("tiny", 256, 1, 16, 64, "stack-facts shape, batch 256"),
    ("15M", 32, 1, 16, 64, "stack-facts shape, batch 32"),
    ("15M", 32, 8, 16, 16, "rollout: 32 prompts x 8 samples"),
    ("15M", 256, 1, 16, 64, "stack-facts shape, batch 256 (the matmul-limit row)"),
]
TINY_CASES = [("tiny", 4, 2, 4, 4, "smoke test")]


_LIMIT_N = 2048


def _limit_matmul():
    """One fp32 2048^3 matmul: timed between the engine's runs, it gives the compute ceiling here."""
    a, b = torch.randn(_LIMIT_N, _LIMIT_N), torch.randn(_LIMIT_N, _LIMIT_N)
    return lambda: a @ b


def _no_eos(hf_dir: Path) -> None:
    """Drop eos from the model's configs so neither side stops before new_tokens."""
    import json

    for name in ("config.json", "generation_config.json"):
        path = hf_dir / name
        cfg = json.loads(path.read_text())
        cfg["eos_token_id"] = None
        path.write_text(json.dumps(cfg))


def make_tiny(root: Path) -> Path:
    src = create_tiny_qwen3(root / "tiny-src", seed=0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = root / "tiny"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(out)
    tok = AutoTokenizer.from_pretrained(src)
    tok.eos_token = None
    tok.save_pretrained(out)
    _no_eos(out)
    return out


def make_15m(root: Path) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = 8192
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    out = root / "15m"
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab)}, unk_token="<t0>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<t0>").save_pretrained(out)
    _no_eos(out)
    return out


def _interleaved_medians(*fns, repeats: int) -> list[float]:
    """Median seconds of each of `fns`, run in turn (a, b, a, b, ...) after warm-ups.

    Alternating puts all under the same background load, which on a shared CPU moves more than
    any one number. Three warm-ups each: the first calls in a process pay for allocator growth.
    """
    for _ in range(3):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def run_case(
    hf_dir: Path, distinct: int, per_prompt: int, prompt_len: int, new: int, repeats: int, dtype: str = "float32",
    decode_path: str = "auto", with_limit: bool = False,
) -> tuple[float, float, float | None]:
    """(ours tok/s, generate tok/s, and with `with_limit` the fp32 matmul FLOP/s timed between them)."""
    from transformers import AutoModelForCausalLM

    batch = distinct * per_prompt
    engine = BuiltinEngine(hf_dir, max_batch_size=batch, seed=0, dtype=dtype, decode_path=decode_path)
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    # Each prompt repeated per_prompt times in a row, as a rollout sends them.
    prompts = torch.randint(4, vocab, (distinct, prompt_len), generator=g).repeat_interleave(per_prompt, 0)
    # Seeded per request, as the rollout manager sends them (the seed only picks the draws).
    reqs = [
        GenerateRequest(p.tolist(), SamplingParams(temperature=1.0, max_new_tokens=new, seed=i), return_logprob=True)
        for i, p in enumerate(prompts)
    ]

    def ours() -> None:
        out = engine.generate(reqs)
        assert all(len(r.output_ids) == new for r in out)

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    mask = torch.ones_like(prompts)

    def hf() -> None:
        with torch.inference_mode():
            out = model.generate(
                input_ids=prompts, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
            )
        assert out.shape == (batch, prompt_len + new)

    tokens = batch * new
    if not with_limit:
        t_ours, t_hf = _interleaved_medians(ours, hf, repeats=repeats)
        return tokens / t_ours, tokens / t_hf, None
    t_ours, t_hf, t_mm = _interleaved_medians(ours, hf, _limit_matmul(), repeats=repeats)
    return tokens / t_ours, tokens / t_hf, 2 * _LIMIT_N**3 / t_mm


# (model, requests, batch slots, prompt_len, longest new_tokens)
MIXED_CASES = [("tiny", 256, 64, 8, 64), ("15M", 128, 32, 16, 32)]


def run_mixed(
    hf_dir: Path, n: int, slots: int, prompt_len: int, longest: int, repeats: int, dtype: str = "float32",
    decode_path: str = "auto",
) -> float:
    """Generated tokens/s when each request has its own length (uniform in 1..longest)."""
    engine = BuiltinEngine(hf_dir, max_batch_size=slots, seed=0, dtype=dtype, decode_path=decode_path)
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, vocab, (n, prompt_len), generator=g)
    lengths = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    reqs = [
        GenerateRequest(p.tolist(), SamplingParams(temperature=1.0, max_new_tokens=k, seed=i), return_logprob=True)
        for i, (p, k) in enumerate(zip(prompts, lengths))
    ]
    engine.generate(reqs)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        times.append(time.perf_counter() - t0)
        assert [len(r.output_ids) for r in out] == lengths
    return sum(lengths) / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is steadiest on a shared CPU)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", choices=["tiny", "15M"], default=None)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="both sides' weights and activations (the engine's --rollout-dtype)")
    ap.add_argument("--decode-path", choices=["auto", "hf"], default="auto",
                    help="the engine's decode path: auto (the fast decoder for Qwen3) or hf (Hugging Face's forward)")
    ap.add_argument("--tiny", action="store_true", help="one small case, one repeat (the smoke test)")
    ap.add_argument("--json", type=Path, default=None, help="also write the goal rows here (bench/run_all.py reads it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = TINY_CASES if args.tiny else CASES
    repeats = 1 if args.tiny else args.repeats
    results: dict[tuple, tuple[float, float]] = {}
    console = Console(width=120)
    table = Table(title=f"built-in engine vs HF generate (sampling, {args.dtype}, decode path {args.decode_path}, torch threads={args.threads})")
    for col in ("model", "prompts x samples", "prompt len", "new", "ours tok/s", "generate tok/s", "ours / gen"):
        table.add_column(col, no_wrap=True)
    with tempfile.TemporaryDirectory() as tmp:
        dirs: dict[str, Path] = {}
        for name, distinct, per_prompt, plen, new, what in cases:
            if args.only and name != args.only:
                continue
            if name not in dirs:
                dirs[name] = make_tiny(Path(tmp)) if name == "tiny" else make_15m(Path(tmp))
            with console.status(f"{name}: {what}"):
                # The batch-256 15M case takes ~10 s a call here: fewer repeats.
                limit_row = (name, distinct) == ("15M", 256)
                n = min(repeats, 3) if limit_row else repeats
                ours, hf, limit = run_case(
                    dirs[name], distinct, per_prompt, plen, new, n, args.dtype, args.decode_path, with_limit=limit_row
                )
                results[(name, distinct, per_prompt, plen, new)] = (ours, hf)
                if limit_row:
                    limit_flops = limit
                    from transformers import AutoConfig, AutoModelForCausalLM

                    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dirs[name])).parameters())
            shape = f"{distinct} x {per_prompt}"
            table.add_row(name, shape, str(plen), str(new), f"{ours:,.0f}", f"{hf:,.0f}", f"{ours / hf:.2f}x")
            console.print(f"{name} {shape} p={plen} n={new} ({what}): ours {ours:,.0f} tok/s, "
                          f"generate {hf:,.0f} tok/s, ratio {ours / hf:.2f}x")
    console.print(table)
    mixed = Table(title="continuous batching: requests of mixed lengths through fewer batch slots")
    for col in ("model", "requests", "slots", "new tokens", "ours tok/s"):
        mixed.add_column(col, no_wrap=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, n, slots, plen, longest in MIXED_CASES:
            if args.only and name != args.only:
                continue
            hf_dir = make_tiny(Path(tmp)) if name == "tiny" else make_15m(Path(tmp))
            with console.status(f"{name}: {n} requests of 1..{longest} tokens"):
                tps = run_mixed(hf_dir, n, slots, plen, longest, args.repeats, args.dtype, args.decode_path)
            mixed.add_row(name, str(n), str(slots), f"1..{longest}", f"{tps:,.0f}")
    console.print(mixed)
    rows = []
    for key, label in (
        (("tiny", 32, 1, 16, 64), "engine vs HF generate tok/s, batch 32"),
        (("tiny", 256, 1, 16, 64), "engine vs HF generate tok/s, batch 256"),
        (("tiny", 32, 8, 4, 4), "engine vs HF generate tok/s, rollout 32x8x4"),
        (("15M", 256, 1, 16, 64), "engine vs HF generate tok/s, 15M batch 256"),
        (TINY_CASES[0][:5], "engine vs HF generate tok/s (smoke size)"),
    ):
        if key in results:
            ours, hf = results[key]
            rows.append({"what": label, "value": ours / hf, "unit": "x generate", "goal": ">= 2" if "rollout" not in label and "smoke" not in label else "",
                         "met": ours / hf >= 2 if "rollout" not in label and "smoke" not in label else None})
    if ("15M", 256, 1, 16, 64) in results:
        # Decoding costs about 2 FLOPs per parameter per token (tied embeddings counted once); the
        # limit is the median of 2048^3 matmuls timed between the engine's runs (same load).
        frac = results[("15M", 256, 1, 16, 64)][0] * 2 * params / limit_flops
        console.print(f"15M batch 256: {frac:.0%} of the fp32 matmul limit ({limit_flops / 1e9:.0f} GFLOP/s at {args.threads} thread(s))")
        rows.append({"what": "engine, 15M batch 256: share of the fp32 matmul limit", "value": frac, "unit": "of limit",
                     "goal": ">= 0.6", "met": frac >= 0.6})
    if args.json:
        import json

        args.json.write_text(json.dumps({"bench": "rollout_engine", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
