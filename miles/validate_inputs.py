"""Check every input a run reads before anything starts (no Ray, no model load, nothing written).

    check_inputs(cfg, command="train", checkpoint=None, pending=[...])

Each problem is a `UserError` naming the option and the fix (exit 2, one sentence). Checked:

- `--hf-checkpoint` (and `--ref-load` when a KL term loads the reference model) is a Hugging Face
  model directory (config.json);
- `--opd-teacher-load` (`--use-opd --opd-type megatron`) is one too, with the student's vocabulary
  size (the teacher scores the student's token ids) and, on the megatron trainer, its architecture
  and sizes;
- `--prompt-data` and every `--eval-prompt-data` file exists and every row parses and has
  `--input-key` (and `--label-key` when set), read the way the run reads it;
- `--load` (a resume) and `miles eval --checkpoint` hold a readable tracker naming a complete checkpoint;
- every hook path (`--custom-rm-path`, `--dynamic-sampling-filter-path`, ...) imports, and
  `--custom-generate-function-path` / `--rollout-function-path` name async functions;
- `--use-prometheus`: `--prometheus-host`:`--prometheus-port` can be bound now.

`pending` lists the directories that `miles full-train`'s prepare steps have yet to create: inputs
inside them are checked after those steps ran, not before. `creatable` (for `miles train`) lists the
same directories, which train does not prepare: a missing input inside one suggests `miles full-train`,
any other does not (full-train would not create it). `--dry-run` runs the same checks.
Reads files only; imports neither torch nor Ray.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import Any, Iterable

from miles.ckpt.checkpoint_dir import TRACKER, latest_checkpoint
from miles.errors import MissingInput, UserError

HOOK_OPTIONS = (
    ("rollout", "dynamic_sampling_filter_path"),
    ("reward", "custom_rm_path"),
    ("reward", "custom_reward_post_process_path"),
    ("reward", "custom_convert_samples_to_train_data_path"),
    ("algo", "custom_loss_function_path"),
    ("algo", "custom_tis_function_path"),
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_pending(path: str | Path, pending: Iterable[Path]) -> bool:
    p = Path(path).absolute()
    return any(p == d or d in p.parents for d in pending)


def _hf_dir(path: str | None, flag: str, hint: str = "") -> None:
    if not path or not Path(path).exists():
        raise MissingInput(f"{flag} {path} does not exist; point it at a Hugging Face model directory.{hint}", option=flag)
    if not (Path(path) / "config.json").is_file():
        raise UserError(f"{flag} {path} is not a Hugging Face model directory (no config.json); point it at one.{hint}", option=flag)


def _hub_hint(path: str | None) -> str:
    """For `<--model-dir>/owner--name`, where a --hf-checkpoint Hub id is downloaded: how to get it there."""
    name = Path(path or "").name
    if "--" not in name or Path(path).exists():
        return ""
    from miles.prepare.hub import hf_download_command

    repo_id = name.replace("--", "/", 1)
    return (
        f" It is where the Hub id {repo_id} is downloaded: run `miles full-train` with the same options, "
        f"or `{hf_download_command(repo_id, path)}` where there is network."
    )


def _rows(path: str, *, flag: str, input_key: str, label_key: str | None) -> None:
    """Every row of a prompt file, parsed as the run parses it, with the keys the run reads."""
    from miles.rollout.data_source import _read_rows

    count = 0
    for where, row in _read_rows(Path(path), flag):
        count += 1
        if input_key not in row:
            raise UserError(
                f"{where}: no key {input_key!r} (the row has {sorted(row)}); set --input-key to the key holding the prompt.",
                option="--input-key" if flag == "--prompt-data" else "--eval-input-key",
            )
        if label_key is not None and label_key not in row:
            raise UserError(
                f"{where}: no key {label_key!r} (the row has {sorted(row)}); set --label-key to the key holding the answer.",
                option="--label-key" if flag == "--prompt-data" else "--eval-label-key",
            )
    if count == 0:
        raise UserError(f"{flag} {path}: it has no rows; give a file with at least one prompt.", option=flag)


def _checkpoint_dir(path: str, flag: str) -> None:
    """A directory that may hold checkpoints: unreadable or garbage trackers are caught here."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise UserError(f"{flag} {path} is a file, not a checkpoint directory; point {flag} at a directory.", option=flag)
    latest_checkpoint(p, flag=flag)


def _hooks(cfg: Any, command: str) -> None:
    from miles.rollout.generate_hub.loading import load_generate_function, load_rollout_function
    from miles.utils.load_function import load_function

    for group, name in HOOK_OPTIONS:
        value = getattr(getattr(cfg, group), name, None)
        if value:
            load_function(value, flag=_flag(name))
    load_generate_function(cfg.rollout.custom_generate_function_path)  # an async function, or exit 2
    r = cfg.rollout
    if r.generate_execute_tool_function_path or r.generate_tool_specs_path:
        from miles.rollout.tools.execution import load_execute_tool, load_tool_specs

        load_execute_tool(r.generate_execute_tool_function_path)
        load_tool_specs(r.generate_tool_specs_path)
    if r.custom_agent_function_path:
        from miles.rollout.generate_hub.agentic_tool_call import load_agent_function

        load_agent_function(r.custom_agent_function_path)
    if command != "eval":
        load_rollout_function(cfg.rollout.rollout_function_path)


def _vocab_size(hf_dir: str) -> int | None:
    import json

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(size) if size is not None else None


_SHAPE_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "head_dim", "tie_word_embeddings")
"""config.json entries a megatron-built teacher must share with the student (it is built with the student's layout)."""


def _opd_teacher(cfg: Any, pending: list[Path]) -> None:
    """The trainer-forwarded OPD teacher is a model directory whose vocabulary is the student's."""
    o = cfg.opd
    if not (o.use_opd and o.opd_type == "megatron" and o.opd_teacher_load) or _is_pending(o.opd_teacher_load, pending):
        return
    _hf_dir(o.opd_teacher_load, "--opd-teacher-load", " --use-opd --opd-type megatron forwards the teacher from there.")
    student = cfg.rollout.hf_checkpoint
    if not student or _is_pending(student, pending) or not (Path(student) / "config.json").is_file():
        return
    if cfg.train.train_backend == "megatron":
        import json

        read = lambda d: json.loads((Path(d) / "config.json").read_text())  # noqa: E731
        teacher, mine = read(o.opd_teacher_load), read(student)
        differ = [k for k in _SHAPE_KEYS if teacher.get(k) != mine.get(k)]
        if differ:
            raise UserError(
                f"--opd-teacher-load {o.opd_teacher_load} differs from the student (--hf-checkpoint) in {', '.join(differ)}; the megatron "
                "trainer builds the teacher with the student's layout, so give a teacher of the student's architecture and sizes "
                "(or use --train-backend torch, which loads any causal LM with the student's vocabulary).",
                option="--opd-teacher-load",
            )
    teacher_vocab, student_vocab = _vocab_size(o.opd_teacher_load), _vocab_size(student)
    if teacher_vocab != student_vocab:
        raise UserError(
            f"--opd-teacher-load {o.opd_teacher_load} has a vocabulary of {teacher_vocab} tokens but the student "
            f"(--hf-checkpoint) has {student_vocab}; the teacher must score the student's token ids, so give a teacher "
            "with the student's tokenizer.",
            option="--opd-teacher-load",
        )


def _port(host: str, port: int) -> None:
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the run binds it the same way
            s.bind((host, port))
    except socket.gaierror as e:
        raise UserError(f"--prometheus-host {host} is not a valid address ({e.strerror}); use 127.0.0.1 or 0.0.0.0.", option="--prometheus-host") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"--prometheus-port {port} is already in use on {host}; pick a free port.", option="--prometheus-port") from None
        if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise UserError(
                f"--prometheus-host {host} is not an address of this machine; use 127.0.0.1, 0.0.0.0 or one of this host's addresses.",
                option="--prometheus-host",
            ) from None
        raise


def check_inputs(
    cfg: Any, *, command: str, checkpoint: str | None = None, pending: Iterable[Path] = (), creatable: Iterable[Path] = ()
) -> None:
    """Raise a `UserError` for the first input of this run that is missing or unreadable (see module doc)."""
    pending = [Path(p).absolute() for p in pending]
    creatable = [Path(p).absolute() for p in creatable]

    def hint_for(path: str | None) -> str:
        return " Run `miles full-train` to prepare it." if path and _is_pending(path, creatable) else ""

    r, d, e = cfg.rollout, cfg.data, cfg.eval
    if checkpoint and (Path(checkpoint) / "config.json").is_file():
        pass  # `miles eval --checkpoint HF_DIR` evaluates that model instead of --hf-checkpoint
    elif not (r.hf_checkpoint and _is_pending(r.hf_checkpoint, pending)):
        _hf_dir(r.hf_checkpoint, "--hf-checkpoint", _hub_hint(r.hf_checkpoint) or hint_for(r.hf_checkpoint))
    if command != "eval":
        if d.prompt_data is None:
            raise UserError("--prompt-data is required to train; give a .jsonl or .parquet file.", option="--prompt-data")
        if not _is_pending(d.prompt_data, pending):
            if not Path(d.prompt_data).is_file():
                raise MissingInput(f"--prompt-data {d.prompt_data} does not exist; give a .jsonl or .parquet file.{hint_for(d.prompt_data)}", option="--prompt-data")
            _rows(d.prompt_data, flag="--prompt-data", input_key=d.input_key, label_key=None if cfg.algo.loss_type == "sft_loss" else d.label_key)  # SFT rows need no label
        a = cfg.algo
        if (a.use_kl_loss or a.kl_coef != 0) and cfg.ckpt.ref_load and not _is_pending(cfg.ckpt.ref_load, pending):
            _hf_dir(cfg.ckpt.ref_load, "--ref-load", " --use-kl-loss and --kl-coef read the reference model from there.")
        _opd_teacher(cfg, pending)
        if cfg.ckpt.load:
            _checkpoint_dir(cfg.ckpt.load, "--load")
        if cfg.ckpt.save and cfg.ckpt.save != cfg.ckpt.load:
            _checkpoint_dir(cfg.ckpt.save, "--save")
    pairs = e.eval_prompt_data or []
    for name, path in zip(pairs[0::2], pairs[1::2]):
        if not _is_pending(path, pending):
            if not Path(path).is_file():
                raise MissingInput(f"--eval-prompt-data {name} {path}: no such file; give a .jsonl or .parquet file.{hint_for(path)}", option="--eval-prompt-data")
            _rows(path, flag="--eval-prompt-data", input_key=e.eval_input_key or d.input_key, label_key=e.eval_label_key or d.label_key)
    if checkpoint:
        p = Path(checkpoint)
        if not p.exists():
            raise MissingInput(f"--checkpoint {p} does not exist; give a Hugging Face model directory or a run's checkpoint directory.", option="--checkpoint")
        if not (p / "config.json").is_file():
            if not (p / TRACKER).is_file():
                raise UserError(
                    f"--checkpoint {p} is neither a Hugging Face model directory (config.json) nor a miles checkpoint "
                    f"directory ({TRACKER}).",
                    option="--checkpoint",
                )
            _checkpoint_dir(checkpoint, "--checkpoint")
    _hooks(cfg, command)
    from miles.ray.threads import user_thread_cap

    user_thread_cap()  # a bad OMP_NUM_THREADS stops the run here, before anything is written
    if command != "eval" and cfg.tracking.use_prometheus:
        _port(cfg.tracking.prometheus_host, cfg.tracking.prometheus_port)
