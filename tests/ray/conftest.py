"""One Ray for the whole test session (starting one costs ~5 s and ~1 GB)."""

import pytest


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
