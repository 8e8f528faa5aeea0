"""A run's directory under a storage URI: config, checkpoints and the event log.

`{storage}/{run_name}/` holds `config.yaml`, `checkpoints/` (a manifest per checkpoint over
chunks written once, the newest `keep_checkpoints` kept, `latest` naming the newest:
`tidegraph.storage.checkpoint`), `events/` (the durable event log), `stream/` (the stream of a
run from a file, spooled: `tidegraph.storage.spool`; its parts before the oldest kept
checkpoint are dropped), and, for local storage, the
run's `metrics.jsonl` and `summary.json`. Every file is written to a temporary name and moved
into place, so a crash leaves the previous checkpoint intact. A fresh run refuses a directory
that already holds a run (a run's files are erased only by checkpoint retention); `resume`
continues from the newest checkpoint. Unwritable storage is found when the directory is
opened, before any training.

A run's result depends on its configuration except for the `NEUTRAL` fields (where it writes,
progress bars, threads, checkpoint cadence, the cluster's shape: the same results up to float
summation order). `check_resume_config` refuses to resume a run with a field that matters
changed on purpose, naming the fields; each checkpoint holds the configuration that wrote it,
and `load_checkpoint` refuses one whose configuration differs in a field that matters from the
run's (checkpoints without one, if any, load unchecked).
"""

from __future__ import annotations

import json
import logging

import pyarrow.fs as pafs
import yaml

from tidegraph.storage.checkpoint import CheckpointStore, read_file, write_file
from tidegraph.storage.eventlog import EventLog, open_fs
from tidegraph.timeline import trace_document

__all__ = ["NEUTRAL", "RunDir", "check_resume_config", "config_diff"]

log = logging.getLogger(__name__)


class RunDir:
    def __init__(self, storage: str, run_name: str, resume: bool = False) -> None:
        self.fs, root = open_fs(storage)
        self.uri = storage
        self.path = f"{root.rstrip('/')}/{run_name}"
        self.run_name = run_name
        self._check_writable()
        has_run = self._exists("config.yaml")
        if has_run and not resume:
            raise ValueError(
                f"run directory {self.path} already holds a run: pass --resume to continue it, "
                "or choose another --run-name"
            )
        if resume and not has_run:
            raise ValueError(f"--resume: {self.path} holds no run to resume")
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self.checkpoints = CheckpointStore(self.fs, f"{self.path}/checkpoints")
        # the same store for other processes: an absolute path, or the URI with its options
        base, _, options = storage.partition("?")
        where = f"{base.rstrip('/')}/{run_name}/checkpoints" if "://" in base else (
            f"{self.path}/checkpoints")  # fmt: skip
        self.checkpoint_uri = where + (f"?{options}" if options else "")
        self.config: dict | None = None  # the run's configuration (checkpoints must match it)
        self._timeline_seq: int | None = None  # the next timeline file's number

    def _check_writable(self) -> None:
        probe = f"{self.path}/.write-probe"
        try:
            self.fs.create_dir(self.path, recursive=True)
            with self.fs.open_output_stream(probe) as out:
                out.write(b"ok")
            self.fs.delete_file(probe)
        except (OSError, ValueError) as e:  # pyarrow raises OSError subclasses for I/O
            raise ValueError(f"storage: cannot write to {self.path}: {e}") from None

    def _exists(self, name: str) -> bool:
        info = self.fs.get_file_info(f"{self.path}/{name}")
        return info.type != pafs.FileType.NotFound

    def _write(self, name: str, data: bytes) -> None:
        write_file(self.fs, f"{self.path}/{name}", data)

    def _read(self, name: str) -> bytes:
        return read_file(self.fs, f"{self.path}/{name}")

    # ---- contents ---------------------------------------------------------------------------

    def event_log(self) -> EventLog:
        return EventLog(f"{self.uri.rstrip('/')}/{self.run_name}")

    def spool_uri(self) -> str:
        """Where the run's stream is spooled (`tidegraph.storage.spool`), as a URI any process
        on the storage opens."""
        base, _, options = self.uri.partition("?")
        where = f"{base.rstrip('/')}/{self.run_name}/stream" if "://" in base else (
            f"{self.path}/stream")  # fmt: skip
        return where + (f"?{options}" if options else "")

    def save_config(self, config: dict) -> None:
        self._write("config.yaml", yaml.safe_dump(config, sort_keys=False).encode())
        self.config = config

    def load_config(self) -> dict:
        self.config = yaml.safe_load(self._read("config.yaml"))
        return self.config

    def save_checkpoint(
        self, state: dict, tag: str, keep: int | None = None, meta: dict | None = None
    ) -> None:
        """Checkpoint `tag`, the newest; only the newest `keep` are kept (None: all)."""
        self.checkpoints.save(state, tag, keep, meta)
        log.info("checkpoint %s written to %s/checkpoints", tag, self.path)

    def write_timeline(self, events: list[dict], meta: dict) -> str:
        """`events` as the next file of timeline/ (a whole Chrome trace each); its name."""
        if self._timeline_seq is None:  # a resumed run numbers on after its files
            found = self.fs.get_file_info(pafs.FileSelector(f"{self.path}/timeline",
                                                            allow_not_found=True))  # fmt: skip
            names = [f.base_name for f in found if f.base_name.endswith(".json")]
            self._timeline_seq = 1 + max((int(n.split(".")[0]) for n in names), default=-1)
        name = f"timeline/{self._timeline_seq:05d}.json"
        self._timeline_seq += 1
        self._write(name, json.dumps(trace_document(events, meta)).encode())
        return name

    def latest_name(self) -> str | None:
        return self.checkpoints.latest()

    def load_checkpoint(self, config: dict | None = None, resolve: bool = True) -> dict:
        """The newest checkpoint; refused (ValueError naming the fields) when the configuration
        that wrote it differs from `config` (default: the run's) in a field that matters."""
        tag = self.latest_name()
        state = self.checkpoints.load(tag, resolve)
        if config is None and self.config is None and self._exists("config.yaml"):
            self.load_config()
        config = config if config is not None else self.config
        written = state.get("config") if isinstance(state, dict) else None
        if written is None or config is None:
            log.info("checkpoint %s: no configuration to compare it with (an older one)", tag)
        else:
            changed = [f for f in config_diff(written, config) if not _neutral(f)]
            if changed:
                raise ValueError(
                    f"checkpoint {tag} of run {self.run_name} was written with another "
                    f"configuration: {_show(changed, written, config, 'checkpoint', 'run')}; "
                    "resume it with the configuration that wrote it, or start a new run"
                )
        log.info("resuming %s from checkpoint %s", self.run_name, tag)
        return state


# fields (or whole sections) that do not change a run's result
NEUTRAL = (
    "run_name", "out_dir", "storage", "progress", "threads", "checkpoint_every",
    "keep_checkpoints", "cluster", "data.quarantine", "timeline",
)  # fmt: skip


def _neutral(field: str) -> bool:
    return any(field == n or field.startswith(n + ".") for n in NEUTRAL)


def config_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted fields whose values differ between two config mappings (tuples equal lists)."""
    out = []
    for key in sorted(set(a) | set(b), key=str):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += config_diff(x, y, f"{prefix}{key}.")
        elif _plain(x) != _plain(y):
            out.append(f"{prefix}{key}")
    return out


def check_resume_config(stored: dict, given: dict, explicit) -> None:
    """Resuming a run whose configuration is `stored` with `given`, in which the dotted fields
    `explicit` were asked for (by the YAML or flags: `config_check.explicit_fields`): refused,
    naming them, when an explicit field that matters differs; the run keeps its stored values
    of the others (logged)."""
    changed = config_diff(stored, given)
    asked = [f for f in changed if _asked(f, explicit)]
    refused = [f for f in asked if not _neutral(f)]
    if refused:
        raise ValueError(
            f"--resume: the run was configured otherwise: {_show(refused, stored, given)}; "
            "a resumed run keeps the configuration its checkpoints were made with (drop these "
            "settings, or start a new run)"
        )
    if asked:
        log.info("resuming with the run's stored %s (they do not change the result)",
                 _show(asked, stored, given))  # fmt: skip


def _asked(field: str, explicit) -> bool:
    parts = field.split(".")
    return any(".".join(parts[: i + 1]) in explicit for i in range(len(parts)))


def _show(fields: list[str], a: dict, b: dict, a_name: str = "run", b_name: str = "given") -> str:
    return ", ".join(f"{f} ({a_name} {_get(a, f)!r}, {b_name} {_get(b, f)!r})" for f in fields)


def _get(config: dict, field: str):
    for key in field.split("."):
        config = config.get(key) if isinstance(config, dict) else None
    return _plain(config)


def _plain(x):
    if isinstance(x, tuple | list):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x
