"""Weight sync, trainer ranks -> rollout engines, bucket by bucket; the driver only orders it.

    driver:          targets = manager.begin_weight_update()      # engines paused, flushed, in a session
                     every trainer rank: push_weights(targets, v)  # the bytes: source rank -> engines
                     manager.end_weight_update(v)                  # version set, restarted engines join
                                                                   # the router, generation continues

Every trainer rank iterates the weight buckets (a collective once TP/PP shards are gathered); only
the source rank sends. The paths:

- `in_process`: the in-process engine (inside the rollout manager actor). Each bucket goes from the
  source rank to the manager as a Ray object (worker -> manager, never via the driver).
- `tensor` (--update-weight-transfer-mode tensor): engine servers on the source rank's host. Per
  bucket the source POSTs handles to a copy of it in shared memory (CUDA IPC on a GPU) to every
  engine's `/update_weights_from_tensor`, then one cache flush
  (`miles.rollout.engine.weight_transport.TensorSender`).
- `broadcast`: engine servers. A gloo group between the source rank and every engine
  (`miles.rollout.engine.weight_transport.BroadcastSender`), kept across updates and rebuilt when
  the set of engines changes (a restarted engine has a new address).
- `disk`: engine servers. The source rank writes one safetensors shard per bucket under the run
  directory, then every engine loads the directory.

`trainer_weight_buckets` is the one place that knows how a trainer yields its weights.
"""

from __future__ import annotations

import time
from typing import Any, Iterator


def trainer_weight_buckets(backend, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """HF-named weight buckets of at most `bucket_bytes` from one trainer rank: the backend's
    `iter_weight_buckets`, a collective every rank iterates to the end (TP/PP/EP gathers)."""
    return backend.iter_weight_buckets(bucket_bytes)


def is_weight_source(worker) -> bool:
    """Whether this rank sends the weights (`TrainerBackend.is_weight_source`)."""
    return worker.backend.is_weight_source


def push_weights(worker, targets: dict[str, Any], version: int) -> dict[str, float]:
    """Run on every trainer rank (TrainWorker.push_weights): iterate the buckets, send from the source."""
    import ray

    buckets = trainer_weight_buckets(worker.backend, targets["bucket_bytes"])
    if not is_weight_source(worker):
        for _ in buckets:  # take part in the collective, send nothing
            pass
        return {}
    t0 = time.perf_counter()
    sent = 0
    mode = targets["mode"]
    if mode == "in_process":
        manager = targets["manager"]
        for bucket in buckets:
            bucket = [(name, t.detach().cpu()) for name, t in bucket]
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            # One bucket in flight at a time: --update-weight-buffer-size bounds the memory it costs.
            ray.get(manager.load_weight_bucket.remote(bucket), timeout=600)
    elif mode == "tensor":
        sender = _tensor_sender(worker, targets["urls"], targets.get("tp_sizes"))
        for bucket in buckets:
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            sender.send_bucket(bucket, weight_version=version)
        sender.finish()
    elif mode == "broadcast":
        sender = _broadcast_sender(worker, targets["urls"])
        for bucket in buckets:
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            sender.send_bucket(bucket, weight_version=version)
    elif mode == "disk":
        from miles.rollout.engine.weight_transport import DiskSender

        sender = DiskSender(targets["urls"], targets["disk_dir"], targets.get("hf_checkpoint"))
        try:
            for bucket in buckets:
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                sender.send_bucket(bucket)
            sender.finish(version)
        finally:
            sender.close()
    else:
        raise ValueError(f"unknown weight transfer mode {mode!r}")
    return {"perf/weight_sync_bytes": float(sent), "perf/weight_sync_send_time": time.perf_counter() - t0}


def _tensor_sender(worker, urls: list[str], tp_sizes: list[int] | None):
    """Kept across updates (its bucket buffer is reused); rebuilt when the set of engines changes."""
    from miles.rollout.engine.weight_transport import TensorSender

    sender = getattr(worker, "_tensor_sender", None)
    if sender is not None and (sender.urls, sender.tp_sizes) != (list(urls), list(tp_sizes or [1] * len(urls))):
        sender.close()
        sender = None
    if sender is None:
        sender = worker._tensor_sender = TensorSender(urls, tp_sizes=tp_sizes)
    return sender


def _broadcast_sender(worker, urls: list[str]):
    from miles.rollout.engine.weight_transport import BroadcastSender

    sender = getattr(worker, "_weight_sender", None)
    if sender is not None and sender.urls != list(urls):
        sender.close()  # an engine was restarted (new address): rebuild the group
        sender = None
    if sender is None:
        sender = BroadcastSender(urls)
        sender.connect()
        worker._weight_sender = sender
    return sender


def sync_weights(cfg, workers, manager, *, version: int, wait) -> dict[str, float]:
    """The driver's part: three calls, no tensors. `wait` is the driver's ray.get with a timeout.

    If an engine dies during the update, the rollout manager finds it: without fault tolerance that
    stops the run with a sentence naming the engine; with it the engine is restarted and the whole
    update runs again (the restarted engine included)."""
    try:
        return _sync_once(cfg, workers, manager, version=version, wait=wait)
    except Exception:
        if not wait(manager.recover_engines.remote(), "the rollout manager to check the engines after a failed weight update"):
            raise
    return _sync_once(cfg, workers, manager, version=version, wait=wait)


def _sync_once(cfg, workers, manager, *, version: int, wait) -> dict[str, float]:
    targets = wait(manager.begin_weight_update.remote(), "the rollout engines to pause for a weight update")
    targets["bucket_bytes"] = cfg.rollout.update_weight_buffer_size
    if targets["mode"] == "in_process":
        targets["manager"] = manager
    results = wait(
        [w.push_weights.remote(targets, version) for w in workers],
        f"the trainer ranks to send weights (version {version}) to {len(targets.get('urls') or [1])} engine(s)",
    )
    wait(manager.end_weight_update.remote(version), "the rollout engines to finish the weight update")
    return next((r for r in results if r), {})
