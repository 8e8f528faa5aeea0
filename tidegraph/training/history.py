"""What a learner holds of the stream's events, and where it reads the rest.

`EventHistory` keeps the window (events [base, end) in memory: the block under way, phase 1
or an increment, and what arrived after it) and, of the events before the block under way
(old events), only bounded summaries:
- a replay reservoir (`ReplayReservoir`, `continual.replay_capacity` events: all of them
  while they fit, a uniform sample after) that replay and forgetting probes draw from;
- every node's event count (importance replay) and the partition's counts (`PartitionTally`);
old events themselves are read back from the durable event log (a lost shard's rebuild, the
forgetting of each increment), mapped to dense ids through the stream's id map. A live run
with a log drops old events from memory once learned (`forget`), so the driver's memory does
not grow with the run. A spooled stream (a run from a file or a bundled dataset, with a run
directory: `tidegraph.storage.spool`) holds none of its events: the block under way is read
from the spool a window at a time (`window` events, `continual.window_events`: the units of a
pass, read in order, come from one read of the spool per window; a range larger than the
window is read alone and not held), so the driver holds at most a window of a block however
large the block. Other streams (built in memory)
keep their events but read old ones from the log all the same when there is one. The
caller's `Stream` is not changed (a restart builds its learner from it again).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tidegraph.storage.events import EventBatch
from tidegraph.storage.partition import PartitionTally
from tidegraph.training.sampling import ReplayReservoir, node_degree

__all__ = ["EventHistory", "windows"]


def windows(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    """[lo, hi) cut in ranges of at most `size` events."""
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


class EventHistory:
    def __init__(
        self, stream, event_log, live: bool, capacity: int, seed: int, importance: bool,
        block: Callable[[], tuple[int, int]], window: int = 1 << 20,
    ) -> None:  # fmt: skip
        """`block()`: the bounds of the block under way (the events before it are old);
        `window`: the most events of it a spooled stream holds at once."""
        self.stream, self.event_log, self.live = stream, event_log, live
        self.events, self.base = stream.events, 0
        self.spool = stream.spool  # a spooled stream's events: on disk, read a block at a time
        self.block, self.window = block, window
        self.importance = importance
        self.reservoir = ReplayReservoir(capacity, seed)
        self.degree = torch.zeros(0, dtype=torch.int64)
        self.tally = PartitionTally()

    @property
    def end(self) -> int:
        """One past the stream's last event so far."""
        held = self.end_held
        return held if self.spool is None else max(held, self.spool.num_events)

    @property
    def end_held(self) -> int:
        """One past the last event held in memory."""
        return self.base + len(self.events)

    def old_end(self) -> int:
        """Where the block under way starts: the events before it are old."""
        return self.block()[0]

    def read(self, lo: int, hi: int) -> EventBatch:
        """Events [lo, hi): from the window, or, old events of a run with a durable log,
        read back from the log; a spooled stream's from its spool, a window of the block
        under way at a time (`_from_spool`)."""
        if lo >= self.old_end() or self.event_log is None:
            if self.spool is not None and not self.base <= lo <= hi <= self.end_held:
                return self._from_spool(lo, hi)
            if lo < self.base:
                raise RuntimeError(f"events [{lo}, {hi}) are no longer held and no log has them")
            return self.events.select(slice(lo - self.base, hi - self.base))
        ev = self.event_log.read(lo, hi)
        idmap = self.stream.idmap
        if idmap.kind == "int" and idmap.mapped:  # the log holds external ids
            ev.src, ev.dst = idmap.map_events(ev.src, ev.dst)
        ev.t = ev.t.to(self.events.t.dtype)
        if ev.edge_feat is not None and self.events.edge_feat is not None:
            ev.edge_feat = ev.edge_feat.to(self.events.edge_feat.dtype)
        return ev

    def _from_spool(self, lo: int, hi: int) -> EventBatch:
        """Events [lo, hi) of the spool. Inside the block under way, and no larger than the
        window: the window's events from `lo` on (to the block's end at most) are read and
        held, for the reads that follow; any other range is read alone."""
        blo, bhi = self.block()
        if not blo <= lo <= hi <= bhi or hi - lo > self.window:
            return self.spool.read(lo, hi)
        top = min(bhi, lo + self.window)
        self.events, self.base = self.spool.read(lo, top), lo
        return self.events.select(slice(0, hi - lo))

    def pool(self) -> EventBatch:
        """The old events replay and forgetting probes draw from (src, dst, t, eid)."""
        if self.reservoir.events is not None:
            return self.reservoir.events
        ev = self.events
        return EventBatch(ev.src[:0], ev.dst[:0], ev.t[:0], ev.eid[:0])

    def ingested(self, ev: EventBatch, partitioner, num_nodes: int) -> None:
        """Events just routed to the shards: counted per node and per partition."""
        self.tally.add(ev.src, ev.dst, partitioner)
        if self.importance:
            self.degree = node_degree(self.degree, ev, num_nodes)

    def learned(self, ev: EventBatch) -> None:
        """A block's events, learned: old from now on."""
        self.reservoir.add(ev)

    def forget(self) -> None:
        """A live run with a durable log, and a spooled one, drop the old events from memory
        (the log or the spool, the shards and, a sample, the reservoir hold them)."""
        lo = self.old_end()
        drops = self.spool is not None or (self.live and self.event_log is not None)
        if drops and lo > self.base:
            self._window(self.events.select(slice(lo - self.base, None)), lo)

    def append(self, events: EventBatch) -> None:
        """Dense events [end, end + len) arrived (a live stream's next increment)."""
        self.events = EventBatch.cat([self.events, events])

    def append_learned(self, lo: int, hi: int) -> None:
        """Events [lo, hi), learned before the checkpoint a run resumes from: not held."""
        if lo != self.end:
            raise ValueError(f"append_learned: [{lo}, {hi}) does not follow event {self.end}")
        self._window(self.events.select(slice(0, 0)), hi)

    def _window(self, events: EventBatch, base: int) -> None:
        self.events = EventBatch.cat([events])  # its own tensors: a slice keeps its storage
        self.base = base

    def count_old(self, blocks: list, ingested: int, partitioner, num_nodes: int) -> None:
        """The reservoir, degrees and partition counts of a checkpoint written before they
        were kept: counted again from the learned `blocks` and the `ingested` events, read a
        window at a time."""
        for lo, hi in blocks:
            for a, b in windows(lo, hi, self.window):
                self.learned(self.read(a, b))
        done = blocks[-1][1] if blocks else 0
        for lo, hi in [*blocks, (done, ingested)]:
            for a, b in windows(lo, hi, self.window):
                self.ingested(self.read(a, b), partitioner, num_nodes)

    def state_dict(self, store: str | None = None) -> dict:
        """`store`: the checkpoint store it is saved to (the reservoir's base is written
        there once, then referenced)."""
        return {"reservoir": self.reservoir.state_dict(store), "degree": self.degree.clone(),
                "tally": self.tally.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.reservoir.load_state_dict(state["reservoir"])
        self.degree = state["degree"].clone()
        self.tally.load_state_dict(state["tally"])
