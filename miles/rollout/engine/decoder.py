"""A lean forward pass for the Llama family (Llama, Qwen2, Qwen3) over a preallocated slot KV cache.

Why it exists: on a CPU the built-in engine's decode step on small models is per-op dispatch and
Python, not arithmetic. Hugging Face's modules grow a `DynamicCache` with `torch.cat` every step,
build masks and rotary tables every step and run ~40 small ops per layer. This module computes the
same function with about half the ops and no per-step allocation that grows with the sequence:

- **Weights are the Hugging Face model's own tensors.** q/k/v (and gate/up) are concatenated once
  into one matrix each and the HF parameters are made *views* into it, so `param.copy_(new)` (every
  weight update path) writes straight into the fused matrix: no second copy, nothing to refresh.
  If something replaces a parameter's storage (`model.to(device)`, a transport that swaps `.data`),
  `ensure_current()` notices (the views no longer point into the fused matrix) and fuses again.
  Tied embeddings stay tied: the output projection is whatever `get_output_embeddings()` holds.
- **KV cache** (`SlotKV`): per layer K as [rows, kv_heads, head_dim, columns] (transposed, so the
  scores are a plain batched matmul) and V as [rows, kv_heads, columns, head_dim], grown
  geometrically, written in place with one `index_put_` each per step. Every row starts at column 0
  (prompts are right-padded), so a token's rotary position is its column, and a row attends to
  columns <= its own length (one additive mask per step, shared by the layers).
- **Rotary tables** come from the model's own `rotary_emb` module, evaluated once for all positions
  up to the cache's width (so every static rope type it implements is reproduced exactly).

Supported: `model_type` llama, qwen2, qwen3 with SiLU MLPs, full attention on every layer (no sliding
window) and a static rope type. `unsupported_reason(model)` says why another model is not; the
engine then runs Hugging Face's forward instead (`miles.rollout.engine.builtin`).

Numerics: the same float32 math in a different order (fused matmuls, `F.rms_norm`, grouped-query
attention without repeating K/V), so logits match Hugging Face's forward to ~1e-6 relative on the
tiny model; tests/rollout/test_decoder.py compares them on random inputs
(`python -m pytest -q tests/rollout/test_decoder.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when `Decoder(model)` computes `model`'s forward exactly; otherwise why it cannot."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention"
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return "layers other than full attention"
    if (getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    inner = getattr(model, "model", None)
    rope = getattr(inner, "rotary_emb", None)
    if rope is None or "dynamic" in str(getattr(rope, "rope_type", "")) or getattr(rope, "rope_type", "") == "longrope":
        return "a dynamic rope type"
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return "an output head that is not a linear layer"
    for layer in getattr(inner, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return f"attention without q/k/v/o projections ({type(attn).__name__})"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"an MLP without gate/up/down projections ({type(mlp).__name__})"
        if len({m.bias is None for m in (attn.q_proj, attn.k_proj, attn.v_proj)}) != 1:
            return "q/k/v projections that differ in having a bias"
        if len({m.bias is None for m in (mlp.gate_proj, mlp.up_proj)}) != 1:
            return "gate/up projections that differ in having a bias"
    return None


def _fuse(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One matrix (and bias) holding the modules' weights; the modules' parameters become views of it."""
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in modules])
        bias = None if modules[0].bias is None else torch.cat([m.bias.detach() for m in modules])
        row = 0
        for m in modules:
            n = m.weight.shape[0]
            m.weight.data = weight[row : row + n]
            if bias is not None:
                m.bias.data = bias[row : row + n]
            row += n
    return weight, bias


class _Layer:
    """One decoder layer's tensors: fused ones owned here, the rest the HF Parameters themselves."""

    def __init__(self, layer: torch.nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.attn, self.mlp = attn, mlp
        self.ln1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm = None if q_norm is None else q_norm.weight
        self.k_norm = None if k_norm is None else k_norm.weight
        self.qk_eps = None if q_norm is None else q_norm.variance_epsilon
        self.o, self.down = attn.o_proj, mlp.down_proj
        self.fuse()

    def fuse(self) -> None:
        self.qkv = (self.attn.q_proj, self.attn.k_proj, self.attn.v_proj)
        self.gate_up = (self.mlp.gate_proj, self.mlp.up_proj)
        self.wqkv, self.bqkv = _fuse(list(self.qkv))
        self.wgu, self.bgu = _fuse(list(self.gate_up))
        self._ptrs = self._current_ptrs()

    def _current_ptrs(self) -> tuple[int, ...]:
        mods = self.qkv + self.gate_up
        return tuple(m.weight.data_ptr() for m in mods) + tuple(m.bias.data_ptr() for m in mods if m.bias is not None)

    def current(self) -> bool:
        """Whether the HF parameters are still views of the fused matrices."""
        return self._current_ptrs() == self._ptrs


class SlotKV:
    """The running batch's KV cache, per layer: K as [rows, kv_heads, head_dim, columns] (stored
    transposed, so the scores are a plain batched matmul: twice as fast as through a transposed
    view at these sizes) and V as [rows, kv_heads, columns, head_dim]."""

    def __init__(self, n_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.rows = self.cols = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def ensure(self, rows: int, cols: int) -> None:
        """Capacity for `rows` x `cols`, doubling what is short (existing entries are kept)."""
        if rows <= self.rows and cols <= self.cols:
            return
        new_rows = self.rows if rows <= self.rows else max(rows, 2 * self.rows)
        new_cols = self.cols if cols <= self.cols else max(cols, 2 * self.cols, 16)
        H, D = self.kv_heads, self.head_dim
        for cache, shape in ((self.k, (new_rows, H, D, new_cols)), (self.v, (new_rows, H, new_cols, D))):
            for i in range(self.n_layers):
                # Zeros, not empty: masked columns get probability 0, and 0 x NaN would still be NaN.
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(cache):
                    old = cache[i]
                    grown[: self.rows, :, : old.shape[2], : old.shape[3]] = old
                    cache[i] = grown
                else:
                    cache.append(grown)
        self.rows, self.cols = new_rows, new_cols
        # Flat offsets of (row, head, dim) at column 0 in K's and of (row, head) in V's [-1, D] view.
        r = torch.arange(new_rows, device=self.device)[:, None] * H + torch.arange(H, device=self.device)
        self.k_base = (r[:, :, None] * D + torch.arange(D, device=self.device)) * new_cols
        self.v_base = r * new_cols
        self.columns = torch.arange(new_cols, device=self.device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> None:
        """Decode: k, v [n, kv_heads, head_dim] of rows 0..n-1 into column lens[r] of row r."""
        n = k.shape[0]
        self.k[layer].view(-1).index_put_((self.k_base[:n] + lens[:, None, None],), k)
        self.v[layer].view(-1, self.head_dim).index_put_((self.v_base[:n] + lens[:, None],), v)

    def move(self, dst: torch.Tensor, src: torch.Tensor, width: int) -> None:
        """Copy rows `src` into rows `dst` (the first `width` columns)."""
        for t in self.k:
            view = t[..., :width]
            view.index_copy_(0, dst, view.index_select(0, src))
        for t in self.v:
            view = t[:, :, :width]
            view.index_copy_(0, dst, view.index_select(0, src))


class Decoder:
    """Prefill and decode forwards of a supported HF causal LM (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fast decoder cannot run this model: {reason}")
        cfg = model.config
        self.model = model
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.head = model.get_output_embeddings()
        self.rotary = inner.rotary_emb
        attn = inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.groups = self.heads // self.kv_heads
        self.scale = attn.scaling
        self.layers = [_Layer(layer) for layer in inner.layers]
        p = self.embed
        self.dtype, self.device = p.dtype, p.device
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)

    # ------------------------------------------------------------------ state

    def ensure_current(self) -> None:
        """Fuse again the layers whose HF parameters no longer alias the fused matrices (see module doc)."""
        for layer in self.layers:
            if not layer.current():
                layer.fuse()
        p = self.embed
        if p.device != self.device or p.dtype != self.dtype:
            self.dtype, self.device = p.dtype, p.device
            self._rope_len = 0

    def new_cache(self) -> SlotKV:
        return SlotKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)

    def _rope(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin [length, head_dim]: `rotate_half(x) * sin == x.roll(D/2) * sin_signed`."""
        if length > self._rope_len:
            n = max(length, 2 * self._rope_len, 64)
            pos = torch.arange(n, device=self.device)[None]
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(probe, pos)
            half = self.head_dim // 2
            self._cos = cos[0].contiguous()
            self._sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
            self._rope_len = n
        return self._cos, self._sin

    # ------------------------------------------------------------------ forwards

    def _qkv(self, lyr: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Projections, q/k norms and rotary for `h` [..., hidden] -> q [..., H, D], k, v [..., Hkv, D]."""
        D, H, Hkv = self.head_dim, self.heads, self.kv_heads
        qkv = F.linear(h, lyr.wqkv, lyr.bqkv)
        v = qkv[..., (H + Hkv) * D :].unflatten(-1, (Hkv, D))
        qk = qkv[..., : (H + Hkv) * D].unflatten(-1, (H + Hkv, D))
        if lyr.q_norm is not None:  # q and k heads normalised together, each with its own weight
            weight = torch.cat([lyr.q_norm.expand(H, D), lyr.k_norm.expand(Hkv, D)])
            qk = _rms(qk, weight, lyr.qk_eps)
        # rotate_half(x) * sin == x.roll(D/2) * sin_signed (see _rope)
        qk = torch.addcmul(qk * cos, qk.roll(D // 2, -1), sin)
        return qk[..., :H, :], qk[..., H:, :], v

    def _mlp(self, lyr: _Layer, x: torch.Tensor) -> torch.Tensor:
        """x + MLP(norm(x)), the residual folded into the down projection's matmul."""
        gate, up = F.linear(_rms(x, lyr.ln2, lyr.eps2), lyr.wgu, lyr.bgu).chunk(2, dim=-1)
        return _linear_add(x, F.silu(gate) * up, lyr.down)

    def prefill_into(
        self, ids: torch.Tensor, last: torch.Tensor, kv: SlotKV, first_row: int, src: torch.Tensor
    ) -> torch.Tensor:
        """Right-padded prompts `ids` [P, W]; cache rows first_row + i take prompt src[i]'s K/V.

        Returns float32 logits [P, V] of each prompt's last real token (column `last[p]`). Padding
        columns get K/V too, but a row never attends past its own length and decoding overwrites them.
        """
        P, W = ids.shape
        cos, sin = self._rope(W)
        cos, sin = cos[:W, None, :], sin[:W, None, :]
        rows = src.shape[0]
        x = F.embedding(ids, self.embed)
        for i, lyr in enumerate(self.layers):
            q, k, v = self._qkv(lyr, _rms(x, lyr.ln1, lyr.eps1), cos, sin)  # [P, W, heads, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            kv.k[i][first_row : first_row + rows, :, :, :W] = k.index_select(0, src).transpose(2, 3)
            kv.v[i][first_row : first_row + rows, :, :W] = v.index_select(0, src)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.groups > 1)
            x = _linear_add(x, o.transpose(1, 2).flatten(2), lyr.o)
            x = self._mlp(lyr, x)
        x = x[torch.arange(P, device=x.device), last]
        return self._logits(x)

    def decode(self, tokens: torch.Tensor, lens: torch.Tensor, kv: SlotKV, width: int) -> torch.Tensor:
        """One token per row for cache rows 0..n-1: `tokens` [n] go to columns `lens` [n].

        `width` > max(lens) bounds the columns attended. Returns float32 logits [n, V].
        """
        n = tokens.shape[0]
        D, Hkv, G = self.head_dim, self.kv_heads, self.groups
        cos_t, sin_t = self._rope(width)
        cos, sin = cos_t[lens][:, None, :], sin_t[lens][:, None, :]
        # 0 for columns <= the row's own length, -inf after: one mask for every layer and head.
        bias = torch.zeros((n, width), dtype=self.dtype, device=lens.device)
        bias.masked_fill_(kv.columns[:width] > lens[:, None], float("-inf"))
        bias = bias.repeat_interleave(Hkv, dim=0)[:, None, :]  # [n*Hkv, 1, width]
        x = F.embedding(tokens, self.embed)
        for i, lyr in enumerate(self.layers):
            q, k, v = self._qkv(lyr, _rms(x, lyr.ln1, lyr.eps1), cos, sin)  # q [n, H, D]; k, v [n, Hkv, D]
            kv.write(i, k, v, lens)
            keys_t = kv.k[i][:n, :, :, :width].flatten(0, 1)  # [n*Hkv, D, width], a view
            vals = kv.v[i][:n, :, :width].flatten(0, 1)  # [n*Hkv, width, D]
            scores = torch.baddbmm(bias, q.reshape(n * Hkv, G, D), keys_t, alpha=self.scale)
            if self.dtype != torch.float32:
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            else:
                probs = torch.softmax(scores, dim=-1)
            x = _linear_add(x, torch.bmm(probs, vals).view(n, Hkv * G * D), lyr.o)
            x = self._mlp(lyr, x)
        return self._logits(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms(x, self.norm, self.norm_eps), self.head.weight, self.head.bias).float()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm (float32 statistics) in fewer ops than `F.rms_norm`'s CPU composite."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)) * weight
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))).to(x.dtype)


def _linear_add(x: torch.Tensor, h: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    """x + lin(h), as one matmul with beta = 1 when there is no bias (a residual add saved)."""
    if lin.bias is not None or x.dim() != 2:
        return x + F.linear(h, lin.weight, lin.bias)
    return torch.addmm(x, h, lin.weight.t())
