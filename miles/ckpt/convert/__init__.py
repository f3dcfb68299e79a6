"""Checkpoint conversion between Hugging Face safetensors and megatron-core `torch_dist`.

    from miles.ckpt.convert import run_convert
    from miles.config.convert import ConvertOptions
    run_convert(ConvertOptions(hf_checkpoint="Qwen3-0.6B", save="Qwen3-0.6B_torch_dist"))

or on the command line `miles convert --from hf --to torch_dist --hf-checkpoint DIR --save OUT`
(see docs/convert.md). Modules: `families` (supported architectures, shapes from config.json),
`mapping` (the per-family rule tables and the pure tensor mapping), `layout` (megatron-core's sharded
keys), `hf_io` / `torch_dist` (streaming readers and writers; `dcp_stream` holds the torch DCP planner
and storage writer that write one tensor at a time), `run` (the atomic, skippable driver).
Importing this package does not import torch; converting never imports megatron-core.
"""

from miles.ckpt.convert.families import ModelShape, supported_architectures, validate_megatron_args
from miles.ckpt.convert.mapping import hf_to_megatron_state_dict, megatron_to_hf_state_dict, rules_for
from miles.ckpt.convert.run import is_complete, prepare_torch_dist, run_convert

__all__ = [
    "ModelShape", "hf_to_megatron_state_dict", "is_complete", "megatron_to_hf_state_dict", "prepare_torch_dist",
    "rules_for", "run_convert", "supported_architectures", "validate_megatron_args",
]
