"""The rollout of `--loss-type sft_loss`: supervised fine-tuning on conversations, with no generation.

    miles train --loss-type sft_loss --prompt-data conversations.jsonl --input-key messages ...

With `--loss-type sft_loss` the rows of `--prompt-data` are whole conversations (OpenAI-style `messages`,
assistant messages may carry `tool_calls`, tool results are `tool` messages; the row's `--tool-key` tools
go to the chat template). The dataset renders each one once through the tokenizer's chat template into a
finished sample whose loss mask is 1 on the assistant messages' tokens only
(`miles.rollout.conversation.conversation_ids`), and this rollout function hands out
`--rollout-batch-size` of them per step, in the data source's order (epochs, `--rollout-shuffle`, the
saved position on resume all work as for prompts). The trainer's `sft_loss` is the negative
log-likelihood of the masked tokens. It is the rollout `--loss-type sft_loss` uses unless
`--rollout-function-path` names another; upstream's path, `miles.rollout.sft_rollout.generate_rollout`,
selects it too. Eval still generates from `--eval-prompt-data` prompts.
"""

from __future__ import annotations

from miles.errors import UserError
from miles.rollout.generate_hub.types import RolloutFnInput, RolloutFnOutput
from miles.sample import SampleStatus

PATH = "miles.rollout.sft_rollout.generate_rollout"


async def generate_rollout(input: RolloutFnInput) -> RolloutFnOutput:
    """`--rollout-batch-size` conversation groups of the data source, as they are (reward 0: unused)."""
    d = input.cfg.data
    groups = input.data_source.get_samples(d.rollout_batch_size, d.n_samples_per_prompt)
    for s in (s for g in groups for s in g):
        if s.loss_mask is None or s.response_length == 0:
            raise UserError(
                f"{PATH} trains on conversations, but sample {s.index} is a prompt without a response; "
                "use it with --loss-type sft_loss, which reads --prompt-data rows as conversations.",
                option="--rollout-function-path",
            )
        s.reward = 0.0
        s.status = SampleStatus.COMPLETED
    return RolloutFnOutput(samples=groups)


def rollout_function_path(cfg) -> str | None:
    """The training rollout function of the run: --rollout-function-path, else this one under
    --loss-type sft_loss, else None (the built-in rollout)."""
    if cfg.rollout.rollout_function_path:
        return cfg.rollout.rollout_function_path
    return PATH if cfg.algo.loss_type == "sft_loss" else None
