"""The update log: what redoes a training step without computing it.

Rank 0 of the trainer group writes, for every k-th training step (`cluster.update_log_every`),
the step's reduced gradient (the flat all-reduced gradient the optimizer stepped with, after
any quantization: every rank stepped with exactly these values), the node-state updates of
every slice in rank order and the batch's loss, as `step-NNNNNNNNN.pt` in the run directory's
`updates/`. A background thread writes them (a temporary file renamed into place, so a reader
never sees half a record), so training does not wait for the disk.

When no replica is left (every trainer lost) the run restarts from its newest checkpoint and
the steps since it are replayed from the log: the optimizer steps with the logged gradient and
the logged node-state updates are applied, with no sampling, feature fetch, forward, backward
or all-reduce. Steps not logged (k > 1, or records lost with the process before the thread
wrote them) are computed as usual between replayed ones; either way the state after each
step is the same, so the run ends bitwise as an uninterrupted one. Every trainer reads the
same records, so the log must be on storage every trainer reaches (the run directory, as for
checkpoints). Evaluation passes are computed again (they are forward passes only).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
from pathlib import Path

import torch

__all__ = ["UpdateLog", "logged_steps", "read_step"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"step-(\d{9})\.pt")


def _path(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:09d}.pt"


def logged_steps(directory: str | Path, since: int = 0) -> list[int]:
    """Steps >= `since` with a record in `directory` (none if it does not exist)."""
    if not Path(directory).is_dir():
        return []
    found = (_NAME.fullmatch(name) for name in os.listdir(directory))
    return sorted(s for m in found if m and (s := int(m.group(1))) >= since)


def read_step(directory: str | Path, step: int) -> dict:
    """The record of `step`: {"step", "grad", "updates", "loss"}."""
    return torch.load(_path(directory, step), weights_only=True)


def _copy(x):
    if torch.is_tensor(x):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_copy(v) for v in x)
    return x


class UpdateLog:
    """Writes step records to `directory` from a background thread (`record` only queues)."""

    def __init__(self, directory: str | Path, every: int) -> None:
        if every < 1:
            raise ValueError(f"update log: every must be >= 1, got {every}")
        self.directory, self.every = Path(directory), every
        self.directory.mkdir(parents=True, exist_ok=True)
        self.bytes = self.records = 0
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write, daemon=True, name="update-log")
        self._thread.start()

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def record(self, step: int, grad: torch.Tensor, updates: list, loss: float) -> None:
        """Queue step `step`'s record (copied now: buffers are reused)."""
        self._queue.put({"step": step, "grad": grad.detach().clone(), "updates": _copy(updates),
                         "loss": float(loss)})  # fmt: skip

    def flush(self) -> None:
        """Wait until every queued record is on disk."""
        self._queue.join()
        if self.error is not None:
            raise RuntimeError(f"update log {self.directory}: {self.error}") from self.error

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _write(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                path = _path(self.directory, item["step"])
                tmp = path.with_suffix(".tmp")
                torch.save(item, tmp)
                os.replace(tmp, path)
                self.bytes += path.stat().st_size
                self.records += 1
            except BaseException as exc:  # kept for flush(); training goes on without it
                if self.error is None:
                    log.error("update log %s: writing failed: %s", self.directory, exc)
                self.error = exc
            finally:
                self._queue.task_done()
