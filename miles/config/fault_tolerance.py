"""Fault-tolerance options: health checks of the rollout engines and their recovery."""

from __future__ import annotations

from dataclasses import dataclass

from miles.config.fields import option

_NOT_YET = "engine health monitoring and recovery are not built yet; a crashed run resumes from its last checkpoint with --load"


@dataclass
class FaultToleranceConfig:
    use_fault_tolerance: bool = option(
        False, help="Health-check the rollout engines and restart dead ones.", unsupported=_NOT_YET
    )
    rollout_health_check_interval: float = option(
        30.0, help="Seconds between engine health checks.", unsupported=_NOT_YET
    )
    rollout_health_check_timeout: float = option(
        30.0, help="Seconds an engine may take to answer a health check.", unsupported=_NOT_YET
    )
    rollout_health_check_first_wait: float = option(
        0.0, help="Seconds to wait after (re)start before the first health check.", unsupported=_NOT_YET
    )
