"""The update log: what redoes a training step without computing it.

Rank 0 of the trainer group writes, for every k-th training step (`cluster.update_log_every`),
the step's reduced gradient (the flat all-reduced gradient the optimizer stepped with, after
any quantization: every rank stepped with exactly these values), the node-state updates of
every slice in rank order and the batch's loss, as `step-NNNNNNNNN.rec` in the run directory's
`updates/`. A background thread writes them (a temporary file renamed into place, so a reader
never sees half a record), so training does not wait for the disk.

A record is raw bytes, not a pickle: a JSON header (the records' nesting, each tensor's dtype
and shape, the loss) and then every tensor's bytes, each at an 8-byte boundary. Writing it is
a few `write` calls on views of the tensors, which release the GIL while the kernel copies;
`torch.save` held the GIL while it pickled and zipped (with a CRC of every byte), stalling
the training thread's Python between kernels. At most `QUEUED` records wait for the writer
(then `record` waits: memory stays bounded). Records of the earlier format
(`step-NNNNNNNNN.pt`, `torch.save`) are still read, so a run directory written before can
resume.

Records of steps before the oldest kept checkpoint are deleted when a checkpoint is written
(`drop_steps_before`), so the log holds at most the steps since that checkpoint.

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

import json
import logging
import os
import queue
import re
import struct
import threading
from pathlib import Path

import torch

__all__ = ["UpdateLog", "logged_steps", "read_step"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"step-(\d{9})\.(rec|pt)")
_MAGIC = b"TGUPDLOG1\n"
_ALIGN = 8
_IOV = 512  # buffers per writev (the kernel takes up to IOV_MAX, 1024 on Linux)
QUEUED = 64  # records waiting for the writer (~1.3 MB each for the default TGN)


def _path(directory: str | Path, step: int, suffix: str = ".rec") -> Path:
    return Path(directory) / f"step-{step:09d}{suffix}"


def logged_steps(directory: str | Path, since: int = 0) -> list[int]:
    """Steps >= `since` with a record in `directory` (none if it does not exist)."""
    if not Path(directory).is_dir():
        return []
    found = (_NAME.fullmatch(name) for name in os.listdir(directory))
    return sorted({s for m in found if m and (s := int(m.group(1))) >= since})


def drop_steps_before(directory: str | Path, step: int) -> int:
    """Delete the records of steps before `step` (no kept checkpoint needs them); returns how
    many were deleted."""
    if not Path(directory).is_dir():
        return 0
    found = (_NAME.fullmatch(name) for name in os.listdir(directory))
    old = [m.group(0) for m in found if m and int(m.group(1)) < step]
    for name in old:
        Path(directory, name).unlink(missing_ok=True)
    return len(old)


def read_step(directory: str | Path, step: int) -> dict:
    """The record of `step`: {"step", "grad", "updates", "loss"}."""
    path = _path(directory, step)
    if not path.exists() and _path(directory, step, ".pt").exists():
        return torch.load(_path(directory, step, ".pt"), weights_only=True)  # earlier format
    data = bytearray(path.read_bytes())
    if not data.startswith(_MAGIC):
        raise ValueError(f"update log {path}: not an update-log record")
    at = len(_MAGIC)
    (size,) = struct.unpack_from("<Q", data, at)
    header = json.loads(bytes(data[at + 8 : at + 8 + size]))
    at = _aligned(at + 8 + size)
    leaves = []
    for dtype, shape, nbytes in header["tensors"]:
        flat = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=at) if nbytes else (
            torch.empty(0, dtype=torch.uint8))  # fmt: skip
        leaves.append(flat.view(getattr(torch, dtype)).reshape(shape))
        at = _aligned(at + nbytes)
    return _decode(header["record"], leaves)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _encode(x, leaves: list):
    """`x` as JSON with each tensor replaced by its index in `leaves` (appended to it)."""
    if torch.is_tensor(x):
        leaves.append(x)
        return {"t": len(leaves) - 1}
    if isinstance(x, dict):  # pairs: keys need not be strings
        return {"d": [[_encode(k, leaves), _encode(v, leaves)] for k, v in x.items()]}
    if isinstance(x, list | tuple):
        return {"l" if isinstance(x, list) else "u": [_encode(v, leaves) for v in x]}
    if x is None or isinstance(x, bool | int | float | str):
        return {"v": x}
    raise TypeError(f"update log: cannot record a {type(x).__name__}")


def _decode(x, leaves: list):
    ((kind, value),) = x.items()
    if kind == "t":
        return leaves[value]
    if kind == "d":
        return {_decode(k, leaves): _decode(v, leaves) for k, v in value}
    if kind in ("l", "u"):
        out = [_decode(v, leaves) for v in value]
        return out if kind == "l" else tuple(out)
    return value


def _host_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of `x` that the caller may change afterwards."""
    x = x.detach()
    return x.cpu() if x.device.type != "cpu" else x.contiguous().clone()


def _host_copies(x):
    """`x` with every tensor copied to the host (buffers are reused by the next step)."""
    if torch.is_tensor(x):
        return _host_copy(x)
    if isinstance(x, dict):
        return {k: _host_copies(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_host_copies(v) for v in x)
    return x


def write_record(path: Path, record: dict) -> int:
    """Write `record` (tensors on the host) to `path` in the raw format; bytes written."""
    leaves: list[torch.Tensor] = []
    skeleton = _encode(record, leaves)
    views = [x.contiguous().reshape(-1).view(torch.uint8).numpy() for x in leaves]
    meta = [(str(x.dtype).removeprefix("torch."), list(x.shape), v.nbytes)
            for x, v in zip(leaves, views, strict=True)]  # fmt: skip
    header = json.dumps({"record": skeleton, "tensors": meta}).encode()
    head = _MAGIC + struct.pack("<Q", len(header)) + header
    buffers, size = [], 0
    for chunk in [head, *views]:
        pad = _aligned(size) - size
        if pad:
            buffers.append(bytes(pad))
            size += pad
        if len(chunk):
            buffers.append(chunk)
            size += len(chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, buffers)
    finally:
        os.close(fd)
    return size


def _write_all(fd: int, buffers: list) -> None:
    """All of `buffers` in as few `writev` calls as the kernel takes (it releases the GIL)."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        done = os.writev(fd, views[:_IOV])
        while views and done >= len(views[0]):
            done -= len(views.pop(0))
        if views and done:
            views[0] = views[0][done:]


class UpdateLog:
    """Writes step records to `directory` from a background thread (`record` only queues)."""

    def __init__(self, directory: str | Path, every: int) -> None:
        if every < 1:
            raise ValueError(f"update log: every must be >= 1, got {every}")
        self.directory, self.every = Path(directory), every
        self.directory.mkdir(parents=True, exist_ok=True)
        self.bytes = self.records = 0
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUED)
        self._thread = threading.Thread(target=self._write, daemon=True, name="update-log")
        self._thread.start()

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def record(self, step: int, grad: torch.Tensor, updates: list, loss: float) -> None:
        """Queue step `step`'s record (the gradient copied now: its buffer is reused)."""
        self._queue.put({"step": step, "grad": _host_copy(grad), "updates": _host_copies(updates),
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
                size = write_record(tmp, item)
                os.replace(tmp, path)
                self.bytes += size
                self.records += 1
            except BaseException as exc:  # kept for flush(); training goes on without it
                if self.error is None:
                    log.error("update log %s: writing failed: %s", self.directory, exc)
                self.error = exc
            finally:
                self._queue.task_done()
