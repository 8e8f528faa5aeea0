"""Temporal neighbour sampling over the dynamic graph store."""

from tidegraph.sampling.block import Block
from tidegraph.sampling.sampler import TemporalSampler

__all__ = ["Block", "TemporalSampler"]
