"""The converter without a megatron model: bit-exact round trips, the QKV layout, atomicity, errors."""

from __future__ import annotations

import glob
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from _mp_models import FAMILIES, make_hf_model
from miles.ckpt.convert import ModelShape, run_convert, validate_megatron_args
from miles.ckpt.convert.mapping import fuse_qkv, split_qkv
from miles.config.convert import ConvertOptions
from miles.errors import UserError

torch.set_num_threads(1)
warnings.filterwarnings("ignore")


def _load_dir(d):
    out = {}
    for f in glob.glob(str(d / "*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_torch_dist_hf_round_trip_is_bit_exact(tmp_path, family):
    model = make_hf_model(family, tmp_path / "hf", tie_word_embeddings=family == "qwen2")
    run_convert(ConvertOptions(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "td")), progress=False)
    assert (tmp_path / "td" / "latest_checkpointed_iteration.txt").read_text() == "release"
    # chunk_size small enough to force several shards
    run_convert(ConvertOptions(from_format="torch_dist", to_format="hf", load=str(tmp_path / "td"),
                               save=str(tmp_path / "back"), chunk_size=20_000), progress=False)
    orig, back = load_file(tmp_path / "hf" / "model.safetensors"), _load_dir(tmp_path / "back")
    assert set(orig) == set(back) and len(glob.glob(str(tmp_path / "back" / "*.safetensors"))) > 1
    for name in orig:
        assert torch.equal(orig[name], back[name]), name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    AutoTokenizer.from_pretrained(tmp_path / "back")
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_fuse_qkv_interleaves_per_query_group():
    shape = ModelShape.from_hf_config({"architectures": ["Qwen3ForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "hidden_size": 4, "head_dim": 1, "num_hidden_layers": 1, "vocab_size": 8,
                                       "intermediate_size": 8})
    q, k, v = torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])
    fused = fuse_qkv(q, k, v, shape)
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1 (not [q; k; v])
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.tolist() for t in split_qkv(fused, shape)] == [q.tolist(), k.tolist(), v.tolist()]


@pytest.mark.parametrize("family", FAMILIES)
def test_row_blocks_are_the_torch_mapping(family):
    # The converter moves bytes by these row blocks; on row-numbered tensors they must give exactly
    # the rows fuse_qkv / torch.cat give, and split_blocks must invert them.
    from _mp_models import hf_config
    from miles.ckpt.convert.families import ARCHITECTURES
    from miles.ckpt.convert.layout import hf_shapes
    from miles.ckpt.convert.mapping import hf_to_megatron, row_blocks, rules_for, split_blocks

    arch = {f: a for a, f in ARCHITECTURES.items()}[family]
    shape = ModelShape.from_hf_config(hf_config(family).to_dict() | {"architectures": [arch]})
    hf = hf_shapes(shape)
    kinds = set()
    for rule in rules_for(shape):
        rows = [hf[n][0] for n in rule.hf]
        parts = [torch.arange(r, dtype=torch.float64) + 1000 * i for i, r in enumerate(rows)]  # part i, row j -> 1000 i + j
        expected = hf_to_megatron(rule, parts, shape).tolist()
        assert [1000 * p + first + k for p, first, n in row_blocks(rule, shape, rows) for k in range(n)] == expected, rule
        for i, blocks in enumerate(split_blocks(rule, shape, rows)):
            assert [expected[a + k] for a, n in blocks for k in range(n)] == parts[i].tolist(), rule
        kinds.add(rule.kind)
    assert kinds >= {"copy", "qkv", "gate_up"}


def test_complete_output_is_skipped_unless_force(tmp_path, capsys):
    make_hf_model("qwen3", tmp_path / "hf")
    opts = ConvertOptions(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "td"))
    run_convert(opts, progress=False)
    stamp = (tmp_path / "td" / "release" / "metadata.json").stat().st_mtime_ns
    run_convert(opts, progress=False)
    assert "skipped" in capsys.readouterr().err
    assert (tmp_path / "td" / "release" / "metadata.json").stat().st_mtime_ns == stamp
    opts.force = True
    run_convert(opts, progress=False)
    assert (tmp_path / "td" / "release" / "metadata.json").stat().st_mtime_ns != stamp


def test_interrupted_convert_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    make_hf_model("qwen3", tmp_path / "hf")
    import miles.ckpt.convert.run as run

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "save_torch_dist", boom)
    with pytest.raises(KeyboardInterrupt):
        run_convert(ConvertOptions(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "td")), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_unknown_architecture_names_supported_ones(tmp_path):
    make_hf_model("qwen3", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, Qwen2ForCausalLM"):
        run_convert(ConvertOptions(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "td")), progress=False)


def test_partial_checkpoint_is_a_user_error(tmp_path):
    make_hf_model("llama", tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # the weights hold 2 layers
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="missing tensors model.layers.2"):
        run_convert(ConvertOptions(hf_checkpoint=str(tmp_path / "hf"), save=str(tmp_path / "td")), progress=False)
    assert not (tmp_path / "td").exists()


def test_all_megatron_arg_mismatches_in_one_message():
    shape = ModelShape.from_hf_config({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 8, "intermediate_size": 64,
                                       "rope_theta": 10000.0})
    with pytest.raises(UserError) as e:
        validate_megatron_args(shape, {"hidden_size": 64, "num_layers": 3, "rotary_base": 10000, "seq_length": 9},
                               tensor_model_parallel_size=3)
    msg = str(e.value)
    assert "--hidden-size 64 (HF config says 32)" in msg and "--num-layers 3 (HF config says 2)" in msg
    assert "rotary" not in msg and "num_attention_heads=4 is not divisible by --tensor-model-parallel-size 3" in msg


@pytest.mark.parametrize("kwargs,flag", [
    (dict(to_format="hf"), "--to"),
    (dict(save=None), "--save"),
    (dict(load="x"), "--load"),
    (dict(hf_checkpoint="/nonexistent"), "--hf-checkpoint"),
    (dict(from_format="torch_dist", to_format="hf", hf_checkpoint=None), "--load"),
])
def test_options_check_names_the_flag(tmp_path, kwargs, flag):
    base = dict(hf_checkpoint=str(tmp_path), save=str(tmp_path / "out"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError) as e:
        ConvertOptions(**{**base, **kwargs}).check()
    assert e.value.option == flag and flag in str(e.value)
