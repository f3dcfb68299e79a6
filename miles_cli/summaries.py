"""One-line summaries of the `miles` commands, in the order `miles --help` lists them.

Standard library only: `miles --help` lists the commands from here without importing any of them
(miles_cli/lazy.py builds a command only when it is invoked, completed or documented).
"""

from __future__ import annotations

CONVERT = "Convert checkpoints between Hugging Face safetensors and megatron-core torch_dist."
RUN = {
    "full-train": "Prepare (create or convert checkpoints, data, warm start) and train, skipping completed steps.",
    "train": "Train from prepared checkpoints and data (RL loop with eval and checkpoints).",
    "eval": "Evaluate a model or checkpoint on the eval datasets.",
}
DOCKER_BUILD = "Build (or --dry-run print) the Docker image of one hardware variant."
DOCKER_BUILD_SHORT = "Build the Docker image of one hardware variant (cu13, cu12-x86, rocm700-mi35x, ...)."
DOCS = "Generate the reference pages (generate) or check every page against the code (check)."
