"""Prompt data: read a prompt dataset (`--prompt-data`) and hand it out as groups of samples.

Two pieces:

- `PromptDataset`: the rows of a local JSONL or Parquet file turned into prompt `Sample`s. Keys
  `--input-key` (prompt: text or chat messages), `--label-key` (reference answer), `--metadata-key`
  (dict passed to rewards and filters), `--tool-key` (tool specs for the chat template). With
  `--apply-chat-template` the prompt is rendered by the tokenizer's chat template (HF-style
  `apply_chat_template`, extra keyword arguments from `--apply-chat-template-kwargs`); with a
  tokenizer, prompts longer than `--rollout-max-prompt-len` tokens are dropped. With `--loss-type
  sft_loss` a row is a whole conversation instead, rendered into a finished sample whose loss mask
  covers the assistant messages only (`conversations=True`). Bad data is a
  `UserError` naming the file, the line (or Parquet row) and the flag that fixes it.
- `RolloutDataSource`: hands out `get_samples(num_groups, n_samples_per_prompt)` groups in order,
  epoch after epoch (reshuffled each epoch when `--rollout-shuffle`, seeded by `--rollout-seed` and the
  epoch number, so every run sees the same order). Groups given back with `add_samples` (aborted or
  over-sampled ones) are handed out first. `state_dict()`/`load_state_dict()` save and restore the
  position and that buffer, so a resumed run receives exactly the prompts an uninterrupted run would.

What it is not: generation, rewards or dynamic-sampling filters (`miles/rollout/filters.py`). Usage:

    dataset = PromptDataset.from_config(cfg.data, cfg.rollout, tokenizer)
    source = RolloutDataSource(dataset, shuffle=cfg.rollout.rollout_shuffle, seed=cfg.rollout.rollout_seed)
    groups = source.get_samples(cfg.rollout.over_sampling_batch_size, cfg.data.n_samples_per_prompt)
    source.add_samples(unused_groups)                  # handed out again first
    state = source.state_dict()                        # plain JSON-able dict, saved with the checkpoint
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import random
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from miles.errors import UserError
from miles.sample import Sample, SampleStatus

if TYPE_CHECKING:
    from miles.config.data import DataConfig
    from miles.config.rollout import RolloutConfig

_SUFFIXES = (".jsonl", ".parquet")


def _read_rows(path: Path, flag: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (where, row) pairs; `where` is "file:line" (JSONL) or "file row N" (Parquet), 1-based."""
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file; give the path of a local .jsonl or .parquet file.", option=flag)
    if path.suffix not in _SUFFIXES:
        raise UserError(f"{flag} {path}: unsupported file type {path.suffix!r}; use a .jsonl or .parquet file.", option=flag)
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        try:
            table = pyarrow.parquet.read_table(path)
        except (pyarrow.ArrowException, OSError) as e:
            raise UserError(f"{flag} {path}: cannot read it as Parquet ({e}).", option=flag) from None
        for i, row in enumerate(table.to_pylist(), start=1):
            yield f"{path} row {i}", row
        return
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); fix or remove the line in {flag}.",
                        option=flag,
                    ) from None
                if not isinstance(row, dict):
                    raise UserError(
                        f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}; fix the line in {flag}.",
                        option=flag,
                    )
                yield f"{path}:{lineno}", row
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path}: not UTF-8 text ({e.reason} at byte {e.start}).", option=flag) from None
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot read it ({e.strerror}).", option=flag) from None


def _parse_chat_template_kwargs(value: str | dict[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, dict):
        return dict(value)
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise UserError(
            f"--apply-chat-template-kwargs {value!r} is not valid JSON ({e.msg}); give an object such as '{{\"enable_thinking\": false}}'.",
            option="--apply-chat-template-kwargs",
        ) from None
    if not isinstance(parsed, dict):
        raise UserError(
            f"--apply-chat-template-kwargs {value!r} must be a JSON object of keyword arguments.",
            option="--apply-chat-template-kwargs",
        )
    return parsed


def _tool_specs(path: str | None) -> list[dict[str, Any]] | None:
    if not path:
        return None
    from miles.rollout.tools.execution import load_tool_specs

    return load_tool_specs(path)


class PromptDataset(Sequence[Sample]):
    """The prompts of one dataset file as `Sample`s with prompt, label, metadata, tools (and tokens)."""

    def __init__(
        self,
        path: str | Path,
        *,
        tokenizer: Any = None,
        input_key: str = "input",
        label_key: str | None = None,
        metadata_key: str = "metadata",
        tool_key: str = "tools",
        apply_chat_template: bool = False,
        apply_chat_template_kwargs: str | dict[str, Any] | None = None,
        max_prompt_len: int | None = None,
        flag: str = "--prompt-data",
        default_tools: list[dict[str, Any]] | None = None,
        conversations: bool = False,
    ):
        """Read and prepare every row now, so data errors surface before any training starts.

        `tokenizer` (HF-style: `apply_chat_template`, `__call__` returning "input_ids") is needed for
        `apply_chat_template` and `max_prompt_len`; with it, each sample's `tokens` hold the prompt ids.
        `flag` names the option that gave `path`, for error messages (eval datasets pass their own).
        `default_tools` (--generate-tool-specs-path) are the tools of rows that have none under `tool_key`.
        `conversations` (`--loss-type sft_loss`): each row's `input_key` is a whole conversation, rendered by
        the chat template into a finished sample: `tokens`, `response_length` and a `loss_mask` that is 1
        on the assistant messages only (`miles.rollout.conversation`); `prompt` keeps the messages.
        """
        self.path = Path(path)
        if (apply_chat_template or conversations or max_prompt_len is not None) and tokenizer is None:
            raise ValueError("PromptDataset needs a tokenizer for apply_chat_template, conversations or max_prompt_len")
        template_kwargs = _parse_chat_template_kwargs(apply_chat_template_kwargs)
        self.num_filtered = 0
        """Rows dropped because their prompt is longer than max_prompt_len tokens."""
        self._samples: list[Sample] = []
        for where, row in _read_rows(self.path, flag):
            if input_key not in row:
                raise UserError(
                    f"{where}: no key {input_key!r} (the row has {sorted(row)}); set --input-key to the key holding the prompt.",
                    option="--input-key",
                )
            if label_key is not None and label_key not in row and not conversations:  # SFT: no label needed
                raise UserError(
                    f"{where}: no key {label_key!r} (the row has {sorted(row)}); set --label-key to the key holding the answer.",
                    option="--label-key",
                )
            prompt = row[input_key]
            metadata = self._metadata(row.get(metadata_key), where, metadata_key)
            tools = row.get(tool_key)
            if tools is None:
                tools = default_tools
            if conversations:
                self._samples.append(self._conversation(prompt, tools, where, tokenizer, template_kwargs))
                self._samples[-1].label = row.get(label_key) if label_key is not None else None
                self._samples[-1].metadata = metadata
                continue
            text = self._render(prompt, tools, where, tokenizer, apply_chat_template, template_kwargs)
            tokens: list[int] = []
            if tokenizer is not None:
                tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
                if max_prompt_len is not None and len(tokens) > max_prompt_len:
                    self.num_filtered += 1
                    continue
            self._samples.append(
                Sample(
                    prompt=text,
                    tokens=tokens,
                    label=row[label_key] if label_key is not None else None,
                    metadata=metadata,
                    tools=tools,
                )
            )
        if not self._samples:
            why = (
                f"all {self.num_filtered} prompts are longer than --rollout-max-prompt-len {max_prompt_len} tokens; raise it"
                if self.num_filtered
                else "it has no rows; give a file with at least one prompt"
            )
            raise UserError(f"{flag} {self.path}: {why}.", option="--rollout-max-prompt-len" if self.num_filtered else flag)

    @classmethod
    def from_config(
        cls, data: DataConfig, rollout: RolloutConfig, tokenizer: Any = None, *, conversations: bool = False
    ) -> PromptDataset:
        """The training prompts as the resolved configuration declares them (`conversations`: SFT rows)."""
        if data.prompt_data is None:
            raise UserError("--prompt-data is required; give a .jsonl or .parquet file of prompts.", option="--prompt-data")
        return cls(
            data.prompt_data,
            tokenizer=tokenizer,
            input_key=data.input_key,
            label_key=data.label_key,
            metadata_key=data.metadata_key,
            tool_key=data.tool_key,
            apply_chat_template=data.apply_chat_template,
            apply_chat_template_kwargs=data.apply_chat_template_kwargs,
            max_prompt_len=rollout.rollout_max_prompt_len,
            default_tools=_tool_specs(rollout.generate_tool_specs_path),
            conversations=conversations,
        )

    @staticmethod
    def _metadata(value: Any, where: str, key: str) -> dict[str, Any]:
        if value is None:
            return {}
        if isinstance(value, str):  # Parquet files often store metadata as a JSON string
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        if not isinstance(value, dict):
            raise UserError(
                f"{where}: metadata {key!r} must be an object (or a JSON string of one), got {type(value).__name__}; "
                "fix the row or point --metadata-key elsewhere.",
                option="--metadata-key",
            )
        return value

    @staticmethod
    def _conversation(messages: Any, tools: Any, where: str, tokenizer: Any, kwargs: dict[str, Any]) -> Sample:
        """A conversation row as a finished SFT sample (loss mask 1 on its assistant messages)."""
        from miles.rollout.conversation import TemplateMismatch, conversation_ids

        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)):
            raise UserError(
                f"{where}: with --loss-type sft_loss a row holds a conversation, a list of chat messages {{role, content}}, "
                f"got {type(messages).__name__}; point --input-key at the messages.",
                option="--input-key",
            )
        try:
            ids, prompt_len, mask = conversation_ids(tokenizer, messages, tools=tools, **kwargs)
        except TemplateMismatch as e:
            raise UserError(f"{where}: cannot train on this conversation token-exactly: {e}.", option="--input-key") from None
        except ValueError as e:
            raise UserError(f"{where}: {e}; give every conversation at least one assistant message.", option="--input-key") from None
        return Sample(
            prompt=messages, tokens=ids, response=tokenizer.decode(ids[prompt_len:], skip_special_tokens=False),
            response_length=len(ids) - prompt_len, loss_mask=mask, tools=tools, status=SampleStatus.COMPLETED,
        )

    @staticmethod
    def _render(prompt: Any, tools: Any, where: str, tokenizer: Any, apply_chat_template: bool, kwargs: dict[str, Any]) -> Any:
        if apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages)):
                raise UserError(
                    f"{where}: the prompt must be text or a list of chat messages {{role, content}}, got {type(prompt).__name__}.",
                    option="--input-key",
                )
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
        if not isinstance(prompt, str):
            raise UserError(
                f"{where}: the prompt is a {type(prompt).__name__}, not text; add --apply-chat-template to render chat messages.",
                option="--apply-chat-template",
            )
        return prompt

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, i):  # type: ignore[override]
        return self._samples[i]


_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), enum.Enum, tuple, frozenset)


def fresh_copy(prompt: Sample) -> Sample:
    """An independent copy of a dataset sample, as `copy.deepcopy` would make it, at a fraction of the
    cost: immutable fields are shared, empty containers replaced by new empty ones, and only non-empty
    containers (metadata, chat messages, a list label) deep-copied. Each of a group's samples may then
    be changed (metadata by a custom reward, tokens by the rollout) without touching its siblings or
    the dataset. (`deepcopy` of every sample was about a third of the rollout manager's own time.)"""
    return fresh_copies(prompt, 1)[0]


def fresh_copies(prompt: Sample, n: int) -> list[Sample]:
    """`n` times `fresh_copy(prompt)`: which fields need their own copy is found once for the group, and
    each copy starts as the instance dict's shallow copy (what `copy.copy` does, without its protocol)."""
    plan = _copy_plan(prompt)
    state, cls = prompt.__dict__, type(prompt)
    out = []
    for _ in range(n):
        sample = cls.__new__(cls)
        sample.__dict__.update(state)
        for f, how in plan:
            setattr(sample, f, how(state[f]))
        out.append(sample)
    return out


def _copy_plan(prompt: Sample) -> list[tuple[str, Any]]:
    """(field, how to copy its value) for every field a copy must not share with `prompt`."""
    plan = []
    for f in _FIELDS:
        value = getattr(prompt, f)
        if isinstance(value, _IMMUTABLE) and not (isinstance(value, (tuple, frozenset)) and value):
            continue  # a non-empty tuple may hold mutable items: deep-copied below
        if type(value) is list and all(type(x) is int for x in value):
            plan.append((f, list))  # token ids
        elif type(value) in (list, dict, set) and not value:
            plan.append((f, _new_empty))
        else:
            plan.append((f, copy.deepcopy))
    return plan


def _new_empty(value):
    return type(value)()


_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))


class RolloutDataSource:
    """Hands out prompt groups epoch after epoch, with a buffer of returned groups and a saved position."""

    def __init__(self, dataset: Sequence[Sample], *, shuffle: bool = False, seed: int = 42):
        if len(dataset) == 0:
            raise ValueError("RolloutDataSource needs a non-empty dataset")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        """Passes started over the dataset; the first pass is epoch 0."""
        self.offset = 0
        """Position within the current epoch's order."""
        self.num_groups_handed_out = 0
        """Groups drawn from the dataset so far (buffered groups not counted); numbers the groups."""
        self._buffer: deque[list[Sample]] = deque()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            # A string seed is hashed with SHA-512 by `random`: stable across runs, machines and Python versions.
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        return order

    def __len__(self) -> int:
        """Groups waiting in the buffer (returned with `add_samples`)."""
        return len(self._buffer)

    def get_samples(self, num_groups: int, n_samples_per_prompt: int) -> list[list[Sample]]:
        """`num_groups` groups: first those given back with `add_samples`, then fresh prompts.

        A fresh group holds `n_samples_per_prompt` independent copies of one prompt, numbered with
        `group_index` (running count of fresh groups) and `index` (group_index * n + position).
        Buffered groups come back as they were given (their own size and numbering).
        """
        if num_groups < 0 or n_samples_per_prompt < 1:
            raise ValueError(f"get_samples({num_groups}, {n_samples_per_prompt}): need num_groups >= 0 and n >= 1")
        groups: list[list[Sample]] = []
        while self._buffer and len(groups) < num_groups:
            groups.append(self._buffer.popleft())
        while len(groups) < num_groups:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._epoch_order(self.epoch)
            prompt = self.dataset[self._order[self.offset]]
            self.offset += 1
            group_index = self.num_groups_handed_out
            self.num_groups_handed_out += 1
            group = fresh_copies(prompt, n_samples_per_prompt)
            for j, sample in enumerate(group):
                sample.group_index = group_index
                sample.index = group_index * n_samples_per_prompt + j
                sample.status = SampleStatus.PENDING
            groups.append(group)
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Give back groups that were not used (aborted or over-sampled); they are handed out first, in this order."""
        for group in groups:
            if not group:
                raise ValueError("add_samples got an empty group")
            self._buffer.append(list(group))

    def state_dict(self) -> dict[str, Any]:
        """Position and buffer as plain JSON-able data, saved with each checkpoint."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "num_groups_handed_out": self.num_groups_handed_out,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
            "buffer": [[s.to_dict() for s in group] for group in self._buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was saved; the dataset and shuffle settings must be the same."""
        saved = (state["dataset_size"], state["shuffle"], state["seed"])
        current = (len(self.dataset), self.shuffle, self.seed)
        if saved != current:
            raise UserError(
                "the checkpoint's data position was saved for (dataset size, --rollout-shuffle, --rollout-seed) = "
                f"{saved} but this run has {current}; resume with the same --prompt-data, --rollout-shuffle and --rollout-seed.",
                option="--prompt-data",
            )
        self.epoch = state["epoch"]
        self.offset = state["offset"]
        self.num_groups_handed_out = state["num_groups_handed_out"]
        self._order = self._epoch_order(self.epoch)
        self._buffer = deque([Sample.from_dict(d) for d in group] for group in state["buffer"])
