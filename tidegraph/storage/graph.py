"""The dynamic graph store: a growing list of immutable segments with tiered compaction.

Each `add_edges` call sorts its batch into a new segment; segments are merged like a binary
counter (the newest two merge while the older one is no larger than the newer), so a node's
history spans O(log E) segments and every edge is re-sorted O(log E) times. Segments are listed
oldest first, which is also insertion order: ties in time are broken by it.

Assumptions: node ids are non-negative int64; `num_nodes` is the largest id seen plus one (ids
index node-feature and memory tables); times are float64 (int64 seconds are exact below 2**53);
`num_edges` counts inserted events, and with `add_reverse` each event is stored twice (from src
and from dst, with the same eid), which `num_stored_edges` counts.

State (`state_dict`) is the segments as they are, or (`piece_state`), for checkpoints that
reference what earlier ones wrote, pieces: the edges added between two checkpoints, each
written once and never again, whatever merges the segments go through later (merges rewrite
O(log E) of the graph per batch, which a checkpoint of the segments would rewrite with them).
Loading pieces groups the batches (their edges: those of eids in their spans) as adding them
and merging them as the counter says did, and builds each group's segment at once, which gives
the same segments bitwise (a merged segment's edges are in (node, t, batch, insertion) order).
This needs each batch's eids above those of the batches before it (`ordered`; stream positions
are); otherwise only the segments are state.

Placement: "cpu" and "cuda" keep every segment on that device. "pinned" keeps segments in pinned
host memory and queries them with CUDA kernels through zero-copy views (`uva_view`): the graph
can outgrow GPU memory while sampling still runs on the GPU, reading host memory over the bus.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch

from tidegraph.storage.checkpoint import pack_rows, unpack_rows
from tidegraph.storage.idmap import check_ids
from tidegraph.storage.segment import Segment
from tidegraph.storage.uva import uva_view

__all__ = ["DynamicGraph"]

log = logging.getLogger(__name__)

_PLACEMENTS = ("cpu", "cuda", "pinned")
_MAX_EXACT_TIME = 2.0**53


class DynamicGraph:
    """A time-indexed graph that only grows (apart from offloading old history)."""

    def __init__(self, device: str | torch.device = "cpu", add_reverse: bool = True) -> None:
        placement = str(device)
        if placement.split(":")[0] not in _PLACEMENTS:
            raise ValueError(f"DynamicGraph: device must be one of {_PLACEMENTS}, got {device!r}")
        if placement != "cpu" and not torch.cuda.is_available():
            raise ValueError(f"DynamicGraph: device {placement!r} needs CUDA, which is absent")
        self.placement = placement
        self.add_reverse = add_reverse
        self.segments: list[Segment] = []
        self.num_nodes = 0
        self.num_edges = 0
        self._next_eid = 0
        # [lo, hi) of each added batch's eids, oldest first, while each batch's eids are all
        # above the batches' before it (None once one was not: pieces are then not state)
        self.spans: list[tuple[int, int]] | None = []

    @property
    def device(self) -> torch.device:
        """Where queries run and inputs are expected (pinned segments are read from CUDA)."""
        return torch.device("cuda" if self.placement == "pinned" else self.placement)

    @property
    def num_stored_edges(self) -> int:
        return sum(s.num_edges for s in self.segments)

    # ---- ingest ---------------------------------------------------------------------------

    def add_edges(self, src, dst, t, eid=None) -> None:
        """Insert a batch of edges (torch or numpy 1-D arrays, any time order).

        Default eids continue after the largest eid so far (the number of events inserted so
        far while every eid was a default one), so they never collide. Invalid input (ids
        negative or non-integer, NaN or non-finite times, mismatched lengths) raises ValueError
        and leaves the graph unchanged.
        """
        src, dst, t = (
            _as_tensor(x, name, self.device) for x, name in ((src, "src"), (dst, "dst"), (t, "t"))
        )
        n = src.shape[0]
        if eid is None:
            eid = torch.arange(self._next_eid, self._next_eid + n, device=self.device)
        else:
            eid = _as_tensor(eid, "eid", self.device)
        src, dst, eid = (  # shapes and negatives: checked with the batch, in one host sync
            check_ids(x, "DynamicGraph", name=name, negative=False, one_dim=False)
            for x, name in ((src, "src"), (dst, "dst"), (eid, "eid"))
        )
        t = t.to(torch.float64)
        if not all(x.shape == (n,) for x in (dst, t, eid)):
            raise ValueError(
                "add_edges: src, dst, t and eid must be 1-D of equal length, got "
                f"{tuple(src.shape)}, {tuple(dst.shape)}, {tuple(t.shape)}, {tuple(eid.shape)}"
            )
        if n == 0:
            return
        _check_batch(src, dst, t, eid)
        if self.add_reverse:
            node = torch.stack([src, dst], 1).flatten()
            nbr = torch.stack([dst, src], 1).flatten()
            t, eid = t.repeat_interleave(2), eid.repeat_interleave(2)
        else:
            node, nbr = src, dst
        segment = self._place(Segment.build(node, nbr, t, eid))
        num_nodes = max(self.num_nodes, int(torch.maximum(src.max(), dst.max())) + 1)
        span = (int(eid.min()), int(eid.max()) + 1)
        next_eid = max(self._next_eid, span[1])
        # commit point: nothing above changed the graph, nothing below can leave it half-updated
        self._append(segment, span)
        self.num_nodes, self.num_edges, self._next_eid = num_nodes, self.num_edges + n, next_eid

    def _append(self, segment: Segment, span: tuple[int, int]) -> None:
        """A batch's segment (its eids in `span`), merged as the counter says."""
        self.segments.append(segment)
        if self.spans is not None and (not self.spans or span[0] >= self.spans[-1][1]):
            self.spans.append(span)
        else:
            self.spans = None
        try:
            self._compact()
        except (MemoryError, torch.OutOfMemoryError) as exc:  # the batch is stored; merge later
            log.warning("compaction postponed: %s; the graph stays valid, less compacted", exc)

    def _compact(self) -> None:
        """Merge the newest two segments while the older is no larger. Each merge replaces its
        inputs only once the merged segment exists, so a failure (out of memory) leaves a valid,
        less compacted graph."""
        while len(self.segments) >= 2 and (
            self.segments[-2].num_edges <= self.segments[-1].num_edges
        ):
            merged = self._place(Segment.merge(self.segments[-2], self.segments[-1]))
            self.segments[-2:] = [merged]

    def _place(self, segment: Segment) -> Segment:
        """Pinned placement: move to pinned host memory, keep CUDA views of it for queries."""
        if self.placement != "pinned":
            return segment
        host = segment.map(lambda x: x.cpu().pin_memory())
        return dataclasses.replace(host.map(lambda x: uva_view(x, self.device)), host=host)

    # ---- queries --------------------------------------------------------------------------

    def out_degree(self, nodes) -> torch.Tensor:
        """Number of stored edges of each node (reverse copies included), int64 like `nodes`."""
        nodes = _as_tensor(nodes, "nodes", self.device)
        nodes = check_ids(nodes, "DynamicGraph", name="nodes", negative=False, one_dim=False)
        deg = torch.zeros_like(nodes)
        for seg in self.segments:
            lo, hi = seg.node_ranges(nodes)
            deg += hi - lo
        return deg

    def temporal_neighbors(self, node: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All edges of `node` as (nbr, t, eid), newest first; ties: later-inserted first."""
        root = torch.tensor([int(node)], device=self.device)
        parts = []
        for seg in reversed(self.segments):
            lo, hi = seg.node_ranges(root)
            sl = slice(int(lo), int(hi))
            parts.append((seg.nbr[sl].long().flip(0), seg.t[sl].flip(0), seg.eid[sl].flip(0)))
        if not parts:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty, empty.double(), empty
        nbr, t, eid = (torch.cat(p) for p in zip(*parts, strict=True))
        order = torch.sort(t, descending=True, stable=True).indices
        return nbr[order], t[order], eid[order]

    # ---- maintenance ----------------------------------------------------------------------

    def offload_before(self, t: float) -> int:
        """Drop stored edges older than `t` and free their memory; returns how many went."""
        if math.isnan(t):
            raise ValueError("offload_before: t is NaN")
        before = self.num_stored_edges
        kept = []
        for seg in self.segments:
            if seg.t_min >= t:
                kept.append(seg)
            elif seg.t_max >= t:
                trimmed = seg.drop_before(t)
                if trimmed is not None:
                    kept.append(self._place(trimmed))
        if self.placement == "pinned":
            # kernels reading pinned memory through views are not tracked by the host caching
            # allocator: let queued ones finish before their memory can be handed out again
            torch.cuda.current_stream(self.device).synchronize()
        self.segments = kept
        self.spans = None  # the pieces would bring the dropped edges back
        dropped = before - self.num_stored_edges
        log.info("offloaded %d stored edges older than t=%s", dropped, t)
        return dropped

    def memory_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def memory_report(self) -> dict:
        """Bytes held in total and per stored edge, with the segment count."""
        stored = self.num_stored_edges
        total = self.memory_bytes()
        return {
            "placement": self.placement,
            "segments": len(self.segments),
            "num_edges": self.num_edges,
            "num_stored_edges": stored,
            "bytes": total,
            "bytes_per_stored_edge": total / stored if stored else 0.0,
        }

    # ---- state ----------------------------------------------------------------------------

    @property
    def ordered(self) -> bool:
        """Whether the graph's state can be pieces (see the module's docstring)."""
        return self.spans is not None

    @property
    def eid_end(self) -> int:
        """One past the eids of the batches added so far (0: none)."""
        return self.spans[-1][1] if self.spans else 0

    def rows_since(self, lo: int) -> dict:
        """The edges of eid `lo` and above (the batches added since the one that ended at
        `lo`), a piece: {"lo": lo, "rows": rows of (node, nbr, t, eid) packed by `pack_rows`,
        on the host}. Rows are 20 bytes (node and nbr int32, t float64, eid - lo int32) while
        ids and the piece's eids fit in int32, else 32 (int64 node, nbr and eid)."""
        narrow = self.num_nodes <= _INT32_MAX and self.eid_end - lo <= _INT32_MAX
        parts = []
        for seg in self.segments:  # each batch lies in one segment, its edges in their order
            seg = seg.host if seg.host is not None else seg
            keep = (seg.eid >= lo).nonzero().squeeze(1)
            if keep.numel():
                node, nbr, t, eid = (c.index_select(0, keep).cpu() for c in
                                     (seg.expanded_nodes(), seg.nbr, seg.t, seg.eid))  # fmt: skip
                if narrow:
                    cols = (node.int(), nbr.int(), t, (eid - lo).int())
                else:
                    cols = (node, nbr.long(), t, eid)
                parts.append(pack_rows(list(cols)))
        width = _NARROW_BYTES if narrow else _WIDE_BYTES
        rows = torch.cat(parts) if parts else torch.empty(0, width, dtype=torch.uint8)
        return {"lo": lo, "rows": rows}

    def piece_state(self, pieces: list) -> dict:
        """The state as `pieces` (every `rows_since` from 0 to `eid_end`, in order, or refs
        to them in a checkpoint store)."""
        if self.spans is None:
            raise ValueError("DynamicGraph.piece_state: batches were not added in eid order")
        return {
            "add_reverse": self.add_reverse,
            "num_nodes": self.num_nodes,
            "num_edges": self.num_edges,
            "next_eid": self._next_eid,
            "spans": torch.tensor(self.spans, dtype=torch.int64).reshape(-1, 2),
            "pieces": list(pieces),
        }

    def state_dict(self) -> dict:
        return {
            "add_reverse": self.add_reverse,
            "num_nodes": self.num_nodes,
            "num_edges": self.num_edges,
            "next_eid": self._next_eid,
            "spans": None if self.spans is None else torch.tensor(self.spans).reshape(-1, 2),
            "segments": [s.state_dict() for s in self.segments],
        }

    def load_state_dict(self, state: dict) -> None:
        self.add_reverse = state["add_reverse"]
        self.num_nodes = state["num_nodes"]
        self.num_edges = state["num_edges"]
        self._next_eid = state["next_eid"]
        spans = state.get("spans")  # none in state written before pieces: not ordered
        spans = None if spans is None else [tuple(x) for x in spans.tolist()]
        if "pieces" in state:
            self._load_pieces(state["pieces"], spans)
            return
        self.spans = spans
        # pinned: straight to host memory, never through the GPU (the graph may not fit there)
        where = "cpu" if self.placement == "pinned" else self.device
        self.segments = [
            self._place(Segment.from_state_dict(s).to(where)) for s in state["segments"]
        ]

    def _load_pieces(self, pieces: list, spans: list[tuple[int, int]]) -> None:
        """The segments again from pieces: each batch's edges (those of eids in its span),
        grouped as adding the batches one by one and merging them as the counter says did
        (`_counter_groups`), each group built into its segment at once: a merged segment
        holds its edges sorted by (node, t), ties in batch order and, within a batch, in
        insertion order, which is what building it from its batches' edges in that order
        gives, bitwise."""
        node, nbr, t, eid = _piece_columns(pieces)
        los = torch.tensor([lo for lo, _ in spans], dtype=torch.int64)
        batch = torch.searchsorted(los, eid, right=True) - 1
        counts = torch.bincount(batch.clamp(min=0), minlength=len(spans))
        his = torch.tensor([hi for _, hi in spans], dtype=torch.int64)
        stored = self.num_edges * (2 if self.add_reverse else 1)
        if eid.numel() != stored or bool((batch < 0).any() | (eid >= his[batch]).any()):
            raise ValueError(f"graph state: its pieces hold {eid.numel()} edges, not the "
                             f"{stored} of its {len(spans)} batches' spans")  # fmt: skip
        order = torch.argsort(batch, stable=True)  # a batch's edges keep their order
        where = "cpu" if self.placement == "pinned" else self.device
        groups = _counter_groups(counts.tolist())
        sizes = [size for size, _ in groups]
        cols = [x.index_select(0, order).to(where).split(sizes) for x in (node, nbr, t, eid)]
        self.segments, self.spans = [], list(spans)
        for i, (_, merged) in enumerate(groups):
            built = Segment.build(*(c[i] for c in cols), time_ordered=not merged)
            self.segments.append(self._place(built))


_INT32_MAX = 2**31 - 1
_NARROW = (torch.int32, torch.int32, torch.float64, torch.int32)  # eid - the piece's lo
_WIDE = (torch.int64, torch.int64, torch.float64, torch.int64)


def _row_bytes(dtypes) -> int:
    return sum(torch.empty(0, dtype=d).element_size() for d in dtypes)


_NARROW_BYTES, _WIDE_BYTES = _row_bytes(_NARROW), _row_bytes(_WIDE)


def _piece_columns(pieces: list) -> tuple[torch.Tensor, ...]:
    """(node, nbr, t, eid) of every edge of `pieces`, in order, as int64 and float64: pieces
    of `rows_since` ({"lo", "rows"} of 20- or 32-byte rows) or, as checkpoints before
    narrow pieces wrote them, 32-byte rows alone."""
    cols: list[list[torch.Tensor]] = [[], [], [], []]
    for piece in pieces or [torch.empty(0, _WIDE_BYTES, dtype=torch.uint8)]:
        lo, rows = (piece["lo"], piece["rows"]) if isinstance(piece, dict) else (0, piece)
        narrow = rows.shape[1] == _NARROW_BYTES
        if not narrow and rows.shape[1] != _WIDE_BYTES:
            raise ValueError(f"graph state: a piece has rows of {rows.shape[1]} bytes, not "
                             f"{_NARROW_BYTES} or {_WIDE_BYTES}")  # fmt: skip
        node, nbr, t, eid = unpack_rows(rows, list(_NARROW if narrow else _WIDE))
        for out, x in zip(cols, (node.long(), nbr.long(), t, eid.long() + (lo if narrow else 0)),
                          strict=True):  # fmt: skip
            out.append(x)
    return tuple(torch.cat(c) for c in cols)


def _counter_groups(sizes: list[int]) -> list[tuple[int, bool]]:
    """The segments that adding batches of `sizes` edges one at a time leaves, as `_compact`
    merges them (the newest two while the older is no larger): (edges, merged) of each, oldest
    first; each holds a run of consecutive batches. A loop per batch over counts only."""
    out: list[list] = []
    for size in sizes:
        out.append([size, False])
        while len(out) >= 2 and out[-2][0] <= out[-1][0]:
            newer = out.pop()
            out[-1] = [out[-1][0] + newer[0], True]
    return [(size, merged) for size, merged in out]


def _as_tensor(x, name: str, device: torch.device) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))  # torch takes no negative strides
    elif not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dim() != 1:
        raise ValueError(f"add_edges: {name} must be 1-D, got shape {tuple(x.shape)}")
    return x.to(device)


def _check_batch(src: torch.Tensor, dst: torch.Tensor, t: torch.Tensor, eid: torch.Tensor) -> None:
    """One host sync for all checks; the message names the first offending row."""
    bad_id = (src < 0) | (dst < 0) | (eid < 0)
    bad_t = ~torch.isfinite(t) | (t.abs() > _MAX_EXACT_TIME)
    flags = torch.stack([bad_id.any(), bad_t.any()]).tolist()
    if flags[0]:
        row = int(bad_id.nonzero()[0])
        raise ValueError(
            f"add_edges: row {row} has a negative id "
            f"(src={int(src[row])}, dst={int(dst[row])}, eid={int(eid[row])})"
        )
    if flags[1]:
        row = int(bad_t.nonzero()[0])
        value = float(t[row])
        if math.isfinite(value):
            raise ValueError(
                f"add_edges: row {row} has time {value:.17g}, beyond +-2^53 where float64 "
                "times stop being exact (nanosecond Unix times are): rescale the times"
            )
        raise ValueError(f"add_edges: row {row} has time {value}, not a finite number")
