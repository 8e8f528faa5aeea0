"""The coordinator actor: hosts the trainers' rendezvous store (never a trainer's process)."""

from __future__ import annotations

import ray

from tidegraph.comm.collective import StoreHost

__all__ = ["CoordinatorActor"]

CoordinatorActor = ray.remote(num_cpus=0)(StoreHost)
