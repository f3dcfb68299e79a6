"""Create the embedded default model: a tiny random-init Qwen3 checkpoint and a character tokenizer.

`create_tiny_qwen3(out_dir)` writes a Hugging Face model directory that `AutoModelForCausalLM` and
`AutoTokenizer` load from disk, with nothing downloaded:

- `config.json` + `model.safetensors`: a Qwen3 causal LM (by default hidden 64, 2 layers, 4 query and
  2 key/value heads, MLP 256, ~124k parameters, the size of the TRL CPU baseline), initialised from
  `seed`. The same arguments give the same bytes.
- `tokenizer.json` + `tokenizer_config.json`: a character-level tokenizer built with the `tokenizers`
  library over the characters of the arithmetic task (`TASK_CHARS`) and three specials
  (`<|pad|>`, `<|bos|>`, `<|eos|>`). The model never sees characters outside the task, so there is
  no need for byte fallback; an unknown character maps to `<|unk|>`.
- `generation_config.json` with the eos/pad/bos ids, so a plain `generate` stops at `<|eos|>`.

It is not a pretrained model: it knows nothing until the SFT warm start teaches it the task format.

Usage:

    from miles.prepare.tiny_model import create_tiny_qwen3
    hf_dir = create_tiny_qwen3("runs/tiny/hf", seed=0)   # skipped when already complete
"""

from __future__ import annotations

import os
from pathlib import Path

from miles.prepare import build_once

TASK_CHARS = "0123456789+-*= "
"""Every character the arithmetic task uses (digits, operators, '=', space)."""
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>")
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = SPECIAL_TOKENS


def tiny_vocab() -> dict[str, int]:
    """Token -> id: the specials first (pad = 0, bos = 1, eos = 2, unk = 3), then `TASK_CHARS`."""
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *TASK_CHARS))}


def build_char_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The character tokenizer as a `PreTrainedTokenizerFast` (not saved; see `create_tiny_qwen3`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=tiny_vocab(), unk_token=UNK_TOKEN))
    # Every character (space included) is its own token; decoding glues them back without spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",  # decoder-only batches are left-padded
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


CHAT_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
"""Every character of the chat variant: printable ASCII and the newline (tool calls are JSON)."""
CHAT_SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|im_end|>", "<|unk|>", "<|im_start|>")
CHAT_TAG_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Qwen3's tool tags, one token each and not special: decoding keeps them, so the text can be parsed."""

# Qwen3's layout in miniature: the tools are named in a system block, a tool result comes back inside
# <tool_response> in a user block, and every message ends with <|im_end|> (the eos) and a newline.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "tools: {% for t in tools %}{{ t.function.name if t.function is defined else t.name }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
    "<tool_call>{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


TOOL_WORDS = ("system\n", "user\n", "assistant\n", "tools: ", "calculator", '{"name": "', '", "arguments": ',
              '{"expression": "', '"}}')
"""Multi-character tokens of the tool recipe's tokenizer (`words=TOOL_WORDS`): the chat template's role
names and the calculator call's JSON, so a tool conversation is ~60 tokens instead of ~200 characters
(a 2-layer model then copies the numbers over short distances, and a CPU trains it in minutes)."""


def chat_vocab(words: tuple[str, ...] = ()) -> dict[str, int]:
    """Token -> id of the chat variant: specials (pad 0, bos 1, eos `<|im_end|>` 2, unk 3, `<|im_start|>` 4),
    the tool tags, `CHAT_CHARS`, then `words` (so the ids of everything before stay the same)."""
    return {tok: i for i, tok in enumerate((*CHAT_SPECIAL_TOKENS, *CHAT_TAG_TOKENS, *CHAT_CHARS, *words))}


def build_chat_tokenizer(words: tuple[str, ...] = ()):  # -> transformers.PreTrainedTokenizerFast
    """The chat variant of the character tokenizer: printable ASCII, Qwen3's tool tags and a chat template
    (`CHAT_TEMPLATE`) that takes `tools=`; eos is `<|im_end|>`, as in Qwen3. `words` are extra
    multi-character tokens, matched in the text before it is split into characters (like the tags)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pad, bos, eos, unk, _ = CHAT_SPECIAL_TOKENS
    tok = Tokenizer(models.WordLevel(vocab=chat_vocab(words), unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m:.)"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(CHAT_SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (*CHAT_TAG_TOKENS, *words)])
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk,
        padding_side="left", clean_up_tokenization_spaces=False, model_max_length=4096,
    )
    out.chat_template = CHAT_TEMPLATE
    return out


def create_tiny_qwen3(
    out_dir: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    chat: bool = False,
    chat_words: tuple[str, ...] | list[str] = (),
) -> Path:
    """Write the tiny Qwen3 model + tokenizer to `out_dir` (atomically) and return its path.

    Skipped when `out_dir` is already complete with the same arguments; a complete directory built
    with other arguments raises `UserError`. `chat=True` gives it the chat tokenizer
    (`build_chat_tokenizer`: printable ASCII, tool tags, a chat template) instead of the arithmetic one,
    with `chat_words` as extra multi-character tokens (e.g. `TOOL_WORDS`).
    """
    chat_words = tuple(chat_words)
    if hidden_size % heads or heads % kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})"
        )
    spec = {
        "kind": "tiny-qwen3",
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "intermediate": intermediate,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "seed": seed,
        "vocab": "".join(TASK_CHARS),
    }
    if chat:  # a key only the chat variant has: the default directory's spec (and bytes) stay as they were
        spec["vocab"] = "".join((*CHAT_SPECIAL_TOKENS, *CHAT_TAG_TOKENS, CHAT_CHARS))
        spec["chat_template"] = CHAT_TEMPLATE
        if chat_words:
            spec["chat_words"] = list(chat_words)

    def build(tmp: Path) -> None:
        import torch
        from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

        vocab = chat_vocab(chat_words) if chat else tiny_vocab()
        eos_token = CHAT_SPECIAL_TOKENS[2] if chat else EOS_TOKEN
        config = Qwen3Config(
            vocab_size=len(vocab),
            hidden_size=hidden_size,
            intermediate_size=intermediate,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hidden_size // heads,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=vocab[BOS_TOKEN],
            eos_token_id=vocab[eos_token],
            pad_token_id=vocab[PAD_TOKEN],
            torch_dtype="float32",
        )
        # fork_rng: seeding must not disturb the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
        model.generation_config = GenerationConfig(
            bos_token_id=vocab[BOS_TOKEN], eos_token_id=vocab[eos_token], pad_token_id=vocab[PAD_TOKEN]
        )
        model.save_pretrained(tmp)
        (build_chat_tokenizer(chat_words) if chat else build_char_tokenizer()).save_pretrained(tmp)

    return build_once(out_dir, spec, build, what="tiny Qwen3 model")


def create_tiny_qwen3_moe(
    out_dir: str | os.PathLike[str],
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    num_experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Write a tiny Qwen3-MoE (`Qwen3MoeForCausalLM`: every layer's MLP `num_experts` routed SwiGLU
    experts of width `moe_intermediate`, top-`experts_per_token` with normalised weights, untied
    embeddings) and the arithmetic tokenizer to `out_dir`, like `create_tiny_qwen3`. transformers fuses
    its experts in memory; the checkpoint holds them per expert (`mlp.experts.{e}.gate_proj.weight`)."""
    if hidden_size % heads or heads % kv_heads or experts_per_token > num_experts:
        raise ValueError("hidden_size must divide by heads, heads by kv_heads, and experts_per_token <= num_experts")
    spec = {"kind": "tiny-qwen3-moe", "hidden_size": hidden_size, "num_layers": num_layers, "heads": heads,
            "kv_heads": kv_heads, "num_experts": num_experts, "experts_per_token": experts_per_token,
            "moe_intermediate": moe_intermediate, "max_position_embeddings": max_position_embeddings, "seed": seed,
            "vocab": "".join(TASK_CHARS)}

    def build(tmp: Path) -> None:
        import torch
        from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

        vocab = tiny_vocab()
        config = Qwen3MoeConfig(
            vocab_size=len(vocab), hidden_size=hidden_size, intermediate_size=moe_intermediate,
            moe_intermediate_size=moe_intermediate, num_experts=num_experts, num_experts_per_tok=experts_per_token,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=num_layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden_size // heads,
            max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
            bos_token_id=vocab[BOS_TOKEN], eos_token_id=vocab[EOS_TOKEN], pad_token_id=vocab[PAD_TOKEN],
            torch_dtype="float32",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3MoeForCausalLM(config)
        model.generation_config = GenerationConfig(
            bos_token_id=vocab[BOS_TOKEN], eos_token_id=vocab[EOS_TOKEN], pad_token_id=vocab[PAD_TOKEN])
        model.save_pretrained(tmp)
        build_char_tokenizer().save_pretrained(tmp)

    return build_once(out_dir, spec, build, what="tiny Qwen3-MoE model")
