"""Ray actors: thin `ray.remote` wrappers over the shard and trainer cores and the store host.

Actors are named `tidegraph-shard-{p}`, `tidegraph-trainer-{w}` and `tidegraph-coordinator` in a
namespace named after the run, so `ray.get_actor(name, namespace=run)` finds them.
"""

from tidegraph.actors.coordinator import CoordinatorActor
from tidegraph.actors.shard import GraphShardActor, RemoteShard
from tidegraph.actors.trainer import TrainerActor

__all__ = ["CoordinatorActor", "GraphShardActor", "RemoteShard", "TrainerActor"]
