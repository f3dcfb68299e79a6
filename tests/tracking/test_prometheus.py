"""Prometheus endpoint: real HTTP GETs on a free port, exact exposition text, the bind address,
port-in-use and shutdown. Served by prometheus_client."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from miles.config.tracking import TrackingConfig
from miles.errors import UserError
from miles.tracking import Tracker
from miles.utils.net import free_port as _net_free_port


def _get(host: str, port: int, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as r:
        return r.headers["Content-Type"], r.read().decode()


def _free_port() -> int:
    return _net_free_port("127.0.0.1")


def _other_local_address() -> str | None:
    """An address of this machine other than loopback (to check the endpoint is not bound to it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_endpoint_serves_latest_gauges(run_dir: Path) -> None:
    port = _free_port()
    cfg = TrackingConfig(use_prometheus=True, prometheus_port=port, prometheus_run_name='exp "7"')
    t = Tracker(cfg, run_dir=run_dir, run_id="r", params={})
    assert t.prometheus.port == port
    t.log({"rollout/raw_reward": 0.25, "eval/gsm8k-x/pass@4": 1}, step=1)
    t.log({"rollout/raw_reward": 0.75, "train/grad_norm": float("inf"), "train/nan": float("nan")}, step=2)
    content_type, body = _get("127.0.0.1", port)
    assert content_type.startswith("text/plain; version=0.0.4")
    label = '{run_name="exp \\"7\\""}'
    assert body == (
        "# HELP miles_metric_eval_gsm8k_x_pass_at_4 eval/gsm8k-x/pass@4\n"
        "# TYPE miles_metric_eval_gsm8k_x_pass_at_4 gauge\n"
        f"miles_metric_eval_gsm8k_x_pass_at_4{label} 1.0\n"
        "# HELP miles_metric_rollout_raw_reward rollout/raw_reward\n"
        "# TYPE miles_metric_rollout_raw_reward gauge\n"
        f"miles_metric_rollout_raw_reward{label} 0.75\n"
        "# HELP miles_metric_train_grad_norm train/grad_norm\n"
        "# TYPE miles_metric_train_grad_norm gauge\n"
        f"miles_metric_train_grad_norm{label} +Inf\n"
        "# HELP miles_metric_train_nan train/nan\n"
        "# TYPE miles_metric_train_nan gauge\n"
        f"miles_metric_train_nan{label} NaN\n"
        "# HELP miles_step last logged step\n"
        "# TYPE miles_step gauge\n"
        f"miles_step{label} 2.0\n"
    )
    assert body == t.prometheus.page()
    assert t.finish() == {}
    with pytest.raises(urllib.error.URLError):  # finish() stopped the server
        _get("127.0.0.1", port)


def test_bound_to_loopback_by_default(run_dir: Path) -> None:
    """Nothing is exposed to other hosts unless --prometheus-host says so."""
    assert TrackingConfig().prometheus_host == "127.0.0.1"
    port = _free_port()
    t = Tracker(TrackingConfig(use_prometheus=True, prometheus_port=port), run_dir=run_dir, run_id="r", params={})
    try:
        assert t.prometheus.server.server_address[0] == "127.0.0.1"
        other = _other_local_address()
        if other is not None:
            with pytest.raises(urllib.error.URLError):
                _get(other, port)
    finally:
        t.finish()
    t = Tracker(
        TrackingConfig(use_prometheus=True, prometheus_port=port, prometheus_host="0.0.0.0"), run_dir=run_dir, run_id="r", params={}
    )
    try:
        assert t.prometheus.server.server_address[0] == "0.0.0.0"
        assert "miles" not in _get("127.0.0.1", port)[1]  # served (empty) on every interface
    finally:
        t.finish()


def test_host_that_is_not_local_is_a_user_error(run_dir: Path) -> None:
    cfg = TrackingConfig(use_prometheus=True, prometheus_port=_free_port(), prometheus_host="203.0.113.1")  # TEST-NET-3
    with pytest.raises(UserError, match="--prometheus-host 203.0.113.1 is not an address of this machine") as info:
        Tracker(cfg, run_dir=run_dir, run_id="r", params={})
    assert info.value.option == "--prometheus-host"


def test_port_in_use_is_a_user_error_and_earlier_sinks_are_closed(mlflow_run_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = TrackingConfig(use_mlflow=True, use_prometheus=True, prometheus_port=port)
        with pytest.raises(UserError, match=f"--prometheus-port {port} is already in use") as info:
            Tracker(cfg, run_dir=mlflow_run_dir, run_id="r", params={})
    assert info.value.option == "--prometheus-port"
    # The MLflow run opened before the failing sink was closed, marked FAILED, not left RUNNING.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{mlflow_run_dir.resolve() / 'mlflow.db'}")
    run_id = (mlflow_run_dir / "mlflow_run_id.txt").read_text().strip()
    assert client.get_run(run_id).info.status == "FAILED"
