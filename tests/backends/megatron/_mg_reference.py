"""A plain-torch reference of the megatron trainer's step, written out in full for the tests.

The same math as `MegatronTrainer.train_step` with nothing shared but `miles.algo` (the loss) and the
LR formula: a Hugging Face model (eager attention, fp32) run one sample at a time, log-probs of the
response tokens at the rollout temperature, `torch.optim.AdamW` with megatron's parameter groups (no
weight decay on 1-D parameters), global-norm clipping, the global batch cut into steps and
micro-batches with gradients accumulated. Used by test_megatron_trainer.py.
"""

from __future__ import annotations

import math

import torch


def make_train_data(n: int, *, seed: int, vocab: int, min_len: int = 5, max_len: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    data = {"tokens": [], "response_lengths": [], "loss_masks": [], "rewards": []}
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        resp = int(torch.randint(1, length - 1, (1,), generator=g))
        # Never the pad id 0: HF's embedding has padding_idx=0 and freezes that row's gradient, which
        # megatron-core's embedding (like upstream's) does not; rollouts never contain it.
        data["tokens"].append(torch.randint(1, vocab, (length,), generator=g).tolist())
        data["response_lengths"].append(resp)
        mask = (torch.rand(resp, generator=g) > 0.2).float()
        mask[0] = 1.0
        data["loss_masks"].append(mask.tolist())
        data["rewards"].append(float(torch.randn((), generator=g)))
    return data


class TorchReference:
    def __init__(self, hf_dir: str, cfg):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
        o = cfg.optimizer
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, foreach=False)
        self.steps = 0
        self.grad_norms: list[float] = []  # before clipping, one per optimizer step

    def log_probs(self, tokens: list[int], resp: int, *, entropy: bool = False):
        from miles.algo.entropy import entropy_from_logits

        logits = self.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
        t = self.cfg.rollout.rollout_temperature
        step = logits[len(tokens) - resp - 1 : len(tokens) - 1] / (t if t > 0 else 1.0)
        lp = torch.log_softmax(step, -1).gather(-1, torch.tensor(tokens[len(tokens) - resp :]).unsqueeze(-1)).squeeze(-1)
        return lp, (entropy_from_logits(step) if entropy else None)

    def train_step(self, data: dict) -> list[float]:
        """One rollout; returns the loss of every optimizer step."""
        from miles.algo.advantages import compute_advantages_and_returns
        from miles.algo.losses import get_loss_function
        from miles.algo.segments import Segments
        from miles.train.lr_schedule import lr_at

        a, d = self.cfg.algo, self.cfg.data
        n = len(data["tokens"])
        masks = [torch.tensor(m) for m in data["loss_masks"]]
        sft = a.loss_type == "sft_loss"
        with torch.no_grad():
            old = [self.log_probs(t, r)[0] for t, r in zip(data["tokens"], data["response_lengths"])]
        if not sft:
            # miles.algo's packed API: per-token tensors flattened over the samples, with their Segments.
            lengths = torch.tensor([len(m) for m in masks])
            flat, _ = compute_advantages_and_returns(a, rewards=torch.tensor(data["rewards"]), loss_mask=torch.cat(masks),
                                                     segments=Segments.from_lengths(lengths),
                                                     n_samples_per_prompt=d.n_samples_per_prompt, log_probs=torch.cat(old))
            adv = list(flat.split(lengths.tolist()))
        fn = get_loss_function(a)
        gbs = d.global_batch_size
        losses = []
        for s in range(n // gbs):
            idx = list(range(s * gbs, (s + 1) * gbs))
            self.opt.zero_grad()
            total = 0.0
            mbs = self.cfg.train.micro_batch_size
            for k in range(0, gbs, mbs):
                mb = idx[k : k + mbs]
                out = [self.log_probs(data["tokens"][i], data["response_lengths"][i], entropy=not sft) for i in mb]
                lps = torch.cat([o[0] for o in out])
                seg = Segments.from_lengths(torch.tensor([len(masks[i]) for i in mb]))
                mb_mask = torch.cat([masks[i] for i in mb])
                if sft:
                    loss, _ = fn(a, log_probs=lps, loss_mask=mb_mask, segments=seg, normalizer=float(gbs))
                else:
                    ents = torch.cat([o[1] if a.entropy_coef != 0 else o[1].detach() for o in out])
                    loss, _ = fn(a, log_probs=lps, old_log_probs=torch.cat([old[i] for i in mb]),
                                 advantages=torch.cat([adv[i] for i in mb]), loss_mask=mb_mask, segments=seg,
                                 entropy=ents, normalizer=float(gbs))
                loss.backward()
                total += float(loss.detach())
            clip = self.cfg.optimizer.clip_grad
            self.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else math.inf)))
            for group in self.opt.param_groups:
                group["lr"] = lr_at(self.steps, self.cfg.optimizer)
            self.opt.step()
            self.steps += 1
            losses.append(total)
        return losses
