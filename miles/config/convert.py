"""Options of `miles convert`: Hugging Face safetensors <-> megatron-core `torch_dist` checkpoints.

`ConvertOptions` is a plain dataclass; the CLI builds `miles convert --help` from it, and
`miles.ckpt.convert.run_convert(opts)` does the work. `check()` catches user mistakes before anything
heavy is imported (one sentence each, naming the flag and the fix). Nothing here imports torch.

    miles convert --from hf --to torch_dist --hf-checkpoint DIR --save OUT
    miles convert --from torch_dist --to hf --load OUT --save HF_OUT
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from miles.config.fields import option
from miles.errors import UserError

Format = Literal["hf", "torch_dist"]

GIB = 1024**3


@dataclass
class ConvertOptions:
    from_format: Format = option("hf", flag="--from", help="Format of the input checkpoint.")
    to_format: Format = option("torch_dist", flag="--to", help="Format to write.")
    hf_checkpoint: str | None = option(
        None, help="Hugging Face model directory (config.json + *.safetensors) to convert; needed with --from hf."
    )
    load: str | None = option(
        None,
        help="Checkpoint to convert: a run's checkpoints/ directory (the latest complete iteration, or "
        "--ckpt-step N), one of its iter_* directories (torch or megatron trainer), or a `miles convert "
        "--to torch_dist` output; needed with --from torch_dist.",
    )
    save: str | None = option(
        None, help="Output directory; written under a temporary name and renamed when complete.", required=True
    )
    force: bool = option(False, help="Replace --save even when it already holds a complete checkpoint.")
    tensor_model_parallel_size: int = option(
        1,
        help="Tensor-parallel size the checkpoint will be trained with; conversion checks the model divides by it "
        "(torch_dist stores whole tensors, so it loads at any TP that divides the model).",
    )
    ckpt_step: int | None = option(
        None,
        help="With --from torch_dist and --load a run's checkpoints/ directory: convert iter_<N> instead of the "
        "latest complete checkpoint the tracker names.",
    )
    origin_hf_dir: str | None = option(
        None,
        help="With --to hf: where config.json and tokenizer files come from; default: the copy a conversion "
        "from Hugging Face keeps (hf_assets/), else the --hf-checkpoint the run's run.json records.",
    )
    chunk_size: int = option(5 * GIB, help="With --to hf: maximum bytes per safetensors shard.")

    def check(self) -> None:
        """Raise `UserError` for the first mistake found; heavy checks (file contents) come later."""
        if self.from_format == self.to_format:
            raise UserError(
                f"--from and --to are both {self.from_format}; pass --to "
                f"{'torch_dist' if self.from_format == 'hf' else 'hf'} to convert between formats.",
                option="--to",
            )
        if self.save is None:
            raise UserError("--save is required: pass the output directory, e.g. --save /data/model_torch_dist.", option="--save")
        if self.tensor_model_parallel_size < 1:
            raise UserError("--tensor-model-parallel-size must be at least 1.", option="--tensor-model-parallel-size")
        if self.ckpt_step is not None and self.ckpt_step < 0:
            raise UserError("--ckpt-step must be a rollout id (0 or more) of a saved checkpoint.", option="--ckpt-step")
        if self.chunk_size < 1:
            raise UserError("--chunk-size must be a positive number of bytes (default 5 GiB).", option="--chunk-size")
        if self.from_format == "hf":
            if self.load is not None:
                raise UserError(
                    "--load reads a torch_dist checkpoint, but --from is hf; pass the Hugging Face directory "
                    "as --hf-checkpoint instead.",
                    option="--load",
                )
            if self.ckpt_step is not None:
                raise UserError("--ckpt-step picks a training checkpoint to read, but --from is hf; drop it, or pass --from torch_dist --load CHECKPOINTS_DIR.", option="--ckpt-step")
            if self.hf_checkpoint is None:
                raise UserError("--hf-checkpoint is required with --from hf: pass the Hugging Face model directory.", option="--hf-checkpoint")
            _readable_dir(self.hf_checkpoint, "--hf-checkpoint")
            if not (Path(self.hf_checkpoint) / "config.json").is_file():
                raise UserError(
                    f"--hf-checkpoint {self.hf_checkpoint} has no config.json; pass a Hugging Face model directory.",
                    option="--hf-checkpoint",
                )
        else:
            if self.load is None:
                raise UserError("--load is required with --from torch_dist: pass the torch_dist checkpoint directory.", option="--load")
            _readable_dir(self.load, "--load")
            if self.hf_checkpoint is not None and self.origin_hf_dir is None:
                # Upstream users pass --hf-checkpoint for the origin; accept it rather than ignore it.
                self.origin_hf_dir = self.hf_checkpoint
            if self.origin_hf_dir is not None:
                _readable_dir(self.origin_hf_dir, "--origin-hf-dir")
        if Path(self.save).resolve() == Path(self.hf_checkpoint or self.load or "").resolve():
            raise UserError("--save is the input directory; pass a different output directory.", option="--save")


def _readable_dir(path: str, flag: str) -> None:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{flag} {path} is not a directory; pass an existing checkpoint directory.", option=flag)
    if not os.access(p, os.R_OK | os.X_OK):
        raise UserError(f"{flag} {path} is not readable; fix its permissions.", option=flag)
