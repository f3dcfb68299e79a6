"""`SharedBucket` / `SharedBucketReader` (miles/rollout/engine/tensor_ipc.py), as the in-process weight
sync uses them between a trainer rank and the rollout manager: the sender keeps one shared-memory
segment (a memfd) for the run, the receiver (here another process, as the manager is) maps it once and
keeps its views, and every sync after the first reads that sync's weights through the same mapping;
and none of it starts torch's `torch_shm_manager` daemon."""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
import subprocess
import sys

import pytest
import torch

from miles.rollout.engine.tensor_ipc import SharedBucket, SharedBucketReader, SharedSegment, bucket_nbytes, flatten_bucket, shared_bucket

# The receiving process: one pickled SharedBucket per line in; per line out, the mapping's address
# (the same address = mapped once) and the sha256 of every tensor's bytes as read through the views.
_READER = r"""
import base64, hashlib, pickle, sys
from miles.rollout.engine.tensor_ipc import SharedBucketReader
reader = SharedBucketReader()
for line in sys.stdin:
    views = reader.views(pickle.loads(base64.b64decode(line)))
    digests = [hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for _, t in views]
    print(reader._flat.data_ptr(), *digests, flush=True)
""".replace("import base64", "import torch, base64")


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 16, generator=g)),
        ("model.norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(64, 16, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randint(-5, 5, (7,), generator=g)),
    ]


@pytest.fixture
def reader_process():
    proc = subprocess.Popen([sys.executable, "-c", _READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(bucket: SharedBucket) -> tuple[str, list[str]]:
        proc.stdin.write(base64.b64encode(pickle.dumps(bucket)).decode() + "\n")
        proc.stdin.flush()
        address, *digests = proc.stdout.readline().split()
        return address, digests

    yield ask
    proc.stdin.close()
    proc.wait(timeout=60)


def _segment_for(weights, segment: SharedSegment | None) -> SharedSegment:
    """As the sender does: the kept segment while the bucket fits, else a new one of its size."""
    need = bucket_nbytes(weights)
    return segment if segment is not None and segment.size >= need else SharedSegment(need)


def test_a_kept_buffer_gives_the_other_process_each_syncs_new_weights_through_one_mapping(reader_process):
    segment, addresses = None, set()
    for seed in (1, 2, 3):
        weights = _weights(seed)
        segment = _segment_for(weights, segment)
        _, views = flatten_bucket(weights, segment.flat)
        address, digests = reader_process(shared_bucket(segment, views))
        addresses.add(address)
        assert digests == [_digest(t) for _, t in weights], f"sync {seed}: the reader saw other weights than were sent"
    assert len(addresses) == 1  # mapped once, read three times


def test_a_larger_bucket_moves_to_a_new_segment_and_the_reader_follows(reader_process):
    small = _weights(4)[:2]
    segment = _segment_for(small, None)
    _, views = flatten_bucket(small, segment.flat)
    first, digests = reader_process(shared_bucket(segment, views))
    assert digests == [_digest(t) for _, t in small]
    large = _weights(5)  # does not fit: a new segment
    bigger = _segment_for(large, segment)
    assert bigger is not segment
    _, views = flatten_bucket(large, bigger.flat)
    _, digests = reader_process(shared_bucket(bigger, views))
    assert digests == [_digest(t) for _, t in large]
    # And the smaller layout inside the larger segment again (the views are per layout).
    _, views = flatten_bucket(_weights(6)[:2], bigger.flat)
    _, digests = reader_process(shared_bucket(bigger, views))
    assert digests == [_digest(t) for _, t in _weights(6)[:2]]


def test_the_reader_in_process_aliases_the_buffer_and_keeps_one_view_list_per_layout():
    weights = _weights(7)
    segment = _segment_for(weights, None)
    _, views = flatten_bucket(weights, segment.flat)
    reader = SharedBucketReader()
    got = reader.views(shared_bucket(segment, views))
    assert [n for n, _ in got] == [n for n, _ in weights]
    assert all(torch.equal(a, t) and a.dtype == t.dtype and a.shape == t.shape for (_, a), (_, t) in zip(got, weights))
    fresh = _weights(8)
    _, views = flatten_bucket(fresh, segment.flat)
    again = reader.views(shared_bucket(segment, views))
    assert again is got  # the same layout: the kept views, no new mapping
    assert all(torch.equal(a, t) for (_, a), (_, t) in zip(again, fresh))


def test_views_outside_the_segment_are_not_described_as_in_it():
    segment = SharedSegment(64)
    with pytest.raises(ValueError, match="does not lie in the shared segment"):
        shared_bucket(segment, [("w", torch.zeros(4))])


def test_a_closed_segment_is_not_mapped_again_under_its_old_fd_number(tmp_path):
    segment = SharedSegment(64)
    _, views = flatten_bucket([("w", torch.ones(4))], segment.flat)
    bucket = shared_bucket(segment, views)
    segment.close()  # the sender let it go; the number now names another file
    fd = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    try:
        assert fd == segment.fd
        with pytest.raises(RuntimeError, match="no longer the weight sender's segment"):
            SharedBucketReader().views(bucket)
    finally:
        os.close(fd)


# A sender and a reader in one fresh process, then every process on the host whose parent is it: the
# in-process sync must not start torch's shared-memory manager daemon (`torch_shm_manager`, ~110 MB).
_NO_DAEMON = r"""
import os, torch
from miles.rollout.engine.tensor_ipc import SharedBucketReader, SharedSegment, flatten_bucket, shared_bucket
w = [("w", torch.arange(8.0))]
segment = SharedSegment(64)
_, views = flatten_bucket(w, segment.flat)
got = SharedBucketReader().views(shared_bucket(segment, views))
assert torch.equal(got[0][1], w[0][1])
me, children = str(os.getpid()), []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        continue
    if stat.rsplit(")", 1)[1].split()[1] == me:
        children.append(stat.split("(", 1)[1].rsplit(")", 1)[0])
print(*children)
"""


def test_the_shared_segment_starts_no_torch_shm_manager():
    out = subprocess.run([sys.executable, "-c", _NO_DAEMON], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch_shm_manag" not in out.stdout, f"processes started: {out.stdout}"
