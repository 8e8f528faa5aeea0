"""Shared fixtures: a `device` parameter that covers CPU always and CUDA under the `gpu` marker."""

import os

# Ray started by tests binds to loopback: on Linux Ray replaces 127.0.0.1 by the address it
# would be reached at from other hosts, unless it is told it runs on one machine (read when
# ray is imported, so before any test module imports it)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # trainer collectives on loopback too

import pytest  # noqa: E402
import torch  # noqa: E402

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """Run a test on CPU, and on CUDA when the `gpu` tests run on a machine that has one."""
    return torch.device(request.param)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray on loopback for one test module (its actors and namespaces go with it)."""
    import ray

    ray.init(  # "local": a Ray of its own, never a cluster that happens to run here
        address="local", _node_ip_address="127.0.0.1", num_cpus=8, include_dashboard=False,
        namespace="tidegraph-tests", configure_logging=False,
    )  # fmt: skip
    yield
    ray.shutdown()
