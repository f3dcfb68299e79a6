"""The pinned SGLang `ServerArgs` and sglang-router `RouterArgs` fields, as checked-in data.

miles generates its `--sglang-<field>` and `--sglang-router-<field>` options from two JSON files next
to this module, `server_args.json` and `router_args.json`, so `miles --help` never imports SGLang
(which would import torch). Each entry is one field: its name, the flag SGLang's own CLI uses for
it, its kind (`bool`, `int`, `float`, `str`, `list`), its default, its choices when they are a fixed
list, and its help text.

Regenerate both files from the pinned wheels (downloaded with `pip download --no-deps`; nothing is
installed and nothing imports torch: the wheels' Python sources are read with `ast`):

    python -m miles.rollout.sglang.snapshot                 # download the pinned wheels, rewrite
    python -m miles.rollout.sglang.snapshot --wheel-dir D   # use wheels already in D
    python -m miles.rollout.sglang.snapshot --check         # exit 1 if the files would change

Where SGLang is importable, tests/rollout/test_sglang_snapshot.py also cross-checks the snapshot
against the installed `ServerArgs` (`msgspec.structs.fields`) and `RouterArgs`.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from miles.sglang_spec import (  # noqa: F401  (the checked-in snapshot and its readers live there)
    ROUTER_ARGS_FILE,
    SERVER_ARGS_FILE,
    SGLANG_ROUTER_VERSION,
    SGLANG_VERSION,
    router_fields,
    server_fields,
    snapshot_version,
)
PIP_DOWNLOAD_TIMEOUT_S = 600

_FIELDS_DIR = "sglang/srt/arg_groups/fields/"
_CHOICES_FILE = "sglang/srt/arg_groups/choices.py"
_ORDER_FILE = "sglang/srt/arg_groups/field_order.py"
_ROUTER_FILE = "sglang_router/router_args.py"
_SERVER_ARGS_PY = "sglang/srt/server_args.py"


# --- generating it from the wheels -------------------------------------------------------------------


def _literal(node: ast.AST, names: dict[str, Any]) -> Any:
    """Evaluate a literal expression, allowing names bound to literals and `+`/`*` of literals."""
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult, ast.Pow)):
        left, right = _literal(node.left, names), _literal(node.right, names)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Mult):
            return left * right
        return left**right
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e, names) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_literal(node.operand, names)
    return ast.literal_eval(node)


def _try_literal(node: ast.AST | None, names: dict[str, Any]) -> tuple[bool, Any]:
    if node is None:
        return False, None
    try:
        return True, _literal(node, names)
    except (ValueError, TypeError, SyntaxError, KeyError, RecursionError):
        return False, None


def _module_literals(source: str) -> dict[str, Any]:
    """Module-level `NAME = <literal>` bindings (later ones may use earlier ones)."""
    names: dict[str, Any] = {}
    for stmt in ast.parse(source).body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        value = getattr(stmt, "value", None)
        for target in targets:
            if isinstance(target, ast.Name) and value is not None:
                ok, v = _try_literal(value, names)
                if ok:
                    names[target.id] = v
    return names


def _split_annotation(node: ast.AST) -> tuple[ast.AST, ast.AST | None]:
    """`A[T, meta]` -> (T, meta); anything else -> (node, None)."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in ("A", "Annotated"):
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return elts[0], (elts[1] if len(elts) > 1 else None)
    return node, None


def _kind_of(type_text: str, has_parser: bool) -> tuple[str, bool]:
    """(kind, optional) from a type annotation's source text as SGLang's CLI treats it."""
    t = type_text.replace("typing.", "").replace(" ", "")
    optional = t.startswith("Optional[") or "None" in t.split("|") or t.endswith(",None]")
    inner = t[len("Optional["):-1] if t.startswith("Optional[") else t
    inner = "|".join(p for p in inner.split("|") if p != "None")
    if inner.startswith(("List[", "list[")) and not has_parser:
        return "list", optional
    if inner == "bool":
        return "bool", optional
    if inner == "int":
        return "int", optional
    if inner == "float":
        return "float", optional
    if inner.startswith("Literal["):
        return "str", optional
    return "str", optional  # str, dicts and unions given as JSON text: SGLang parses the string


def server_fields_from_wheel(wheel: Path) -> list[dict[str, Any]]:
    """Every CLI field of `ServerArgs`, read statically from the wheel's `arg_groups/fields/*.py`."""
    import zipfile  # here, not at the top: `miles train --help` reads this module's snapshot only

    with zipfile.ZipFile(wheel) as zf:
        choices = _module_literals(zf.read(_CHOICES_FILE).decode())
        order = _module_literals(zf.read(_ORDER_FILE).decode())["POSITIONAL_FIELD_ORDER"]
        sources = sorted(n for n in zf.namelist() if n.startswith(_FIELDS_DIR) and n.endswith(".py") and not n.endswith("__init__.py"))
        found: dict[str, dict[str, Any]] = {}
        hidden: dict[str, tuple[str, Any]] = {}  # fields without automatic CLI registration
        for name in sources:
            text = zf.read(name).decode()
            names = {**choices, **_module_literals(text)}
            for cls in ast.parse(text).body:
                if not isinstance(cls, ast.ClassDef):
                    continue
                if not any(isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "_NS_PATH" for t in s.targets) for s in cls.body):
                    continue
                for stmt in cls.body:
                    if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                        continue
                    field = stmt.target.id
                    if field.startswith("_"):
                        continue
                    type_node, meta = _split_annotation(stmt.annotation)
                    entry = _field_entry(field, type_node, meta, stmt.value, names)
                    if entry is not None:
                        found[field] = entry
                    else:
                        hidden[field] = (ast.unparse(type_node), _try_literal(stmt.value, names)[1])
        found.update(_manual_server_flags(zf.read(_SERVER_ARGS_PY).decode(), hidden))
    ordered = [n for n in order if n in found] + [n for n in found if n not in set(order)]
    return [found[n] for n in ordered]


def _manual_server_flags(source: str, hidden: dict[str, tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """Flags `ServerArgs.add_cli_args` registers by hand for fields with dynamic choices.

    Deprecated spellings (and `--config`) are left out: miles offers the current flag instead.
    """
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs")
    add_cli = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    out: dict[str, dict[str, Any]] = {}
    for call in ast.walk(add_cli):
        if not (isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument" and call.args):
            continue
        if not isinstance(call.args[0], ast.Constant):
            continue
        flag = call.args[0].value
        kw = {k.arg: k.value for k in call.keywords}
        field = flag.lstrip("-").replace("-", "_")
        help_src = ast.unparse(kw["help"]) if "help" in kw else ""
        if field not in hidden or "action" in kw or "Deprecated" in help_src:
            continue
        type_text, default = hidden[field]
        ok, help_text = _try_literal(kw.get("help"), {})
        if not ok:  # f-strings listing the dynamic choices: keep their constant sentences
            sentences = [
                v.value for p in ast.walk(kw["help"]) if isinstance(p, ast.JoinedStr) for v in p.values if isinstance(v, ast.Constant)
            ]
            help_text = "".join(sentences).replace("Options include: .", "").strip()
        kind, optional = _kind_of(type_text, False)
        out[field] = {
            "name": field,
            "cli": flag,
            "kind": kind,
            "optional": optional or default is None,
            "type": type_text,
            "default": default if isinstance(default, (str, int, float, bool, list, type(None))) else None,
            "required": False,
            "choices": None,
            "nargs": None,
            "help": " ".join(str(help_text).split()),
        }
    return out


def _field_entry(field: str, type_node: ast.AST, meta: ast.AST | None, value: ast.AST | None, names: dict[str, Any]) -> dict[str, Any] | None:
    help_text, cli_name, has_parser, action, nargs, listed = "", None, False, None, None, None
    if isinstance(meta, ast.Constant) and isinstance(meta.value, str):
        help_text = meta.value
    elif isinstance(meta, ast.Call) and getattr(meta.func, "id", "") == "Arg":
        kw = {k.arg: k.value for k in meta.keywords}
        if "no_cli" in kw and _try_literal(kw["no_cli"], names) == (True, True):
            return None
        ok, help_text = _try_literal(kw.get("help"), names)
        help_text = help_text if ok and isinstance(help_text, str) else ""
        ok, cli_name = _try_literal(kw.get("cli_name"), names)
        cli_name = cli_name if ok else None
        has_parser = "type_parser" in kw
        action = ast.unparse(kw["action"]) if "action" in kw else None
        ok, nargs = _try_literal(kw.get("nargs"), names)
        nargs = nargs if ok else None
        ok, listed = _try_literal(kw.get("choices"), names)
        listed = [str(c) for c in listed] if ok and isinstance(listed, (list, tuple)) else None
    elif meta is None:
        return None  # no CLI metadata: SGLang registers no flag for it
    type_text = ast.unparse(type_node)
    kind, optional = _kind_of(type_text, has_parser)
    if kind == "str" and "Literal[" in type_text and listed is None:
        for node in ast.walk(type_node):
            if isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", "")) == "Literal":
                elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                ok, lit = _try_literal(ast.List(elts=list(elts), ctx=ast.Load()), names)
                listed = [str(c) for c in lit] if ok else None
                break
    if value is None:
        default, required = None, True
    else:
        ok, default = _try_literal(value, names)
        required = False
        if not ok:
            default = None  # computed (a factory or a call): SGLang fills it; unset here
    if action is not None:
        kind = "bool" if "StoreTrue" in action or "store_true" in action else "str"
    if kind == "bool" and nargs is not None:
        kind = "str"
    return {
        "name": field,
        "cli": cli_name or "--" + field.replace("_", "-"),
        "kind": kind,
        "optional": optional or default is None,
        "type": type_text,
        "default": default if isinstance(default, (str, int, float, bool, list, type(None))) else None,
        "required": required,
        "choices": listed,
        "nargs": nargs,
        "help": " ".join(help_text.split()),
    }


def router_fields_from_wheel(wheel: Path) -> list[dict[str, Any]]:
    """Every option `RouterArgs.add_cli_args` registers, read statically from the router wheel."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(_ROUTER_FILE).decode()
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RouterArgs")
    defaults: dict[str, Any] = {}
    types: dict[str, str] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            types[stmt.target.id] = ast.unparse(stmt.annotation)
            ok, v = _try_literal(stmt.value, {})
            if not ok and isinstance(stmt.value, ast.Call):  # dataclasses.field(default_factory=list)
                kw = {k.arg: k.value for k in stmt.value.keywords}
                if getattr(kw.get("default_factory"), "id", "") in ("list", "dict"):
                    ok, v = True, ([] if kw["default_factory"].id == "list" else {})
            defaults[stmt.target.id] = v if ok else None
    add_cli = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "add_cli_args")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for call in ast.walk(add_cli):
        if not (isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument" and call.args):
            continue
        first = call.args[0]
        if isinstance(first, ast.JoinedStr):
            flag = "".join(v.value for v in first.values if isinstance(v, ast.Constant))
        elif isinstance(first, ast.Constant):
            flag = first.value
        else:
            continue
        kw = {k.arg: k.value for k in call.keywords}
        dest = None
        if "dest" in kw:
            d = kw["dest"]
            dest = "".join(v.value for v in d.values if isinstance(v, ast.Constant)) if isinstance(d, ast.JoinedStr) else _try_literal(d, {})[1]
        name = dest or flag.lstrip("-").replace("-", "_")
        if name in seen:
            continue
        seen.add(name)
        action = _try_literal(kw.get("action"), {})[1]
        type_name = getattr(kw.get("type"), "id", None)
        nargs = _try_literal(kw.get("nargs"), {})[1]
        ok, choices = _try_literal(kw.get("choices"), {})
        choices = [str(c) for c in choices] if ok and isinstance(choices, list) else None
        dnode = kw.get("default")
        # `RouterArgs.x`, or `int(os.getenv("ENV", RouterArgs.x))` (the environment can change it; the snapshot keeps x)
        attrs = [n for n in ast.walk(dnode) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "RouterArgs"] if dnode else []
        if attrs:
            default = defaults.get(attrs[0].attr)
        else:
            ok, default = _try_literal(dnode, {})
            default = default if ok else None
        if action in ("store_true", "store_false"):
            kind = "bool"
            default = bool(default) if default is not None else (action == "store_false")
        elif nargs in ("*", "+"):
            kind = "list"
        else:
            kind = {"int": "int", "float": "float"}.get(type_name or "", "str")
        ok, help_text = _try_literal(kw.get("help"), {})
        out.append(
            {
                "name": name,
                "cli": flag,
                "kind": kind,
                "optional": default is None,
                "type": types.get(name, type_name or "str"),
                "default": default if isinstance(default, (str, int, float, bool, list, type(None))) else None,
                "required": False,
                "choices": choices,
                "nargs": nargs,
                "action": action,
                "help": " ".join(help_text.split()) if ok and isinstance(help_text, str) else "",
            }
        )
    return out


def _download(spec: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(into), spec]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, timeout=PIP_DOWNLOAD_TIMEOUT_S)
    name = spec.split("==")[0].replace("-", "_")
    return next(p for p in into.glob("*.whl") if p.name.startswith(name + "-"))


def render(version: str, package: str, fields: list[dict[str, Any]]) -> str:
    doc = {"package": package, "version": version, "generated_by": "python -m miles.rollout.sglang.snapshot", "fields": fields}
    return json.dumps(doc, indent=1, ensure_ascii=False, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="Regenerate the pinned SGLang field snapshots from the wheels.")
    parser.add_argument("--wheel-dir", type=Path, help="directory holding the pinned wheels (default: download them)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if a file would change")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = args.wheel_dir or Path(tmp)

        def wheel(spec: str) -> Path:
            name, version = spec.split("==")
            stem = name.replace("-", "_")
            hits = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
            return hits[0] if hits else _download(spec, wheels)

        outputs = {
            SERVER_ARGS_FILE: render(SGLANG_VERSION, "sglang", server_fields_from_wheel(wheel(f"sglang=={SGLANG_VERSION}"))),
            ROUTER_ARGS_FILE: render(
                SGLANG_ROUTER_VERSION, "sglang-router", router_fields_from_wheel(wheel(f"sglang-router=={SGLANG_ROUTER_VERSION}"))
            ),
        }
    changed = [p for p, text in outputs.items() if not p.is_file() or p.read_text() != text]
    if args.check:
        for p in changed:
            print(f"{p} is out of date; run python -m miles.rollout.sglang.snapshot", file=sys.stderr)
        return 1 if changed else 0
    for p, text in outputs.items():
        p.write_text(text)
        print(f"wrote {p} ({len(json.loads(text)['fields'])} fields)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
