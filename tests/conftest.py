"""Shared fixtures: a `device` parameter that covers CPU always and CUDA under the `gpu` marker;
a local Ray shared by the modules that use it; Ray groups whose trainers report every 10 ms
(`quick_polls`) and that wait for members being started (`members_first`)."""

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
    # the modules that use the shared local Ray (`ray_session`) run last, one after another,
    # each in its own order: Ray starts once, and no other test meets it (tests that start
    # Ray or a cluster of their own, or a job that would join a running Ray, run before)
    shared = {item.module.__name__ for item in items if "ray_session" in item.fixturenames}
    items.sort(key=lambda item: item.module.__name__ in shared)  # stable


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> torch.device:
    """Run a test on CPU, and on CUDA when the `gpu` tests run on a machine that has one."""
    return torch.device(request.param)


_OURS: dict = {}  # the shared Ray's GCS address, while this process is connected to it


# custom resources the shared Ray offers, for runs with cluster.trainer_resources and
# shard_resources (tests/test_backends.py)
TEST_RESOURCES = {"tg_trainer": 64, "tg_shard": 64}


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray on loopback, shared by the modules that ask for it (they run last, see
    `pytest_collection_modifyitems`): starting Ray costs seconds of CPU. Every Ray group a
    test builds is shut down by that test; a module that leaves CPUs held (a failed test's
    actors or placement groups) takes this Ray down with it, so the next module starts a
    fresh one."""
    import time

    import ray

    ours = ray.is_initialized() and _OURS.get("gcs") == ray.get_runtime_context().gcs_address
    if not ours:
        if ray.is_initialized():  # a cluster or job of another test, left connected
            ray.shutdown()
        ray.init(  # "local": a Ray of its own, never a cluster that happens to run here
            address="local", _node_ip_address="127.0.0.1", num_cpus=8, include_dashboard=False,
            namespace="tidegraph-tests", configure_logging=False,
            resources=dict(TEST_RESOURCES),
        )  # fmt: skip
        _OURS["gcs"] = ray.get_runtime_context().gcs_address
    yield
    for _ in range(100):  # bounded: placement groups are released asynchronously
        if ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"):
            break
        time.sleep(0.05)
    else:
        _OURS.clear()
        ray.shutdown()


def pytest_sessionfinish(session, exitstatus):
    if _OURS:
        import ray

        _OURS.clear()
        ray.shutdown()


@pytest.fixture
def quick_polls(monkeypatch):
    """Trainers report their steps (and read stop requests) every 10 ms: a kill or a resize
    lands mid-pass."""
    from tidegraph.orchestrator.ray_group import RayGroup

    monkeypatch.setattr(RayGroup, "progress_s", 0.01)


@pytest.fixture
def members_first(monkeypatch):
    """Ray groups of this test wait, at each pass boundary, for the members being started to
    be up (at most 120 s): trainers toward the wanted count, spares, shard successors, shard
    actors toward the wanted count. Starting a process takes seconds of CPU, which a run
    would otherwise have to outlast on 2 cores; so the elastic tests' runs can be short, and
    members still join mid-run, at the next pass's first step boundary."""
    import time

    import ray

    from tidegraph.orchestrator.ray_group import RayGroup

    original = RayGroup._pass

    def _pass(self, *args, **kwargs):
        for _ in range(2400):  # bounded: 120 s
            self._plan(force=True)  # starts members in placed slots; the requests are kept
            starting = [j[2] for j in self.joiners.values()]
            starting += [s[2] for s in self.shard_successors.values()]
            starting += [s[2] for s in self.shard_joiners.values()]
            lacking = len(self.joiners) < self.target - self.num_trainers
            lacking = lacking or bool(self._wanted_moves - set(self.shard_successors))
            hosts = len(self._shard_hosts()) + len(self.shard_joiners)
            lacking = lacking or hosts < min(self.shard_target, self.num_shards)
            up = ray.wait(starting, num_returns=len(starting), timeout=0)[0] if starting else []
            if not lacking and len(up) == len(starting):
                break
            time.sleep(0.05)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(RayGroup, "_pass", _pass)
