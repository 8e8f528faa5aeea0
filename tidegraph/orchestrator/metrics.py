"""Prometheus metrics of a run, served by the driver on 127.0.0.1 (prometheus-client).

Names (all prefixed `tidegraph_`):
- `events_ingested_total`: events made durable and routed to shards;
- `train_events_per_second`, `eval_events_per_second`: rates of the latest increment;
- `step_seconds_total{phase}`: trainer time per step phase (sample, fetch, compute, allreduce,
  optimizer, apply), averaged over trainers;
- `allreduce_bytes_total`: gradient bytes each trainer sent: with compression (`comm:`) what
  trainer 0 counted on the wire, else a ring all-reduce's 2 (W-1)/W of the fp32 gradient per
  step;
- `allreduce_bucket_bits{bucket}`: with compression, the bits each gradient bucket was last
  sent with (trainer 0's; 32: exact, 0: top-k), so adaptive decisions can be followed;
- `feature_cache_hit_rate`: trainer 0's edge-feature cache;
- `increment_ap`, `increment_mrr`: metrics of the latest increment; `increments_total`;
- `trainers_alive`, `shards_alive`: actors the GCS reports alive at the last update;
- `trainers`: the trainer group's size; `resizes_total{direction}` (grow, shrink) and
  `recoveries_total`: membership changes so far (each is a line of metrics.jsonl too);
- `shard_actors`: the actors holding the run's partitions; `shard_resizes_total{direction}`;
- `controller_state{tidegraph_controller_state}`: the run controller's state (a state set: 1
  for the current one of scheduling, running, recovering, resizing, restarting, finished,
  errored; 0 for the others).
Each run has its own registry, so several runs in one process do not collide.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, start_http_server

__all__ = ["RunMetrics"]

log = logging.getLogger(__name__)

STATES = ("scheduling", "running", "recovering", "resizing", "restarting", "finished", "errored")
PHASES = ("sample", "fetch", "compute", "allreduce", "optimizer", "apply", "exchange")


class RunMetrics:
    """Metrics of one run; `port` 0 picks a free port (`self.port` says which)."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.registry = r = CollectorRegistry()
        self.ingested = Counter("tidegraph_events_ingested", "events ingested", registry=r)
        self.train_rate = Gauge("tidegraph_train_events_per_second", "training rate", registry=r)
        self.eval_rate = Gauge("tidegraph_eval_events_per_second", "evaluation rate", registry=r)
        self.seconds = Counter("tidegraph_step_seconds", "trainer seconds per step phase",
                               ["phase"], registry=r)  # fmt: skip
        self.bytes = Counter("tidegraph_allreduce_bytes", "gradient bytes sent per trainer",
                             registry=r)  # fmt: skip
        self.bucket_bits = Gauge("tidegraph_allreduce_bucket_bits", "bits each gradient "
                                 "bucket was last sent with", ["bucket"], registry=r)  # fmt: skip
        self.hit_rate = Gauge("tidegraph_feature_cache_hit_rate", "edge-feature cache hit rate",
                              registry=r)  # fmt: skip
        self.ap = Gauge("tidegraph_increment_ap", "AP of the latest increment", registry=r)
        self.mrr = Gauge("tidegraph_increment_mrr", "MRR of the latest increment", registry=r)
        self.increments = Counter("tidegraph_increments", "increments done", registry=r)
        self.trainers = Gauge("tidegraph_trainers_alive", "trainer actors alive", registry=r)
        self.shards = Gauge("tidegraph_shards_alive", "graph shard actors alive", registry=r)
        self.size = Gauge("tidegraph_trainers", "trainers in the group", registry=r)
        self.resizes = Counter("tidegraph_resizes", "trainer group resizes", ["direction"],
                               registry=r)  # fmt: skip
        self.recoveries = Counter("tidegraph_recoveries", "recoveries from lost members",
                                  registry=r)  # fmt: skip
        self.shard_actors = Gauge("tidegraph_shard_actors", "actors holding partitions",
                                  registry=r)  # fmt: skip
        self.shard_resizes = Counter("tidegraph_shard_resizes", "changes of the shard-actor "
                                     "count", ["direction"], registry=r)  # fmt: skip
        self.state = Enum("tidegraph_controller_state", "the run controller's state",
                          states=list(STATES), registry=r)  # fmt: skip
        self._resizes = self._recoveries = self._shard_resizes = 0
        self._ingested = self._steps = self._sent = 0
        self.server, _ = start_http_server(port, addr=host, registry=r)
        self.port = self.server.server_port
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def controller_state(self, state: str) -> None:
        self.state.state(state)

    def observe(
        self, learner, record: dict, seconds: list[dict], grad_values: int, comm=None
    ) -> None:
        """Update from a phase-1 or increment record, the trainers' step seconds and, with
        gradient compression, trainer 0's totals (`comm`)."""
        group = learner.group
        trainers, shards = group.alive()
        self.trainers.set(trainers)
        self.shards.set(shards)
        self.size.set(group.num_trainers)
        for event in group.resizes[self._resizes :]:
            self.resizes.labels("grow" if event["to"] > event["from"] else "shrink").inc()
        self._resizes = len(group.resizes)
        self.shard_actors.set(group.shard_actors)
        for event in group.shard_resizes[self._shard_resizes :]:
            direction = "grow" if event["to"] > event["from"] else "shrink"
            self.shard_resizes.labels(direction).inc()
        self._shard_resizes = len(group.shard_resizes)
        recoveries = group.recoveries
        self.recoveries.inc(len(recoveries) - self._recoveries)
        self._recoveries = len(recoveries)
        self.ingested.inc(learner.ingested - self._ingested)
        self._ingested = learner.ingested
        w = max(len(seconds), 1)
        for phase in PHASES:
            self.seconds.labels(phase).inc(sum(s.get(phase, 0.0) for s in seconds) / w)
        steps = learner.cursor.step - self._steps
        self._steps = learner.cursor.step
        if comm is not None:  # counted on the wire (a resumed run's totals start again)
            self.bytes.inc(max(0, comm["bytes_sent"] - self._sent))
            self._sent = comm["bytes_sent"]
            for bucket, bits in enumerate(comm.get("last_bits") or ()):
                self.bucket_bits.labels(str(bucket)).set(bits)
        else:
            ring = 2 * (group.num_trainers - 1) / group.num_trainers
            self.bytes.inc(steps * grad_values * 4 * ring)
        if "train_events_per_s" in record:
            self.train_rate.set(record["train_events_per_s"])
        if record.get("phase") == "increment":
            self.increments.inc()
            self.ap.set(record["ap"])
            self.mrr.set(record["mrr"])
            self.eval_rate.set(record["eval_events_per_s"])
            if "edge_cache_hit_rate" in record:
                self.hit_rate.set(record["edge_cache_hit_rate"])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
