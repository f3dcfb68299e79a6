"""PromptDataset (JSONL/Parquet, keys, chat template, length filter, bad data) and RolloutDataSource
(groups, shuffle determinism, epochs, buffer, resume equality).

Run: pytest tests/rollout/test_data_source.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.errors import UserError
from miles.rollout.data_source import PromptDataset, RolloutDataSource
from miles.sample import Sample, SampleStatus

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789+=?<>|:_"
# Renders [{"role": "user", "content": "1+1=?"}] as "<|user|>1+1=?<|assistant|>"; tools and kwargs show up.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "{% if tools %}<|tools:{{ tools|length }}|>{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<|nothink|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A local character-level tokenizer (one token per character, no download): len(ids) == len(text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", chat_template=CHAT_TEMPLATE)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"question": "1+1=?", "answer": "2", "metadata": {"rm_type": "math"}},
    {"question": "2+2=?", "answer": "4", "tools": [{"name": "calc"}]},
    {"question": "10+10=?", "answer": "20"},
]


def test_jsonl_keys(tmp_path):
    ds = PromptDataset(write_jsonl(tmp_path / "p.jsonl", ROWS), input_key="question", label_key="answer")
    assert len(ds) == 3
    assert [s.prompt for s in ds] == ["1+1=?", "2+2=?", "10+10=?"]
    assert [s.label for s in ds] == ["2", "4", "20"]
    assert ds[0].metadata == {"rm_type": "math"} and ds[1].metadata == {}
    assert ds[1].tools == [{"name": "calc"}] and ds[0].tools is None
    assert ds[0].tokens == []  # no tokenizer, no tokens


def test_parquet_reads_the_same_rows_and_json_metadata(tmp_path):
    import pyarrow
    import pyarrow.parquet

    rows = [{"input": "hi", "label": 3, "metadata": json.dumps({"rm_type": "f1"})}, {"input": "yo", "label": 4, "metadata": None}]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "p.parquet")
    ds = PromptDataset(tmp_path / "p.parquet", label_key="label")
    assert [(s.prompt, s.label, s.metadata) for s in ds] == [("hi", 3, {"rm_type": "f1"}), ("yo", 4, {})]


def test_chat_template_with_tools_and_kwargs(tmp_path, tokenizer):
    ds = PromptDataset(
        write_jsonl(tmp_path / "p.jsonl", ROWS[:2]),
        tokenizer=tokenizer,
        input_key="question",
        apply_chat_template=True,
        apply_chat_template_kwargs='{"enable_thinking": false}',
    )
    assert ds[0].prompt == "<|user|>1+1=?<|assistant|><|nothink|>"
    assert ds[1].prompt == "<|user|>2+2=?<|tools:1|><|assistant|><|nothink|>"
    assert len(ds[0].tokens) == len("<|user|>") + len("1+1=?") + len("<|assistant|>") + len("<|nothink|>") == 8 + 5 + 13 + 11
    assert ds[0].tokens[8:13] == [CHARS.index(c) + 1 for c in "1+1=?"]


def test_chat_messages_are_rendered_as_given(tmp_path, tokenizer):
    rows = [{"input": [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]}]
    ds = PromptDataset(write_jsonl(tmp_path / "p.jsonl", rows), tokenizer=tokenizer, apply_chat_template=True)
    assert ds[0].prompt == "<|system|>be<|user|>hi<|assistant|>"


def test_max_prompt_len_drops_long_prompts(tmp_path, tokenizer):
    # Token counts equal character counts: "1+1=?" and "2+2=?" are 5 tokens, "10+10=?" is 7.
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = PromptDataset(path, tokenizer=tokenizer, input_key="question", max_prompt_len=6)
    assert [s.prompt for s in ds] == ["1+1=?", "2+2=?"] and ds.num_filtered == 1
    assert len(PromptDataset(path, tokenizer=tokenizer, input_key="question", max_prompt_len=7)) == 3
    with pytest.raises(UserError, match="all 3 prompts are longer than --rollout-max-prompt-len 4") as e:
        PromptDataset(path, tokenizer=tokenizer, input_key="question", max_prompt_len=4)
    assert e.value.option == "--rollout-max-prompt-len"


# --- bad data: the message names the file, the line and the flag -----------------------------------


def test_missing_input_key_names_file_line_and_flag(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "a"}, {"prompt": "b"}])
    with pytest.raises(UserError) as e:
        PromptDataset(path)
    assert f"{path}:2: no key 'input'" in str(e.value) and "--input-key" in str(e.value)
    assert "['prompt']" in str(e.value)  # shows what the row does have


def test_missing_label_key(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"input": "a", "label": 1}, {"input": "b", "label": 2}, {"input": "c"}])
    with pytest.raises(UserError, match=rf"{path}:3: no key 'label'.*--label-key"):
        PromptDataset(path, label_key="label")


def test_bad_json_line_is_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"input": "a"}\n\n{"input": "b",\n')
    with pytest.raises(UserError, match=rf"{path}:3: not valid JSON"):
        PromptDataset(path)


def test_row_that_is_not_an_object(tmp_path):
    with pytest.raises(UserError, match=r":1: a row must be a JSON object, got list"):
        PromptDataset(write_jsonl(tmp_path / "p.jsonl", [["input", "a"]]))


def test_bad_metadata(tmp_path):
    with pytest.raises(UserError, match=r":1: metadata 'metadata' must be an object.*--metadata-key"):
        PromptDataset(write_jsonl(tmp_path / "p.jsonl", [{"input": "a", "metadata": [1]}]))


def test_messages_without_chat_template(tmp_path):
    with pytest.raises(UserError, match="--apply-chat-template"):
        PromptDataset(write_jsonl(tmp_path / "p.jsonl", [{"input": [{"role": "user", "content": "x"}]}]))


def test_missing_empty_unreadable_files(tmp_path):
    with pytest.raises(UserError, match=r"--prompt-data .*nope.jsonl: no such file"):
        PromptDataset(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match=r"empty.jsonl: it has no rows"):
        PromptDataset(tmp_path / "empty.jsonl")
    (tmp_path / "p.csv").write_text("input\na\n")
    with pytest.raises(UserError, match=r"unsupported file type '.csv'"):
        PromptDataset(tmp_path / "p.csv")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(UserError, match=r"bad.parquet: cannot read it as Parquet"):
        PromptDataset(tmp_path / "bad.parquet")
    (tmp_path / "latin.jsonl").write_bytes(b'{"input": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"latin.jsonl: not UTF-8"):
        PromptDataset(tmp_path / "latin.jsonl")


def test_bad_chat_template_kwargs(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS[:1])
    for bad in ("{nope", "[1]"):
        with pytest.raises(UserError, match="--apply-chat-template-kwargs"):
            PromptDataset(path, tokenizer=tokenizer, input_key="question", apply_chat_template=True, apply_chat_template_kwargs=bad)


def test_from_config_uses_the_declared_flags(tmp_path, tokenizer):
    from miles.config.data import DataConfig
    from miles.config.rollout import RolloutConfig

    data = DataConfig(prompt_data=str(write_jsonl(tmp_path / "p.jsonl", ROWS)), input_key="question", label_key="answer")
    ds = PromptDataset.from_config(data, RolloutConfig(rollout_max_prompt_len=5), tokenizer)
    assert [(s.prompt, s.label) for s in ds] == [("1+1=?", "2"), ("2+2=?", "4")]


# --- RolloutDataSource ---------------------------------------------------------------------------


def prompts(n: int) -> list[Sample]:
    return [Sample(prompt=f"p{i}", label=str(i)) for i in range(n)]


def drawn(groups: list[list[Sample]]) -> list[str]:
    return [g[0].prompt for g in groups]


def test_groups_are_independent_copies_with_numbering():
    source = RolloutDataSource(prompts(3))
    groups = source.get_samples(2, 3)
    assert [[s.prompt for s in g] for g in groups] == [["p0"] * 3, ["p1"] * 3]
    assert [[s.index for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5]]
    assert [g[0].group_index for g in groups] == [0, 1]
    groups[0][0].response = "changed"
    groups[0][0].metadata["x"] = 1
    assert groups[0][1].response == "" and groups[0][1].metadata == {}
    assert source.dataset[0].metadata == {}  # the dataset itself is never modified


def test_copies_share_nothing_mutable_with_the_dataset_or_each_other():
    """The copies skip `deepcopy` (a third of the manager's own time): every container must still be new."""
    from miles.rollout.data_source import fresh_copy

    chat = [{"role": "user", "content": "hi"}]
    prompt = Sample(prompt=chat, label=["4", {"alt": "four"}], tokens=[5, 6, 7], metadata={"k": {"deep": [1]}},
                    tools=[{"name": "calc"}], loss_mask=[1], rollout_log_probs=[-0.5])
    group = RolloutDataSource([prompt]).get_samples(1, 2)[0]
    a, b = group
    assert fresh_copy(prompt) == prompt and a.prompt == chat and a.tokens == [5, 6, 7] and a.label == ["4", {"alt": "four"}]
    a.prompt[0]["content"] = "changed"
    a.label[1]["alt"] = "x"
    a.tokens.append(8)
    a.metadata["k"]["deep"].append(2)
    a.tools[0]["name"] = "y"
    a.loss_mask.append(0)
    a.rollout_log_probs.append(0.0)
    for other in (b, prompt):
        assert other.prompt == [{"role": "user", "content": "hi"}] and other.label == ["4", {"alt": "four"}]
        assert other.tokens == [5, 6, 7] and other.metadata == {"k": {"deep": [1]}} and other.tools == [{"name": "calc"}]
        assert other.loss_mask == [1] and other.rollout_log_probs == [-0.5]


def test_sequential_epochs_wrap_around():
    source = RolloutDataSource(prompts(3))
    assert drawn(source.get_samples(2, 1)) == ["p0", "p1"]
    assert drawn(source.get_samples(2, 1)) == ["p2", "p0"]
    assert (source.epoch, source.offset) == (1, 1)


def test_shuffle_is_deterministic_per_seed_and_epoch():
    def first_two_epochs(seed: int) -> list[str]:
        return drawn(RolloutDataSource(prompts(20), shuffle=True, seed=seed).get_samples(40, 1))

    a, b, c = first_two_epochs(42), first_two_epochs(42), first_two_epochs(7)
    assert a == b  # same seed, same order
    assert a != c  # another seed, another order
    epoch0, epoch1 = a[:20], a[20:]
    assert sorted(epoch0) == sorted(epoch1) == sorted(f"p{i}" for i in range(20))  # each epoch is a permutation
    assert epoch0 != epoch1  # reshuffled every epoch
    assert epoch0 != [f"p{i}" for i in range(20)]


def test_returned_groups_come_first_in_order():
    source = RolloutDataSource(prompts(10))
    over_sampled = source.get_samples(4, 2)
    source.add_samples(over_sampled[2:])  # two groups not needed this step
    assert len(source) == 2
    again = source.get_samples(3, 2)
    assert drawn(again) == ["p2", "p3", "p4"]
    assert again[0] is not None and [s.index for s in again[0]] == [4, 5]  # buffered groups keep their numbering
    assert [s.index for s in again[2]] == [8, 9]


def test_resume_hands_out_exactly_the_same_prompts():
    """Save after step 2 (with aborted groups in the buffer), restore into a fresh source: steps 3-6 match."""

    def run(resume_after: int | None) -> list[list[str]]:
        source = RolloutDataSource(prompts(7), shuffle=True, seed=3)
        steps = []
        for step in range(6):
            if step == resume_after:
                state = json.loads(json.dumps(source.state_dict()))  # through JSON, as in a checkpoint
                source = RolloutDataSource(prompts(7), shuffle=True, seed=3)
                source.load_state_dict(state)
            groups = source.get_samples(3, 2)
            steps.append([f"{g[0].prompt}#{g[0].index}:{g[0].response}" for g in groups])
            aborted = groups[-1]
            for s in aborted:
                s.status, s.response = SampleStatus.ABORTED, "partial"
            source.add_samples([aborted])
        return steps

    uninterrupted = run(None)
    assert run(2) == uninterrupted
    assert run(5) == uninterrupted
    # The run crosses epochs (6 steps x 2 fresh groups = 12 draws of 7 prompts) and buffered groups reappear.
    assert any("partial" in g for step in uninterrupted for g in step)


def test_resume_restores_sample_fields_bit_exactly():
    source = RolloutDataSource(prompts(2))
    group = source.get_samples(1, 2)[0]
    group[0].rollout_log_probs = [-0.1234567890123, -2.5e-300]
    group[0].status = SampleStatus.ABORTED
    source.add_samples([group])
    restored = RolloutDataSource(prompts(2))
    restored.load_state_dict(json.loads(json.dumps(source.state_dict())))
    assert restored.get_samples(1, 2)[0] == group


def test_resume_with_other_data_is_refused():
    state = RolloutDataSource(prompts(5), shuffle=True).state_dict()
    with pytest.raises(UserError, match="--rollout-seed"):
        RolloutDataSource(prompts(5), shuffle=True, seed=1).load_state_dict(state)
    with pytest.raises(UserError, match="--prompt-data"):
        RolloutDataSource(prompts(6), shuffle=True).load_state_dict(state)
