"""Prometheus endpoint: real HTTP GETs on a free port, exact exposition text, port-in-use and shutdown."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from miles.config.tracking import TrackingConfig
from miles.errors import UserError
from miles.tracking import Tracker
from miles.tracking.prometheus_sink import exposition


def _get(port: int, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return r.headers["Content-Type"], r.read().decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_serves_latest_gauges(run_dir: Path) -> None:
    port = _free_port()
    cfg = TrackingConfig(use_prometheus=True, prometheus_port=port, prometheus_run_name='exp "7"')
    t = Tracker(cfg, run_dir=run_dir, run_id="r", params={}, prometheus_host="127.0.0.1")
    assert t.prometheus.port == port
    t.log({"rollout/raw_reward": 0.25, "eval/gsm8k-x/pass@4": 1}, step=1)
    t.log({"rollout/raw_reward": 0.75, "train/grad_norm": float("inf")}, step=2)
    content_type, body = _get(port)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
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
        "# HELP miles_step last logged step\n"
        "# TYPE miles_step gauge\n"
        f"miles_step{label} 2.0\n"
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(port, "/other")
    assert err.value.code == 404
    assert t.finish() == {}
    with pytest.raises(urllib.error.URLError):  # finish() stopped the server
        _get(port)


def test_run_name_defaults_to_run_id_and_nan_is_spelled_nan() -> None:
    assert exposition({"g": ("k", float("nan"))}, "run-1").splitlines()[-1] == 'g{run_name="run-1"} NaN'
    assert exposition({}, "x") == "\n"


def test_port_in_use_is_a_user_error_and_earlier_sinks_are_closed(mlflow_run_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = TrackingConfig(use_mlflow=True, use_prometheus=True, prometheus_port=port)
        with pytest.raises(UserError, match=f"--prometheus-port {port} is already in use") as info:
            Tracker(cfg, run_dir=mlflow_run_dir, run_id="r", params={}, prometheus_host="127.0.0.1")
    assert info.value.option == "--prometheus-port"
    # The MLflow run opened before the failing sink was closed, marked FAILED, not left RUNNING.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{mlflow_run_dir.resolve() / 'mlflow.db'}")
    run_id = (mlflow_run_dir / "mlflow_run_id.txt").read_text().strip()
    assert client.get_run(run_id).info.status == "FAILED"
