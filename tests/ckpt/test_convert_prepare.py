"""The `miles full-train` convert step: the tiny-qwen3 recipe's PrepareStep, run by the real prepare runner.

The megatron trainer does not exist yet (resolve() rejects `--train-backend megatron`), so the recipe's
plan is built directly; the step must work with exactly the kwargs the recipe passes, write the
sentinel the recipe names, and be skipped when rerun.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from miles.ckpt.convert import ModelShape
from miles.ckpt.convert.hf_io import read_hf_config
from miles.ckpt.convert.torch_dist import TorchDistReader
from miles.prepare.runner import run_prepare_steps
from miles.prepare.tiny_model import create_tiny_qwen3
from recipes import tiny_qwen3

torch.set_num_threads(1)
warnings.filterwarnings("ignore")


def test_recipe_convert_step_runs_with_its_own_kwargs_and_is_skipped_after(tmp_path, capsys):
    opts = tiny_qwen3.Options(train_backend="megatron", mode="debug_minimal", model_dir=str(tmp_path / "models"),
                              data_dir=str(tmp_path / "data"), output_dir=str(tmp_path / "runs"))
    steps = {s.name: s for s in tiny_qwen3.plan(opts).prepare}
    step = steps["convert"]
    assert step.function == "miles.ckpt.convert:prepare_torch_dist"
    assert set(step.kwargs) == {"hf_checkpoint", "save"}
    # The SFT step would write this directory; the untrained tiny model has the same files and shapes.
    create_tiny_qwen3(step.kwargs["hf_checkpoint"], **tiny_qwen3.MODEL)

    run_prepare_steps([step])  # imports the function from its string, calls it with step.kwargs
    assert open(step.sentinel).read() == "release"
    hf = load_file(f"{step.kwargs['hf_checkpoint']}/model.safetensors")
    shape = ModelShape.from_hf_config(read_hf_config(Path(step.kwargs["hf_checkpoint"])))
    assert shape.tie_word_embeddings  # the tiny model ties its embeddings: no output_layer is written
    with TorchDistReader(Path(step.kwargs["save"]) / "release", shape) as reader:
        emb = reader.read(["embedding.word_embeddings.weight"])["embedding.word_embeddings.weight"]
        assert "output_layer.weight" not in {k for k in reader.metadata.state_dict_metadata}
    assert torch.equal(emb, hf["model.embed_tokens.weight"])

    capsys.readouterr()
    run_prepare_steps([step])
    assert "convert: already complete" in capsys.readouterr().out
