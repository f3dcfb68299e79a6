"""The fleet around a memory release: the health monitor never probes a released engine (and probes
again once it is resumed), and a release waits, aborting again, for a request that arrived after the
first abort. Two built-in engine servers as Ray actors behind the real sglang-router, tiny model.
"""

from __future__ import annotations

import time

import pytest

from miles.prepare.tiny_model import create_tiny_qwen3

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return create_tiny_qwen3(tmp_path_factory.mktemp("fleetmem") / "model", seed=0)


def _calls(slot) -> list[str]:
    return slot.client.call("/server_info", method="GET", timeout=30)["control_calls"]


def _probes(fleet) -> list[int]:
    return [_calls(s).count("/health_generate") for s in fleet.slots]


def test_the_monitor_never_probes_a_released_engine(model, tmp_path, ray_session):
    from miles.config.fault_tolerance import FaultToleranceConfig
    from miles.ray.engine_factory import builtin_fleet

    ft = FaultToleranceConfig(rollout_health_check_first_wait=0, rollout_health_check_interval=1.0, rollout_health_check_timeout=10)
    fleet = builtin_fleet(str(model), num_engines=2, policy="round_robin", ft=ft, log_dir=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while min(_probes(fleet)) < 1:  # the monitor runs
            assert time.monotonic() < deadline, "the health monitor never probed the engines"
            time.sleep(0.2)
        fleet.release_memory_occupation()
        released = _probes(fleet)
        time.sleep(3.5)  # a train step longer than three health intervals
        assert _probes(fleet) == released
        fleet.resume_memory_occupation(["weights"])
        time.sleep(2.5)
        assert _probes(fleet) == released  # the KV cache is still released: no generation yet
        fleet.resume_memory_occupation(["kv_cache", "cuda_graph"])
        deadline = time.monotonic() + 30
        while not all(a > b for a, b in zip(_probes(fleet), released)):
            assert time.monotonic() < deadline, "the monitor did not probe again after the resume"
            time.sleep(0.2)
        calls = _calls(fleet.slots[0])
        i = calls.index("/release_memory_occupation weights,kv_cache,cuda_graph")
        between = calls[i : calls.index("/resume_memory_occupation kv_cache,cuda_graph") + 1]
        assert "/health_generate" not in between and "/resume_memory_occupation weights" in between
        assert fleet.health()["ok"] and fleet.restarts == 0
    finally:
        fleet.shutdown()


def test_a_release_waits_for_a_request_that_arrives_after_the_first_abort(model, tmp_path, ray_session, monkeypatch):
    from miles.config.fault_tolerance import FaultToleranceConfig
    from miles.rollout.engine import fleet as fleet_mod
    from miles.rollout.engine.base import GenerateRequest, SamplingParams
    from miles.ray.engine_factory import builtin_fleet

    ft = FaultToleranceConfig(rollout_health_check_first_wait=3600)
    fleet = builtin_fleet(str(model), num_engines=2, policy="round_robin", ft=ft, max_batch_size=1, log_dir=tmp_path)
    try:
        late = []
        aborts = []
        abort = fleet.abort_request

        def abort_then_a_late_request(rid: str = "", abort_all: bool = False) -> None:
            abort(rid, abort_all)
            aborts.append(time.monotonic())
            if len(aborts) == 1:  # a request still on its way when the first abort went out
                req = GenerateRequest([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4000), False, "late")
                late.append(fleet.slots[0].client.submit(req))
                deadline = time.monotonic() + 60
                while fleet.slots[0].client.load() == 0:
                    assert time.monotonic() < deadline, "the late request never reached the engine"
                    time.sleep(0.01)

        monkeypatch.setattr(fleet, "abort_request", abort_then_a_late_request)
        monkeypatch.setattr(fleet_mod, "DRAIN_POLL_S", 0.05)
        fleet.release_memory_occupation()  # the server refuses (HTTP 400) a release while a request runs
        assert len(aborts) >= 2
        assert late[0].result(60).finish_type == "abort"
        assert [_calls(s)[-1] for s in fleet.slots] == ["/release_memory_occupation weights,kv_cache,cuda_graph"] * 2
        fleet.resume_memory_occupation()
    finally:
        fleet.shutdown()


def test_a_drain_that_never_ends_says_what_it_waited_for(model, tmp_path, ray_session, monkeypatch):
    from miles.config.fault_tolerance import FaultToleranceConfig
    from miles.ray.engine_factory import builtin_fleet
    from miles.rollout.engine.http_client import HttpEngine

    fleet = builtin_fleet(str(model), num_engines=1, policy="round_robin", ft=FaultToleranceConfig(rollout_health_check_first_wait=3600), log_dir=tmp_path)
    try:
        monkeypatch.setattr(HttpEngine, "load", lambda self, timeout=None: 3)
        with pytest.raises(TimeoutError, match=r"timed out after 1 s waiting for the rollout engines to finish their requests before releasing memory \(still running or waiting: \{'http://127\.0\.0\.1:\d+': 3\}\)"):
            fleet.drain(timeout_s=1)
    finally:
        fleet.shutdown()
