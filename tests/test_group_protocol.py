"""Both backends' groups implement the `Group` interface the learner, the controller and the
metrics use (so none of them asks a group what it has), and share one core: the same
routing, slicing and common state."""

import inspect

import pytest
import torch

from tidegraph.orchestrator.ray_group import RayGroup
from tidegraph.storage.events import EventBatch
from tidegraph.training import RunConfig
from tidegraph.training.group import LocalGroup
from tidegraph.training.groupcore import GroupCore
from tidegraph.training.protocol import Group

CONFIG = {
    "model": {"name": "tgn", "dim": 16, "time_dim": 8, "memory_dim": 16},
    "data": {"dataset": "wikipedia", "max_events": 200},
    "cluster": {"backend": "local", "shards": 2, "trainers": 3},
    "seed": 5,
}


def members(kind) -> set[str]:
    """Methods and properties `kind` declares (a protocol's, without typing's own)."""
    own = set(vars(Group)) if kind is Group else set(dir(kind))
    return {
        n
        for n in own
        if not n.startswith("_")
        and n in vars(Group)
        and (inspect.isfunction(vars(Group)[n]) or isinstance(vars(Group)[n], property))
    }


def test_a_local_group_is_a_group():
    group = LocalGroup(RunConfig.from_dict(CONFIG), 10, 0)
    assert isinstance(group, Group)
    assert (group.shard_actors, group.supports_update_log, group.runs_passes) == (2, False, False)
    assert group.recoveries == group.resizes == group.shard_moves == group.shard_resizes == []


def test_a_ray_group_declares_every_method_of_a_group():
    """Without Ray running: the class has every method and property (a live one is checked
    with `isinstance` in tests/test_ray.py)."""
    declared = members(Group)
    assert len(declared) > 20
    assert members(RayGroup) == declared
    assert members(LocalGroup) == declared


def test_both_groups_are_cut_and_routed_by_one_core():
    assert issubclass(LocalGroup, GroupCore) and issubclass(RayGroup, GroupCore)
    for name in ("_route", "_train_cut", "_eval_cut", "_common_state", "report"):
        assert name not in vars(LocalGroup) and name not in vars(RayGroup), name


def test_an_evaluation_batch_is_cut_for_the_trainers_that_get_a_slice():
    cfg = RunConfig.from_dict({**CONFIG, "sampler": {"history": "batch"}})
    group = LocalGroup(cfg, 10, 0)
    ev = EventBatch(torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([5.0, 7.0]),
                    torch.tensor([0, 1]))  # fmt: skip
    cut, start = group._eval_cut(ev, torch.zeros(2, 1, dtype=torch.long))
    assert [w for w, _, _ in cut] == [0, 1]  # 2 events for 3 trainers: the third has none
    assert start == 5.0
    assert torch.equal(torch.cat([e.t for _, e, _ in cut]), ev.t)


def test_the_update_log_on_a_local_group_is_refused_by_name():
    group = LocalGroup(RunConfig.from_dict(CONFIG), 10, 0)
    with pytest.raises(ValueError, match="cluster.backend 'ray'"):
        group.set_update_log("/tmp/x", 1)


class _Joining:
    """What `RayGroup._first_connect` uses of a group: `_connect`, failing as told."""

    connect_tries = RayGroup.connect_tries
    _first_connect = RayGroup._first_connect

    def __init__(self, failures: list) -> None:
        self.failures, self.calls = failures, 0

    def _connect(self) -> None:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)


def _task_error(cause: Exception):
    import ray

    return ray.exceptions.RayTaskError("connect", "traceback", cause)


def test_a_first_rendezvous_that_timed_out_is_joined_again_a_bounded_number_of_times():
    import torch.distributed as dist

    timeout = dist.DistStoreError("wait timeout after 8000ms")
    group = _Joining([_task_error(timeout)])
    group._first_connect()
    assert group.calls == 2  # joined on the second try
    group = _Joining([_task_error(timeout) for _ in range(RayGroup.connect_tries)])
    with pytest.raises(Exception) as raised:
        group._first_connect()
    assert raised.value.cause is timeout
    assert group.calls == RayGroup.connect_tries
    bad = ValueError("bad config")
    group = _Joining([_task_error(bad)])  # not a rendezvous: raised at once
    with pytest.raises(Exception) as raised:
        group._first_connect()
    assert raised.value.cause is bad
    assert group.calls == 1
