"""Token ids for what comes between two model turns, rendered by the tokenizer's own chat template.

A multi-turn trajectory is trained on the engine's tokens, so earlier turns are never rendered again:
only the new messages (tool results, a user's next message) are turned into ids, as the text the chat
template puts after an assistant message. That text is found by rendering a stand-in conversation
twice, `[user, assistant]` and `[user, assistant, *new]` (with the generation prompt), and keeping the
second's tail from the end of the assistant's end-of-turn token (`tokenizer.eos_token`, `<|im_end|>` in
Qwen3). Whatever the template writes after that token (Qwen3's newline) belongs to the suffix, so the
ids are the same as a full render would give. A model turn that did not end with the end-of-turn
token (stopped by a stop string, say) gets it first, as template tokens.

A template whose render of the longer conversation does not extend the shorter one (one that rewrites
earlier turns, e.g. drops past reasoning) cannot be used token-exactly: `TemplateMismatch`.
"""

from __future__ import annotations

from typing import Any

from miles.rollout.conversation import TemplateMismatch

__all__ = ["TemplateMismatch", "prompt_ids", "suffix_ids"]


def _stand_in_assistant(tool_calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def suffix_ids(
    tokenizer: Any,
    new_messages: list[dict[str, Any]],
    *,
    last_output_ids: list[int],
    tools: list[dict[str, Any]] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The ids to append after a model turn (`last_output_ids`) for `new_messages`, ending with the
    template's opening of the next assistant turn. `tool_calls` (OpenAI format) are the calls the
    turn made, given to the stand-in assistant message for templates that pair results with calls."""
    eos = tokenizer.eos_token
    if eos is None:
        raise TemplateMismatch("the tokenizer has no eos token to end an assistant turn with")
    base = [{"role": "user", "content": "."}, _stand_in_assistant(tool_calls)]
    kw: dict[str, Any] = {"tokenize": False}
    if tools:
        kw["tools"] = tools
    short = tokenizer.apply_chat_template(base, add_generation_prompt=False, **kw)
    full = tokenizer.apply_chat_template(base + list(new_messages), add_generation_prompt=True, **kw)
    end = short.rfind(eos)
    if end < 0:
        raise TemplateMismatch(f"the chat template does not end an assistant message with the eos token {eos!r}")
    cut = end + len(eos)
    if full[:cut] != short[:cut]:
        raise TemplateMismatch("the chat template renders the earlier turns differently when more messages follow")
    ids = list(tokenizer.encode(full[cut:], add_special_tokens=False))
    eos_id = tokenizer.eos_token_id
    if not last_output_ids or last_output_ids[-1] != eos_id:
        ids = [eos_id, *ids]
    return ids


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The ids of a whole conversation's first render, with the generation prompt."""
    kw: dict[str, Any] = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False, **kw)
    return list(tokenizer.encode(text, add_special_tokens=False))

