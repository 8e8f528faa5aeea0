"""Loading a dataset as one time-ordered `EventBatch`: the single place that reads files.

`load_stream` accepts a bundled name (`wikipedia`, `collegemsg`) or a path. The bundled files are
read here directly with pyarrow (their ids are already dense: wikipedia's items follow its
users). Swap this function body for `tidegraph.storage.loaders.load_events` to take every format
the loaders support; nothing else in training reads files.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv
import torch

from tidegraph.storage.events import EventBatch

__all__ = ["BUNDLED", "Stream", "load_stream"]

BUNDLED = {
    "wikipedia": "wikipedia_u_i_ts_label.csv.gz",
    "collegemsg": "CollegeMsg.txt.gz",
}


@dataclass
class Stream:
    """The whole stream in time order, with the node-id bound and the edge-feature width."""

    events: EventBatch
    num_nodes: int
    edge_dim: int
    name: str


def load_stream(dataset: str, max_events: int | None = None) -> Stream:
    path = _resolve(dataset)
    if path.name.startswith("CollegeMsg") or path.suffixes[:1] == [".txt"]:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(column_names=["u", "i", "ts"]),
            parse_options=pacsv.ParseOptions(delimiter=" "),
        )
    else:
        table = pacsv.read_csv(path)
    cols = table.column_names
    src = table.column(cols[0]).to_numpy().astype(np.int64)
    dst = table.column(cols[1]).to_numpy().astype(np.int64)
    t = table.column(cols[2]).to_numpy().astype(np.float64)
    label = table.column(cols[3]).to_numpy().astype(np.int64) if len(cols) > 3 else None
    order = np.argsort(t, kind="stable")
    if max_events is not None:
        order = order[:max_events]
    n = len(order)
    events = EventBatch(
        src=torch.from_numpy(src[order].copy()),
        dst=torch.from_numpy(dst[order].copy()),
        t=torch.from_numpy(t[order].copy()),
        eid=torch.arange(n),
        label=None if label is None else torch.from_numpy(label[order].copy()),
    )
    num_nodes = int(max(src.max(), dst.max())) + 1 if len(src) else 0
    return Stream(events=events, num_nodes=num_nodes, edge_dim=0, name=path.name)


def _resolve(dataset: str) -> Path:
    key = dataset.lower()
    if key in BUNDLED:
        return Path(str(resources.files("tidegraph.data") / BUNDLED[key]))
    path = Path(dataset)
    if not path.exists():
        raise ValueError(
            f"data.dataset: {dataset!r} is neither a bundled dataset {sorted(BUNDLED)} "
            "nor an existing file"
        )
    return path
