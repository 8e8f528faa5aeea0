"""Shard recovery: a lost partition promoted from a replica, or rebuilt from the log.

A lost partition with a replica is taken over by it (`recovery.shards.plan_shard_recovery`).
Without one it is rebuilt on the surviving shard actors (or a new actor in its slot) from the
newest checkpoint's snapshot and the batches ingested since, routed again with the same feature
rounding, and checked by event count; with node state on the shards, the journal of node-state
updates since the snapshot is replayed too (`recovery.shards.replay_ops`). The journal keeps
what changed the shards since the last two states taken.
"""

from __future__ import annotations

import contextlib
import logging
import time

import ray
import torch

from tidegraph.actors.shard import PartHandle
from tidegraph.elastic.policy import plan_parts
from tidegraph.recovery.shards import plan_shard_recovery, replay_ops

__all__ = ["ShardRecovery"]

log = logging.getLogger(__name__)


class ShardRecovery:
    """Rebuilding lost partitions, and the shard journal (a `RayGroup` part)."""

    def _probe_shards(self) -> list[int]:
        """Partitions whose shard actor is dead or does not answer within `probe_s` (that
        actor is killed: every partition it held is lost), and partitions rebuilt only in
        part when a recovery was interrupted (dropped by the actor holding them)."""
        refs = [s.ping.remote() for s in self.shards]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.probe_s)
        dead = set()
        for p, ref in enumerate(refs):
            try:
                if ref not in ready:  # hung
                    raise TimeoutError
                ray.get(ref)
            except (ray.exceptions.RayActorError, TimeoutError):
                dead.add(self.shards[p].actor._actor_id.hex())
        lost = []
        for p, handle in enumerate(self.shards):
            if handle.actor._actor_id.hex() in dead:
                ray.kill(handle.actor)  # a hung one, or free a dead one's name
                lost.append(p)
            elif p in self._stale_shards:
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.get(handle.actor.drop_part.remote(p))
                lost.append(p)
        return lost

    def _recover_shards(
        self, cause: Exception, lost: list[int] | None = None, lost_trainers: tuple = ()
    ) -> None:
        """Rebuild lost shards by routing every batch ingested so far again (the same
        batches, the same feature rounding): each gets exactly the events the log holds for
        its partition, checked by count. Trainers (but `lost_trainers`) are pointed at the
        new actors."""
        lost = self._probe_shards() if lost is None else lost
        if not lost:
            raise cause
        live = [t for w, t in enumerate(self.trainers) if w not in lost_trainers]
        plan = plan_shard_recovery(lost, [len(r) for r in self.replicas])
        promoted = list(plan.promote)
        for p in promoted:  # a replica holds all the shard held: it takes its place
            self.shards[p] = self.replicas[p].pop(0)
            self.shard_slots[p] = self.replica_slots[p].pop(0)
            self._start_replicas(p)
        if promoted:
            ray.get([t.replace_shard.remote(p, self.shards[p]) for t in live for p in promoted])
            self.recoveries.append({"lost_shards": promoted, "promoted": promoted,
                                    "events": {p: ray.get(self.shards[p].report.remote())[
                                        "events"] for p in promoted}})  # fmt: skip
            log.warning("shard recovery: replicas promoted for %s", promoted)
        lost = list(plan.rebuild)
        if not lost:
            self._refresh(self.num_nodes, live, recovering=True)
            return
        if self.replay_source is None:
            raise RuntimeError(f"shards {lost} were lost and no replay source is set") from cause
        self.recovery_budget.spend("shard", cause)
        t0 = time.perf_counter()
        self._stale_shards = set(lost)
        snap, start = self._snapshot()
        # node state on the shards too: the journal since the snapshot, in order
        ops = replay_ops(lost, snap, start, len(self.ingests),
                         self._journal if self.sharded else None, self._journal_base,
                         cause)  # fmt: skip
        where = self._rebuild_hosts(lost)
        # each lost partition as the checkpoint holds it (or empty), then the later ingests
        ray.get([actor.add_part.remote(p, *self._part_args(p),
                                       *((None,) if snap is None else (snap["shards"][p],
                                                                       snap.get("store"))))
                 for p, actor in where.items()])  # fmt: skip
        expected = dict.fromkeys(lost, 0)
        if snap is not None:
            expected = {p: snap["shards"][p]["num_events"] for p in lost}
        gen = torch.Generator()
        calls = []
        for kind, what in ops:  # each actor runs its calls in order
            if kind == "ingest":
                lo, hi, state = self.ingests[what]
                if state is None:  # learned before the checkpoint this run resumed from
                    raise RuntimeError(
                        f"shard recovery: ingest {what} (events [{lo}, {hi})) is before the "
                        "checkpoint this run resumed from, whose shards do not match the run"
                    )
                gen.set_state(state)
                events = self.replay_source(lo, hi)
                pieces = self._pieces(events, gen)
                for p in lost:
                    expected[p] += pieces[p].num_events
                    calls.append(self.shards[p].ingest.remote(pieces[p]))
            elif kind == "apply":
                calls += [self.shards[p].apply_state.remote(what) for p in lost]
            elif kind == "reset":
                calls += [self.shards[p].reset_state.remote() for p in lost]
            else:  # "load"
                parts = ray.get(what)
                calls += [self.shards[p].load_node_state_dict.remote(parts[p]) for p in lost]
        ray.get(calls)
        held = {p: ray.get(self.shards[p].report.remote())["events"] for p in lost}
        if held != expected:
            raise RuntimeError(f"rebuilt shards hold {held} events, the log has {expected}")
        self._stale_shards = set()
        ray.get([t.replace_shard.remote(p, self.shards[p]) for t in live for p in lost])
        self._refresh(self.num_nodes, live, recovering=True)  # replacements get them new
        actors = len({a._actor_id.hex() for a in where.values()})
        log.warning(
            "shard recovery: rebuilt %s on %d shard actors from %s and %d logged batches (%s "
            "events); %.2f s", lost, actors,
            "the checkpoint's snapshot" if snap is not None else "nothing",
            len(self.ingests) - start, held, time.perf_counter() - t0,
        )  # fmt: skip
        self.recoveries.append({"lost_shards": lost, "events": held, "snapshot": snap is not None,
                                "replayed_batches": len(self.ingests) - start,
                                "rebuilt_on": actors,
                                "seconds": time.perf_counter() - t0})  # fmt: skip
        self._trace_event("shard recovery", t0, self.recoveries[-1])
        self._top_up_shards()  # lost hosts' slots: hosts start there and take partitions back

    def _rebuild_hosts(self, lost: list[int]) -> dict:
        """{p: the actor that rebuilds lost partition p}. The surviving shard actors split
        the lost partitions among them (`elastic.policy.plan_parts`: each replays its share
        of the log at the same time, with no process to start); with none left, a new actor
        per lost one starts in its slot. The lost actors' slots are kept: Ray places them
        again (a lost node's on another), and new actors there take partitions over."""
        hosts = self._shard_hosts()
        gone = {key for key, (_, _, parts) in hosts.items() if set(parts) <= set(lost)}
        for key in gone:  # dead, or alive holding only partitions it had not finished
            ray.kill(hosts[key][0])
        survivors = {k: [q for q in parts if q not in lost] for k, (_, _, parts) in hosts.items()
                     if k not in gone}  # fmt: skip
        if not survivors or self.num_copies > 1:
            where = {}
            for key in gone:
                actor, slot, parts = hosts[key]
                name = f"tidegraph-shard-{parts[0]}-h{next(self._hosts_named)}"
                new = self._new_host([], slot, name)
                where.update(dict.fromkeys(parts, new))
                for q in parts:
                    self.shards[q] = PartHandle(new, q)
            return where
        lost_hosts = {key: hosts[key][2] for key in gone}
        moves = plan_parts(survivors | lost_hosts, {}, gone)
        where = {}
        for q, _, dst in moves:
            actor, slot, _ = hosts[dst]
            where[q] = actor
            self.shards[q], self.shard_slots[q] = PartHandle(actor, q), slot
        for key in gone:
            slot = hosts[key][1]
            if all(slot is not x for x in self.shard_spares):
                self.shard_spares.append(slot)
        return where

    def _snapshot(self) -> tuple[dict | None, int]:
        """The newest checkpoint's group state, if it is a prefix of this run's ingests (same
        spans), and how many ingests it covers; (None, 0) without one."""
        if self.snapshot_source is None:
            return None, 0
        snap = self.snapshot_source()
        if snap is None:
            return None, 0
        n = len(snap["ingests"])
        spans = [tuple(x[:2]) for x in snap["ingests"]]
        if n > len(self.ingests) or spans != [tuple(x[:2]) for x in self.ingests[:n]]:
            log.warning("shard recovery: the checkpoint's shards are not a prefix of this run's "
                        "ingests; replaying every batch")  # fmt: skip
            return None, 0
        return snap, n

    @property
    def _journaling(self) -> bool:
        return self.sharded and self.num_copies == 1

    def _note(self, kind: str, what) -> None:
        """Journal one change of the shards (`_journal`)."""
        if self._journaling:
            self._journal.append((kind, what))

    def _cut_journal(self) -> int:
        """The journal's position now (a state is taken); entries older than the states
        taken before the last one are dropped (a rebuild starts from the newest checkpoint,
        or the one before if the newest was not written)."""
        pos = self._journal_base + len(self._journal)
        self._journal_cuts = [*self._journal_cuts[-1:], pos]
        drop = self._journal_cuts[0] - self._journal_base
        if drop > 0:
            del self._journal[:drop]
            self._journal_base += drop
        return pos
