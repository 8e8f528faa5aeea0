"""Loading a dataset as one time-ordered `EventBatch`: the single place training reads files.

`load_stream` accepts a bundled name (the registry is `tidegraph.data`: `wikipedia`, `uci`
and their aliases such as `collegemsg`) or a path. Both go through
`tidegraph.storage.ingest.load_events`: every format the loaders read (detected from the file),
with their validation and error messages, quarantine of bad rows when asked, and an in-memory
sort (the whole stream is loaded anyway); edge features come along when the format has them or
the data section names them. `stream_for(config.data)` applies every option of a `DataConfig`.
Nothing else in training reads files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tidegraph.data import bundled_names, bundled_path, is_bundled
from tidegraph.storage.events import EventBatch
from tidegraph.storage.ingest import load_events, parse_columns, parse_features

__all__ = ["Stream", "load_stream", "stream_for", "stream_of"]

log = logging.getLogger(__name__)


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
    columns: str | dict | None = None,
    header: bool | None = None,
    features: str | list | None = None,
) -> Stream:
    """The stream of a bundled name or a file; the other options apply to files (the bundled
    files are read with their known layout)."""
    num_nodes = None
    if is_bundled(dataset):
        path = bundled_path(dataset)
        log.info("bundled dataset %s: %s", dataset, path)
        given = {"format": format != "auto", "quarantine": quarantine, "columns": columns,
                 "header": header is not None, "features": features}  # fmt: skip
        ignored = [k for k, v in given.items() if v]
        if ignored:
            log.warning("%s apply to files only: %s is read with its known layout",
                        ", ".join(ignored), dataset)  # fmt: skip
        events = load_events(path, sort="full")
        num_nodes = _num_nodes(events)  # of the whole file, as always for bundled data
    else:
        path = _resolve(dataset)
        options = {
            "columns": parse_columns(columns, "data.columns"),
            "features": parse_features(features, "data.features"),
            "header": header,
        }
        if options["features"] is not None and getattr(options["columns"], "features", None):
            raise ValueError("data.features (--features): the feature columns are named in "
                             "data.columns (--columns) too; name them once")  # fmt: skip
        events = load_events(path, format, sort="full", quarantine=quarantine, **options)
    if max_events is not None:
        events = events.select(slice(0, max_events))
    if len(events) == 0:
        raise ValueError(f"data.dataset: {path} holds no valid events")
    stream = stream_of(events, path.name)
    if num_nodes is not None:
        stream.num_nodes = num_nodes
    return stream


def stream_for(data) -> Stream:
    """The stream a `DataConfig` names, with all its loader options."""
    return load_stream(
        data.dataset,
        data.max_events,
        format=data.format,
        quarantine=data.quarantine,
        columns=data.columns,
        header=data.header,
        features=data.features,
    )


def stream_of(events: EventBatch, name: str) -> Stream:
    """`events` (time-ordered, not empty) as a stream: eids become their positions, the rows
    of the stream and of its edge-feature store."""
    events.eid = torch.arange(len(events))
    feat = events.edge_feat
    edge_dim = 0 if feat is None else int(feat.shape[1])
    return Stream(events=events, num_nodes=_num_nodes(events), edge_dim=edge_dim, name=name)


def _num_nodes(events: EventBatch) -> int:
    return int(torch.maximum(events.src.max(), events.dst.max())) + 1


def _resolve(dataset: str) -> Path:
    path = Path(dataset)
    if not path.exists():
        raise ValueError(
            f"data.dataset: {dataset!r} is neither a bundled dataset {bundled_names()} "
            "(or an alias such as 'collegemsg') nor an existing file"
        )
    return path
