"""SFT on conversations (`--loss-type sft_loss`): the loss mask is the assistant messages' tokens exactly,
tool results and template markers are masked out, and the trained loss is the hand-computed NLL of those
tokens under the model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from miles.errors import UserError
from miles.prepare.tiny_model import build_chat_tokenizer
from miles.rollout.data_source import PromptDataset
from miles.rollout.conversation import conversation_ids
from miles.rollout.tools.builtin import TOOL_SPECS

CALL = {"function": {"name": "calculator", "arguments": {"expression": "123*45"}}}
CONVO = [
    {"role": "system", "content": "Use the tool."},
    {"role": "user", "content": "What is 123*45?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "5535"},
    {"role": "assistant", "content": "5535"},
]

# The chat template's text of CONVO, by hand, cut where the mask changes (miles/prepare/tiny_model.py).
PROMPT = "<|im_start|>system\nUse the tool.\ntools: calculator, python<|im_end|>\n<|im_start|>user\nWhat is 123*45?<|im_end|>\n<|im_start|>assistant\n"
TURN1 = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call><|im_end|>'
TOOL = "\n<|im_start|>user\n<tool_response>5535</tool_response><|im_end|>\n<|im_start|>assistant\n"
TURN2 = "5535<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def by_hand(tok, prompt: str, *pieces: tuple[str, int]) -> tuple[list[int], int, list[int]]:
    """(ids, prompt length, loss mask) of a prompt and (text, mask) pieces, from the literal text."""
    ids, mask = enc(tok, prompt), []
    for text, m in pieces:
        ids += enc(tok, text)
        mask += [m] * len(enc(tok, text))
    return ids, len(enc(tok, prompt)), mask


def test_the_mask_is_exactly_the_assistant_messages(tok):
    ids, prompt_len, mask = conversation_ids(tok, CONVO, tools=TOOL_SPECS)
    assert (ids, prompt_len, mask) == by_hand(tok, PROMPT, (TURN1, 1), (TOOL, 0), (TURN2, 1))
    # The tokens are the chat template's render of the whole conversation (up to the last eos).
    full = tok.apply_chat_template(CONVO, tools=TOOL_SPECS, tokenize=False)
    assert tok.decode(ids, skip_special_tokens=False) == full[: full.rindex("<|im_end|>") + len("<|im_end|>")]


def test_trailing_non_assistant_messages_are_dropped_and_no_assistant_is_refused(tok):
    ids, p, mask = conversation_ids(tok, [*CONVO, {"role": "user", "content": "thanks"}], tools=TOOL_SPECS)
    assert (ids, p, mask) == conversation_ids(tok, CONVO, tools=TOOL_SPECS)
    with pytest.raises(ValueError, match="no assistant message"):
        conversation_ids(tok, CONVO[:2])


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_dataset_reads_conversations_as_finished_samples(tok, tmp_path):
    data = write(tmp_path / "c.jsonl", [{"messages": CONVO, "tools": TOOL_SPECS}])
    (s,) = PromptDataset(data, tokenizer=tok, input_key="messages", conversations=True)
    ids, p, mask = conversation_ids(tok, CONVO, tools=TOOL_SPECS)
    assert s.prompt == CONVO and s.tokens == ids and s.response_length == len(ids) - p and s.loss_mask == mask
    bad = write(tmp_path / "bad.jsonl", [{"messages": CONVO[:2]}, {"messages": "hi"}])
    with pytest.raises(UserError, match=r"bad.jsonl:1: .*no assistant message") as e:
        PromptDataset(bad, tokenizer=tok, input_key="messages", conversations=True)
    assert e.value.option == "--input-key"


def hand_nll(model, ids: list[int], prompt_len: int, mask: list[int]) -> tuple[float, int]:
    """Sum and count of -log p(token | prefix) over the masked response tokens, one token at a time."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    total, n = 0.0, 0
    for j, m in enumerate(mask):
        if m:
            pos = prompt_len + j  # predicted from position pos - 1
            total -= torch.log_softmax(logits[pos - 1], -1)[ids[pos]].item()
            n += 1
    return total, n


@pytest.mark.parametrize("per_token", [True, False])
def test_the_trained_loss_is_the_nll_of_the_assistant_tokens(tok, tmp_path, per_token):
    from transformers import AutoModelForCausalLM

    from miles.backends.torch import TorchBackend
    from miles.config.algo import AlgoConfig
    from miles.config.engine import EngineConfig
    from miles.prepare.tiny_model import create_tiny_qwen3
    from miles.rollout.train_data import samples_to_train_data
    from miles.train.step import train_rollout

    torch.set_num_threads(1)
    hf = create_tiny_qwen3(tmp_path / "m", chat=True, hidden_size=32, heads=2, kv_heads=1, intermediate=64, seed=0)
    short = [{"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "6"}]
    data = write(tmp_path / "c.jsonl", [{"messages": CONVO, "tools": TOOL_SPECS}, {"messages": short}])
    samples = list(PromptDataset(data, tokenizer=tok, input_key="messages", conversations=True))
    for s in samples:
        s.reward = 0.0
    hand = [  # the expected loss is over the hand-written spans, not the code's own mask
        by_hand(tok, PROMPT, (TURN1, 1), (TOOL, 0), (TURN2, 1)),
        by_hand(tok, "<|im_start|>user\n2*3?<|im_end|>\n<|im_start|>assistant\n", ("6<|im_end|>", 1)),
    ]
    algo = AlgoConfig(loss_type="sft_loss", calculate_per_token_loss=per_token)
    train_data = samples_to_train_data(samples, algo=algo, n_samples_per_prompt=1, reward_key=None)
    assert train_data["loss_masks"] == [s.loss_mask for s in samples]
    cfg = EngineConfig(algo=algo)
    cfg.rollout.hf_checkpoint = str(hf)
    cfg.train.micro_batch_size = 1  # two micro-batches: the accumulation must give the batch's loss
    cfg.train.deterministic_mode = True
    cfg.data.global_batch_size = 2
    cfg.data.num_steps_per_rollout = 1
    trainer = TorchBackend(cfg, rank=0, world_size=1, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(hf, local_files_only=True).eval()
    sums = [hand_nll(model, *h) for h in hand]
    if per_token:
        expected = sum(t for t, _ in sums) / sum(n for _, n in sums)
    else:
        expected = sum(t / n for t, n in sums) / len(sums)
    got = train_rollout(trainer, train_data, rollout_id=0)["train/loss"]
    assert math.isclose(got, expected, rel_tol=1e-5), (got, expected)
