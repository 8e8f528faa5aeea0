"""What a run appends to `out_dir/metrics.jsonl`, and the group's part of its records.

The learner (continual.py) makes a record after phase 1 and after every increment and keeps
them in its `history`; `RecordLog` writes each, preceded by what the group did since the last
one, read from the group itself:
- its resizes, recoveries, shard moves and changes of the shard-actor count, as records of
  phase "resize" / "recovery" / "shard_move" / "shard_resize";
- with gradient compression, its bits per gradient bucket whenever they changed, as a record
  of phase "comm_bits".
Those are not in `history`: a run's results do not depend on them. The group is read at every
record whether or not there is an `out_dir` to write to.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["RecordLog", "cluster_record"]


class RecordLog:
    """Writes a run's records to `config.out_dir/metrics.jsonl` (nothing without `out_dir`),
    with the changes of `group` since the last record before each."""

    def __init__(self, config, group) -> None:
        self.config, self.group = config, group
        self._membership_seen: dict[str, int] = {}  # resizes, recoveries written so far
        self._comm_bits: list[int] | None = None  # gradient buckets' bits last written

    def write(self, record: dict) -> None:
        """`record`, after the group's changes since the last call."""
        self._write([*self._membership_records(), *self._comm_records(), record])

    def _membership_records(self) -> list[dict]:
        """The group's resizes, recoveries, shard moves and changes of the shard-actor count
        since the last record, as metrics.jsonl records of phase "resize" / "recovery" /
        "shard_move" / "shard_resize" (not in `history`: a run's results do not depend on
        them)."""
        out = []
        kinds = (("resize", "resizes"), ("recovery", "recoveries"),
                 ("shard_move", "shard_moves"), ("shard_resize", "shard_resizes"))  # fmt: skip
        for kind, name in kinds:
            events = getattr(self.group, name)  # the membership lists of `Group`
            seen = self._membership_seen.get(kind, 0)
            out += [{"phase": kind, **e} for e in events[seen:]]
            self._membership_seen[kind] = len(events)
        return out

    def _comm_records(self) -> list[dict]:
        """With gradient compression, a metrics.jsonl record of phase "comm_bits" whenever the
        bits per gradient bucket changed since the last record (adaptive decisions; 32: sent
        exact, 0: top-k), with trainer 0's steps and bytes ratio so far."""
        if self.config.comm.compression == "none":
            return []
        totals = self.group.comm_totals()
        bits = list(totals["last_bits"]) if totals else []
        if not bits or bits == self._comm_bits:
            return []
        self._comm_bits = bits
        keep = ("steps", "compressed_steps", "ratio")
        return [{"phase": "comm_bits", "bits": bits, **{k: totals[k] for k in keep}}]

    def _write(self, records: list[dict]) -> None:
        if self.config.out_dir:
            path = Path(self.config.out_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.writelines(json.dumps(r, default=str) + "\n" for r in records)


def cluster_record(group) -> dict:
    """The group's shape, in the phase-1 record and the summary."""
    return {
        "trainers": group.num_trainers,
        "shards": group.num_shards,
        "memory_placement": group.memory_placement,
    }
