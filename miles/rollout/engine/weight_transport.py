"""Weight transport between the trainer's source rank and engine servers, both ends.

SGLang's three paths, as the built-in engine server implements them (the in-process engine takes
tensors by `RolloutEngine.update_weights_from_tensors` instead):

- **broadcast** (SGLang's `init_weights_update_group` + `update_weights_from_distributed`): the
  source rank and every engine form their own gloo group (rank 0 = source, engine i = rank 1 + i),
  separate from the training world. Per bucket the source POSTs the bucket's names/dtypes/shapes to
  every engine *first*, then broadcasts each tensor in that order; each engine receives into fresh
  tensors and copies them into its model.
- **disk** (SGLang's `update_weights_from_disk`): the source writes each bucket as one safetensors
  shard (plus the model's config files, so the directory is a loadable HF checkpoint), then every
  engine loads the directory.
- **tensor** (SGLang's `update_weights_from_tensor`, its colocated path): per bucket the source copies
  the tensors into one fresh buffer and POSTs *handles* to it (CUDA IPC on a GPU, a shared-memory
  segment on a CPU; `miles.rollout.engine.tensor_ipc`), one payload per engine TP rank, with
  `flush_cache: false`; the buffer lives until every engine has answered; one `/flush_cache` after
  the last bucket. Only for engines on the source rank's host (and on a GPU, on its GPU).

Either way the driver process only says "update to version v"; the bytes go source rank -> engines.

    # trainer source rank
    sender = BroadcastSender(["http://127.0.0.1:31001", ...]); sender.connect()
    for bucket in buckets: sender.send_bucket(bucket)
    # engine side: miles.rollout.engine.server routes the HTTP calls to a WeightReceiver
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from miles.utils.net import free_port

if TYPE_CHECKING:
    from miles.rollout.engine.builtin import BuiltinEngine

GROUP_NAME = "miles_weight_sync"
GROUP_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 600.0
# Files copied next to the shards so the directory is a complete HF checkpoint (a real SGLang
# engine's update_weights_from_disk reads config and tokenizer from model_path too).
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def make_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float):
    """A gloo group of its own (not the default world), with the store keys torch gives a named group
    and SGLang's `init_weights_update_group` gives its end: a `tcp://` rendezvous, then the prefixes
    "<group>", "<group>/" and "<first device>/" (torch builds one gloo backend, for the first device
    gloo serves, and registers it for the others). With other keys a real SGLang server would wait for
    its peers forever. The group is not registered with torch.distributed, so both ends may share a
    process. Returns (the gloo backend, the store that must stay alive with it)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, BackendConfig, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    device = next(iter(BackendConfig(Backend("gloo")).get_device_backend_map()))
    prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout), store


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class WeightReceiver:
    """The engine end: turns the weight-update HTTP bodies into tensors copied into the engine."""

    def __init__(self, engine: "BuiltinEngine"):
        self.engine = engine
        self.groups: dict[str, Any] = {}

    def init_group(self, body: dict[str, Any]) -> None:
        backend = body.get("backend", "gloo")
        if backend != "gloo":
            raise ValueError(f"the built-in engine joins weight groups over gloo, not {backend!r}")
        name = body.get("group_name", GROUP_NAME)
        self.destroy_group({"group_name": name})
        self.groups[name] = make_group(
            body["master_address"], int(body["master_port"]), int(body["rank_offset"]), int(body["world_size"]), name,
            float(body.get("timeout", GROUP_TIMEOUT_S)),
        )

    def destroy_group(self, body: dict[str, Any]) -> None:
        self.groups.pop(body.get("group_name", GROUP_NAME), None)

    def update_from_distributed(self, body: dict[str, Any]) -> None:
        name = body.get("group_name", GROUP_NAME)
        if name not in self.groups:
            raise RuntimeError(f"no weight update group {name!r}; call /init_weights_update_group first")
        group, _ = self.groups[name]
        if body.get("load_format") not in (None, "auto"):
            raise ValueError(f"load_format {body['load_format']!r} is not supported; send one tensor per name")
        received = []
        for tname, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            t = torch.empty(tuple(shape), dtype=_dtype(dtype))
            _broadcast(group, t)
            received.append((tname, t))
        self.engine.update_weights_from_tensors(received, flush=bool(body.get("flush_cache", True)))

    def update_from_tensor(self, body: dict[str, Any]) -> None:
        """SGLang's body: `serialized_named_tensors` (one payload per TP rank; this server is rank 0 of
        one), `load_format` None (a list of (name, tensor)), `flush_cache`, `weight_version`."""
        from miles.rollout.engine.tensor_ipc import deserialize_payload

        if body.get("load_format") not in (None, "auto"):
            raise ValueError(f"load_format {body['load_format']!r} is not supported; send a list of (name, tensor) (load_format null)")
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads or not isinstance(payloads[0], str):
            raise ValueError("serialized_named_tensors must be a list of base64 strings, one per engine TP rank")
        named = deserialize_payload(payloads[0])
        if not isinstance(named, list) or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in named):
            raise ValueError("a tensor payload must hold a list of (name, tensor) pairs")
        self.engine.update_weights_from_tensors(named, flush=bool(body.get("flush_cache", True)))

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


def _post(url: str, path: str, body: dict[str, Any], timeout: float = HTTP_TIMEOUT_S) -> Any:
    import requests

    r = requests.post(f"{url}{path}", json=body, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{url}{path} answered HTTP {r.status_code}: {r.text[:300]}")
    data = r.json() if r.content else None
    if isinstance(data, dict) and data.get("success") is False:
        raise RuntimeError(f"{url}{path} failed: {data.get('message')}")
    return data


def group_master_address(engine_urls: list[str]) -> str:
    """The address engines use to reach the sender's rendezvous store: loopback when every engine is on
    this host, else this node's address as Ray knows it (engines on other nodes cannot reach 127.0.0.1)."""
    from urllib.parse import urlparse

    if all(urlparse(u).hostname in ("127.0.0.1", "localhost", "::1") for u in engine_urls):
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


class BroadcastSender:
    """The source rank's end of the broadcast path (one group with all engines)."""

    def __init__(self, engine_urls: list[str], *, group_name: str = GROUP_NAME, timeout_s: float = GROUP_TIMEOUT_S):
        self.urls = list(engine_urls)
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.group = None
        self._store = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.urls)))

    def connect(self) -> None:
        """Rendezvous: engines are asked to join first (without waiting), then rank 0 joins, then wait."""
        port = free_port("127.0.0.1")
        world = 1 + len(self.urls)
        master = group_master_address(self.urls)
        calls = [
            self._pool.submit(
                _post, url, "/init_weights_update_group",
                {"master_address": master, "master_port": port, "rank_offset": 1 + i, "world_size": world,
                 "group_name": self.group_name, "backend": "gloo", "timeout": self.timeout_s},
            )
            for i, url in enumerate(self.urls)
        ]
        self.group, self._store = make_group(master, port, 0, world, self.group_name, self.timeout_s)
        _wait(calls, f"{len(self.urls)} engine(s) to join the weight update group", self.timeout_s)

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], *, weight_version: int | None = None) -> None:
        tensors = [t.detach().contiguous().cpu() for _, t in bucket]
        body = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self.group_name,
            "flush_cache": False,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)  # SGLang's field is a string
        calls = [self._pool.submit(_post, url, "/update_weights_from_distributed", body) for url in self.urls]
        for t in tensors:  # same order as the names the engines were given
            _broadcast(self.group, t)
        _wait(calls, f"{len(self.urls)} engine(s) to load a weight bucket of {len(tensors)} tensors", self.timeout_s)

    def close(self) -> None:
        for url in self.urls:
            try:
                _post(url, "/destroy_weights_update_group", {"group_name": self.group_name}, timeout=30)
            except Exception:  # noqa: BLE001 - a dead engine has no group to destroy
                pass
        self.group = self._store = None
        self._pool.shutdown(wait=False)


def is_local_engine(url: str) -> bool:
    """Whether the engine at `url` runs on this host (loopback, or this node's address as Ray knows it)."""
    from urllib.parse import urlparse

    host = urlparse(url).hostname
    if host in ("127.0.0.1", "localhost", "::1"):
        return True
    try:
        import ray

        return host == ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray here: only loopback is known to be local
        return False


class TensorSender:
    """The source rank's end of the tensor path: handles to each bucket, one payload per engine TP rank.

    `tp_sizes[i]` is engine i's TP size (SGLang's TP rank r deserialises entry r). Every payload points
    at the source's own copy: right on a CPU (one shared memory), and on a GPU for the one engine that
    shares the source rank's GPU (the config allows no other layout with this mode)."""

    def __init__(self, engine_urls: list[str], *, tp_sizes: list[int] | None = None, timeout_s: float = HTTP_TIMEOUT_S):
        self.urls = list(engine_urls)
        self.tp_sizes = list(tp_sizes) if tp_sizes is not None else [1] * len(self.urls)
        self.timeout_s = timeout_s
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

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], *, weight_version: int | None = None) -> None:
        from miles.rollout.engine.tensor_ipc import flatten_bucket, serialize_bucket

        if not bucket:
            return
        if bucket[0][1].is_cuda and len(self.urls) > 1:
            raise RuntimeError(
                f"--update-weight-transfer-mode tensor sends CUDA IPC handles of the trainer's GPU, which only the one "
                f"engine colocated with it can open, and this run has {len(self.urls)}; use --update-weight-transfer-mode broadcast"
            )
        self._cuda = self._cuda or bucket[0][1].is_cuda
        flat, views = flatten_bucket(bucket, self._buffer)
        self._buffer = flat
        body = {"load_format": None, "flush_cache": False}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)  # SGLang's field is a string
        calls = [
            self._pool.submit(
                _post, url, "/update_weights_from_tensor",
                {**body, "serialized_named_tensors": [serialize_bucket(views) for _ in range(tp)]}, self.timeout_s,
            )
            for url, tp in zip(self.urls, self.tp_sizes)
        ]
        try:
            _wait(calls, f"{len(self.urls)} engine(s) to load a weight bucket of {len(bucket)} tensors by handle", self.timeout_s)
        finally:
            del views  # the engines have copied out of the buffer (or failed): the next bucket may overwrite it

    def finish(self) -> None:
        """One cache flush per engine after the last bucket (the buckets were sent with flush_cache false)."""
        from miles.rollout.engine.http_client import HttpEngine

        calls = [self._pool.submit(HttpEngine(url).flush_cache) for url in self.urls]
        _wait(calls, f"{len(self.urls)} engine(s) to flush their cache after a weight update", self.timeout_s)
        if self._cuda:  # free the buffers the engines held by IPC as soon as they let go
            torch.cuda.ipc_collect()

    def close(self) -> None:
        self._buffer = None
        self._pool.shutdown(wait=False)


class DiskSender:
    """The source rank's end of the disk path: one safetensors shard per bucket, then engines load."""

    def __init__(self, engine_urls: list[str], directory: str | Path, hf_checkpoint: str | Path | None):
        self.urls = list(engine_urls)
        self.dir = Path(directory)
        self.hf_checkpoint = Path(hf_checkpoint) if hf_checkpoint else None
        self.count = 0
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], **_: Any) -> None:
        from safetensors.torch import save_file

        self.count += 1
        tensors = {n: t.detach().contiguous().cpu() for n, t in bucket}
        save_file(tensors, str(self.dir / f"model-{self.count:05d}.safetensors"))

    def finish(self, weight_version: int) -> None:
        if self.hf_checkpoint is not None:
            for name in _HF_SIDE_FILES:
                if (self.hf_checkpoint / name).is_file():
                    shutil.copy(self.hf_checkpoint / name, self.dir / name)
        body = {"model_path": str(self.dir), "weight_version": str(weight_version), "flush_cache": False}
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.urls))) as pool:
            calls = [pool.submit(_post, url, "/update_weights_from_disk", body) for url in self.urls]
            _wait(calls, f"{len(self.urls)} engine(s) to load weights from {self.dir}", HTTP_TIMEOUT_S)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


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
