"""Weight transport between the trainer's source rank and engine servers, both ends, typed.

Where the weights go is a `WeightTargets` value (one dataclass per transport, each listing its engines
as `EngineTarget(url, tp_size, gpu_ranks)`); `targets.open_sender()` gives the `WeightSender` of that
transport. One sync is `begin(version)`, `send_bucket(bucket, version)` per bucket, `finish(version)`;
a sender is kept across syncs while the targets stay equal (`close()` when they change).

SGLang's three paths, as the built-in engine server implements them (the in-process engine takes
tensors by `RolloutEngine.update_weights_from_tensors`; its sender lives in miles/ray/weight_sync.py):

- **broadcast** (`BroadcastTargets`; SGLang's `init_weights_update_group` +
  `update_weights_from_distributed`): the source rank and every engine TP rank form their own group,
  separate from the training world: world = 1 + Σ engine TP sizes, rank 0 = source, engine i's TP
  rank r = 1 + Σ_{j<i} tp_j + r (SGLang joins TP rank r as `rank_offset + r`). NCCL when the weights
  are CUDA tensors (sent from the GPU, no host copy), gloo when they are CPU tensors. Per bucket the
  source POSTs the bucket's names/dtypes/shapes to every engine *first*, then broadcasts each tensor
  in that order; each engine receives into fresh tensors and copies them into its model.
- **disk** (`DiskTargets`; SGLang's `update_weights_from_disk`): the source writes each bucket as one
  safetensors shard (plus the model's config files, so the directory is a loadable HF checkpoint),
  then every engine loads the directory.
- **tensor** (`TensorTargets`; SGLang's `update_weights_from_tensor`, its colocated path): per bucket
  the source copies the tensors into one reused buffer and POSTs *handles* to it (CUDA IPC on a GPU,
  a shared-memory segment on a CPU; `miles.rollout.engine.tensor_ipc`), one payload per engine TP
  rank, with `flush_cache: false`; one `/flush_cache` after the last bucket. On a GPU each TP rank's
  payload is the handle from the training rank on that TP rank's GPU (`EngineTarget.gpu_ranks`,
  gathered by the caller, `engine_payloads`); on a CPU every TP rank maps the source's one segment.

Either way the driver process only says "update to version v"; the bytes go trainer -> engines.

    targets = BroadcastTargets((EngineTarget("http://127.0.0.1:31001", tp_size=2), ...))
    sender = targets.open_sender()
    sender.begin(v); [sender.send_bucket(b, v) for b in buckets]; sender.finish(v)
    # engine side: miles.rollout.engine.server routes the HTTP calls to a WeightReceiver
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import datetime
import json
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from miles.utils.net import free_port

if TYPE_CHECKING:
    import torch

    from miles.rollout.engine.builtin import BuiltinEngine

# torch is imported inside the functions that compute: the run's driver imports this module (the
# targets it orders a sync by) and, without it, imports no torch (docs/benchmarks.md, memory).

GROUP_NAME = "miles_weight_sync"
GROUP_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 600.0
# Files copied next to the shards so the directory is a complete HF checkpoint (a real SGLang
# engine's update_weights_from_disk reads config and tokenizer from model_path too).
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def group_backend(device: torch.device | str) -> str:
    """The collective backend for weights on `device`: NCCL for CUDA tensors, gloo for CPU ones."""
    import torch

    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float, backend: str = "gloo"
):
    """A process group of its own (not the default world), with the store keys torch gives a named group
    and SGLang's `init_weights_update_group` gives its end: a `tcp://` rendezvous, then the prefixes
    "<group>", "<group>/" and "<first device of the backend>/" ("cpu/" for gloo, "cuda/" for NCCL).
    With other keys a real SGLang server would wait for its peers forever. The group is not registered
    with torch.distributed, so both ends (and several simulated TP ranks) may share a process.
    Returns (the backend's process group, the store that must stay alive with it)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, BackendConfig, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    device = next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts), store
    if backend != "gloo":
        raise ValueError(f"weight groups run over gloo or nccl, not {backend!r}")
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), store


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


# ---------------------------------------------------------------------------------------------- targets
@dataclasses.dataclass(frozen=True)
class EngineTarget:
    """One engine server: its URL, its TP size, and for colocated tensor syncs on a GPU the training
    rank that shares each of its TP ranks' GPU (empty when unknown or not colocated)."""

    url: str
    tp_size: int = 1
    gpu_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"engine {self.url}: tp_size must be >= 1, not {self.tp_size}")
        if self.gpu_ranks and len(self.gpu_ranks) != self.tp_size:
            raise ValueError(f"engine {self.url}: {len(self.gpu_ranks)} gpu_ranks for {self.tp_size} TP ranks")


@dataclasses.dataclass(frozen=True)
class WeightTargets(abc.ABC):
    """Where one sync sends the weights. Equal targets reuse the sender of the last sync."""

    # Whether the sender outlives a sync (a group or a buffer worth keeping) or is closed after it.
    keep_sender: ClassVar[bool] = True

    engines: tuple[EngineTarget, ...] = ()

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @abc.abstractmethod
    def open_sender(self) -> "WeightSender":
        """The sender of this transport, for these engines."""

    def describe(self) -> str:
        return f"{len(self.engines)} engine(s)"


@dataclasses.dataclass(frozen=True)
class BroadcastTargets(WeightTargets):
    group_name: str = GROUP_NAME
    timeout_s: float = GROUP_TIMEOUT_S

    def open_sender(self) -> "BroadcastSender":
        return BroadcastSender(self)


@dataclasses.dataclass(frozen=True)
class TensorTargets(WeightTargets):
    timeout_s: float = HTTP_TIMEOUT_S

    def open_sender(self) -> "TensorSender":
        return TensorSender(self)


@dataclasses.dataclass(frozen=True)
class DiskTargets(WeightTargets):
    keep_sender: ClassVar[bool] = False  # a disk sync leaves no shards behind

    directory: str = "weight_sync"
    hf_checkpoint: str | None = None

    def open_sender(self) -> "DiskSender":
        return DiskSender(self)


# --update-weight-transfer-mode -> the targets of that transport (the in-process engine has its own).
TRANSPORTS: dict[str, type[WeightTargets]] = {"broadcast": BroadcastTargets, "tensor": TensorTargets, "disk": DiskTargets}


def transport_targets(mode: str, engines: tuple[EngineTarget, ...], *, disk_dir: str, hf_checkpoint: str | None) -> WeightTargets:
    """The targets `--update-weight-transfer-mode` names, for these engine servers."""
    if mode not in TRANSPORTS:
        raise ValueError(f"unknown weight transfer mode {mode!r} (one of {', '.join(TRANSPORTS)})")
    if TRANSPORTS[mode] is DiskTargets:
        return DiskTargets(engines, directory=disk_dir, hf_checkpoint=hf_checkpoint)
    return TRANSPORTS[mode](engines)


def engines_of(urls: list[str], tp_sizes: list[int] | None = None) -> tuple[EngineTarget, ...]:
    """`EngineTarget`s for URLs (TP size 1 unless given), in order."""
    tp_sizes = list(tp_sizes) if tp_sizes is not None else [1] * len(urls)
    if len(tp_sizes) != len(urls):
        raise ValueError(f"{len(tp_sizes)} TP sizes for {len(urls)} engines")
    return tuple(EngineTarget(u, tp) for u, tp in zip(urls, tp_sizes))


def rank_offsets(engines: tuple[EngineTarget, ...] | list[EngineTarget]) -> tuple[int, list[int]]:
    """(world size, each engine's `rank_offset`) of a broadcast group: rank 0 is the source, engine i's
    TP ranks follow the TP ranks of the engines before it."""
    offsets, next_rank = [], 1
    for e in engines:
        offsets.append(next_rank)
        next_rank += e.tp_size
    return next_rank, offsets


# ---------------------------------------------------------------------------------------------- senders
class WeightSender(abc.ABC):
    """The trainer's end of one transport. Per sync: `begin`, `send_bucket` per bucket, `finish`."""

    targets: WeightTargets

    def begin(self, version: int) -> None:
        """Before the first bucket of a sync."""

    @abc.abstractmethod
    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        """One bucket of (HF name, full tensor) to every engine."""

    def finish(self, version: int) -> None:
        """After the last bucket: whatever makes the engines use what they were sent."""

    def close(self) -> None:
        """Release what the sender holds (its group, its buffer, its files)."""


def _post(url: str, path: str, body: dict[str, Any], timeout: float = HTTP_TIMEOUT_S) -> Any:
    import requests

    r = requests.post(f"{url}{path}", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url}{path} answered HTTP {r.status_code}: {r.text[:300]}")
    data = r.json() if r.content else None
    if isinstance(data, dict) and data.get("success") is False:
        raise RuntimeError(f"{url}{path} failed: {data.get('message')}")
    return data


def address_toward(host: str) -> str:
    """This host's address on the route to `host` (what a process there reaches this one by); no
    packet is sent (a UDP socket is only connected)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def group_master_address(engine_urls: list[str]) -> str:
    """The address engines use to reach the sender's rendezvous store: loopback when every engine is on
    this host, else this host's address on the route to the first engine elsewhere (engines on other
    nodes cannot reach 127.0.0.1; the route's address is one they can, whatever the hostname says)."""
    from urllib.parse import urlparse

    far = [h for h in (urlparse(u).hostname for u in engine_urls) if h not in _LOOPBACK]
    return address_toward(far[0]) if far else "127.0.0.1"


def is_local_engine(url: str) -> bool:
    """Whether the engine at `url` runs on this host (loopback, or an address of this host's own)."""
    from urllib.parse import urlparse

    host = urlparse(url).hostname
    if host in _LOOPBACK:
        return True
    try:
        return address_toward(host) == host
    except OSError:  # no route: not here
        return False


class BroadcastSender(WeightSender):
    """The source rank's end of the broadcast path (one group with every engine TP rank), kept across
    syncs. The group is formed at the first bucket, over the backend its tensors need."""

    def __init__(self, targets: BroadcastTargets):
        self.targets = targets
        self.urls = targets.urls
        self.group = None
        self.backend: str | None = None
        self._store = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.urls)))

    def connect(self, device: torch.device | str = "cpu") -> None:
        """Rendezvous: engines are asked to join first (without waiting), then rank 0 joins, then wait."""
        t = self.targets
        backend = group_backend(device)
        port = free_port()
        world, offsets = rank_offsets(t.engines)
        master = group_master_address(self.urls)
        calls = [
            self._pool.submit(
                _post, e.url, "/init_weights_update_group",
                {"master_address": master, "master_port": port, "rank_offset": offset, "world_size": world,
                 "group_name": t.group_name, "backend": backend, "timeout": t.timeout_s},
            )
            for e, offset in zip(t.engines, offsets)
        ]  # fmt: skip
        self.group, self._store = make_group(master, port, 0, world, t.group_name, t.timeout_s, backend)
        self.backend = backend
        _wait(calls, f"{len(self.urls)} engine(s) ({world - 1} TP ranks) to join the {backend} weight update group", t.timeout_s)

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        if not bucket:
            return
        device = bucket[0][1].device
        if self.group is None or self.backend != group_backend(device):
            self._destroy()
            self.connect(device)
        # CUDA tensors go from the GPU over NCCL; only CPU tensors (gloo) stay on the host.
        tensors = [t.detach().contiguous() for _, t in bucket]
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self.targets.group_name,
            "flush_cache": False,
        }
        if version is not None:
            body["weight_version"] = str(version)  # SGLang's field is a string
        calls = [self._pool.submit(_post, url, "/update_weights_from_distributed", body) for url in self.urls]
        for t in tensors:  # same order as the names the engines were given
            _broadcast(self.group, t)
        _wait(calls, f"{len(self.urls)} engine(s) to load a weight bucket of {len(tensors)} tensors", self.targets.timeout_s)

    def _destroy(self) -> None:
        if self.group is None:
            return
        for url in self.urls:
            try:
                _post(url, "/destroy_weights_update_group", {"group_name": self.targets.group_name}, timeout=30)
            except Exception:  # noqa: BLE001 - a dead engine has no group to destroy
                pass
        self.group = self._store = None

    def close(self) -> None:
        self._destroy()
        self._pool.shutdown(wait=False)


def engine_payloads(engines: tuple[EngineTarget, ...], by_rank: list[str | None]) -> list[list[str]]:
    """Per engine, one payload per TP rank (SGLang's TP rank r opens entry r), each the payload of the
    training rank on that TP rank's GPU (`EngineTarget.gpu_ranks`; `by_rank[i]` is training rank i's
    handle to its own GPU copy of the bucket, CUDA IPC)."""
    out = []
    for e in engines:
        if not e.gpu_ranks:
            raise RuntimeError(f"engine {e.url}: which training rank shares each of its {e.tp_size} TP ranks' GPU is not known")
        missing = [r for r in e.gpu_ranks if r >= len(by_rank) or by_rank[r] is None]
        if missing:
            raise RuntimeError(f"engine {e.url}: training rank {missing[0]} (on its TP rank's GPU) sent no copy of the bucket")
        out.append([by_rank[r] for r in e.gpu_ranks])
    return out


class TensorSender(WeightSender):
    """The source rank's end of the tensor path: handles to each bucket, one payload per engine TP rank.

    Every engine must be on this host. On a CPU every payload points at the source's one buffer (any
    process of the host maps it); on a GPU the caller gathers each training rank's handle (`by_rank`),
    so every TP rank opens the copy on its own GPU."""

    def __init__(self, targets: TensorTargets):
        self.targets = targets
        self.urls = targets.urls
        far = [u for u in self.urls if not is_local_engine(u)]
        if far:
            raise RuntimeError(
                f"--update-weight-transfer-mode tensor hands the trainer's memory to engines on its own host, and "
                f"engine {far[0]} is on another one; use --update-weight-transfer-mode broadcast"
            )
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.urls)))
        self._cuda = False
        # One bucket-sized buffer, reused bucket after bucket and sync after sync (the engines have
        # copied out of it when their call returns); it grows to the largest bucket.
        self._buffer: torch.Tensor | None = None

    def views(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`bucket` copied into the reused buffer: (name, view) pairs to serialise handles of."""
        from miles.rollout.engine.tensor_ipc import flatten_bucket

        self._cuda = self._cuda or bucket[0][1].is_cuda
        self._buffer, views = flatten_bucket(bucket, self._buffer)
        return views

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int | None = None, *, by_rank: list[str] | None = None) -> None:
        """`by_rank`: every training rank's payload of this bucket (its own GPU copy), gathered by the
        caller; without it (a CPU, or one TP-1 engine on the source's GPU) the source's own copy."""
        from miles.rollout.engine.tensor_ipc import serialize_bucket

        if not bucket:
            return
        engines = self.targets.engines
        if by_rank is not None:
            payloads = engine_payloads(engines, by_rank)
        else:
            if bucket[0][1].is_cuda and (len(engines) > 1 or engines[0].tp_size > 1):
                raise RuntimeError(
                    "--update-weight-transfer-mode tensor on a GPU needs each engine TP rank's handle from the training rank "
                    "on its GPU, and this sync has only the source rank's; use --update-weight-transfer-mode broadcast"
                )
            views = self.views(bucket)
            # One pickle per TP rank: each consumer releases the references its own payload holds.
            payloads = [[serialize_bucket(views) for _ in range(e.tp_size)] for e in engines]
        body = {"load_format": None, "flush_cache": False}
        if version is not None:
            body["weight_version"] = str(version)  # SGLang's field is a string
        calls = [
            self._pool.submit(_post, url, "/update_weights_from_tensor", {**body, "serialized_named_tensors": p}, self.targets.timeout_s)
            for url, p in zip(self.urls, payloads)
        ]
        _wait(calls, f"{len(self.urls)} engine(s) to load a weight bucket of {len(bucket)} tensors by handle", self.targets.timeout_s)

    def finish(self, version: int | None = None) -> None:
        """One cache flush per engine after the last bucket (the buckets were sent with flush_cache false)."""
        from miles.rollout.engine.http_client import HttpEngine

        calls = [self._pool.submit(HttpEngine(url).flush_cache) for url in self.urls]
        _wait(calls, f"{len(self.urls)} engine(s) to flush their cache after a weight update", self.targets.timeout_s)
        if self._cuda:  # free the buffers the engines held by IPC as soon as they let go
            import torch

            torch.cuda.ipc_collect()

    def close(self) -> None:
        self._buffer = None
        self._pool.shutdown(wait=False)


class DiskSender(WeightSender):
    """The source rank's end of the disk path: one safetensors shard per bucket, then engines load."""

    def __init__(self, targets: DiskTargets):
        self.targets = targets
        self.urls = targets.urls
        self.dir = Path(targets.directory)
        self.hf_checkpoint = Path(targets.hf_checkpoint) if targets.hf_checkpoint else None
        self.count = 0

    def begin(self, version: int | None = None) -> None:
        self.count = 0
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        from safetensors.torch import save_file

        if self.count == 0 and not self.dir.is_dir():
            self.begin(version)
        self.count += 1
        tensors = {n: t.detach().contiguous().cpu() for n, t in bucket}
        save_file(tensors, str(self.dir / f"model-{self.count:05d}.safetensors"))

    def finish(self, version: int) -> None:
        if self.hf_checkpoint is not None:
            for name in _HF_SIDE_FILES:
                if (self.hf_checkpoint / name).is_file():
                    shutil.copy(self.hf_checkpoint / name, self.dir / name)
        body = {"model_path": str(self.dir), "weight_version": str(version), "flush_cache": False}
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.urls))) as pool:
            calls = [pool.submit(_post, url, "/update_weights_from_disk", body) for url in self.urls]
            _wait(calls, f"{len(self.urls)} engine(s) to load weights from {self.dir}", HTTP_TIMEOUT_S)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- receiver
class WeightReceiver:
    """The engine end: turns the weight-update HTTP bodies into tensors copied into the engine.

    `tp_size` > 1 simulates an engine of that many TP ranks on one process (the built-in server's
    `--tp-size`): it joins a broadcast group with one member per rank (`rank_offset + r`), every member
    receives every tensor, and a tensor update takes one payload per rank; the copies must agree bit
    for bit before the engine loads rank 0's. That tests the senders' rank and payload arithmetic
    without a GPU."""

    def __init__(self, engine: "BuiltinEngine", *, tp_size: int = 1):
        self.engine = engine
        self.tp_size = tp_size
        self.groups: dict[str, list[tuple[Any, Any]]] = {}
        self._ranks = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, tp_size), thread_name_prefix="miles-tp-rank")

    def init_group(self, body: dict[str, Any]) -> None:
        backend = body.get("backend", "gloo")
        device_type = getattr(getattr(self.engine, "device", None), "type", "cpu")
        if backend != group_backend(device_type):
            raise ValueError(f"the built-in engine on {device_type} joins weight groups over {group_backend(device_type)}, not {backend!r}")
        name = body.get("group_name", GROUP_NAME)
        self.destroy_group({"group_name": name})
        offset, world = int(body["rank_offset"]), int(body["world_size"])
        if offset + self.tp_size > world:
            raise ValueError(f"rank_offset {offset} + tp_size {self.tp_size} exceeds the group's world size {world}")
        joins = [
            self._ranks.submit(
                make_group, body["master_address"], int(body["master_port"]), offset + r, world, name,
                float(body.get("timeout", GROUP_TIMEOUT_S)), backend,
            )
            for r in range(self.tp_size)
        ]  # fmt: skip
        self.groups[name] = [j.result() for j in joins]

    def destroy_group(self, body: dict[str, Any]) -> None:
        self.groups.pop(body.get("group_name", GROUP_NAME), None)

    def _agreed(self, copies: list[list[tuple[str, torch.Tensor]]]) -> list[tuple[str, torch.Tensor]]:
        import torch

        first = copies[0]
        for r, other in enumerate(copies[1:], start=1):
            if [n for n, _ in other] != [n for n, _ in first] or not all(torch.equal(a, b) for (_, a), (_, b) in zip(first, other)):
                raise RuntimeError(f"TP rank {r} received other weights than TP rank 0")
        return first

    def update_from_distributed(self, body: dict[str, Any]) -> None:
        name = body.get("group_name", GROUP_NAME)
        if name not in self.groups:
            raise RuntimeError(f"no weight update group {name!r}; call /init_weights_update_group first")
        if body.get("load_format") not in (None, "auto"):
            raise ValueError(f"load_format {body['load_format']!r} is not supported; send one tensor per name")
        import torch

        device = getattr(self.engine, "device", torch.device("cpu"))
        specs = list(zip(body["names"], body["dtypes"], body["shapes"]))

        def receive(group) -> list[tuple[str, torch.Tensor]]:
            out = []
            for tname, dtype, shape in specs:
                t = torch.empty(tuple(shape), dtype=_dtype(dtype), device=device if device.type == "cuda" else "cpu")
                _broadcast(group, t)
                out.append((tname, t))
            return out

        copies = [f.result() for f in [self._ranks.submit(receive, g) for g, _ in self.groups[name]]]
        self.engine.update_weights_from_tensors(self._agreed(copies), flush=bool(body.get("flush_cache", True)))

    def update_from_tensor(self, body: dict[str, Any]) -> None:
        """SGLang's body: `serialized_named_tensors` (one payload per TP rank, rank r opens entry r),
        `load_format` None (a list of (name, tensor)), `flush_cache`, `weight_version`."""
        import torch

        from miles.rollout.engine.tensor_ipc import deserialize_payload

        if body.get("load_format") not in (None, "auto"):
            raise ValueError(f"load_format {body['load_format']!r} is not supported; send a list of (name, tensor) (load_format null)")
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
            raise ValueError("serialized_named_tensors must be a list of base64 strings, one per engine TP rank")
        if len(payloads) != self.tp_size:
            raise ValueError(f"serialized_named_tensors has {len(payloads)} payloads for an engine of {self.tp_size} TP ranks")
        copies = []
        for p in payloads:
            named = deserialize_payload(p)
            if not isinstance(named, list) or not all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor) for x in named):
                raise ValueError("a tensor payload must hold a list of (name, tensor) pairs")
            copies.append(named)
        self.engine.update_weights_from_tensors(self._agreed(copies), flush=bool(body.get("flush_cache", True)))

    def update_from_disk(self, body: dict[str, Any]) -> None:
        from safetensors.torch import load_file

        path = Path(body["model_path"])
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        # Outside a begin/end session (SGLang allows that for disk updates) this call is its own one.
        own_session = not self.engine._updating
        if own_session:
            self.engine.begin_weight_update()
        try:
            for shard in shards:  # one shard in memory at a time
                self.engine.update_weights_from_tensors(list(load_file(shard).items()), flush=False)
        finally:
            if own_session:
                version = body.get("weight_version")
                self.engine.end_weight_update(self.engine.weight_version if version is None else int(version))


def _wait(futures, what: str, timeout: float) -> list[Any]:
    done, pending = concurrent.futures.wait(futures, timeout=timeout)
    if pending:
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
    return [f.result() for f in futures]


def manifest(directory: str | Path) -> dict[str, Any]:
    """Names per shard of a disk update (for tests and debugging)."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out[shard.name] = list(f.keys())
    return json.loads(json.dumps(out))
