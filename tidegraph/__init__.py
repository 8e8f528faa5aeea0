"""tidegraph: continuous training of temporal graph neural networks on an elastic Ray cluster."""

__version__ = "0.1.0"
