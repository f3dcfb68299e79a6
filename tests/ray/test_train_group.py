"""The training worker group: backend selection by --train-backend, and the rendezvous address that
multi-node training needs (rank 0's node IP as Ray reports it, a port free on that node)."""

from __future__ import annotations

import socket

import pytest

from miles.config.engine import EngineConfig
from miles.errors import UserError
from miles.ray.train_group import make_backend


def test_rendezvous_address_is_rank_zeros_ray_node_ip(ray_session):
    import ray

    from miles.ray.actors import TrainWorkerActor
    from miles.ray.hosting import start_actor

    worker = start_actor(TrainWorkerActor, EngineConfig(), rank=0, world_size=2, device="cpu", label="rank 0", actor_options={"num_cpus": 0})
    ray.get(worker.ready_ref, timeout=120)
    addr, port = ray.get(worker.handle.rendezvous_address.remote(), timeout=60)
    node_ips = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert addr in node_ips, (addr, node_ips)  # the address other nodes reach, not a loopback guess
    with socket.socket() as s:  # the port is free on that node (this test runs on the same node)
        s.bind((addr, port))


def test_megatron_backend_is_selected_by_name(monkeypatch):
    import sys
    import types

    built = {}

    class MegatronTrainer:
        def __init__(self, cfg, *, rank, world_size, device, role):
            built.update(rank=rank, world_size=world_size, device=device, role=role)

    monkeypatch.setitem(sys.modules, "miles.backends.megatron", types.SimpleNamespace(MegatronTrainer=MegatronTrainer))
    cfg = EngineConfig()
    cfg.train.train_backend = "megatron"
    assert isinstance(make_backend(cfg, rank=1, world_size=2, device="cpu"), MegatronTrainer)
    assert built == {"rank": 1, "world_size": 2, "device": "cpu", "role": "actor"}


def test_missing_megatron_backend_is_a_user_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "miles.backends.megatron", None)  # import fails
    cfg = EngineConfig()
    cfg.train.train_backend = "megatron"
    with pytest.raises(UserError, match="--train-backend"):
        make_backend(cfg, rank=0, world_size=1, device="cpu")
