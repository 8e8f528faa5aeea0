"""A run's directory under a storage URI: config, checkpoints and the event log.

`{storage}/{run_name}/` holds `config.yaml`, `checkpoints/` (one file per checkpoint, and
`latest` naming the newest), `events/` (the durable event log), and, for local storage, the
run's `metrics.jsonl` and `summary.json`. Every file is written to a temporary name and moved
into place, so a crash leaves the previous checkpoint intact. A fresh run refuses a directory
that already holds a run (nothing is ever erased); `resume` continues from the newest
checkpoint. Unwritable storage is found when the directory is opened, before any training.
"""

from __future__ import annotations

import io
import logging

import pyarrow.fs as pafs
import torch
import yaml

from tidegraph.storage.eventlog import EventLog, open_fs

__all__ = ["RunDir"]

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
        final = f"{self.path}/{name}"
        self.fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
        tmp = f"{final}.tmp"
        with self.fs.open_output_stream(tmp) as out:
            out.write(data)
        self.fs.move(tmp, final)

    def _read(self, name: str) -> bytes:
        with self.fs.open_input_stream(f"{self.path}/{name}") as f:
            return f.read()

    # ---- contents ---------------------------------------------------------------------------

    def event_log(self) -> EventLog:
        return EventLog(f"{self.uri.rstrip('/')}/{self.run_name}")

    def save_config(self, config: dict) -> None:
        self._write("config.yaml", yaml.safe_dump(config, sort_keys=False).encode())

    def load_config(self) -> dict:
        return yaml.safe_load(self._read("config.yaml"))

    def save_checkpoint(self, state: dict, tag: str) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self._write(f"checkpoints/{tag}.pt", buffer.getvalue())
        self._write("checkpoints/latest", tag.encode())
        log.info("checkpoint %s written to %s/checkpoints", tag, self.path)

    def latest_name(self) -> str | None:
        if not self._exists("checkpoints/latest"):
            return None
        return self._read("checkpoints/latest").decode().strip()

    def load_checkpoint(self) -> dict:
        tag = self.latest_name()
        state = torch.load(io.BytesIO(self._read(f"checkpoints/{tag}.pt")), weights_only=False)
        log.info("resuming %s from checkpoint %s", self.run_name, tag)
        return state
