"""miles/backends/megatron/vocab_parallel.py: log-probs and entropies over a TP group equal those of the
whole vocabulary on one rank, values and gradients, with vocabulary padding on the last rank.

Two gloo processes each hold half of [R, 20] logits (vocabulary 19, padded to 20 for TP=2, as the tiny
model's); the reference is log_softmax / entropy of the 19 real columns on one process. The gradient of
a loss using both is checked slice by slice: an all-reduce whose backward summed the TP copies would
double it. A few seconds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from miles.algo.entropy import entropy_from_logits
from miles.utils.net import free_port

VOCAB, PADDED, ROWS = 19, 20, 7


def _data():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(ROWS, PADDED, generator=g) * 3
    logits[:, VOCAB:] = 100.0  # padding columns: large, so counting them would show
    targets = torch.tensor([0, 5, 9, 10, 14, 18, 18])  # both halves, both edges of the split
    return logits, targets


def _loss(lp, ent):
    w = torch.arange(1.0, ROWS + 1)
    return (w * lp).sum() + 0.3 * (w.flip(0) * ent).sum()


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from miles.backends.megatron.vocab_parallel import vocab_parallel_log_probs

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    logits, targets = _data()
    width = PADDED // 2
    mine = logits[:, rank * width:(rank + 1) * width].clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(mine, targets, vocab_start=rank * width, vocab_size=VOCAB, group=dist.group.WORLD,
                                       with_entropy=True)
    _loss(lp, ent).backward()
    torch.save({"lp": lp.detach(), "ent": ent.detach(), "grad": mine.grad}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_tp2_log_probs_entropies_and_gradients_equal_the_whole_vocabulary(tmp_path: Path):
    mp.spawn(_worker, args=(free_port("127.0.0.1"), str(tmp_path)), nprocs=2, join=True)
    logits, targets = _data()
    full = logits[:, :VOCAB].clone().requires_grad_(True)
    lp = torch.log_softmax(full, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    ent = entropy_from_logits(full)
    _loss(lp, ent).backward()
    grad = torch.cat([full.grad, torch.zeros(ROWS, PADDED - VOCAB)], dim=1)  # padding gets no gradient
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for r, got in enumerate(ranks):
        torch.testing.assert_close(got["lp"], lp.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(got["ent"], ent.detach(), rtol=0, atol=1e-5)
        torch.testing.assert_close(got["grad"], grad[:, r * 10:(r + 1) * 10], rtol=0, atol=1e-5)


if __name__ == "__main__":  # pragma: no cover - spawn re-imports this module
    sys.exit(0)
