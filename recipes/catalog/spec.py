"""The typed data of a real-model recipe: what upstream's launcher for that model sets, as values.

A `ModelRecipe` says where the model and data come from (Hugging Face Hub ids), how the job is laid
out (nodes, GPUs, GPUs per SGLang engine, colocated or not), upstream's megatron layout as engine option
values, the model's `config.json` numbers (for the memory plan before the download), the engine
options it sets (training hyperparameters and `--sglang-*` values, by option name) and the environment
variables of the run. `recipes/catalog/recipe.py` turns one into a recipe (`Options` + `plan()`).
Nothing here runs anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class HubFiles:
    """A Hugging Face Hub repository to download into `<dir>/<local_name>` (model or dataset)."""

    repo_id: str
    local_name: str
    repo_type: Literal["model", "dataset"] = "model"
    allow_patterns: tuple[str, ...] = ()  # empty: the whole repository


@dataclass(frozen=True)
class ModelRecipe:
    name: str  # --model-name
    summary: str
    model: HubFiles
    num_nodes: int
    num_gpus_per_node: int
    hardware: Literal["H100", "H200", "B200", "GB200"]
    megatron: dict[str, Any]  # engine options of upstream's megatron layout (TP/PP/CP/EP/ETP, recompute, bf16, ...), applied under --train-backend megatron
    hf_config: dict[str, Any]  # the model's config.json numbers (architecture, sizes): the memory plan's model before it is downloaded
    rollout_gpus_per_engine: int
    colocate: bool
    engine: dict[str, Any]  # engine options by field name, including sglang_* passthrough values
    debug_engine: dict[str, Any] = field(default_factory=dict)  # what --mode debug_minimal changes
    env: dict[str, str] = field(default_factory=dict)  # environment of every run
    datasets: tuple[HubFiles, ...] = ()
    prompt_file: str = "dapo-math-17k/dapo-math-17k.jsonl"  # inside --data-dir
    eval_file: str | None = "aime-2024/aime-2024.jsonl"
    default_mode: Literal["normal", "debug_minimal"] = "normal"
    train_deterministic: bool = False
    source: str = ""  # the upstream launcher these values come from
