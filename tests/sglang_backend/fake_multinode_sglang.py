"""Stands in for `python -m sglang.launch_server` in tests of engines spanning nodes (no SGLang runs).

Takes the argv miles writes for each node of an engine, plus `--record-dir DIR` (and, to test a node
that fails, `--exit-on-node-rank R`). Every node records its argv, pid and CUDA_VISIBLE_DEVICES in
DIR. Node rank 0 then waits, as SGLang's node 0 does, until every node of its engine (same
`--dist-init-addr`) has joined, and serves the built-in engine server from the SGLang flags it takes;
the other node ranks only wait, as a joined SGLang node that serves no HTTP.

    python tests/sglang_backend/fake_multinode_sglang.py --record-dir /tmp/rec --model-path M --host H --port P \
        --tp-size 2 ... --nnodes 2 --node-rank 1 --dist-init-addr H:PORT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

JOIN_TIMEOUT_S = 120.0


def _take(argv: list[str], flag: str) -> str | None:
    if flag not in argv:
        return None
    i = argv.index(flag)
    value = argv[i + 1]
    del argv[i : i + 2]
    return value


def main() -> None:
    argv = sys.argv[1:]
    record = Path(_take(argv, "--record-dir"))
    fail_rank = _take(argv, "--exit-on-node-rank")
    nnodes, rank, addr = int(_take(argv, "--nnodes")), int(_take(argv, "--node-rank")), _take(argv, "--dist-init-addr")
    tp = _take(argv, "--tp-size")  # the whole engine's; the built-in server is one process of TP 1
    key = addr.replace(":", "_")
    record.mkdir(parents=True, exist_ok=True)
    (record / f"{key}-node-{rank}.json").write_text(
        json.dumps({"argv": sys.argv, "pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "tp_size": tp})
    )
    print(f"[fake sglang] node {rank} of {nnodes}, dist-init-addr {addr}", flush=True)
    if fail_rank is not None and int(fail_rank) == rank:
        sys.exit(5)
    if rank > 0:
        while True:
            time.sleep(3600)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while len(list(record.glob(f"{key}-node-*.json"))) < nnodes:
        if time.monotonic() > deadline:
            sys.exit(f"[fake sglang] the other nodes did not join {addr} within {JOIN_TIMEOUT_S:g} s")
        time.sleep(0.1)
    from miles.rollout.engine.server import main as serve

    serve(argv)


if __name__ == "__main__":
    main()
