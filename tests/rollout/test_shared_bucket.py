"""`SharedBucket` / `SharedBucketReader` (miles/rollout/engine/tensor_ipc.py), as the in-process weight
sync uses them between a trainer rank and the rollout manager: the sender keeps one shared-memory
buffer for the run, the receiver (here another process, as the manager is) maps it once and keeps its
views, and every sync after the first reads that sync's weights through the same mapping."""

from __future__ import annotations

import base64
import hashlib
import pickle
import subprocess
import sys

import pytest
import torch

from miles.rollout.engine.tensor_ipc import SharedBucket, SharedBucketReader, flatten_bucket, shared_bucket

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


def test_a_kept_buffer_gives_the_other_process_each_syncs_new_weights_through_one_mapping(reader_process):
    buffer, addresses = None, set()
    for seed in (1, 2, 3):
        weights = _weights(seed)
        buffer, views = flatten_bucket(weights, buffer)
        address, digests = reader_process(shared_bucket(buffer, views))
        addresses.add(address)
        assert digests == [_digest(t) for _, t in weights], f"sync {seed}: the reader saw other weights than were sent"
    assert len(addresses) == 1  # mapped once, read three times


def test_a_larger_bucket_moves_to_a_new_segment_and_the_reader_follows(reader_process):
    small = _weights(4)[:2]
    buffer, views = flatten_bucket(small, None)
    first, digests = reader_process(shared_bucket(buffer, views))
    assert digests == [_digest(t) for _, t in small]
    large = _weights(5)  # does not fit: a new segment
    bigger, views = flatten_bucket(large, buffer)
    assert bigger.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    _, digests = reader_process(shared_bucket(bigger, views))
    assert digests == [_digest(t) for _, t in large]
    # And the smaller layout inside the larger segment again (the views are per layout).
    _, views = flatten_bucket(_weights(6)[:2], bigger)
    _, digests = reader_process(shared_bucket(bigger, views))
    assert digests == [_digest(t) for _, t in _weights(6)[:2]]


def test_the_reader_in_process_aliases_the_buffer_and_keeps_one_view_list_per_layout():
    weights = _weights(7)
    buffer, views = flatten_bucket(weights, None)
    reader = SharedBucketReader()
    got = reader.views(shared_bucket(buffer, views))
    assert [n for n, _ in got] == [n for n, _ in weights]
    assert all(torch.equal(a, t) and a.dtype == t.dtype and a.shape == t.shape for (_, a), (_, t) in zip(got, weights))
    fresh = _weights(8)
    _, views = flatten_bucket(fresh, buffer)
    again = reader.views(shared_bucket(buffer, views))
    assert again is got  # the same layout: the kept views, no new mapping
    assert all(torch.equal(a, t) for (_, a), (_, t) in zip(again, fresh))


def test_a_buffer_off_the_cpu_is_not_described_as_shared_memory():
    with pytest.raises(RuntimeError, match="CPU shared memory"):
        shared_bucket(torch.empty(0, device="meta"), [])
