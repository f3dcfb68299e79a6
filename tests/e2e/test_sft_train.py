"""`miles train --loss-type sft_loss` through the real CLI: the rows of --prompt-data are tool-using
conversations, the run trains on them without generating (the trained samples are the conversations'
chat-template tokens with the assistant-only loss mask), and the SFT loss falls."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MILES = [sys.executable, "-m", "miles_cli.main"]


def conversation(a: int, b: int) -> list[dict]:
    e = f"{a}*{b}"
    return [
        {"role": "user", "content": f"What is {e}?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": e}}}]},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def test_sft_loss_trains_on_the_conversations_of_the_prompt_data(tmp_path: Path):
    from miles.prepare.tiny_model import build_chat_tokenizer, create_tiny_qwen3
    from miles.rollout.conversation import conversation_ids
    from miles.rollout.tools.builtin import TOOL_SPECS

    model = create_tiny_qwen3(tmp_path / "m", chat=True, hidden_size=32, heads=2, kv_heads=1, intermediate=64, seed=0)
    convos = [conversation(100 + i, 12) for i in range(4)]
    (tmp_path / "conv.jsonl").write_text("".join(json.dumps({"messages": c, "tools": TOOL_SPECS}) + "\n" for c in convos))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"messages": c[:1], "tools": TOOL_SPECS, "label": c[-1]["content"]}) + "\n" for c in convos[:2]))
    dumps = tmp_path / "dumps"
    extra = (
        f"--loss-type sft_loss --prompt-data {tmp_path}/conv.jsonl --input-key messages --num-rollout 3 "
        "--rollout-batch-size 4 --n-samples-per-prompt 1 --global-batch-size 4 --micro-batch-size 4 --lr 3e-3 "
        f"--eval-prompt-data tools {tmp_path}/eval.jsonl --eval-interval 3 --apply-chat-template --rollout-max-response-len 8 "
        f"--save-interval 3 --save-debug-rollout-data {dumps}/rollout_{{rollout_id}}.jsonl"
    )
    argv = ["train", "--hf-checkpoint", str(model), "--output-dir", str(tmp_path / "runs"), "--run-id", "sft", "--extra-args", extra]
    r = subprocess.run(MILES + argv, cwd=tmp_path, capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"

    tok = build_chat_tokenizer()
    expected = {json.dumps(conversation_ids(tok, c, tools=TOOL_SPECS)) for c in convos}
    for rollout_id in range(3):
        trained = [json.loads(line) for line in (dumps / f"rollout_{rollout_id}.jsonl").read_text().splitlines()]
        assert len(trained) == 4
        got = {json.dumps((s["tokens"], len(s["tokens"]) - s["response_length"], s["loss_mask"])) for s in trained}
        assert got == expected  # every conversation once per epoch, as rendered, never generated
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "sft" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.1, losses
    # nothing was generated or rewarded: no reward on record, the step line shows the loss
    assert not any("rollout/raw_reward" in m or "perf/rollout_tokens_per_s" in m for m in metrics)
    assert "step 3/3 · loss " in r.stdout and "reward 0.000" not in r.stdout, r.stdout[-2000:]
