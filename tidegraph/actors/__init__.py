"""Ray actors: thin `ray.remote` wrappers over the shard and trainer cores, and the run's
coordinator.

Actors are named `tidegraph-shard-{p}`, `tidegraph-trainer-{w}` and `tidegraph-coordinator` in a
namespace named after the run, so `ray.get_actor(name, namespace=run)` finds them.

Names are imported on first use: a worker process that runs the coordinator imports this
package, and the coordinator must not pay for torch, which the shard and trainer modules import.
"""

import importlib

_MODULES = {
    "CoordinatorActor": "tidegraph.actors.coordinator",
    "GraphShardActor": "tidegraph.actors.shard",
    "RemoteShard": "tidegraph.actors.shard",
    "TrainerActor": "tidegraph.actors.trainer",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)
