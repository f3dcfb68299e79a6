"""A whole chat conversation as token ids and a loss mask, the way the tokenizer's chat template renders it.

`conversation_ids(tokenizer, messages, tools=...)` is the data of SFT on conversations (`--loss-type
sft_loss`, `miles.rollout.sft_rollout`): the loss mask is 1 on the assistant messages' tokens (content,
tool calls, the closing eos) and 0 on every other message and on the template's turn markers. It lives
here, outside the generate hub, because the dataset (`miles.rollout.data_source`) renders the rows with it;
the hub's multi-turn token helpers (`generate_hub.chat_tokens`) share its `TemplateMismatch`.
"""

from __future__ import annotations

from typing import Any


class TemplateMismatch(ValueError):
    """The chat template renders earlier turns differently once more messages follow."""


def conversation_ids(
    tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, **template_kwargs: Any
) -> tuple[list[int], int, list[int]]:
    """A whole conversation as `(ids, prompt_length, loss_mask)` for SFT: the chat template's render of
    `messages`, with loss mask 1 on the assistant messages' tokens (their content, tool calls and closing
    eos) and 0 on everything else (the messages of other roles, each turn's opening markers).

    The text is rendered once; assistant message i spans from the end of the render of `messages[:i]`
    with the generation prompt to the first eos after it. The text is tokenized piece by piece at those
    span boundaries, the same boundaries a multi-turn rollout's tokens have (the engine's turns start
    after the generation prompt and end with the eos), so SFT and RL train on the same layout. The
    prompt is everything before the first assistant message; the text after the last one's eos (and
    any trailing non-assistant messages) is dropped, as a rollout ends at the model's eos.
    """
    kw: dict[str, Any] = dict(template_kwargs, tokenize=False)
    if tools:
        kw["tools"] = tools
    eos = tokenizer.eos_token
    if eos is None:
        raise TemplateMismatch("the tokenizer has no eos token to end an assistant turn with")
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise ValueError("the conversation has no assistant message to train on")
    full = tokenizer.apply_chat_template(list(messages), add_generation_prompt=False, **kw)
    spans: list[tuple[int, int]] = []
    for i in turns:
        head = tokenizer.apply_chat_template(list(messages[:i]), add_generation_prompt=True, **kw)
        if not full.startswith(head) or (spans and len(head) < spans[-1][1]):
            raise TemplateMismatch(
                f"the chat template renders the turns before message {i} differently once later messages follow"
            )
        end = full.find(eos, len(head))
        if end < 0:
            raise TemplateMismatch(f"the chat template does not end assistant message {i} with the eos token {eos!r}")
        spans.append((len(head), end + len(eos)))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    ids = encode(full[: spans[0][0]])
    prompt_len = len(ids)
    mask: list[int] = []
    for k, (start, end) in enumerate(spans):
        if k:  # what the template puts between the previous assistant message and this one
            between = encode(full[spans[k - 1][1] : start])
            ids += between
            mask += [0] * len(between)
        own = encode(full[start:end])
        ids += own
        mask += [1] * len(own)
    return ids, prompt_len, mask
