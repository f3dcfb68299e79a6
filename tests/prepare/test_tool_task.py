"""The tiny-qwen3-tools task: held-out problems never trained on, the SFT mix, the final-answer reward,
and the tool tokenizer's multi-character words (the plain chat tokenizer's ids unchanged)."""

from __future__ import annotations

import json

from miles.prepare.tiny_model import TOOL_WORDS, build_chat_tokenizer, chat_vocab
from miles.prepare.tool_task import calculator_spec, conversation, create_tool_task, final_answer_reward
from miles.rollout.conversation import conversation_ids
from miles.sample import Sample


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_task_holds_out_its_eval_problems_and_mixes_tool_and_direct_answers(tmp_path):
    task = create_tool_task(tmp_path / "t", seed=0, n_train=500, n_eval=50, n_sft=400, tool_fraction=0.3)
    train, evals, sft = rows(task / "train.jsonl"), rows(task / "eval.jsonl"), rows(task / "sft.jsonl")
    assert (len(train), len(evals), len(sft)) == (500, 50, 400)
    question = lambda r: r["messages"][0]["content"]  # noqa: E731
    held_out = {question(r) for r in evals}
    assert len(held_out) == 50 and not held_out & ({question(r) for r in train} | {question(r) for r in sft})
    for r in train + evals:
        a, b = map(int, question(r).split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and r["label"] == str(a * b) and r["tools"] == [calculator_spec()]
    with_tool = sum(len(r["messages"]) == 4 for r in sft)
    assert 0.2 < with_tool / len(sft) < 0.4
    for r in sft:  # every conversation ends with the right product
        a, b = map(int, question(r).split("*"))
        assert r["messages"][-1] == {"role": "assistant", "content": str(a * b)}


def test_the_reward_reads_only_the_models_last_turn():
    tool_turn = ('<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'
                 "\n<|im_start|>user\n<tool_response>5535</tool_response><|im_end|>\n<|im_start|>assistant\n")
    score = lambda response: final_answer_reward(None, Sample(response=response, label="5535"))  # noqa: E731
    assert score(tool_turn + "5535") == 1.0
    assert score(tool_turn + "5536") == 0.0
    assert score(tool_turn) == 0.0  # the tool's answer is not the model's
    assert score("5535") == 1.0 and score("5535<|im_end|>") == 1.0 and score("55350") == 0.0


def test_the_tool_words_shorten_a_conversation_and_keep_the_chat_tokenizers_ids():
    plain, words = chat_vocab(), chat_vocab(TOOL_WORDS)
    assert {t: words[t] for t in plain} == plain
    convo = conversation(686, 72, use_tool=True)
    ids, prompt_len, mask = conversation_ids(build_chat_tokenizer(TOOL_WORDS), convo, tools=[calculator_spec()])
    long_ids, _, _ = conversation_ids(build_chat_tokenizer(), convo, tools=[calculator_spec()])
    assert (len(ids), len(long_ids)) == (52, 149)  # only calculator in the system block
    tok = build_chat_tokenizer(TOOL_WORDS)
    assert tok.decode(ids, skip_special_tokens=False) == build_chat_tokenizer().decode(long_ids, skip_special_tokens=False)
