"""The driver loop: one RL run on Ray, in upstream's order, resumable from its last complete checkpoint.

    for rollout_id in range(start, num_rollout):
        eval (before the first step, unless --skip-eval-before-train)
        generate → train → save (every --save-interval, and the last step) → update weights
        eval (every --eval-interval, and the last step)

With --train-async (one-step overlap) rollout k+1 is generated while rollout k trains and the update
waits for it; with --fully-async each generate takes groups from the rollout manager's buffer
(miles/ray/fully_async.py), which its engines fill meanwhile. Same actors, same calls.

Cluster set-up (Ray, placement, the actors) is miles/ray/cluster.py; every derived value (steps,
layout, offload as it takes effect) is `cfg.layout`, resolved once (miles/config/resolve.py). Every
wait on an actor has a timeout and names what it waited for (miles/ray/waiting.py). With --save, a
run killed at any moment resumes from its last complete checkpoint when the same command is run
again (--load).

Colocated with offload (GPUs), memory is handed over in upstream's order so the trainer and the
engine are never both at full size: before training the engine releases its memory and the trainer
comes back; after it the trainer moves to host memory, the engine resumes its weights, takes the new
ones, and only then resumes its KV cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from pathlib import Path

from miles.config.engine import EngineConfig
from miles.errors import StepFailed, UserError
from miles.ray.waiting import ACTOR_START_TIMEOUT_S, STEP_TIMEOUT_S, wait  # noqa: F401  (the driver's timeouts)


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    final_step: int
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    plot: Path | None
    resumed_from: int | None


def run_training(cfg: EngineConfig, *, run_dir: str | Path, run_id: str, env: dict[str, str] | None = None) -> RunResult:
    from miles.ray.cluster import start_cluster
    from miles.tracking.console import progress

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # The actor classes' modules load on a thread while Ray's node starts. MLflow's imports, store and
    # run are left to the Tracker's writer thread, after the actors are up: seconds of CPU that would
    # otherwise take a core from Ray's start and the actors' set-up (docs/benchmarks.md, "Start-up and
    # memory, 2026-12-04").
    stack = _import_in_background(("miles.ray.actors",))
    with start_cluster(cfg, run_dir=run_dir, env=env or {}, stack=stack) as cluster:
        n = cfg.data.num_rollout
        _print_trainer_line(cfg, cluster)
        start, resumed_from = _resume(cfg, cluster)
        tracker = _open_tracker(cfg, run_dir, run_id, start, resumed_from)
        status, first_eval, last_eval = "FAILED", {}, {}
        try:
            _update_weights(cfg, cluster, version=start)
            _trainer_off_device(cfg, cluster)
            first_eval = last_eval = _eval_at_start(cfg, cluster, tracker, run_dir, start, resumed_from)
            with progress() as bar:
                first_eval, last_eval = _run_steps(cfg, cluster, tracker, bar, start, first_eval)
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            plot = _finish(cluster, tracker, run_dir, status)
        return RunResult(run_dir, n, first_eval, last_eval, plot, resumed_from)


def _run_steps(cfg: EngineConfig, cluster, tracker, bar, start: int, first_eval: dict[str, float]) -> tuple[dict, dict]:
    """Rollouts `start`..n-1; returns (first eval, last eval). With --train-async rollout k+1 is generated
    while rollout k trains (so with the weights from before rollout k's update, one update old when it
    trains), and the weight update waits for it, so no generation spans an update; otherwise each rollout
    is generated after the previous update."""
    from miles.tracking.console import print_step_summary

    manager, n, overlap = cluster.manager.handle, cfg.data.num_rollout, cfg.asynchrony.train_async
    task = bar.add_task("RL steps", total=n, completed=start)
    last_eval, pending, train_end = first_eval, None, time.perf_counter()
    for rollout_id in range(start, n):
        step, t0 = rollout_id + 1, time.perf_counter()
        # Two results: the metrics come to the driver; the train data goes from the manager
        # to the trainers by reference, never unpickled and pickled again here.
        data_ref, metrics_ref = pending or manager.generate_split.options(num_returns=2).remote(rollout_id)
        metrics = dict(wait(metrics_ref, f"rollout {rollout_id} to generate"))
        pending = manager.generate_split.options(num_returns=2).remote(step) if overlap and step < n else None
        syncs = not cfg.debug.debug_rollout_only and (step == n or step % cfg.asynchrony.update_weights_interval == 0)
        push = _push_with_train(cfg, cluster, version=step) if syncs else None
        if not cfg.debug.debug_rollout_only:
            metrics["perf/trainer_idle_time"] = time.perf_counter() - train_end
            metrics.update(_train(cfg, cluster, data_ref, rollout_id, push))
            train_end = time.perf_counter()
        tracker.log(metrics, step=step)  # before the checkpoint: a saved step is a logged step
        if cfg.ckpt.save and (step == n or (cfg.ckpt.save_interval and step % cfg.ckpt.save_interval == 0)):
            # Overlapped, rollout `step` is already under way: the checkpoint holds the data position from
            # before it drew, so a resume generates it again (with the checkpoint's weights).
            _save(cfg, cluster, rollout_id, state_before=step if pending else None)
        after: dict[str, float] = {}
        if syncs:
            if pending:  # no generation spans a weight update (upstream's train_async order)
                wait(pending[1], f"rollout {step} to finish before the weight update")
            after = _sync_after_train(cfg, cluster, version=step, pushed=push is not None)
        if _is_eval_step(cfg, step):
            last_eval = wait(manager.eval.remote(step), f"eval after rollout {rollout_id}")
            after.update(last_eval)
            first_eval = first_eval or (last_eval if start == 0 else {})
        after["perf/step_time"] = time.perf_counter() - t0
        tracker.log(after, step=step)
        print_step_summary(step, {**metrics, **after}, num_steps=n)
        bar.advance(task)
    return first_eval, last_eval


def _import_in_background(modules: tuple[str, ...]) -> threading.Thread:
    """Import `modules` on a thread (join it before using them; an import error is raised again there,
    where the caller imports them itself)."""

    def run() -> None:
        import importlib

        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - re-raised by the caller's own import
                return

    thread = threading.Thread(target=run, name="miles-import-driver-stack")
    thread.start()
    return thread


def _print_trainer_line(cfg: EngineConfig, cluster) -> None:
    """What trains (LoRA: the adapters), its share of the model and the optimizer's memory, once at start-up."""
    from rich import get_console

    from miles.train.metrics import parameter_line

    line = parameter_line(cluster.trainer.parameter_metrics(), cfg)
    if line:
        get_console().print(line, markup=False, highlight=False, soft_wrap=True)


def _resume(cfg: EngineConfig, cluster) -> tuple[int, int | None]:
    """(first rollout id, the rollout resumed from or None): from the newest complete checkpoint under --load."""
    from rich import get_console

    from miles.ckpt.trainer_checkpoint import find_latest_checkpoint

    found = find_latest_checkpoint(cfg.ckpt.load) if cfg.ckpt.load else None
    if found is None:
        return 0, None
    rollout_id, ckpt_dir, extra = found
    # Every rank reads its own shard; the trainer state never passes through the driver.
    cluster.trainer.load_checkpoint(str(ckpt_dir))
    if cluster.critic is not None:  # committed with the actor's shards by the same tracker (see _save)
        if not (Path(ckpt_dir) / CRITIC_DIR).is_dir():
            raise UserError(
                f"--load {cfg.ckpt.load}: the checkpoint of rollout {rollout_id} has no PPO critic ({CRITIC_DIR}/), so "
                "--advantage-estimator ppo cannot resume from it; resume it with the estimator it was trained with.",
                option="--load",
            )
        cluster.critic.load_checkpoint(str(Path(ckpt_dir) / CRITIC_DIR))
    wait(cluster.manager.handle.load_state_dict.remote(extra["rollout_manager"]), "the rollout manager to load the data position")
    get_console().print(f"Resumed from rollout {rollout_id} ({cfg.ckpt.load}); continuing at rollout {rollout_id + 1}.")
    return rollout_id + 1, rollout_id


def _open_tracker(cfg: EngineConfig, run_dir: Path, run_id: str, start: int, resumed_from: int | None):
    from miles.tracking import Tracker

    # Rollout r is logged as step r + 1, so a resume at rollout `start` rewrites steps from start + 1;
    # a fresh start drops whatever an earlier start of this run logged before its first checkpoint.
    resume_step = start + 1 if resumed_from is not None else 0
    return Tracker(cfg.tracking, run_dir=run_dir, run_id=run_id, params=cfg, resume_step=resume_step)


def _eval_at_start(cfg: EngineConfig, cluster, tracker, run_dir: Path, start: int, resumed_from: int | None) -> dict[str, float]:
    """Eval before the first step (unless --skip-eval-before-train); on a resume, the eval that the
    interrupted run missed between its checkpoint and its eval (the checkpoint holds exactly the
    weights that eval would have seen, so nothing is missing from the record)."""
    manager = cluster.manager.handle
    first: dict[str, float] = {}
    if start == 0 and cfg.eval.eval_interval is not None and not cfg.eval.skip_eval_before_train:
        first = wait(manager.eval.remote(0), "eval before training")
        tracker.log(first, step=0)
    if resumed_from is not None and _is_eval_step(cfg, start) and not _logged_eval(run_dir, start):
        tracker.log(wait(manager.eval.remote(start), f"the eval of step {start} missed by the interrupted run"), step=start)
    return first


def _trainer_off_device(cfg: EngineConfig, cluster) -> None:
    if cfg.layout.offload_train:
        cluster.trainer.offload()
        if cluster.critic is not None:
            cluster.critic.offload()


def _push_with_train(cfg: EngineConfig, cluster, *, version: int):
    """The weight sync as part of the train call (miles.ray.weight_sync.order_with_train) when nothing
    runs between the two in this loop: no offload, no critic, no asynchrony; else None."""
    if cfg.layout.offload_train or cfg.layout.offload_rollout or cluster.critic is not None or cfg.asynchrony.overlapped:
        return None
    from miles.ray.weight_sync import order_with_train

    return order_with_train(cfg, cluster.manager.handle, version=version)


def _train(cfg: EngineConfig, cluster, data_ref, rollout_id: int, push=None) -> dict[str, float]:
    """The engine releases its memory, the trainer comes back to the device and trains. PPO: the
    critic first (on the device only while it trains), then the actor with the critic's pre-update
    values, except in the first --num-critic-only-steps rollouts. `push`: the train call also syncs
    the weights (perf/weight_sync_time is then its part of the call, not in perf/train_time)."""
    t0 = time.perf_counter()
    if cfg.layout.offload_rollout:
        wait(cluster.manager.handle.offload.remote(), "the rollout engine to release its memory")
    metrics: dict[str, float] = {}
    critic_refs = None
    if cluster.critic is not None:
        if cfg.layout.offload_train:
            cluster.critic.onload()
        critic_metrics, critic_refs = cluster.critic.train_critic(data_ref, rollout_id)
        metrics.update(critic_metrics)
        if cfg.layout.offload_train:
            cluster.critic.offload()
        if rollout_id < cfg.critic.num_critic_only_steps:
            metrics["perf/train_time"] = time.perf_counter() - t0
            return metrics
    if cfg.layout.offload_train:
        cluster.trainer.onload()
    metrics.update(cluster.trainer.train(data_ref, rollout_id, critic_refs, push=push))
    metrics["perf/train_time"] = time.perf_counter() - t0 - metrics.get("perf/weight_sync_time", 0.0)
    return metrics


def _sync_after_train(cfg: EngineConfig, cluster, *, version: int, pushed: bool = False) -> dict[str, float]:
    """Trainer to host memory → engine weights resumed → weights updated → engine KV cache resumed.
    `pushed`: the train call already sent the weights (its metrics hold the sync's); only the check is left."""
    manager, layout = cluster.manager.handle, cfg.layout
    _trainer_off_device(cfg, cluster)
    if layout.offload_rollout:
        wait(manager.onload.remote(tags=["weights"]), "the rollout engine to resume its weights' memory")
    sync_time, metrics = _update_weights(cfg, cluster, version=version, pushed=pushed)
    if layout.offload_rollout:
        wait(manager.onload.remote(tags=["kv_cache", "cuda_graph"]), "the rollout engine to resume its KV cache and CUDA graphs")
    return metrics if pushed else {**metrics, "perf/weight_sync_time": sync_time}


def _is_eval_step(cfg: EngineConfig, step: int) -> bool:
    """Eval runs after every --eval-interval-th step and after the last one."""
    interval = cfg.eval.eval_interval
    return interval is not None and step > 0 and (step % interval == 0 or step == cfg.data.num_rollout)


def _logged_eval(run_dir: Path, step: int) -> bool:
    import json

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("step") == step and any(k.startswith("eval/") for k in row):
            return True
    return False


def _update_weights(cfg: EngineConfig, cluster, *, version: int, pushed: bool = False) -> tuple[float, dict[str, float]]:
    """Seconds the whole update took, and what the trainer's source rank reported (bytes sent, send time)."""
    from miles.ray.weight_sync import sync_weights

    t0 = time.perf_counter()
    manager = cluster.manager.handle
    # The trainer ranks push the buckets to the engines; the driver only orders the three calls.
    sent = {} if pushed else sync_weights(cfg, cluster.trainer.handles, manager, version=version, wait=wait)
    if cfg.debug.check_weight_update_equal:
        trainer_sum = cluster.trainer.weights_checksum()
        engine_sum = wait(manager.weights_checksum.remote(), "the rollout engine's weight checksum")
        if trainer_sum != engine_sum:
            raise StepFailed(
                f"--check-weight-update-equal: after the weight update to version {version} the rollout engine's "
                f"weights (sha256 {engine_sum[:12]}) differ from the trainer's ({trainer_sum[:12]})"
            )
    return time.perf_counter() - t0, dict(sent or {})


CRITIC_DIR = "critic"
"""The PPO critic's shards inside each checkpoint directory (committed with the actor's)."""


def _save(cfg: EngineConfig, cluster, rollout_id: int, *, state_before: int | None = None) -> None:
    """Every training rank writes its own shard into a temporary directory; the driver adds its own
    data and commits (rename + tracker) only after every rank returned. The critic's ranks write into
    its `critic/` subdirectory of the same temporary directory, so one commit holds both.
    `state_before`: save the data position from before that rollout drew (it is under way and is
    generated again on resume)."""
    from miles.ckpt.trainer_checkpoint import begin_checkpoint, commit_checkpoint

    manager_state = wait(cluster.manager.handle.state_dict.remote(state_before), "the data position")
    tmp = begin_checkpoint(cfg.ckpt.save, rollout_id)
    cluster.trainer.save_checkpoint(str(tmp))
    if cluster.critic is not None:
        (tmp / CRITIC_DIR).mkdir()
        cluster.critic.save_checkpoint(str(tmp / CRITIC_DIR))
    commit_checkpoint(
        cfg.ckpt.save,
        rollout_id,
        tmp,
        {"rollout_manager": manager_state, "rollout_id": rollout_id},
        keep_last=cfg.ckpt.keep_last_checkpoints,
    )
    if cfg.ckpt.save_hf:
        cluster.trainer.export_hf(cfg.ckpt.save_hf.format(rollout_id=rollout_id))


def _finish(cluster, tracker, run_dir: Path, status: str) -> Path | None:
    """The curves' plot, the tracker closed with the run's status, and (after a normal end) the router
    and engine servers stopped while the manager is idle. Otherwise (a signal, an error) the manager may
    be busy and would take that call only after its current one: the cluster's end kills it at once,
    its router follows (PR_SET_PDEATHSIG) and Ray ends the engine server actors it owns."""
    plot = None
    with contextlib.suppress(Exception):
        from miles.tracking.plot import plot_curves

        plot = plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
        if plot:
            tracker.log_artifact(plot)
    tracker.finish(status=status)
    if status == "FINISHED":
        with contextlib.suppress(Exception):
            wait(cluster.manager.handle.shutdown.remote(), "the rollout engines to stop", 60)
    return plot
