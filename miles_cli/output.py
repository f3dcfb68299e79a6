"""Rich output of the run commands: the resolved options (all of them for --dry-run and the run
directory, only those that differ from the recipe's defaults on a normal start) and the dry-run plan."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import textwrap
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from miles.config.engine import option_specs
from miles.config.values import format_value

console = Console(stderr=False)

OPTIONS_FILE = "options.json"
"""Written to the run directory on start: every resolved option with its value and source."""


def _cell(value: Any, secret: bool = False) -> str:
    return "****" if secret and value else format_value(value)


def say(text: str, *, label: str = "", indent: str = "    ") -> None:
    """One line of the plan, `label` in bold, wrapped at word boundaries to the terminal's width with a
    hanging indent: a terminal's own wrap cuts values mid-word (a path, a flag) at 80 columns."""
    lines = textwrap.wrap(label + text, width=console.width, subsequent_indent=indent, break_long_words=False,
                          break_on_hyphens=False) or [""]
    for i, line in enumerate(lines):
        if i == 0 and label and line.startswith(label):
            console.print(f"[bold]{escape(label)}[/bold]{escape(line[len(label):])}", highlight=False, soft_wrap=True)
        else:
            console.print(line, highlight=False, markup=False, soft_wrap=True)


def say_command(prefix: str, argv: list[str], indent: str = "      ") -> None:
    """A command line as a shell would take it: wrapped between arguments (a flag stays with its value)
    with ` \\` continuations, so it can be pasted as printed at any width."""
    flag = re.compile(r"^--?[A-Za-z]")
    words: list[str] = []
    for arg in map(shlex.quote, argv):
        if words and flag.match(words[-1]) and " " not in words[-1] and not flag.match(arg):
            words[-1] += " " + arg
        else:
            words.append(arg)
    lines, current = [], prefix + words[0]
    for word in words[1:]:
        if len(current) + 1 + len(word) + 2 > console.width:
            lines.append(current)
            current = indent + word
        else:
            current += " " + word
    lines.append(current)
    for line in lines[:-1]:
        console.print(line + " \\", highlight=False, markup=False, soft_wrap=True)
    console.print(lines[-1], highlight=False, markup=False, soft_wrap=True)


def option_rows(inv, *, sglang_defaults: bool = True) -> list[tuple[str, str, str, str]]:
    """(panel, flag, value, source) for every recipe and engine option of this invocation;
    `sglang_defaults=False` leaves out the SGLang options this run does not set (hundreds of them)."""
    from miles.config.sglang import GROUPS as SGLANG_GROUPS

    rows = []
    linked = {f.metadata.get("engine") for f in dataclasses.fields(inv.options)} - {None}
    only_eval = inv.command == "eval"  # an eval reads only its own options (in_eval): the rest is not its plan
    for f in dataclasses.fields(inv.options):
        if only_eval and not f.metadata.get("in_eval"):
            continue
        rows.append(("Recipe", "--" + f.name.replace("_", "-"), _cell(getattr(inv.options, f.name)), inv.recipe_sources.get(f.name, "recipe default")))
    for s in option_specs():
        if s.name in linked:  # set through the recipe option that names it, shown above
            continue
        if only_eval and not s.in_eval:
            continue
        if not sglang_defaults and s.group in SGLANG_GROUPS and inv.sources.get(s.name) == "default":
            continue
        rows.append((s.panel, s.flag, _cell(inv.config.get(s.name), s.secret), inv.sources.get(s.name, "")))
    return rows


def print_options_table(inv) -> None:
    """Every recipe and engine option with its value and where the value came from (--dry-run)."""
    rows = option_rows(inv, sglang_defaults=False)
    widest = max(len(flag) for _, flag, _, _ in rows) + max(len(v) for _, _, v, _ in rows) + max(len(src) for *_, src in rows) + 10
    if console.width < widest:
        # Too narrow for the three columns: one option a line, so no value is cut mid-word
        # (a table folded paths like runs/models/Qw│en3-4B at 80 columns).
        console.print(f"[bold]miles {inv.command} — {inv.options.model_name}[/bold] (option value (source)):", highlight=False)
        last_panel = None
        for panel, flag, value, source in rows:
            if panel != last_panel:
                console.print(f"[bold]{escape(panel)}[/bold]", highlight=False)
                last_panel = panel
            console.print(f"  [cyan]{flag}[/cyan] {escape(value)}  [dim]({escape(source)})[/dim]", highlight=False, soft_wrap=True)
        return
    table = Table(title=f"miles {inv.command} — {inv.options.model_name}", show_lines=False, expand=False)
    table.add_column("Option", style="cyan", no_wrap=True)
    table.add_column("Value", overflow="fold")
    table.add_column("Source", style="dim")
    last_panel = None
    for panel, flag, value, source in rows:
        if panel != last_panel and last_panel is not None:
            table.add_section()
        last_panel = panel
        table.add_row(flag, value, source)
    console.print(table)


def print_changed_options(inv) -> None:
    """On a normal start: the run, and only the options that differ from the recipe's defaults."""
    changed = inv.differs_from_recipe()
    console.print(f"[bold]miles {inv.command}[/bold] {inv.options.model_name} → {inv.options.run_dir}")
    rows = [(flag, value, source) for _, flag, value, source in option_rows(inv) if flag in changed]
    for flag, value, source in rows:
        console.print(f"  {flag} {value}  [dim]({source})[/dim]", highlight=False)
    # Printed before anything is checked: options.json does not exist yet (a failed start or a rerun
    # that trains nothing never writes it), so its path is printed once it is written (execute.py).
    console.print("[dim]Every option and its source: rerun with --dry-run.[/dim]")


def write_options_file(inv) -> Path:
    """The full resolved table as JSON in the run directory (written atomically)."""
    path = Path(inv.options.run_dir) / OPTIONS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {flag: {"value": value, "source": source} for _, flag, value, source in option_rows(inv)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"command": inv.command, "env": inv.env, "options": data}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def print_memory_and_gaps(inv) -> None:
    """The memory plan (or why there is none yet) and what `train` would refuse (--dry-run)."""
    from miles_cli.run_plan import memory_plan, trainer_gaps

    plan, why = memory_plan(inv)
    if plan is None:
        console.print(f"[bold]Memory plan[/bold]: none, {escape(why)}.", highlight=False)
    else:
        first, *rest = plan.lines()
        say("", label=first, indent="  ")
        for line in rest:
            say(line)
    gaps = trainer_gaps(inv)
    if gaps:
        say(" (train and full-train exit 2; miles/config/trainer_support.py):", label="Cannot train yet")
        for _, sentence in gaps:
            say(f"  {sentence}")


def print_plan(inv) -> None:
    """The prepare steps `full-train` would run (and which are already complete), for --dry-run."""
    if inv.command == "full-train":
        console.print("[bold]Prepare steps[/bold] (skipped when their sentinel exists):")
        for step in inv.plan.prepare:
            done = os.path.exists(step.sentinel)
            mark = "complete" if done else "to run"
            say(f"  {step.name}: {step.description} → {step.sentinel} ({mark})")
    from miles.hardware import device_summary

    if inv.command == "eval":
        _print_eval_plan(inv)
        return
    c, t = inv.config.cluster, inv.config.train
    on_gpu = device_summary(c.device) == "cuda"
    units = "GPUs" if on_gpu else "CPU worker process(es)"
    layout = f"--train-backend {t.train_backend}"
    if t.train_backend == "megatron":
        layout += (f": TP{t.tensor_model_parallel_size} PP{t.pipeline_model_parallel_size} CP{t.context_parallel_size} "
                   f"EP{t.expert_model_parallel_size} ETP{t.expert_tensor_parallel_size}")
    say(f" ({'GPU' if on_gpu else 'CPU'}): {c.actor_num_nodes} node(s) × {c.actor_num_gpus_per_node} {units} for training ({layout})"
        + f"; rollout engines {'colocated with' if c.colocate else 'beside'} the trainer", label="Placement", indent="  ")
    # The values derived from the options (miles/config/layout.py), as the run will use them.
    say(f": {inv.config.layout.describe()}", label="Resolved", indent="  ")
    print_memory_and_gaps(inv)
    if inv.config.rollout.rollout_backend == "sglang":
        from miles.rollout.sglang.launch import planned_processes

        say(" (SGLang servers, one per engine, and the router in front of them):", label="Processes")
        for name, argv in planned_processes(inv.config):
            say_command(f"  {name}: ", argv)
    if inv.env:
        say(": " + " ".join(f"{k}={v}" for k, v in inv.env.items()), label="Environment", indent="  ")
    say(f": {inv.options.run_dir}", label="Run directory", indent="  ")
    console.print("Dry run: nothing was started.")


def _print_eval_plan(inv) -> None:
    """An eval's plan: its engines and where its results go; it starts no trainer."""
    r = inv.config.rollout
    if r.rollout_backend == "sglang":
        from miles.rollout.sglang.launch import planned_processes

        say(": no trainer; the eval datasets are generated by SGLang servers behind the router", label="Placement", indent="  ")
        say(" (SGLang servers, one per engine, and the router in front of them):", label="Processes")
        for name, argv in planned_processes(inv.config):
            say_command(f"  {name}: ", argv)
    else:
        say(": no trainer; the eval datasets are generated by the built-in engine in this process", label="Placement", indent="  ")
    if inv.env:
        say(": " + " ".join(f"{k}={v}" for k, v in inv.env.items()), label="Environment", indent="  ")
    say(f": {inv.options.run_dir}/eval/<label>.json (<label>: the --checkpoint directory's name, rollout_<N> for a "
        "miles checkpoint, hf_checkpoint without one)", label="Results", indent="  ")
    console.print("Dry run: nothing was started.")
