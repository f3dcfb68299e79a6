"""Rich output of the CLI: the resolved options table printed on start, and the dry-run plan."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rich.console import Console
from rich.table import Table

from miles.config.engine import option_specs
from miles.config.sglang import GROUPS as SGLANG_GROUPS
from miles.config.values import format_value

console = Console(stderr=False)


def _cell(value: Any, secret: bool = False) -> str:
    text = "****" if secret and value else format_value(value)
    return text if len(text) <= 60 else text[:57] + "..."


def print_options_table(inv) -> None:
    """Recipe options, then every engine option with its value and where the value came from."""
    table = Table(title=f"miles {inv.command} — {inv.options.model_name}", show_lines=False, expand=False)
    table.add_column("Option", style="cyan", no_wrap=True)
    table.add_column("Value", overflow="fold")
    table.add_column("Source", style="dim")
    recipe_fields = {f.name for f in dataclasses.fields(inv.options)}
    for f in dataclasses.fields(inv.options):
        source = inv.recipe_sources.get(f.name, "recipe default")
        table.add_row("--" + f.name.replace("_", "-"), _cell(getattr(inv.options, f.name)), source)
    last_panel = None
    for s in option_specs():
        if s.name in recipe_fields:  # set through the recipe option of the same name, shown above
            continue
        if s.group in SGLANG_GROUPS and inv.sources.get(s.name) == "default":
            continue  # hundreds of SGLang options: only those this run sets are listed
        if s.panel != last_panel:
            table.add_section()
            last_panel = s.panel
        table.add_row(s.flag, _cell(inv.config.get(s.name), s.secret), inv.sources.get(s.name, ""))
    console.print(table)


def print_plan(inv) -> None:
    """The prepare steps `full-train` would run (and which are already complete), for --dry-run."""
    if inv.command == "full-train":
        console.print("[bold]Prepare steps[/bold] (skipped when their sentinel exists):")
        for step in inv.plan.prepare:
            done = os.path.exists(step.sentinel)
            mark = "[green]complete[/green]" if done else "[yellow]to run[/yellow]"
            console.print(f"  {step.name}: {step.description} → {step.sentinel} ({mark})")
    c = inv.config.cluster
    console.print(
        f"[bold]Placement[/bold]: {c.actor_num_nodes} node(s) × {c.actor_num_gpus_per_node} GPUs for training"
        + (f" ({inv.recipe.SPEC.train_layout.describe()} upstream)" if hasattr(inv.recipe, "SPEC") else "")
        + f"; rollout engines {'colocated with' if c.colocate else 'beside'} the trainer",
        highlight=False,
    )
    if inv.config.rollout.rollout_backend == "sglang":
        import shlex

        from miles.rollout.sglang.launch import planned_processes

        console.print("[bold]Processes[/bold] (SGLang servers, one per engine, and the router in front of them):")
        for name, argv in planned_processes(inv.config):
            console.print(f"  {name}: {shlex.join(argv)}", markup=False, highlight=False, soft_wrap=True)
    if inv.plan.env:
        console.print("[bold]Environment[/bold]: " + " ".join(f"{k}={v}" for k, v in inv.plan.env.items()))
    console.print(f"[bold]Run directory[/bold]: {inv.options.run_dir}")
    console.print("Dry run: nothing was started.")
