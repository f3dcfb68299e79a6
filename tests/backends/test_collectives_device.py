"""Reductions are made on their process group's device (miles/backends/collectives.py): cuda for an
NCCL group, the CPU for gloo. A CPU machine has no NCCL, so the NCCL side is shown by inspection:
`group_device` is asked about a group whose backend reads "nccl", and the trainers' metric and
pipeline reductions are run against fake collectives that record the device of the tensor they get
(the group device is stood in by the meta device, which a CPU build can allocate). The numbers over a
real gloo group are checked by the 2-process tests (test_data_parallel.py, megatron/)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from miles.backends import collectives


@pytest.mark.parametrize(
    "backend, expected",
    [("nccl", torch.device("cuda", 3)), ("NCCL", torch.device("cuda", 3)), ("gloo", torch.device("cpu")),
     ("cpu:gloo,cuda:nccl", torch.device("cpu")), ("cuda:nccl", torch.device("cuda", 3)), ("mpi", torch.device("cpu"))],
)
def test_group_device_is_cuda_for_nccl_and_cpu_for_gloo(monkeypatch, backend, expected):
    group = object()
    monkeypatch.setattr(dist, "get_backend", lambda g=None: backend if g is group else "gloo")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)  # the rank's own GPU, not cuda:0
    assert collectives.group_device(group) == expected
    assert collectives.group_device(None) == torch.device("cpu")


class _Seen(Exception):
    """Raised by a fake collective with the device of the tensor it was handed."""

    def __init__(self, device: torch.device, group):
        super().__init__(str(device))
        self.device, self.group = device, group


def _fake_collectives(monkeypatch, nccl_group):
    """Every collective raises _Seen with its tensor's device; the group `nccl_group` lives on 'meta'."""
    import miles.backends.megatron.model as megatron_model
    import miles.backends.megatron.trainer as megatron_trainer

    meta = torch.device("meta")
    for module in (collectives, megatron_trainer, megatron_model):  # every name the helper is imported under
        if hasattr(module, "group_device"):
            monkeypatch.setattr(module, "group_device", lambda g=None: meta if g is nccl_group else torch.device("cpu"))

    def seen(t, *args, group=None, **kwargs):
        raise _Seen(t.device, group)

    monkeypatch.setattr(dist, "all_reduce", seen)
    monkeypatch.setattr(dist, "broadcast", seen)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: r)
    monkeypatch.setattr(dist, "broadcast_object_list", lambda obj, src=None, group=None: None)


def test_torch_metric_reduction_uses_the_default_groups_device(monkeypatch):
    from miles.backends.torch import trainer as torch_trainer

    _fake_collectives(monkeypatch, nccl_group=None)  # the torch backend reduces over the default group
    with pytest.raises(_Seen) as seen:
        torch_trainer._all_reduce_metrics({"train/loss": 1.0, "train/x_max": 2.0})
    assert seen.value.device == torch.device("meta")
    with pytest.raises(_Seen) as seen:
        torch_trainer.TorchBackend.all_reduce_dp(SimpleNamespace(), torch.ones(3))  # a CPU statistic travels
    assert seen.value.device == torch.device("meta")


def _megatron_self(*, dp: int, pp: int, last: bool):
    dp_group, pp_group = object(), object()
    ps = SimpleNamespace(
        is_pipeline_last_stage=lambda: last, get_pipeline_model_parallel_world_size=lambda: pp,
        get_pipeline_model_parallel_group=lambda: pp_group, get_data_parallel_world_size=lambda: dp,
        get_data_parallel_group=lambda: dp_group)
    return SimpleNamespace(ps=ps), dp_group, pp_group


@pytest.mark.parametrize("dp, pp, group", [(2, 1, "dp"), (1, 2, "pp")])
def test_megatron_metric_reductions_use_their_groups_device(monkeypatch, dp, pp, group):
    from miles.backends.megatron.trainer import MegatronTrainer

    fake, dp_group, pp_group = _megatron_self(dp=dp, pp=pp, last=True)
    target = dp_group if group == "dp" else pp_group
    _fake_collectives(monkeypatch, nccl_group=target)
    with pytest.raises(_Seen) as seen:
        MegatronTrainer._reduce_metrics(fake, {"train/loss": 1.0, "train/x_min": 0.5})
    assert (seen.value.device, seen.value.group) == (torch.device("meta"), target)


@pytest.mark.parametrize("last", [True, False])
def test_megatron_pipeline_broadcast_of_log_probs_uses_the_pp_groups_device(monkeypatch, last):
    from miles.backends.megatron.trainer import MegatronTrainer

    fake, _, pp_group = _megatron_self(dp=1, pp=2, last=last)
    _fake_collectives(monkeypatch, nccl_group=pp_group)
    with pytest.raises(_Seen) as seen:
        MegatronTrainer._broadcast_from_last_stage(fake, [torch.zeros(2), torch.zeros(3)] if last else [None, None], [2, 3])
    assert (seen.value.device, seen.value.group) == (torch.device("meta"), pp_group)


def test_megatron_dp_reduction_moves_a_cpu_tensor_to_the_groups_device(monkeypatch):
    from miles.backends.megatron.trainer import MegatronTrainer

    fake, dp_group, _ = _megatron_self(dp=2, pp=1, last=True)
    _fake_collectives(monkeypatch, nccl_group=dp_group)
    with pytest.raises(_Seen) as seen:
        MegatronTrainer.all_reduce_dp(fake, torch.ones(4, dtype=torch.float64))
    assert (seen.value.device, seen.value.group) == (torch.device("meta"), dp_group)


def test_reductions_over_a_one_rank_gloo_group_keep_their_numbers(tmp_path):
    """Through the helpers for real (gloo, one rank): sums/max/min unchanged, an in-place tensor reduced."""
    from miles.backends.torch.trainer import _all_reduce_metrics
    from miles.utils.net import free_port

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        local = {"train/loss": 0.25, "train/n": 3.0, "train/r_max": 2.0, "train/r_min": -1.0}
        assert _all_reduce_metrics(local) == local
        t = torch.tensor([1.5, 2.5])
        assert collectives.all_reduce_(t) is t and t.tolist() == [1.5, 2.5]
    finally:
        if started:
            dist.destroy_process_group()
