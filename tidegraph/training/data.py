"""Loading a dataset as one time-ordered `EventBatch`: the single place that reads files.

`load_stream` accepts a bundled name (`wikipedia`, `collegemsg`) or a path. The bundled files are
read here directly with pyarrow (known-good files whose ids are already dense: wikipedia's items
follow its users). Any other path goes through `tidegraph.storage.loaders.load_events`: every
format the loaders read (detected from the file), with their validation and error messages,
quarantine of bad rows when asked, and an in-memory sort (the whole stream is loaded anyway);
edge features come along. Nothing else in training reads files.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow.csv as pacsv
import torch

from tidegraph.storage.events import EventBatch
from tidegraph.storage.loaders import load_events

__all__ = ["BUNDLED", "Stream", "load_stream", "stream_of"]

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


def load_stream(
    dataset: str,
    max_events: int | None = None,
    *,
    format: str = "auto",
    quarantine: str | None = None,
) -> Stream:
    """The stream of a bundled name or a file; `format` and `quarantine` apply to files."""
    if dataset.lower() not in BUNDLED:
        return _load_file(_resolve(dataset), max_events, format, quarantine)
    path = _resolve(dataset)
    if path.name.startswith("CollegeMsg"):
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


def _load_file(path: Path, max_events: int | None, format: str, quarantine: str | None):
    events = load_events(path, format, sort="full", quarantine=quarantine)
    if max_events is not None:
        events = events.select(slice(0, max_events))
    if len(events) == 0:
        raise ValueError(f"data.dataset: {path} holds no valid events")
    return stream_of(events, path.name)


def stream_of(events: EventBatch, name: str) -> Stream:
    """`events` (time-ordered, not empty) as a stream: eids become their positions, the rows
    of the stream and of its edge-feature store."""
    events.eid = torch.arange(len(events))
    num_nodes = int(torch.maximum(events.src.max(), events.dst.max())) + 1
    feat = events.edge_feat
    edge_dim = 0 if feat is None else int(feat.shape[1])
    return Stream(events=events, num_nodes=num_nodes, edge_dim=edge_dim, name=name)


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
