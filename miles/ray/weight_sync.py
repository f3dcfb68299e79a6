"""Weight sync, trainer ranks -> rollout engines, bucket by bucket; the driver only orders it.

    driver:          targets = manager.begin_weight_update()       # engines paused, flushed, in a session
                     every trainer rank: push_weights(SyncOrder)    # the bytes: trainer -> engines
                     manager.end_weight_update(v)                   # version set, restarted engines join
                                                                    # the router, generation continues

    in-process engine, from the second sync on (the first showed the engine is in-process):
    driver:          every trainer rank: push_weights(SyncOrder)    # the source's first bucket call pauses
                                                                    # and opens, its last one closes at v
    and in the synchronous loop without offload that order rides on the train call itself
    (`order_with_train`: every trainer rank: train(data, push=SyncOrder)), so a sync adds no driver call.

`begin_weight_update` answers a typed `WeightTargets` (miles.rollout.engine.weight_transport: broadcast,
tensor, disk; `InProcessTargets` here for the engine inside the rollout manager actor). Each train
worker owns one `WeightPusher`, which keeps the sender of the last sync while the targets stay equal (a
broadcast group and a tensor buffer outlive a sync; an engine restarted at a new address makes new
targets, so a new group). Every trainer rank iterates the weight buckets (a collective once TP/PP
shards are gathered); the source rank sends, except for a tensor sync on GPUs, where every rank hands
the source a CUDA IPC handle to its own copy and each engine TP rank opens the one on its GPU.

`in_process`: each bucket goes from the source rank to the manager (worker -> manager, never via the
driver), one bucket in flight at a time (--update-weight-buffer-size bounds its memory): on one node as
places in a shared-memory buffer the source keeps and the manager keeps mapped (`InProcessSender`),
sent over the manager's local socket (`BucketChannel`) rather than as a Ray call; across nodes as a
Ray object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import struct
import threading
import time
from typing import Any, Callable, ClassVar, Iterator

from miles.rollout.engine.weight_transport import TensorSender, TensorTargets, WeightSender, WeightTargets

# How long the source rank waits for the rollout manager to load one in-process bucket.
IN_PROCESS_BUCKET_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class InProcessTargets(WeightTargets):
    """The in-process engine, inside the rollout manager actor (`manager`, a Ray actor handle, on the
    Ray node `node_id`; "" when unknown). `session`: the sender opens and closes the engine's update
    session itself, inside its first and last bucket's call (the driver then makes one call, not three)."""

    keep_sender: ClassVar[bool] = True  # its shared-memory buffer is reused sync after sync

    manager: Any = None
    node_id: str = ""
    session: bool = False
    address: str = ""  # the manager's `BucketChannel` (same node: buckets skip the Ray call); "" without one

    def open_sender(self) -> "InProcessSender":
        return InProcessSender(self)

    def describe(self) -> str:
        return "the in-process engine"


def current_node_id() -> str:
    """This process's Ray node id ("" outside a Ray worker or driver)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # no runtime context (a plain process): never on the same node as anything
        return ""


class InProcessSender(WeightSender):
    """Buckets to the rollout manager's in-process engine.

    On the manager's own node (every local run) each bucket is copied once into a shared-memory
    segment this sender keeps and reuses (a `SharedSegment`, a memfd: no `torch_shm_manager` runs), and
    the manager gets where each tensor lies in it (a `SharedBucket`, `miles.rollout.engine.tensor_ipc`):
    it maps the segment once for the run, keeps its views and copies from them into its parameters.
    Sent as tensors, a 0.5 MB bucket through Ray's object store took ~15 ms (pickling each torch tensor, a
    plasma put and get) against ~1.5 ms for a call with a small argument. On another node the bucket
    goes as tensors through the object store.

    With `targets.session` each bucket is sent once the next one (or the end) is known, so the first
    bucket's call also pauses the engine and opens its update session and the last one's also closes it
    at the new version: one trainer -> manager message per bucket and nothing else (the source holds at
    most two buckets, the one sent and the next). On the manager's node that message goes over its
    `BucketChannel` when the targets name one (`address`), else as a Ray call."""

    def __init__(self, targets: InProcessTargets):
        if targets.manager is None:
            raise ValueError("in-process weight targets need the rollout manager's handle")
        self.targets = targets
        self.by_handle = bool(targets.node_id) and targets.node_id == current_node_id()
        self._segment = None  # the SharedSegment (a memfd), grown to the largest bucket
        self._held: list | None = None  # session: the bucket waiting for the next one (or the end)
        self._opened = False
        self._channel: socket.socket | None = None  # to the manager's BucketChannel, kept across syncs

    def begin(self, version: int) -> None:
        self._held, self._opened = None, False

    def send_bucket(self, bucket, version: int) -> None:
        if not self.targets.session:
            self._load(bucket)
            return
        if self._held is not None:
            self._load(self._held, opens=not self._opened)
            self._opened = True
        self._held = bucket

    def finish(self, version: int) -> None:
        if self.targets.session and self._held is not None:
            held, self._held = self._held, None
            self._load(held, opens=not self._opened, closes_at=version)

    def _load(self, bucket, *, opens: bool = False, closes_at: int | None = None) -> None:
        import ray

        bucket = [(name, t.detach().cpu()) for name, t in bucket]
        if self.by_handle:
            from miles.rollout.engine.tensor_ipc import SharedSegment, bucket_nbytes, flatten_bucket, shared_bucket

            # The manager maps this segment once and keeps its views (SharedBucketReader): a sync sends
            # only where each tensor lies, and the copy into the segment is what the engine then reads.
            need = bucket_nbytes(bucket)
            if self._segment is None or self._segment.size < need:
                self._segment = SharedSegment(need)
            _, views = flatten_bucket(bucket, self._segment.flat)
            bucket = shared_bucket(self._segment, views)
            if self.targets.address:
                self._send_local(bucket, opens, closes_at)
                return
        call = self.targets.manager.load_weight_bucket.remote(bucket, opens=opens, closes_at=closes_at)
        ray.get(call, timeout=IN_PROCESS_BUCKET_TIMEOUT_S)

    def _send_local(self, bucket, opens: bool, closes_at: int | None) -> None:
        """One bucket over the manager's `BucketChannel`: its answer is None or the error it raised."""
        if self._channel is None:
            self._channel = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._channel.settimeout(IN_PROCESS_BUCKET_TIMEOUT_S)
            self._channel.connect(self.targets.address)
        _send_frame(self._channel, {"bucket": _bucket_json(bucket), "opens": opens, "closes_at": closes_at})
        error = _recv_frame(self._channel)
        if error:
            raise RuntimeError(f"the rollout manager could not load a weight bucket: {error}")

    def close(self) -> None:
        self._segment, self._held = None, None
        if self._channel is not None:
            self._channel.close()
            self._channel = None


# -- the local bucket channel: trainer rank -> rollout manager on one node, without a Ray call --------
# A Ray actor call and its answer took 1.5-2 ms each way on the loaded 2-core machine, most of what
# was left of a sync of a small model; a Unix socket between the two processes takes a few tens of µs.
# Frames are a 4-byte length and JSON (never pickle: the socket is local, but its peer is checked and
# its data only describes a shared-memory bucket).


def _bucket_json(bucket) -> dict:
    return {"path": bucket.path, "name": bucket.name, "size": bucket.size, "entries": bucket.entries}


def _bucket_from_json(d: dict):
    from miles.rollout.engine.tensor_ipc import SharedBucket

    entries = tuple((name, dtype, tuple(shape), int(offset)) for name, dtype, shape, offset in d["entries"])
    return SharedBucket(str(d["path"]), str(d["name"]), int(d["size"]), entries)


def _send_frame(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> Any:
    head = _recv_exact(sock, 4)
    if head is None:
        raise ConnectionError("the weight channel's peer went away")
    body = _recv_exact(sock, struct.unpack("!I", head)[0])
    if body is None:
        raise ConnectionError("the weight channel's peer went away mid-message")
    return json.loads(body)


class BucketChannel:
    """The rollout manager's end: a Unix socket in Linux's abstract namespace (nothing on disk to clean
    up) and a daemon thread per connected trainer rank that loads each `SharedBucket` it is sent with
    `load(bucket, opens=, closes_at=)` (`RolloutManager.load_weight_bucket`) and answers None or the
    error. Only processes of this user may connect (SO_PEERCRED). One bucket loads at a time."""

    def __init__(self, load: Callable[..., None]):
        self._load = load
        self._lock = threading.Lock()
        self.address = f"\0miles-weights-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(8)
        threading.Thread(target=self._accept, name="miles-weight-channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="miles-weight-bucket", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    msg = _recv_frame(conn)
                except (ConnectionError, OSError):
                    return
                try:
                    with self._lock:
                        self._load(_bucket_from_json(msg["bucket"]), opens=bool(msg["opens"]), closes_at=msg["closes_at"])
                    error = None
                except Exception as e:  # noqa: BLE001 - the sender raises it, naming what failed
                    error = f"{type(e).__name__}: {e}"
                try:
                    _send_frame(conn, error)
                except OSError:
                    return

    def close(self) -> None:
        self._sock.close()


@dataclasses.dataclass(frozen=True)
class SyncOrder:
    """What the driver hands every trainer rank: where to, which version, how big a bucket."""

    targets: WeightTargets
    version: int
    bucket_bytes: int


def trainer_weight_buckets(backend, bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """HF-named weight buckets of at most `bucket_bytes` from one trainer rank: the backend's
    `iter_weight_buckets`, a collective every rank iterates to the end (TP/PP/EP gathers)."""
    return backend.iter_weight_buckets(bucket_bytes)


def _gathers_handles(targets: WeightTargets, bucket) -> bool:
    """A tensor sync of CUDA tensors to engines whose TP ranks' GPUs are known: every rank's handle."""
    return isinstance(targets, TensorTargets) and bucket[0][1].is_cuda and any(e.gpu_ranks for e in targets.engines)


class WeightPusher:
    """A train worker's end of the weight sync (one per worker, kept across syncs)."""

    def __init__(self):
        self.sender: WeightSender | None = None

    def _sender_for(self, targets: WeightTargets) -> WeightSender:
        if self.sender is not None and self.sender.targets != targets:
            self.sender.close()  # other engines (a restart has a new address): a new group
            self.sender = None
        if self.sender is None:
            self.sender = targets.open_sender()
        return self.sender

    def push(self, backend, order: SyncOrder) -> dict[str, float]:
        """Run on every trainer rank: iterate the buckets, send from the source."""
        buckets = trainer_weight_buckets(backend, order.bucket_bytes)
        source = backend.is_weight_source
        t0 = time.perf_counter()
        sent = 0
        sender: WeightSender | None = None
        try:
            for bucket in buckets:
                if not bucket:
                    continue
                if _gathers_handles(order.targets, bucket):
                    sender = self._sender_for(order.targets)
                    self._send_gathered(sender, bucket, order.version, source)
                elif source:
                    if sender is None:
                        sender = self._sender_for(order.targets)
                        sender.begin(order.version)
                    sender.send_bucket(bucket, order.version)
                # other ranks take part in the collective and send nothing
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
            if sender is not None and source:
                sender.finish(order.version)
        finally:
            if sender is not None and not order.targets.keep_sender:
                sender.close()
                self.sender = None
        if not source:
            return {}
        return {"perf/weight_sync_bytes": float(sent), "perf/weight_sync_send_time": time.perf_counter() - t0}

    @staticmethod
    def _send_gathered(sender: TensorSender, bucket, version: int, source: bool) -> None:
        """Every rank copies the bucket on its own GPU and hands the source a handle; the source posts
        each engine TP rank the handle from its GPU; all keep their copy until the engines answered."""
        import torch.distributed as dist

        from miles.rollout.engine.tensor_ipc import serialize_bucket

        handle = serialize_bucket(sender.views(bucket))
        gathered = [None] * dist.get_world_size() if source else None
        dist.gather_object(handle, gathered, dst=0)
        try:
            if source:
                sender.send_bucket(bucket, version, by_rank=gathered)
        finally:
            dist.barrier()  # the buffers stay alive until every engine has copied out of them


def sync_weights(cfg, workers, manager, *, version: int, wait) -> dict[str, float]:
    """The driver's part: three calls, no tensors (one, to the trainer ranks, once an in-process engine is
    known: its sender opens and closes the update session). `wait` is the driver's ray.get with a timeout.

    If an engine dies during the update, the rollout manager finds it: without fault tolerance that
    stops the run with a sentence naming the engine; with it the engine is restarted and the whole
    update runs again (the restarted engine included)."""
    try:
        return _sync_once(cfg, workers, manager, version=version, wait=wait)
    except Exception:
        if not wait(manager.recover_engines.remote(), "the rollout manager to check the engines after a failed weight update"):
            raise
    return _sync_once(cfg, workers, manager, version=version, wait=wait)


# The rollout manager actors whose engine is in-process (actor id -> targets with `session` set): the
# first sync learns it from `begin_weight_update`; later ones make one call to the trainer ranks.
_IN_PROCESS: dict[str, InProcessTargets] = {}


def _manager_key(manager) -> str:
    return manager._actor_id.hex() if hasattr(manager, "_actor_id") else ""


def order_with_train(cfg, manager, *, version: int) -> SyncOrder | None:
    """The sync the trainer ranks run at the end of their train call (`TrainWorker.train(push=...)`),
    once the sync is that one call to them anyway: the manager's engine is in-process and known from
    an earlier sync (None otherwise: the driver runs `sync_weights` after the train call). It saves the
    driver -> trainer -> driver round trip of a separate call, a third of a sync of a small model."""
    known = _IN_PROCESS.get(_manager_key(manager))
    return None if known is None else SyncOrder(known, version, cfg.rollout.update_weight_buffer_size)


def _sync_once(cfg, workers, manager, *, version: int, wait) -> dict[str, float]:
    key = _manager_key(manager)
    known = _IN_PROCESS.get(key)
    if known is not None:  # the sender opens and closes the session inside its own calls
        order = SyncOrder(known, version, cfg.rollout.update_weight_buffer_size)
        results = wait([w.push_weights.remote(order) for w in workers],
                       f"the trainer ranks to send weights (version {version}) to {known.describe()}")
        return next((r for r in results if r), {})
    targets = wait(manager.begin_weight_update.remote(), "the rollout engines to pause for a weight update")
    if isinstance(targets, InProcessTargets):
        targets = dataclasses.replace(targets, manager=manager)
        if key:
            _IN_PROCESS[key] = dataclasses.replace(targets, session=True)
    order = SyncOrder(targets, version, cfg.rollout.update_weight_buffer_size)
    results = wait(
        [w.push_weights.remote(order) for w in workers],
        f"the trainer ranks to send weights (version {version}) to {targets.describe()}",
    )
    wait(manager.end_weight_update.remote(version), "the rollout engines to finish the weight update")
    return next((r for r in results if r), {})
