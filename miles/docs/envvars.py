"""Every environment variable miles reads, found in the code, and `docs/reference/env-vars.md`.

Sources, all computed (nothing is listed by hand except libraries' own variables, each with why):

- options declared with `env=` (`--prometheus-port` ← `PROMETHEUS_PORT`, ...) and the recipe options'
  `MILES_SCRIPT_<FIELD>` variables, both from the `CliModel` built from the real app;
- a scan of `miles/`, `miles_cli/` and `recipes/` for `os.environ[...]`, `os.environ.get(...)`,
  `os.getenv(...)`, `environ.get(...)` (a mapping named `*environ`) and `"X" in os.environ`, with
  the file:line of each read. A key computed from a module constant iterated in a loop
  (`for name in PROXY_VARIABLES: environ.get(name.lower())`) is expanded; other computed keys are
  listed as such, so nothing is hidden;
- variables options declare for the run (`run_env=`, e.g. `--train-deterministic`), variables recipes
  set for a run, and the build args and `ENV` lines of the Dockerfiles.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from miles.docs.cli_reference import GENERATED_NOTE, code, flag_anchor
from miles.docs.model import CliModel

SCANNED = ("miles", "miles_cli", "recipes")
TOOLING = {"miles_cli/docs_cmd.py"}  # saves and restores variables around in-process runs; reads none
ENV_NAME = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+")

# Variables of libraries and tools that miles pages may mention: read by them, not by miles code.
EXTERNAL: dict[str, str] = {
    "CUDA_VISIBLE_DEVICES": "read by CUDA and torch: which GPUs the process sees (empty: none)",
    "OMP_NUM_THREADS": "read by torch/OpenMP: CPU threads per process",
    "MLFLOW_TRACKING_URI": "read by MLflow: where runs are stored when --mlflow-tracking-uri is unset",
    "RAY_ADDRESS": "read by Ray: the cluster `ray.init()` joins",
    "WANDB_API_KEY": "read by wandb: credentials for online mode",
    "WANDB_MODE": "read by wandb: online, offline or disabled",
    "CUBLAS_WORKSPACE_CONFIG": "read by cuBLAS: needed for deterministic matmuls on GPU",
    "NCCL_DEBUG": "read by NCCL: collective-communication logging",
    "HF_HOME": "read by Hugging Face libraries: cache directory",
    "NO_COLOR": "read by rich: disables colours in the CLI output",
    "COLUMNS": "read by rich: terminal width for help and tables",
    "SGLANG_RETURN_ORIGINAL_LOGPROB": "read by SGLang: return untempered log-probs (T = 1) instead of the sampling ones",
}


@dataclass
class EnvRead:
    name: str
    where: list[str] = field(default_factory=list)  # "path:line"


def _receiver_is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id.endswith("environ")
    )


def _key_names(key: ast.AST, loops: dict[str, list[str]]) -> list[str] | None:
    """The variable names a key expression can take; None when it is computed from something else."""
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return [key.value]
    lower = isinstance(key, ast.Call) and isinstance(key.func, ast.Attribute) and key.func.attr in ("lower", "upper")
    base = key.func.value if lower else key  # type: ignore[union-attr]
    if isinstance(base, ast.Name) and base.id in loops:
        names = loops[base.id]
        return [getattr(n, key.func.attr)() for n in names] if lower else list(names)  # type: ignore[union-attr]
    return None


def _module_constants(tree: ast.Module) -> dict[str, list[str]]:
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Tuple, ast.List)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            values = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if values and len(values) == len(node.value.elts):
                for t in targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = values
    return out


def scan_file(path: Path, rel: str) -> tuple[dict[str, list[str]], list[str]]:
    """({name: [path:line]}, [path:line of computed keys]) for one Python file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    constants = _module_constants(tree)
    found: dict[str, list[str]] = {}
    computed: list[str] = []

    def visit(node: ast.AST, loops: dict[str, list[str]]) -> None:
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Name):
            if node.iter.id in constants:
                loops = {**loops, node.target.id: constants[node.iter.id]}
        key = None
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ("get", "setdefault", "pop") and _receiver_is_environ(f.value):
                key = node.args[0] if node.args else None
            elif isinstance(f, ast.Attribute) and f.attr == "getenv" or isinstance(f, ast.Name) and f.id == "getenv":
                key = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and _receiver_is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            if _receiver_is_environ(node.comparators[0]):
                key = node.left
        if key is not None:
            names = _key_names(key, loops)
            where = f"{rel}:{node.lineno}"
            if names is None:
                computed.append(where)
            for n in names or []:
                found.setdefault(n, []).append(where)
        for child in ast.iter_child_nodes(node):
            visit(child, loops)

    visit(tree, {})
    return found, computed


def scan_source(root: Path) -> tuple[dict[str, list[str]], list[str]]:
    found: dict[str, list[str]] = {}
    computed: list[str] = []
    for package in SCANNED:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in TOOLING:
                continue
            names, comp = scan_file(path, rel)
            for n, where in names.items():
                found.setdefault(n, []).extend(where)
            computed.extend(comp)
    return found, computed


def docker_variables(root: Path) -> dict[str, str]:
    """Build args and ENV names of the Dockerfiles (and of the variants' build args), with where they are."""
    out: dict[str, str] = {}
    for path in sorted((root / "docker").glob("Dockerfile*")):
        if path.suffix == ".dockerignore":
            continue
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines, start=1):
            m = re.match(r"\s*(ARG|ENV)\s+(.*)", line)
            j = n  # an ENV continued with backslashes lists more variables on the next lines
            while m and line.rstrip().endswith("\\") and j < len(lines):
                line = line.rstrip()[:-1] + " " + lines[j]
                j += 1
                m = re.match(r"\s*(ARG|ENV)\s+(.*)", line)
            if m:
                for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)(?==|\s|$)", m.group(2)):
                    if ENV_NAME.fullmatch(name):
                        out.setdefault(name, f"{m.group(1)} in {path.relative_to(root).as_posix()}:{n}")
    try:
        from miles.docker_images import NO_PROXY_VALUE, PROXY_VARIABLES, VARIANTS

        for v in VARIANTS.values():
            for key, _ in v.build_args:
                out.setdefault(key, f"build arg of variant {v.name}")
        for key in PROXY_VARIABLES:
            out.setdefault(key, "build arg passed from the environment")
        out.setdefault("NO_PROXY", f"build arg, always {NO_PROXY_VALUE}")
    except ImportError:
        pass
    return out


@dataclass
class EnvInventory:
    declared: dict[str, list[str]]  # name -> flags it sets (env= options)
    script: dict[str, str]  # MILES_SCRIPT_<FIELD> -> recipe option flag
    read: dict[str, list[str]]  # scanned reads
    computed: list[str]
    recipe_set: dict[str, list[str]]  # name -> recipes that set it
    docker: dict[str, str]
    option_set: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (value, flag), declared run_env

    def known(self) -> set[str]:
        return set(self.declared) | set(self.script) | set(self.read) | set(self.recipe_set) | set(self.docker) | set(EXTERNAL) | set(self.option_set)


def inventory(root: Path, model: CliModel) -> EnvInventory:
    declared: dict[str, list[str]] = {}
    script: dict[str, str] = {}
    for cmd in model.commands.values():
        for fd in cmd.flags:
            if fd.env and fd.env.startswith(model.env_prefix):
                script[fd.env] = fd.flag
            elif fd.env and fd.flag not in declared.get(fd.env, []):
                declared.setdefault(fd.env, []).append(fd.flag)
    for flags in model.recipe_flags.values():
        for fd in flags.values():
            if fd.env and fd.env.startswith(model.env_prefix):
                script.setdefault(fd.env, fd.flag)
    read, computed = scan_source(root)
    recipe_set: dict[str, list[str]] = {}
    for name, r in model.recipes.items():
        for k in r.env:
            recipe_set.setdefault(k, []).append(name)
    return EnvInventory(declared, script, read, computed, recipe_set, docker_variables(root), dict(model.run_env))


def render_env_vars(root: Path, model: CliModel) -> str:
    inv = inventory(root, model)
    lines = [
        "# Environment variables",
        "",
        GENERATED_NOTE.rstrip(),
        "",
        "Every environment variable the code reads, found in the option declarations and by scanning "
        "`miles/`, `miles_cli/` and `recipes/`. The command line always wins over a variable. See the "
        "[CLI reference](cli.md) for the options.",
        "",
        "## Options that read a variable {#env-options}",
        "",
        "| Variable | Sets |",
        "|---|---|",
    ]
    for name in sorted(inv.declared):
        flags = ", ".join(f"[{code(f)}](cli.md#{flag_anchor('train', f)})" for f in inv.declared[name])
        lines.append(f"| {code(name)} | {flags} (when the option is not given) |")
    lines += [
        "",
        f"## Recipe options: `{model.env_prefix}<FIELD>` {{#env-script}}",
        "",
        f"Every recipe option can be set with `{model.env_prefix}<FIELD>`, the option's name in upper snake "
        "case; the command line wins.",
        "",
        "| Variable | Recipe option |",
        "|---|---|",
    ]
    for name in sorted(inv.script):
        lines.append(f"| {code(name)} | [{code(inv.script[name])}](cli.md#{flag_anchor('train', inv.script[name])}) |")
    lines += ["", "## Read by the code {#env-read}", "", "| Variable | Read at |", "|---|---|"]
    for name in sorted(inv.read):
        if name in inv.declared or name in inv.script:
            continue
        lines.append(f"| {code(name)} | {', '.join(code(w) for w in sorted(set(inv.read[name])))} |")
    if inv.computed:
        lines += [
            "",
            "Reads whose variable name is computed (from the option declarations and recipe options above): " + ", ".join(code(w) for w in sorted(set(inv.computed))) + ".",
        ]
    lines += [
        "",
        "## Set for the run by an option {#env-run}",
        "",
        "Declared next to the option (`run_env=`), the same for every recipe: the run's processes get these "
        "when the option is on.",
        "",
        "| Variable | Value | When |",
        "|---|---|---|",
    ]
    for name in sorted(inv.option_set):
        value, flag = inv.option_set[name]
        lines.append(f"| {code(name)} | {code(value)} | [{code(flag)}](cli.md#{flag_anchor('train', flag)}) is on |")
    lines += ["", "## Set by recipes {#env-recipes}", "", "With each recipe's default options.", "", "| Variable | Recipes |", "|---|---|"]
    for name in sorted(inv.recipe_set):
        lines.append(f"| {code(name)} | {', '.join(code(r) for r in inv.recipe_set[name])} |")
    lines += ["", "## Docker images {#env-docker}", "", "| Variable | Where |", "|---|---|"]
    for name in sorted(inv.docker):
        lines.append(f"| {code(name)} | {inv.docker[name]} |")
    lines += ["", "## Read by libraries miles uses {#env-external}", "", "| Variable | Why it matters |", "|---|---|"]
    for name in sorted(EXTERNAL):
        lines.append(f"| {code(name)} | {EXTERNAL[name]} |")
    return "\n".join(lines) + "\n"
