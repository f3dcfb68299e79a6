"""Benchmark: weight sync seconds per GB, trainer -> engine, against a plain tensor copy.

What is timed, for one model's weights (a random Qwen3 of about 80M parameters, 0.33 GB in float32,
created in a temp dir; nothing downloaded), in buckets of --bucket-mb:

- copy:       `param.copy_(tensor)` for every tensor in this process (memory bandwidth; the floor);
- tensor:     `BuiltinEngine.update_weights_from_tensors` in this process (the in-process engine's
              path: session, name lookup, shape checks, copy);
- broadcast:  `BroadcastTargets` -> N engine servers in their own processes (`python -m
              miles.rollout.engine.server`): a gloo group, names first over HTTP, then one broadcast
              per tensor; the number `perf/weight_sync_time` reports for --rollout-num-gpus runs;
- disk:       `DiskTargets`: one safetensors shard per bucket, then every engine loads the directory;
- manager process, handles per sync / kept mapping: the in-process sync's two payloads between this
              process (the trainer's source rank) and a child process holding a `BuiltinEngine` (the
              rollout manager): per bucket, one copy into the sender's kept shared-memory buffer, then
              either handles pickled, mapped and released by the child every sync (`serialize_bucket`,
              before 2026-12-04) or a `SharedBucket` whose segment the child mapped once and keeps
              (`SharedBucketReader`, now); a pipe stands in for the Ray call (timed in the loop, not here);
- tensor to servers: `TensorTargets` (--update-weight-transfer-mode tensor): per bucket one copy into
              a shared-memory buffer (kept across syncs, as the trainer keeps it), then handles to
              it to every server's `/update_weights_from_tensor` (SGLang's colocated path; CUDA IPC
              on a GPU), one flush at the end.

Every engine's weights are checked bit-identical to the sent ones after each path. Reported: the
median of --repeats runs, seconds per GB, and the ratio to the plain copy.

    python bench/weight_sync.py                 # 2 engine servers, 64 MB buckets (a few minutes on 2 cores)
    python bench/weight_sync.py --engines 1 --bucket-mb 512
    python bench/weight_sync.py --tp-size 2     # engines of 2 simulated TP ranks: world 1 + 2·2 per broadcast
    python bench/weight_sync.py --engines 0     # no servers: copy, in-process engine, manager process
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from miles.rollout.engine.base import iter_weight_buckets, tensor_nbytes, weights_checksum
from miles.rollout.engine.builtin import BuiltinEngine
from miles.rollout.engine.http_client import HttpEngine
from miles.rollout.engine.weight_transport import BroadcastTargets, DiskTargets, TensorTargets, engines_of


def make_model(root: Path) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    out = root / "model"
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(32000)}, unk_token="<t0>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<t0>").save_pretrained(out)
    return out


def start_servers(hf_dir: Path, n: int, tp_size: int = 1) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for _ in range(n):
        p = subprocess.Popen(
            [sys.executable, "-m", "miles.rollout.engine.server", "--hf-checkpoint", str(hf_dir), "--port", "0", "--tp-size", str(tp_size)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        procs.append(p)
    for p in procs:
        line = p.stdout.readline().strip()  # the server prints its URL once bound
        if not line.startswith("http://"):
            raise RuntimeError(f"engine server did not start (got {line!r})")
        urls.append(line)
    return procs, urls


# The rollout manager's side of the in-process sync, in a child process: one command per stdin line
# ("begin", "end", "sum", or "handles"/"shared" + a base64 payload for one bucket), "ok"/a checksum back.
_MANAGER = r"""
import base64, pickle, sys, torch
torch.set_num_threads(1)
from miles.rollout.engine.builtin import BuiltinEngine
from miles.rollout.engine.tensor_ipc import SharedBucketReader, deserialize_payload
engine, reader = BuiltinEngine(sys.argv[1]), SharedBucketReader()
print("ok", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "begin":
        engine.pause_generation(); engine.begin_weight_update()
    elif cmd == "end":
        engine.end_weight_update(1); engine.continue_generation()
    elif cmd == "handles":
        engine.update_weights_from_tensors(deserialize_payload(arg))
    elif cmd == "shared":
        engine.update_weights_from_tensors(reader.views(pickle.loads(base64.b64decode(arg))))
    elif cmd == "sum":
        print(engine.get_weights_checksum(), flush=True); continue
    print("ok", flush=True)
"""


class ManagerProcess:
    """A child process with a `BuiltinEngine`, fed the in-process sync's payloads over a pipe."""

    def __init__(self, hf_dir: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", _MANAGER, str(hf_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ask("")  # its start-up "ok"

    def ask(self, line: str) -> str:
        if line:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def sync(self, buckets, sender_buffer: list, *, kept: bool) -> None:
        import base64
        import pickle

        from miles.rollout.engine.tensor_ipc import SharedSegment, bucket_nbytes, flatten_bucket, serialize_bucket, shared_bucket

        self.ask("begin")
        for b in buckets:
            if kept:  # as `InProcessSender`: a memfd segment, grown to the largest bucket
                if sender_buffer[0] is None or sender_buffer[0].size < bucket_nbytes(b):
                    sender_buffer[0] = SharedSegment(bucket_nbytes(b))
                _, views = flatten_bucket(b, sender_buffer[0].flat)
                self.ask("shared " + base64.b64encode(pickle.dumps(shared_bucket(sender_buffer[0], views))).decode())
            else:
                sender_buffer[0], views = flatten_bucket(b, sender_buffer[0])
                self.ask("handles " + serialize_bucket(views))
        self.ask("end")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp-size", type=int, default=1, help="simulated TP ranks per engine server (each receives every broadcast)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    console = Console(width=120)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_model(Path(tmp))
        from transformers import AutoModelForCausalLM

        src = AutoModelForCausalLM.from_pretrained(hf_dir)
        g = torch.Generator().manual_seed(1)
        named = [(n, p.detach() + 0.01 * torch.randn(p.shape, generator=g)) for n, p in src.named_parameters()]
        want = weights_checksum(named)
        gb = sum(tensor_nbytes(t) for _, t in named) / 1e9
        bucket_bytes = args.bucket_mb * 1024**2
        buckets = list(iter_weight_buckets(named, bucket_bytes))
        console.print(f"{len(named)} tensors, {gb:.3f} GB, {len(buckets)} buckets of <= {args.bucket_mb} MB, {args.engines} engine server(s)")

        local = BuiltinEngine(hf_dir)
        params = dict(local.model.named_parameters())

        def copy() -> None:
            with torch.no_grad():
                for n, t in named:
                    params[n].copy_(t)

        def tensor_path() -> None:
            local.begin_weight_update()
            for b in buckets:
                local.update_weights_from_tensors(b)
            local.end_weight_update(1)

        manager = ManagerProcess(hf_dir)
        handles_buffer, kept_buffer = [None], [None]  # each sender's buffer, kept across syncs

        def manager_handles() -> None:
            manager.sync(buckets, handles_buffer, kept=False)

        def manager_kept() -> None:
            manager.sync(buckets, kept_buffer, kept=True)

        with console.status("starting engine servers"):
            procs, urls = start_servers(hf_dir, args.engines, args.tp_size)
        clients = [HttpEngine(u) for u in urls]
        engines = engines_of(urls, [args.tp_size] * len(urls))
        sender = BroadcastTargets(engines).open_sender() if urls else None  # one group, kept across syncs as the trainer keeps it

        def remote(send) -> None:
            for c in clients:
                c.pause_generation()
                c.begin_weight_update()
            send()
            for c in clients:
                c.end_weight_update(1)
                c.continue_generation()

        def broadcast() -> None:
            remote(lambda: [sender.send_bucket(b, 1) for b in buckets])

        def disk() -> None:
            def send() -> None:
                d = DiskTargets(engines, directory=str(Path(tmp) / "sync"), hf_checkpoint=str(hf_dir)).open_sender()
                d.begin(1)
                for b in buckets:
                    d.send_bucket(b, 1)
                d.finish(1)
                d.close()

            remote(send)

        tensor_sender = TensorTargets(engines).open_sender() if urls else None  # kept across syncs, as the trainer's source rank keeps it

        def tensor_servers() -> None:
            def send() -> None:
                for b in buckets:
                    tensor_sender.send_bucket(b, 1)
                tensor_sender.finish(1)

            remote(send)

        rows = []
        try:
            paths = [
                ("copy", copy, lambda: [local.get_weights_checksum()]),
                ("tensor (in-process engine)", tensor_path, lambda: [local.get_weights_checksum()]),
                ("manager process, handles per sync", manager_handles, lambda: [manager.ask("sum")]),
                ("manager process, kept mapping", manager_kept, lambda: [manager.ask("sum")]),
            ]
            servers = [
                (f"broadcast (gloo, {args.engines} servers x TP {args.tp_size})", broadcast, lambda: [c.get_weights_checksum() for c in clients]),
                (f"disk ({args.engines} servers)", disk, lambda: [c.get_weights_checksum() for c in clients]),
                (f"tensor, shared memory ({args.engines} servers x TP {args.tp_size})", tensor_servers, lambda: [c.get_weights_checksum() for c in clients]),
            ]
            for name, fn, check in paths + (servers if urls else []):
                times = []
                with console.status(name):
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        fn()
                        times.append(time.perf_counter() - t0)
                assert all(s == want for s in check()), f"{name}: weights differ after the sync"
                rows.append((name, statistics.median(times)))
        finally:
            manager.close()
            for kept in (sender, tensor_sender):
                if kept is not None:
                    kept.close()
            for p in procs:
                p.terminate()
                p.wait(timeout=30)
        base = rows[0][1] / gb
        table = Table(title=f"weight sync, {gb:.3f} GB, buckets of {args.bucket_mb} MB (median of {args.repeats})")
        for col in ("path", "seconds", "s / GB", "vs copy"):
            table.add_column(col, no_wrap=True)
        for name, s in rows:
            table.add_row(name, f"{s:.3f}", f"{s / gb:.3f}", f"{s / gb / base:.1f}x")
        console.print(table)


if __name__ == "__main__":
    main()
