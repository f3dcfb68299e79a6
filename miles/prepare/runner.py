"""Run a recipe's prepare steps in order, skipping each one whose sentinel already exists."""

from __future__ import annotations

import importlib
import os
import time

from rich.console import Console

console = Console()


def run_prepare_steps(steps) -> None:
    for step in steps:
        if os.path.exists(step.sentinel):
            console.print(f"[green]✓[/green] {step.name}: already complete ({step.sentinel}), skipped")
            continue
        module_name, _, func_name = step.function.partition(":")
        func = getattr(importlib.import_module(module_name), func_name)
        t0 = time.perf_counter()
        with console.status(f"{step.name}: {step.description}"):
            func(**step.kwargs)
        if not os.path.exists(step.sentinel):
            raise RuntimeError(f"prepare step {step.name} finished without writing its sentinel {step.sentinel}")
        console.print(f"[green]✓[/green] {step.name}: {step.description} ({time.perf_counter() - t0:.1f} s)")
