"""Temporal neighbour sampling over the dynamic graph store."""

from tidegraph.sampling.block import Block

__all__ = ["Block"]
