"""Fault-tolerance options: health checks of the rollout engines and their recovery."""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.fields import option

@dataclass
class FaultToleranceConfig:
    use_fault_tolerance: bool = option(
        False,
        help=(
            "Restart a rollout engine server that fails its health check: it gets the current weights before it "
            "serves again and its in-flight requests are sent again. Without it a dead engine stops the run "
            "with a message naming it. (Engine servers run with --rollout-num-gpus.)"
        ),
    )
    rollout_health_check_interval: float = option(
        30.0, help="Seconds between health checks (/health_generate) of each engine server."
    )
    rollout_health_check_timeout: float = option(
        30.0, help="Seconds an engine server may take to answer a health check before it counts as dead."
    )
    rollout_health_check_first_wait: float = option(
        0.0, help="Seconds to wait after the engines start before the first health check."
    )
