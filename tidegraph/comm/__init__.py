"""Communication between trainers: the store host, collective groups per membership."""

from tidegraph.comm.collective import Collective, StoreHost

__all__ = ["Collective", "StoreHost"]
