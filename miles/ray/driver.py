"""The driver loop: one RL run on Ray, in upstream's order, resumable from its last complete checkpoint.

    for rollout_id in range(start, num_rollout):
        eval (before the first step, unless --skip-eval-before-train)
        generate → train → save (every --save-interval, and the last step) → update weights
        eval (every --eval-interval, and the last step)

Ray starts in-process (a private local node) unless --ray-address / RAY_ADDRESS names a cluster.
Every wait on an actor has a timeout and names what it waited for. With --save, a run killed at any
moment resumes from its last complete checkpoint when the same command is run again (--load).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from miles.config.data import rollouts_for_epochs
from miles.config.engine import EngineConfig
from miles.config.resolve import fill_derived
from miles.errors import StepFailed, UserError

ACTOR_START_TIMEOUT_S = 600.0
STEP_TIMEOUT_S = 3600.0


def wait(refs, what: str, timeout: float = STEP_TIMEOUT_S):
    """`ray.get` with a timeout and a message that says what was being waited for."""
    import ray

    from miles.ray.actor_death import ActorDied, describe
    from miles.ray.hosting import unwrap_user_error

    try:
        if isinstance(refs, list) and len(refs) > 1:
            _first_error_first(refs, timeout)
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise StepFailed(f"timed out after {timeout:.0f} s waiting for {what}") from None
    except ray.exceptions.RayActorError as e:
        raise ActorDied(describe(e, what)) from None
    except ray.exceptions.RayTaskError as e:
        user_error = unwrap_user_error(e)
        if user_error is not None:
            raise user_error from None
        raise


def _first_error_first(refs: list, timeout: float) -> None:
    """Wait for `refs` one by one as they finish, so a rank that died is reported at once instead of
    after its peers time out in a collective it will never join."""
    import ray

    deadline = time.monotonic() + timeout
    pending = list(refs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ray.exceptions.GetTimeoutError()
        done, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
        ray.get(done)


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    final_step: int
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    plot: Path | None
    resumed_from: int | None


class _DropDefaultTokenAuthNotice(logging.Filter):
    """Drops the one notice Ray logs on every new local node, that token authentication is on (its default).
    The protection stays as Ray chose it; only the line goes, so a run's console starts with miles' own
    output. Ray's other authentication messages (a disabled mode, a wrong token) still print."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def _quiet_default_token_auth_notice() -> None:
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropDefaultTokenAuthNotice) for f in log.filters):
        log.addFilter(_DropDefaultTokenAuthNotice())


@contextlib.contextmanager
def ray_session(cfg: EngineConfig, env: dict[str, str], num_cpus: int):
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        kwargs: dict[str, Any] = dict(
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
            configure_logging=False,
        )
        # ray.init replaces the SIGTERM handler with a bare sys.exit; keep the caller's (miles.run_stop).
        sigterm = signal.getsignal(signal.SIGTERM)
        if cfg.cluster.ray_address:
            ray.init(address=cfg.cluster.ray_address, **kwargs)
        else:  # "local": a private node, even when another Ray on this machine left /tmp/ray/ray_current_cluster
            _quiet_default_token_auth_notice()
            ray.init(address="local", num_cpus=num_cpus, **kwargs)
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    try:
        yield
    finally:
        if started_here:
            from miles.ray.hosting import end_hosted_actors

            pids = end_hosted_actors()
            ray.shutdown()
            if not cfg.cluster.ray_address:
                _reap(pids)


def _reap(pids: list[int], timeout: float = 10.0) -> None:
    """Make sure the local actor processes are gone once Ray is shut down (no orphan keeps a GPU or a port)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if any(part.startswith("ray::") for part in p.cmdline()[:1]):
                procs.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)


def run_training(cfg: EngineConfig, *, run_dir: str | Path, run_id: str, env: dict[str, str] | None = None) -> RunResult:
    import ray

    # torch and the rollout stack (seconds of imports; the driver needs them only to pick the device
    # and name the actor classes) load on a thread while Ray's node starts, instead of before it.
    stack = _import_in_background(("miles.ray.rollout_manager", "miles.ray.train_group"))
    from miles.ckpt.trainer_checkpoint import find_latest_checkpoint
    from miles.ray.hosting import remote_object
    from miles.tracking import Tracker
    from miles.tracking.tracker import import_sinks_in_background
    from rich import get_console

    from miles.tracking.console import print_step_summary, progress

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    world = cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node
    # Colocated actors take turns on the same devices: each asks for half a device (and half a CPU) so
    # Ray places a trainer and the engine together; separate placement gives each a whole device.
    share = 0.5 if cfg.cluster.colocate else 1.0
    num_engines = rollout_bundles(cfg)  # engine servers' devices (--rollout-num-gpus), or the in-process engine
    num_cpus = max(os.cpu_count() or 1, world + num_engines)

    # MLflow's imports and its new store take seconds: made alongside Ray's start and the actors' (the
    # Tracker, built after, opens them).
    import_sinks_in_background(cfg.tracking, run_dir)
    with contextlib.ExitStack() as session:
        session.enter_context(ray_session(cfg, env or {}, num_cpus))
        stack.join()
        from miles.ray.rollout_manager import RolloutManager, pick_device
        from miles.ray.train_group import TrainWorker

        device = pick_device(cfg.cluster.device)
        options: dict[str, Any] = {"num_cpus": share}
        if device == "cuda":
            options["num_gpus"] = share
            needed = world * share + share
            visible = torch_device_count()
            if not cfg.cluster.ray_address and visible < needed:  # a cluster's GPUs are Ray's to count
                raise UserError(
                    f"this run needs {needed:g} GPUs ({world} training workers + the rollout engine"
                    f"{', colocated' if cfg.cluster.colocate else ', each on its own device'}) but {visible} are visible; "
                    "add --colocate or lower --actor-num-gpus-per-node.",
                    option="--colocate",
                )
        bundle_of = session.enter_context(placement(cfg, world, device))
        if cfg.cluster.rollout_num_gpus or cfg.rollout.rollout_backend == "sglang":
            # Engine servers in their own bundles; the manager only coordinates.
            engine_options = _engine_actor_options(cfg, options, bundle_of, device)
            manager = remote_object(RolloutManager, cfg, engine_actor_options=engine_options, log_dir=str(run_dir), actor_options={"num_cpus": 0})
        else:
            manager = remote_object(RolloutManager, cfg, actor_options={**options, **bundle_of("rollout")})
        d = cfg.data

        def start_workers() -> list:
            workers = [
                remote_object(TrainWorker, cfg, rank=r, world_size=world, device=device, actor_options={**options, **bundle_of(r)})
                for r in range(world)
            ]
            wait([w.ready_ref for w in workers], "the training workers to start", ACTOR_START_TIMEOUT_S)
            # Rendezvous at rank 0's node (its IP as Ray sees it, a port free there), then build the backends.
            master = wait(workers[0].rendezvous_address.remote(), "training rank 0 to pick the rendezvous address")
            wait([w.start.remote(*master) for w in workers], "the training workers to join and load the model", ACTOR_START_TIMEOUT_S)
            from miles.train.metrics import parameter_line

            line = parameter_line(wait(workers[0].parameter_metrics.remote(), "training rank 0 to count its parameters"), cfg)
            if line:
                get_console().print(line, markup=False, highlight=False, soft_wrap=True)
            return workers

        # The trainers need nothing from the manager unless --num-epoch leaves the step count to the
        # dataset's size; otherwise they start and load the model while the manager loads the engine
        # and the datasets (side by side, instead of one after the other).
        workers = start_workers() if d.num_rollout is not None else []
        wait(manager.ready_ref, "the rollout manager to load the engine and the datasets", ACTOR_START_TIMEOUT_S)
        if d.num_rollout is None:  # --num-epoch: the dataset size decides the number of steps
            num_prompts = wait(manager.num_prompts.remote(), "the rollout manager")
            d.num_rollout = rollouts_for_epochs(num_prompts, d.num_epoch, d.rollout_batch_size)
            fill_derived(cfg)  # options derived from --num-rollout (the LR decay length)
            workers = start_workers()

        start, resumed_from = 0, None
        if cfg.ckpt.load:
            found = find_latest_checkpoint(cfg.ckpt.load)
            if found is not None:
                rollout_id, ckpt_dir, extra = found
                # Every rank reads its own shard; the trainer state never passes through the driver.
                wait([w.load_checkpoint.remote(str(ckpt_dir)) for w in workers], f"the training workers to load {ckpt_dir}")
                wait(manager.load_state_dict.remote(extra["rollout_manager"]), "the rollout manager to load the data position")
                start, resumed_from = rollout_id + 1, rollout_id
                get_console().print(f"Resumed from rollout {rollout_id} ({cfg.ckpt.load}); continuing at rollout {start}.")

        tracker = Tracker(
            # Rollout r is logged as step r + 1, so a resume at rollout `start` rewrites steps from start + 1;
            # a fresh start drops whatever an earlier start of this run logged before its first checkpoint.
            cfg.tracking, run_dir=run_dir, run_id=run_id, params=cfg, resume_step=start + 1 if resumed_from is not None else 0
        )
        status = "FAILED"
        first_eval: dict[str, float] = {}
        last_eval: dict[str, float] = {}
        # On CPU the weights already live in host memory: offload/onload calls would be Ray round trips
        # (four a step) that do nothing, so they are not made (the options say "no effect on CPU").
        c = dataclasses.replace(cfg.cluster, offload_train=cfg.cluster.offload_train and device != "cpu",
                                offload_rollout=cfg.cluster.offload_rollout and device != "cpu")
        try:
            _update_weights(cfg, workers, manager, version=start)
            if c.offload_train:
                _each(workers, "offload", "the trainer to move to host memory")
            if start == 0 and cfg.eval.eval_interval is not None and not cfg.eval.skip_eval_before_train:
                first_eval = wait(manager.eval.remote(0), "eval before training")
                tracker.log({**first_eval, "eval/step": 0}, step=0)
                last_eval = first_eval
            if resumed_from is not None and _is_eval_step(cfg, start) and not _logged_eval(run_dir, start):
                # Killed between its checkpoint and its eval: the checkpoint holds exactly the weights
                # that eval would have seen, so run it now and nothing is missing from the record.
                tracker.log(wait(manager.eval.remote(start), f"the eval of step {start} missed by the interrupted run"), step=start)
            with progress() as bar:
                task = bar.add_task("RL steps", total=d.num_rollout, completed=start)
                for rollout_id in range(start, d.num_rollout):
                    step = rollout_id + 1
                    t0 = time.perf_counter()
                    # Two results: the metrics come to the driver; the train data goes from the manager
                    # to the workers by reference, never unpickled and pickled again here.
                    data_ref, metrics_ref = manager.generate_split.options(num_returns=2).remote(rollout_id)
                    metrics = dict(wait(metrics_ref, f"rollout {rollout_id} to generate"))
                    if not cfg.debug.debug_rollout_only:
                        t1 = time.perf_counter()
                        if c.offload_rollout:
                            wait(manager.offload.remote(), "the rollout engine to move to host memory")
                        if c.offload_train:
                            _each(workers, "onload", "the trainer to move back to the device")
                        results = wait([w.train.remote(data_ref, rollout_id) for w in workers], f"training on rollout {rollout_id}")
                        metrics.update(results[0])
                        metrics["perf/train_time"] = time.perf_counter() - t1
                    # Logged before the checkpoint: a run killed after its save has no unlogged training step.
                    tracker.log(metrics, step=step)
                    if cfg.ckpt.save and (step == d.num_rollout or (cfg.ckpt.save_interval and step % cfg.ckpt.save_interval == 0)):
                        _save(cfg, workers, manager, rollout_id)
                    after: dict[str, float] = {}
                    if not cfg.debug.debug_rollout_only:
                        if c.offload_rollout:
                            wait(manager.onload.remote(), "the rollout engine to move back to the device")
                        sync_time, sync_metrics = _update_weights(cfg, workers, manager, version=step)
                        after.update(sync_metrics, **{"perf/weight_sync_time": sync_time})
                        if c.offload_train:
                            _each(workers, "offload", "the trainer to move to host memory")
                    if _is_eval_step(cfg, step):
                        last_eval = wait(manager.eval.remote(step), f"eval after rollout {rollout_id}")
                        after.update(last_eval)
                        if not first_eval and start == 0:
                            first_eval = last_eval
                    after["perf/step_time"] = time.perf_counter() - t0
                    tracker.log(after, step=step)
                    print_step_summary(step, {**metrics, **after}, num_steps=d.num_rollout)
                    bar.advance(task)
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            plot = None
            with contextlib.suppress(Exception):
                from miles.tracking.plot import plot_curves

                plot = plot_curves(run_dir / "metrics.jsonl", run_dir / "curves.png")
            tracker.finish(status=status)
            if status == "FINISHED":  # stop the router and engine servers, if any, while the manager is idle
                with contextlib.suppress(Exception):
                    wait(manager.shutdown.remote(), "the rollout engines to stop", 60)
            # Otherwise (a signal, an error) the manager may be busy and would take this call only after
            # its current one: ray_session's end_hosted_actors kills it at once, its router follows
            # (PR_SET_PDEATHSIG) and Ray ends the engine server actors it owns.
        return RunResult(run_dir, d.num_rollout, first_eval, last_eval, plot, resumed_from)


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


def rollout_bundles(cfg: EngineConfig) -> int:
    """Placement bundles (devices) of the rollout engines: --rollout-num-gpus for engine servers (SGLang:
    its engines × --rollout-num-gpus-per-engine), 1 for the in-process engine."""
    if cfg.rollout.rollout_backend == "sglang":
        from miles.rollout.sglang.launch import engine_layout

        layout = engine_layout(cfg)
        return layout.num_engines * layout.gpus_per_engine
    return cfg.cluster.rollout_num_gpus or 1


def _engine_actor_options(cfg: EngineConfig, options: dict[str, Any], bundle_of, device: str) -> list[dict[str, Any]]:
    """Ray options of each engine server's actor: the bundle of its first device. An SGLang engine of
    N GPUs also gets "gpu_bundles" (its N bundles), whose GPU ids become its CUDA_VISIBLE_DEVICES.

    Colocated, engine device i shares bundle i with training rank i (see `placement`); on GPUs more
    engine devices than training GPUs is a user error (they would not be colocated)."""
    if cfg.rollout.rollout_backend == "sglang":
        from miles.rollout.sglang.launch import engine_layout

        layout = engine_layout(cfg)
        g, n = layout.gpus_per_engine, layout.num_engines
    else:
        g, n = 1, rollout_bundles(cfg)
    world = cfg.cluster.actor_num_nodes * cfg.cluster.actor_num_gpus_per_node
    if cfg.cluster.colocate and n * g > world:
        if device == "cuda":
            raise UserError(
                f"--colocate shares the {world} training GPUs with the rollout engines, and --rollout-num-gpus asks for "
                f"{n * g}; lower --rollout-num-gpus to at most {world} or drop --colocate.",
                option="--rollout-num-gpus",
            )
    if cfg.rollout.rollout_backend != "sglang":
        return [{**options, **bundle_of(("engine", i))} for i in range(n)]
    out = []
    for e in range(n):
        opts = {**options, **bundle_of(("engine", e * g))}
        if device == "cuda":
            opts["gpu_bundles"] = [bundle_of(("engine", e * g + k)) for k in range(g)]
        if layout.nodes_per_engine > 1:  # the first bundle of each other node of the engine
            opts["node_bundles"] = [{**options, **bundle_of(("engine", e * g + r * layout.gpus_per_node))} for r in range(1, layout.nodes_per_engine)]
        out.append(opts)
    return out


@contextlib.contextmanager
def placement(cfg: EngineConfig, world: int, device: str):
    """One PACK placement group, upstream's layout: colocated, max(ranks, engines) bundles with rank i
    and engine i sharing bundle i (each takes half); otherwise a bundle per rank, then one per engine.
    Yields `bundle_of(rank | "rollout" | ("engine", i)) -> actor options` and removes the group
    afterwards (a shared Ray cluster gets its resources back)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    unit = {"CPU": 1.0, **({"GPU": 1.0} if device == "cuda" else {})}
    engines = rollout_bundles(cfg)
    # Colocated, two engines must not share one rank's bundle: two halves fill it and the trainer
    # that takes the other half of that device would never be placed.
    n = max(world, engines) if cfg.cluster.colocate else world + engines
    group = ray.util.placement_group([dict(unit) for _ in range(n)], strategy="PACK")
    wait(group.ready(), f"a placement group of {n} bundles of {unit}", ACTOR_START_TIMEOUT_S)

    def bundle_of(who) -> dict[str, Any]:
        if who == "rollout" or isinstance(who, tuple):  # the in-process engine, or ("engine", i) = server i
            slot = who[1] if isinstance(who, tuple) else 0
            index = slot if cfg.cluster.colocate else world + slot
        else:
            index = who
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)}

    try:
        yield bundle_of
    finally:
        ray.util.remove_placement_group(group)


def torch_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _each(workers, method: str, what: str) -> None:
    wait([getattr(w, method).remote() for w in workers], what)


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


def _update_weights(cfg: EngineConfig, workers, manager, *, version: int) -> tuple[float, dict[str, float]]:
    """Seconds the whole update took, and what the trainer's source rank reported (bytes sent, send time)."""
    from miles.ray.weight_sync import sync_weights

    t0 = time.perf_counter()
    # The trainer ranks push the buckets to the engines; the driver only orders the three calls.
    sent = sync_weights(cfg, workers, manager, version=version, wait=wait)
    if cfg.debug.check_weight_update_equal:
        sums = wait([w.weights_checksum.remote() for w in workers] + [manager.weights_checksum.remote()], "weight checksums")
        trainer_sum, engine_sum = sums[0], sums[-1]
        if trainer_sum != engine_sum:
            raise StepFailed(
                f"--check-weight-update-equal: after the weight update to version {version} the rollout engine's "
                f"weights (sha256 {engine_sum[:12]}) differ from the trainer's ({trainer_sum[:12]})"
            )
    return time.perf_counter() - t0, dict(sent or {})


def _save(cfg: EngineConfig, workers, manager, rollout_id: int) -> None:
    """Every training rank writes its own shard into a temporary directory; the driver adds its own
    data and commits (rename + tracker) only after every rank returned."""
    from miles.ckpt.trainer_checkpoint import begin_checkpoint, commit_checkpoint

    manager_state = wait(manager.state_dict.remote(), "the data position")
    tmp = begin_checkpoint(cfg.ckpt.save, rollout_id)
    wait([w.save_checkpoint.remote(str(tmp)) for w in workers], f"the training workers to write their checkpoint shards into {tmp}")
    commit_checkpoint(
        cfg.ckpt.save,
        rollout_id,
        tmp,
        {"rollout_manager": manager_state, "rollout_id": rollout_id},
        keep_last=cfg.ckpt.keep_last_checkpoints,
    )
    if cfg.ckpt.save_hf:
        wait([w.export_hf.remote(cfg.ckpt.save_hf.format(rollout_id=rollout_id)) for w in workers], "the Hugging Face export")
