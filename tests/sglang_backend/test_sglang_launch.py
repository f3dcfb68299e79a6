"""The SGLang launcher as pure functions: engine layout, server and router argv, health wait.

Run: `pytest tests/sglang/test_sglang_launch.py` (seconds; a local HTTP server stands in for /health).
"""

from __future__ import annotations

import http.server
import sys
import threading

import pytest

from miles.config.resolve import build_config, resolve
from miles.errors import UserError
from miles.rollout.sglang.launch import EngineSlot, engine_layout, router_argv, server_argv, wait_healthy

BASE = {"rollout_backend": "sglang", "hf_checkpoint": "/models/Qwen3-4B", "prompt_data": "p.jsonl", "rollout_batch_size": 8, "global_batch_size": 8, "num_rollout": 1}


def config(**values):
    return resolve(build_config({**BASE, **values}, environ={}))


def test_layout_colocated_uses_the_training_gpus():
    layout = engine_layout(config(colocate=True, actor_num_gpus_per_node=8, rollout_num_gpus_per_engine=2))
    assert (layout.num_engines, layout.gpus_per_engine, layout.nodes_per_engine) == (4, 2, 1)


def test_layout_engine_spanning_two_nodes():
    layout = engine_layout(config(actor_num_gpus_per_node=8, rollout_num_gpus=32, rollout_num_gpus_per_engine=16))
    assert (layout.num_engines, layout.gpus_per_engine, layout.nodes_per_engine) == (2, 16, 2)


@pytest.mark.parametrize("values", [{"rollout_num_gpus": 6, "rollout_num_gpus_per_engine": 4}, {"rollout_num_gpus": 24, "rollout_num_gpus_per_engine": 12}])
def test_bad_layouts_are_user_errors(values):
    with pytest.raises(UserError):
        engine_layout(config(actor_num_gpus_per_node=8, **values))


def test_server_argv_exactly():
    cfg = config(actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2, rollout_seed=7, sglang_mem_fraction_static=0.7)
    argv = server_argv(cfg, EngineSlot(index=1, host="10.0.0.2", port=30002, nccl_port=30003))
    assert argv == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/models/Qwen3-4B", "--host", "10.0.0.2", "--port", "30002",
        "--tp-size", "2", "--random-seed", "8", "--nccl-port", "30003", "--skip-server-warmup", "--mem-fraction-static", "0.7",
    ]
    restarted = server_argv(cfg, EngineSlot(index=1, host="10.0.0.2", port=30002, nccl_port=30003), seed=1008)
    assert restarted[restarted.index("--random-seed") + 1] == "1008"  # the fleet's seed for a restarted engine


def test_server_argv_colocated_multi_node_and_separate_env():
    cfg = config(
        colocate=True, actor_num_nodes=1, actor_num_gpus_per_node=8, rollout_num_gpus=16, rollout_num_gpus_per_engine=16,
        sglang_server_command="/opt/sglang/bin/python -m sglang.launch_server", sglang_enable_dp_lm_head=True,
    )
    argv = server_argv(cfg, EngineSlot(index=0, host="h1", port=1, nccl_port=2, node_rank=1, dist_init_addr="h0:5000"))
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert argv[argv.index("--tp-size") + 1] == "16"
    assert "--enable-memory-saver" in argv  # --offload-rollout follows --colocate
    assert argv[-7:] == ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h0:5000", "--enable-dp-lm-head"]


def test_router_argv_binds_prometheus_to_loopback_on_its_own_port():
    cfg = config(sglang_router_policy="round_robin", sglang_router_disable_health_check=True)
    argv = router_argv(cfg, host="10.0.0.1", port=31000, prometheus_port=31001)
    assert argv == [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "10.0.0.1", "--port", "31000",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "31001", "--policy", "round_robin",
        "--health-check-endpoint", "/health", "--request-timeout-secs", "14400", "--log-level", "warn",
        "--health-check-interval-secs", "30", "--disable-health-check",
    ]  # fmt: skip
    cfg = config(sglang_router_prometheus_port=9100, sglang_router_prometheus_host="0.0.0.0")
    argv = router_argv(cfg, host="h", port=1, prometheus_port=2)
    assert argv[argv.index("--prometheus-host") :][:4] == ["--prometheus-host", "0.0.0.0", "--prometheus-port", "9100"]


def test_router_argv_takes_the_users_router_option_instead_of_the_fleet_default():
    """One flag, once: --sglang-router-request-timeout-secs replaces miles' 14400, it is not added twice."""
    cfg = config(sglang_router_request_timeout_secs=60, sglang_router_log_level="debug", rollout_health_check_interval=5.0)
    argv = router_argv(cfg, host="h", port=1, prometheus_port=2, worker_urls=["http://a:1", "http://b:2"])
    assert argv.count("--request-timeout-secs") == 1 and argv[argv.index("--request-timeout-secs") + 1] == "60"
    assert argv.count("--log-level") == 1 and argv[argv.index("--log-level") + 1] == "debug"
    assert argv[argv.index("--health-check-interval-secs") + 1] == "5"  # --rollout-health-check-interval
    assert argv[argv.index("--worker-urls") :][:3] == ["--worker-urls", "http://a:1", "http://b:2"]


class _Health(http.server.BaseHTTPRequestHandler):
    answers: list[int] = []

    def do_GET(self):  # noqa: N802
        code = self.answers.pop(0) if self.answers else 200
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()


def test_wait_healthy_polls_until_200(server):
    _Health.answers = [503, 503]
    url = f"http://127.0.0.1:{server.server_port}"
    waited = wait_healthy(url, what="engine 0", timeout_s=10, poll_s=0.01)
    assert waited < 10 and _Health.answers == []


def test_wait_healthy_times_out_naming_what_it_waited_for():
    clock = iter(range(0, 1000, 5))
    with pytest.raises(TimeoutError, match=r"SGLang engine 3 did not answer http://127.0.0.1:9/health within 20 s"):
        wait_healthy("http://127.0.0.1:9", what="SGLang engine 3", timeout_s=20, clock=lambda: next(clock), sleep=lambda s: None)


def test_wait_healthy_stops_when_the_process_dies():
    class Dead:
        def poll(self):
            return 137

    with pytest.raises(RuntimeError, match="exited with code 137"):
        wait_healthy("http://127.0.0.1:9", what="SGLang engine 0", timeout_s=600, process=Dead())
