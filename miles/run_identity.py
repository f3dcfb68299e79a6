"""What a run is, recorded in `<run dir>/run.json` and checked before a run starts, so a command never
resumes, extends or overwrites a different run.

A run's identity is its recipe options except those that only say where or how fast it runs
(`PLACE_OPTIONS`: mode, seeds, prepared-input parameters and the backend stay in), and the content of
what it learns from: a fingerprint of `--hf-checkpoint` (its config and weight index or the prepare
step's record) and of `--prompt-data` (size and the sha256 of its first and last MiB). Learning-rate or
step-count changes are not identity: resuming with a longer `--num-rollout` extends the same run.

`check_run_dir()` refuses (a `UserError` naming `--run-id`, exit 2) when

- the run directory's `run.json` records another identity (e.g. a `--mode debug_minimal` run, or a
  run prepared with another `--prepare-seed`), or
- `--save` already holds checkpoints and `--load` points elsewhere: this run would overwrite another
  run's checkpoints (and rewrite its metrics).

The default `--run-id` carries the mode (and the tiny recipe's prepare seed), so the runs a user
starts with default ids never meet these checks; they guard explicit ids and `--load`.
It reads files only; `write_run_record()` is called once the run holds its lock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from miles.ckpt.checkpoint_dir import read_tracker
from miles.errors import UserError

RUN_RECORD = "run.json"
# Recipe options that say where, on what, or how reproducibly a run goes, not what it learns.
PLACE_OPTIONS = frozenset(
    {"run_id", "output_dir", "model_dir", "data_dir", "extra_args", "num_nodes", "num_gpus_per_node", "hardware", "train_deterministic"}
)
_EDGE = 1 << 20


def _file_fingerprint(path: Path) -> str | None:
    if not path.is_file():
        return None
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with path.open("rb") as f:
        h.update(f.read(_EDGE))
        if size > 2 * _EDGE:
            f.seek(size - _EDGE)
        h.update(f.read(_EDGE))
    return h.hexdigest()[:16]


def _model_fingerprint(path: Path) -> str | None:
    """The model's config plus what names its weights: the prepare step's record, else the weight index
    or the sizes of the weight files (hashing gigabytes of weights at every start would be too slow)."""
    if not (path / "config.json").is_file():
        return None
    h = hashlib.sha256((path / "config.json").read_bytes())
    for name in (".miles-complete", "model.safetensors.index.json"):
        if (path / name).is_file():
            h.update((path / name).read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


@dataclasses.dataclass
class RunIdentity:
    recipe: dict[str, Any]  # identity-relevant recipe options, model_name and mode first
    hf_checkpoint: str | None
    prompt_data: str | None
    hf_fingerprint: str | None = None
    prompt_fingerprint: str | None = None

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def identity_of(options: Any, cfg: Any, *, inputs_ready: bool) -> RunIdentity:
    """The identity of the run `options` (recipe) and `cfg` (engine) describe; fingerprints only when
    the inputs exist (`inputs_ready`: after full-train's prepare steps)."""
    recipe = {f.name: getattr(options, f.name) for f in dataclasses.fields(options) if f.name not in PLACE_OPTIONS}
    hf = cfg.rollout.hf_checkpoint
    data = cfg.data.prompt_data
    ident = RunIdentity(recipe, str(Path(hf).absolute()) if hf else None, str(Path(data).absolute()) if data else None)
    if inputs_ready:
        ident.hf_fingerprint = _model_fingerprint(Path(hf)) if hf else None
        ident.prompt_fingerprint = _file_fingerprint(Path(data)) if data else None
    return ident


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _differences(recorded: dict[str, Any], current: RunIdentity) -> list[str]:
    """Human-readable differences; fingerprints are compared only when both sides have one."""
    out = []
    old_recipe = recorded.get("recipe", {})
    for key in sorted(set(old_recipe) | set(current.recipe)):
        if old_recipe.get(key) != current.recipe.get(key):
            out.append(f"{_flag(key)} {old_recipe.get(key)} then, {current.recipe.get(key)} now")
    for fp, path, flag in (("hf_fingerprint", "hf_checkpoint", "--hf-checkpoint"), ("prompt_fingerprint", "prompt_data", "--prompt-data")):
        old, new = recorded.get(fp), getattr(current, fp)
        if old and new and old != new:
            then, now = recorded.get(path), getattr(current, path)
            what = f"{then} then, {now} now" if then != now else f"{now}, whose content changed"
            out.append(f"{flag} {what}")
    return out


def check_run_dir(run_dir: str | os.PathLike[str], ident: RunIdentity, cfg: Any) -> None:
    """Refuse to start when this command would continue or overwrite a different run (see module doc)."""
    run_dir = Path(run_dir)
    record = run_dir / RUN_RECORD
    if record.is_file():
        try:
            recorded = json.loads(record.read_text()).get("identity", {})
        except (OSError, ValueError):
            recorded = {}
        diffs = _differences(recorded, ident)
        if diffs:
            raise UserError(
                f"{run_dir} holds another run ({'; '.join(diffs)}) and this command would resume it; "
                "give this run another --run-id (or delete that directory to start it over).",
                option="--run-id",
            )
    save, load = cfg.ckpt.save, cfg.ckpt.load
    if save:
        saved = read_tracker(save, flag="--save")
        if saved is not None and (not load or Path(load).absolute() != Path(save).absolute()):
            source = f"starts from --load {load}" if load else "starts from --hf-checkpoint"
            raise UserError(
                f"--save {save} already holds the checkpoints of a run (up to rollout {saved}) and this run "
                f"{source} instead of resuming them, so it would overwrite them; give this run another --run-id "
                "(or another --save).",
                option="--run-id",
            )


def write_run_record(run_dir: str | os.PathLike[str], run_id: str, ident: RunIdentity) -> None:
    """Write `<run_dir>/run.json` (temp + rename); kept from the run's first start on."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = run_dir / RUN_RECORD
    previous = {}
    if record.is_file():
        try:
            previous = json.loads(record.read_text())
        except (OSError, ValueError):
            previous = {}
    identity = json.loads(json.dumps(ident.as_json(), default=str))
    if previous.get("run_id") == run_id and previous.get("identity") == identity:
        return  # the same run again: its record stays byte for byte what the first start wrote
    data = {"run_id": run_id, "created": previous.get("created", time.time()), "identity": identity}
    tmp = record.with_name(record.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, record)
