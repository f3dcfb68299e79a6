"""`HostStash` (miles/backends/offload.py) on CPU storages: released storages hold zero bytes, shared
storages are copied once, views stay views, and `restore` gives back every byte (discarded ones as
zeros). The same code runs on a GPU with pinned host copies (tests/backends/test_offload_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from miles.backends.offload import HostStash


def test_release_and_restore_keep_views_and_bytes():
    flat = torch.arange(10, dtype=torch.float32)  # a flat buffer, like megatron's parameter buffer
    a, b = flat[:4].view(2, 2), flat[4:]
    moment = torch.randn(3, dtype=torch.float64)
    grads = torch.ones(5)
    expected = (flat.clone(), moment.clone())
    stash = HostStash()
    freed = stash.offload([a, b, moment, a], "cpu", discard=[grads])
    assert freed == 10 * 4 + 3 * 8 + 5 * 4  # the flat buffer once, though two views and a repeat name it
    assert all(t.untyped_storage().nbytes() == 0 for t in (flat, a, b, moment, grads))
    assert stash.offloaded
    with pytest.raises(RuntimeError, match="twice"):
        stash.offload([moment], "cpu")
    stash.restore()
    assert not stash.offloaded
    assert torch.equal(flat, expected[0]) and torch.equal(moment, expected[1])
    assert torch.equal(grads, torch.zeros(5))  # discarded: back as zeros
    a.add_(100)  # still a view of the buffer
    assert flat[0].item() == 100.0


def test_a_storage_listed_as_kept_and_discarded_is_kept():
    t = torch.tensor([1.0, 2.0])
    stash = HostStash()
    assert stash.offload([t], "cpu", discard=[t[:1]]) == 8
    stash.restore()
    assert t.tolist() == [1.0, 2.0]


def test_only_storages_on_the_given_device_are_released():
    t = torch.ones(4)
    stash = HostStash()
    assert stash.offload([t], "cuda") == 0  # nothing of this CPU tensor is on a GPU
    assert t.untyped_storage().nbytes() == 16
    stash.restore()
