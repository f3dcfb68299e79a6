"""`miles convert`: Hugging Face safetensors ⇄ megatron-core torch_dist checkpoints.

Options come from `miles.config.convert.ConvertOptions`; the work is `miles.ckpt.convert.run_convert`,
imported only when the command runs (it imports neither torch nor megatron-core: docs/convert.md).
"""

from __future__ import annotations

from typing import Any

from miles.config.convert import ConvertOptions
from miles.config.engine import specs_of
from miles_cli import summaries
from miles_cli.errors import user_errors_exit_2
from miles_cli.params import make_parameter, with_signature

SUMMARY = summaries.CONVERT


def build_convert_command():
    specs = specs_of(ConvertOptions, "convert", "Convert")
    defaults = ConvertOptions()
    params = [make_parameter(s, getattr(defaults, s.name)) for s in specs]  # --save is declared required

    def convert(**kwargs: Any) -> None:
        with user_errors_exit_2():
            opts = ConvertOptions(**kwargs)
            opts.check()
            if opts.lora_export is not None:
                from miles.backends.torch.lora_export import export_lora

                export_lora(opts)
                return
            from miles.ckpt.convert import run_convert

            run_convert(opts)

    convert.__doc__ = SUMMARY
    return with_signature(convert, params)
