"""Run configuration: one kw-only dataclass per component, composed into `RunConfig`.

Each `__post_init__` checks its own fields and names the field to fix; `RunConfig` checks the
fields that depend on each other (the sampler's fanouts against the model's layers). A YAML
file maps onto `RunConfig` with `RunConfig.from_dict(yaml.safe_load(...))`, sections named like
the fields (`model`, `data`, `sampler`, `train`, `continual`); unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from tidegraph.comm.config import CommConfig
from tidegraph.config_check import check_fields, read_yaml, unknown_keys
from tidegraph.elastic.policy import SCALE_RULES
from tidegraph.models.config import ModelConfig
from tidegraph.models.registry import REGISTRY, spec
from tidegraph.storage.cache import POLICIES
from tidegraph.storage.features import PRECISIONS
from tidegraph.storage.ingest import FORMATS, parse_columns, parse_features
from tidegraph.training.optim import OPTIMIZER_RULES

__all__ = [
    "ClusterConfig",
    "ContinualConfig",
    "DataConfig",
    "EvalConfig",
    "RunConfig",
    "SamplerConfig",
    "TrainConfig",
    "read_config",
]


@dataclass(kw_only=True)
class DataConfig:
    dataset: str = "wikipedia"  # a bundled name or a file path
    max_events: int | None = None
    format: str = "auto"  # of a file: auto, jodie, tgl, snap, csv or parquet
    quarantine: str | None = None  # a file: rejected rows go there instead of failing the run
    # of a file: which columns hold src, dst, time (label, features): a mapping or
    # "src=0,dst=1,time=3" (positions or header names); None: found by header names, or
    # columns 0, 1, 2 of a headerless file of three columns
    columns: dict | str | None = None
    header: bool | None = None  # of a file: whether line 1 names columns; None: the format's
    features: list | str | int | None = None  # of a file: edge-feature columns ("4-9,rating")
    # of a file: node ids are strings (any text), mapped to dense ids like sparse int ids
    string_ids: bool = False
    # of a file: time order through a window of this many rows (an event may come that many
    # rows after later ones; 0: time must not decrease); None: sort the whole file in memory
    reorder_window: int | None = 100_000
    # edge features (files that have them): host store in this precision, device cache of
    # this fraction of the rows (pass-through on the CPU)
    feature_precision: str = "fp32"
    feature_cache_ratio: float = 0.2
    feature_cache_policy: str = "lru"

    def __post_init__(self) -> None:
        check_fields(self, "data")
        if self.max_events is not None and self.max_events < 10:
            raise ValueError(f"data.max_events must be >= 10 or None, got {self.max_events}")
        if self.format not in FORMATS:
            raise ValueError(f"data.format must be one of {FORMATS}, got {self.format!r}")
        if self.reorder_window is not None and self.reorder_window < 0:
            raise ValueError(f"data.reorder_window must be >= 0 or null, got {self.reorder_window}")
        parse_columns(self.columns, "data.columns")  # raises naming the field
        parse_features(self.features, "data.features")
        if self.feature_precision not in PRECISIONS:
            raise ValueError(
                f"data.feature_precision must be one of {PRECISIONS}, "
                f"got {self.feature_precision!r}"
            )
        if not 0 <= self.feature_cache_ratio <= 1:
            raise ValueError(
                f"data.feature_cache_ratio must be in [0, 1], got {self.feature_cache_ratio}"
            )
        if self.feature_cache_policy not in POLICIES:
            raise ValueError(
                f"data.feature_cache_policy must be one of {POLICIES}, "
                f"got {self.feature_cache_policy!r}"
            )


@dataclass(kw_only=True)
class SamplerConfig:
    fanouts: list[int] | None = None  # None: [10] per model layer
    strategy: str = "recent"
    num_snapshots: int | None = None  # None: 3 for dysat, 1 otherwise
    snapshot_window: float = 86400.0  # seconds per snapshot window (dysat)
    # hops after the first sample each distinct (node, time) root once (TGL's dedup; exact
    # for "recent", shared draws among identical roots for "uniform")
    dedup: bool = True
    # which earlier events a batch's events see: "event" (TGL's convention), every event
    # strictly before its own time, earlier events of its own batch included; "batch" (PyG's
    # TGN), only events before the batch's start (with W > 1 trainers: each trainer's slice)
    history: str = "event"
    # embed each distinct (node, time) root of a batch once and gather back (same embeddings):
    # "auto" when at most 9/10 of the roots are distinct (and the strategy is "recent": with
    # "uniform", identical roots would share draws), "always", or "never"
    root_dedup: str = "auto"

    def __post_init__(self) -> None:
        check_fields(self, "sampler")
        if self.history not in ("event", "batch"):
            raise ValueError(f"sampler.history must be 'event' or 'batch', got {self.history!r}")
        if self.root_dedup not in ("auto", "always", "never"):
            raise ValueError(
                f"sampler.root_dedup must be 'auto', 'always' or 'never', got {self.root_dedup!r}"
            )
        if self.strategy not in ("recent", "uniform"):
            raise ValueError(
                f"sampler.strategy must be 'recent' or 'uniform', got {self.strategy!r}"
            )
        if self.fanouts is not None and any(k < 1 for k in self.fanouts):
            raise ValueError(f"sampler.fanouts must be positive integers, got {self.fanouts}")
        if self.num_snapshots is not None and self.num_snapshots < 1:
            raise ValueError(f"sampler.num_snapshots must be >= 1, got {self.num_snapshots}")
        if self.snapshot_window <= 0:
            raise ValueError(f"sampler.snapshot_window must be > 0, got {self.snapshot_window}")


@dataclass(kw_only=True)
class TrainConfig:
    batch_size: int = 200
    lr: float = 1e-3
    epochs: int = 3  # phase 1 (continual) or the whole run (offline)
    train_negatives: int = 1
    eval_negatives: int = 10  # per positive, for MRR; AP and AUC use the first one
    eval_max_roots: int = 8192  # evaluation batches are cut so one forward has at most this
    # "adam", or "lamb" (Adam's moments, each parameter's update scaled to its norm: large
    # global batches, benchmarks/RESULTS.md); `warmup_steps`: the learning rate ramped
    # linearly over a new optimizer's first steps (0: none)
    optimizer: str = "adam"
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "train")
        if self.optimizer not in OPTIMIZER_RULES:
            raise ValueError(f"train.optimizer must be one of {OPTIMIZER_RULES}, got "
                             f"{self.optimizer!r}")  # fmt: skip
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("batch_size", "epochs", "train_negatives", "eval_negatives"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.eval_max_roots < 3:
            raise ValueError(f"train.eval_max_roots must be >= 3, got {self.eval_max_roots}")


EVAL_PROTOCOLS = ("sampled", "tgb")


@dataclass(kw_only=True)
class EvalConfig:
    """How link prediction is evaluated. "sampled": `train.eval_negatives` uniform negatives a
    positive. "tgb": the Temporal Graph Benchmark's protocol (`tidegraph.training.tgb`): its
    time split (0.70 / 0.85 quantiles, offline mode), `negatives` of its hist_rnd rule a
    positive, MRR by its rank rule and Hits@`hits_k`. In continual mode each increment (and
    phase 1's validation) is scored so, its history every event learned before it."""

    protocol: str = "sampled"
    negatives: int = 999  # tgb: a positive's negatives (TGB's tgbl-wiki: 999, every other item)
    hist_ratio: float = 0.5  # tgb: at most this share of them from the source's history
    hits_k: int = 10
    # tgb: the first `prefix` positives of validation and of test (continual: of each
    # increment) are scored (0: all); the rest is still recorded in node state
    prefix: int = 0
    # tgb, offline: score validation after every epoch (False: after the last only; 999
    # negatives a positive make it as costly as training, and it selects nothing); continual
    # phase 1 records its validation in node state every epoch, so it scores it every epoch
    every_epoch: bool = False

    def tgb_record(self) -> dict:
        """The protocol's settings, as a run's results name them."""
        return {"name": "tgb", "negatives": self.negatives, "hist_ratio": self.hist_ratio,
                "prefix": self.prefix}  # fmt: skip

    def __post_init__(self) -> None:
        check_fields(self, "eval")
        if self.protocol not in EVAL_PROTOCOLS:
            raise ValueError(f"eval.protocol must be one of {EVAL_PROTOCOLS}, got "
                             f"{self.protocol!r}")  # fmt: skip
        for name in ("negatives", "hits_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.hist_ratio <= 1.0:
            raise ValueError(f"eval.hist_ratio must be in [0, 1], got {self.hist_ratio}")
        if self.prefix < 0:
            raise ValueError(f"eval.prefix must be >= 0 (0: every positive), got {self.prefix}")


@dataclass(kw_only=True)
class ContinualConfig:
    train_fraction: float = 0.3  # phase 1: the first part of the stream
    val_fraction: float = 0.15  # of phase 1, its last part, used for validation
    num_increments: int | None = 10  # equal-count increments over the rest ...
    increment_events: int | None = None  # ... or a fixed number of events each ...
    increment_window: float | None = None  # ... or a time window each (e.g. 86400 = a day)
    replay_ratio: float = 0.5  # replayed old events per new event, in [0, 1]
    replay: str = "uniform"  # or "importance"
    # old events the driver keeps to replay from (a uniform reservoir sample of the history;
    # all of it while it fits)
    replay_capacity: int = 1_000_000
    importance_floor: float = 0.1
    retrain_epochs: int = 1
    fresh_optimizer: bool = False
    forget_sample: int = 1000  # old events evaluated after each step (forgetting)
    # the most events of the block under way (phase 1, an increment) the driver handles at
    # once: ingest, the passes' batches and a spooled stream's reads go a window at a time
    window_events: int = 1 << 20

    def __post_init__(self) -> None:
        check_fields(self, "continual")
        if not 0 < self.train_fraction < 1:
            raise ValueError(
                f"continual.train_fraction must be in (0, 1), got {self.train_fraction}"
            )
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"continual.val_fraction must be in [0, 1), got {self.val_fraction}")
        if not 0 <= self.replay_ratio <= 1:
            raise ValueError(f"continual.replay_ratio must be in [0, 1], got {self.replay_ratio}")
        if self.replay not in ("uniform", "importance"):
            raise ValueError(
                f"continual.replay must be 'uniform' or 'importance', got {self.replay!r}"
            )
        if self.replay_capacity < 1:
            raise ValueError(f"continual.replay_capacity must be >= 1, got {self.replay_capacity}")
        if not 0 < self.importance_floor <= 1:
            raise ValueError(
                f"continual.importance_floor must be in (0, 1], got {self.importance_floor}"
            )
        given = [
            n for n in ("increment_events", "increment_window") if getattr(self, n) is not None
        ]
        if len(given) > 1:
            raise ValueError("continual: give increment_events or increment_window, not both")
        if given:
            self.num_increments = None
        elif self.num_increments is None or self.num_increments < 1:
            raise ValueError(f"continual.num_increments must be >= 1, got {self.num_increments}")
        for name in ("increment_events", "increment_window"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"continual.{name} must be > 0, got {value}")
        if self.retrain_epochs < 0:
            raise ValueError(f"continual.retrain_epochs must be >= 0, got {self.retrain_epochs}")
        if self.forget_sample < 0:
            raise ValueError(f"continual.forget_sample must be >= 0, got {self.forget_sample}")
        if self.window_events < 1:
            raise ValueError(f"continual.window_events must be >= 1, got {self.window_events}")


MEMORY_PLACEMENTS = ("auto", "replicated", "sharded")
BACKENDS = ("local", "ray")


FAULT_POINTS = ("forward", "allreduce", "after_step")


def _check_resources(name: str, resources: dict) -> None:
    """Ray custom resources: {name: amount}, names other than CPU and GPU, amounts > 0."""
    for key, amount in resources.items():
        if not isinstance(key, str) or not key or key in ("CPU", "GPU"):
            raise ValueError(
                f"{name}: resource names must be strings other than CPU and GPU (set those "
                f"with cluster.trainer_cpus, shard_cpus, trainer_gpus), got {key!r}"
            )
        number = isinstance(amount, int | float) and not isinstance(amount, bool)
        if not (number and 0 < amount < float("inf")):
            raise ValueError(f"{name}[{key!r}] must be a finite number > 0, got {amount!r}")


@dataclass(kw_only=True)
class ClusterConfig:
    """Shards and trainers: P graph shards, W data-parallel trainers (DESIGN.md)."""

    backend: str = "local"  # local: every shard and trainer in this process; ray: actors
    # W, or {min: a, max: b} (ray backend): the run starts once `min` trainers are placed
    # and grows to `max` as Ray places more; operators resize within [min, max]
    # (`tidegraph.jobs.resize`); trainers on draining nodes leave at a step boundary
    trainers: int | dict = 1
    min_trainers: int | None = None  # set from `trainers` (both W when it is an int)
    max_trainers: int | None = None
    elastic_poll_s: float = 1.0  # seconds between looks at resize requests, drains, slots
    # trainers started ahead and kept idle (ray backend): a lost trainer's replacement, or
    # a joining one, without a process start (seconds); each holds a trainer's resources
    spare_trainers: int = 0
    # when the group's size W changes: "keep_batch" (the global batch and learning rate stay,
    # so the result does not depend on W), "linear" or "sqrt" (each trainer keeps its share
    # of the batch, so the global batch follows W from the next increment, and the learning
    # rate scales by W / W0 or its square root; W0: the size the run started with)
    scale_rule: str = "keep_batch"
    # P, or {min: a, max: b} (ray backend): P = max partitions, held by between min and max
    # shard actors; actors start as Ray places them (the run starts with min) and take
    # partitions over from the largest ones, and leave (operators' counts, draining nodes)
    # handing theirs to the rest; the partition function, and so the run's result, is P's
    shards: int | dict = 1
    min_shards: int | None = None  # set from `shards` (both P when it is an int)
    max_shards: int | None = None
    # copies of each shard (ray backend): r > 1 keeps r - 1 read-only replicas that take
    # every write; a lost shard's replica takes its place (no replay), and a new one starts
    shard_replicas: int = 1
    partitioner: str = "hash"  # or "ldg" (streaming linear deterministic greedy)
    # node state (TGN memory) on every trainer ("replicated") or owned by shards ("sharded");
    # "auto": replicated while nodes x state bytes per node fit memory_budget_mb
    memory: str = "auto"
    memory_budget_mb: float = 2048.0
    # Ray backend: logical CPUs per trainer and per shard actor (a GPU per trainer on CUDA),
    # and the limit of any collective between trainers (a hung peer fails the step then)
    trainer_cpus: float = 1.0
    shard_cpus: float = 0.5
    # GPUs per trainer on CUDA (ray backend), in (0, 1]; None: a whole GPU each when the
    # cluster has one for every trainer slot (max trainers and spares), else an equal share
    # (1 / trainers per GPU, rounded up), so 2 trainers run on a one-GPU machine
    trainer_gpus: float | None = None
    collective_timeout_s: float = 120.0
    # Ray custom resources added to each trainer's and each shard actor's bundle (ray
    # backend), as Ray Train's resources_per_worker: {"tg_trainer": 1} places trainers only
    # on nodes started with `--resources='{"tg_trainer": N}'`. Names are Ray resource names
    # (not CPU or GPU: trainer_cpus, shard_cpus and trainer_gpus set those), amounts > 0. A
    # local Ray started for the run offers what its actors ask for; the local backend has no
    # bundles and ignores them. They do not change results
    trainer_resources: dict[str, float] = field(default_factory=dict)
    shard_resources: dict[str, float] = field(default_factory=dict)
    # trainers sample shards on their own node in place, over the shards' segments in Ray's
    # object store (zero-copy); shards on other nodes answer requests
    local_sampling: bool = True
    # trainers run a whole training or evaluation pass per task, exchanging each step's
    # node-state updates among themselves (replicated node state); False: a task per step
    whole_passes: bool = True
    # cut a step's batch at equal estimated sampled edges when even slices' estimates differ
    # by more than this (heaviest over mean, minus 1); None: always even slices
    rebalance_tolerance: float | None = 0.1
    # trainers lost mid-run are replaced from a surviving replica (no rollback), at most this
    # many times in a run
    max_recoveries: int = 100
    # ray backend: trainer 0 logs every k-th training step's reduced gradient and node-state
    # updates to the run directory's updates/ (0: no log); when every trainer is lost the
    # steps since the checkpoint are replayed from it instead of computed (recovery.updatelog)
    update_log_every: int = 0
    # faults to inject (tests, drills): [{"trainer": w, "step": s, "at": "forward" |
    # "allreduce" | "after_step"}]: trainer w's process kills itself (SIGKILL) at that
    # point of its training step s (counted from 0 over the run); "incarnation": k targets
    # the rank's k-th replacement (default 0, the first trainer)
    faults: list = field(default_factory=list)

    def __post_init__(self) -> None:
        check_fields(self, "cluster")
        if self.backend not in BACKENDS:
            raise ValueError(f"cluster.backend must be one of {BACKENDS}, got {self.backend!r}")
        for i, fault in enumerate(self.faults):
            keys = set(fault) if isinstance(fault, dict) else set()
            if (not {"trainer", "step", "at"} <= keys <= {"trainer", "step", "at", "incarnation"}
                    or fault["at"] not in FAULT_POINTS):  # fmt: skip
                raise ValueError(
                    f"cluster.faults[{i}] must be {{trainer: int, step: int, at: one of "
                    f"{FAULT_POINTS}, incarnation: int (optional, default 0: the rank's "
                    f"first trainer)}}, got {fault!r}"
                )
        if self.max_recoveries < 0:
            raise ValueError(
                f"cluster.max_recoveries must be an integer >= 0, got {self.max_recoveries}"
            )
        self._trainer_bounds()
        if self.trainer_gpus is not None and not 0 < self.trainer_gpus <= 1:
            raise ValueError(
                f"cluster.trainer_gpus must be in (0, 1] or null, got {self.trainer_gpus}"
            )
        self._bounds("shards")
        if self.min_shards < self.max_shards and self.shard_replicas > 1:
            raise ValueError("cluster.shards {min, max} with cluster.shard_replicas > 1 is not "
                             "supported yet: use a fixed shard count with replicas")  # fmt: skip
        for name in ("trainers", "shards", "shard_replicas"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"cluster.{name} must be an integer >= 1, got {value}")
        if self.partitioner not in ("hash", "ldg"):
            raise ValueError(
                f"cluster.partitioner must be 'hash' or 'ldg', got {self.partitioner!r}"
            )
        if self.memory not in MEMORY_PLACEMENTS:
            raise ValueError(
                f"cluster.memory must be one of {MEMORY_PLACEMENTS}, got {self.memory!r}"
            )
        if not self.memory_budget_mb > 0:
            raise ValueError(f"cluster.memory_budget_mb must be > 0, got {self.memory_budget_mb}")
        if self.rebalance_tolerance is not None and not self.rebalance_tolerance >= 0:
            raise ValueError(
                f"cluster.rebalance_tolerance must be >= 0 or null, got {self.rebalance_tolerance}"
            )
        for name in ("trainer_cpus", "shard_cpus", "collective_timeout_s", "elastic_poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster.{name} must be > 0, got {getattr(self, name)}")
        for name in ("trainer_resources", "shard_resources"):
            _check_resources(f"cluster.{name}", getattr(self, name))

    def _bounds(self, field: str) -> None:
        """`<field>: {min, max}` (or an int n: min = max = n) to `min_<field>`, `max_<field>`
        and `<field>` = max (the most the run asks Ray for)."""
        t, lo, hi = getattr(self, field), f"min_{field}", f"max_{field}"
        if isinstance(t, dict):
            if set(t) != {"min", "max"}:
                raise ValueError(f"cluster.{field} must be an integer or {{min, max}}, got {t}")
            setattr(self, lo, t["min"])
            setattr(self, hi, t["max"])
        elif getattr(self, lo) is None and getattr(self, hi) is None:
            if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                raise ValueError(f"cluster.{field} must be an integer >= 1, got {t!r}")
            setattr(self, lo, t)
            setattr(self, hi, t)
        for name in (lo, hi):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster.{field}: {name[:3]} must be an integer >= 1, "
                                 f"got {value!r}")  # fmt: skip
        if getattr(self, lo) > getattr(self, hi):
            raise ValueError(f"cluster.{field}: min {getattr(self, lo)} > max "
                             f"{getattr(self, hi)}")  # fmt: skip
        setattr(self, field, getattr(self, hi))

    def _trainer_bounds(self) -> None:
        """`trainers: {min, max}` (`_bounds`), and the settings that go with resizes."""
        self._bounds("trainers")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"cluster.scale_rule must be one of {SCALE_RULES}, got "
                             f"{self.scale_rule!r}")  # fmt: skip
        if self.spare_trainers < 0:
            raise ValueError(f"cluster.spare_trainers must be >= 0, got {self.spare_trainers}")


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")

_SECTIONS = {
    "model": ModelConfig,
    "data": DataConfig,
    "sampler": SamplerConfig,
    "train": TrainConfig,
    "continual": ContinualConfig,
    "cluster": ClusterConfig,
    "comm": CommConfig,
    "eval": EvalConfig,
}


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    continual: ContinualConfig = field(default_factory=ContinualConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    comm: CommConfig = field(default_factory=CommConfig)  # gradient and row compression
    eval: EvalConfig = field(default_factory=EvalConfig)  # link-prediction evaluation protocol
    mode: str = "continual"  # or "offline" (70/15/15 by time)
    offline_split: tuple[float, float] = (0.70, 0.15)  # train, validation; the rest is test
    seed: int = 0
    device: str = "cpu"
    graph_device: str | None = None  # where the graph lives and sampling runs; None: device
    out_dir: str | None = "runs/latest"
    run_name: str | None = None  # the run's directory under `storage` and its Ray namespace
    storage: str = "runs"  # a local path or a URI pyarrow.fs opens (s3://, gs://)
    checkpoint_every: int = 1  # increments between checkpoints (and one after phase 1, at end)
    keep_checkpoints: int = 3  # the newest checkpoints kept (older ones and what only they use go)
    progress: bool = True
    # the step timeline (tidegraph.timeline): 0 off, K records every K-th step of each pass
    # kind, written to the run directory's timeline/
    timeline: int = 0
    # torch CPU threads, set by the job entry point; 1 is fastest on small CPU boxes (these
    # batches are small, and threads thrash when other processes compete); None: torch's default
    threads: int | None = 1
    deterministic: bool = True  # deterministic kernels (see tidegraph.runtime.set_determinism)

    def __post_init__(self) -> None:
        check_fields(self, "")
        if self.mode not in ("continual", "offline"):
            raise ValueError(f"mode must be 'continual' or 'offline', got {self.mode!r}")
        a, b = self.offline_split
        if not (0 < a and 0 <= b and a + b < 1):
            raise ValueError(f"offline_split must be (train, val) with train + val < 1, got {a, b}")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.timeline < 0:
            raise ValueError(f"timeline must be >= 0 (0: off, K: every K-th step), got "
                             f"{self.timeline}")  # fmt: skip
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.graph_device is None:
            self.graph_device = self.device
        if not _DEVICE.fullmatch(self.graph_device) and self.graph_device != "pinned":
            raise ValueError(
                f"graph_device must be 'cpu', 'cuda', 'cuda:N' or 'pinned' (host memory read "
                f"from CUDA), got {self.graph_device!r}"
            )
        layers, model = self.model.num_layers, spec(self.model.name)
        if self.sampler.fanouts is None:
            self.sampler.fanouts = [model.fanout] * layers
        elif len(self.sampler.fanouts) != layers:
            raise ValueError(
                f"sampler.fanouts has {len(self.sampler.fanouts)} entries but model "
                f"{self.model.name!r} has num_layers={layers}: give one fanout per layer"
            )
        if self.sampler.num_snapshots is None:
            self.sampler.num_snapshots = model.snapshots
        if not model.uses_snapshots and self.sampler.num_snapshots != 1:
            users = [name for name, row in REGISTRY.items() if row.uses_snapshots]
            raise ValueError(
                f"sampler.num_snapshots must be 1 for model {self.model.name!r} "
                f"(only {', '.join(users)} uses snapshots)"
            )

    @staticmethod
    def from_dict(raw: dict | None) -> RunConfig:
        """From a YAML mapping of sections (and top-level fields); a key that is no field, a
        section that is no mapping or a value of the wrong type raises naming it."""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError(
                f"a run config maps section names ({', '.join(_SECTIONS)}) to their fields; "
                f"got a {type(raw).__name__}"
            )
        raw = dict(raw)
        unknown_keys(raw, {f.name for f in dataclasses.fields(RunConfig)}, "top level")
        kwargs = {name: _build(cls, raw.pop(name, None), name) for name, cls in _SECTIONS.items()}
        return RunConfig(**kwargs, **raw)

    @staticmethod
    def from_yaml(path: str) -> RunConfig:
        return RunConfig.from_dict(read_config(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_config(path: str, flag: str = "--config") -> dict:
    """The raw mapping of a YAML config file, its sections checked to be mappings (so flags can
    be merged into them); one-line errors name the file, and the section."""
    raw = read_yaml(path, flag)
    for name in _SECTIONS:
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise ValueError(f"{flag} {path}: {name} must be a mapping of its fields, "
                             f"got {raw[name]!r}")  # fmt: skip
    return raw


def _build(cls, section: dict | None, name: str):
    if section is None:
        return cls()
    if not isinstance(section, dict):
        raise ValueError(f"{name} must be a mapping of its fields, got {section!r}")
    unknown_keys(section, {f.name for f in dataclasses.fields(cls)}, name)
    return cls(**section)
