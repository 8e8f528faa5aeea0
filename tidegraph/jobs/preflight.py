"""Checks a job runs before any work starts: each failure is one line naming the flag or field.

`preflight` finds what would otherwise fail late (after the data is loaded, or after phase 1):
a CUDA device on a machine without one, a run directory or quarantine file that cannot be
written, a dataset file that is missing or unreadable, a followed path that does not exist, or
how to read a dataset file (`--columns`, `--features`, `--header`) given with `--follow`, whose
files are read by their own header and format (refused rather than ignored).
`conflicts` finds command-line flags that the YAML would silently overrule (`--increments`
while the YAML cuts increments by `continual.increment_window`).

Writability is probed by creating (and removing) a temporary file in the nearest existing
directory, since permission bits do not tell the truth to root or on read-only mounts; nothing
else is created. Storage URIs (s3://, gs://) are left to `RunDir`, which probes them when it
opens the run directory, also before any work.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

__all__ = ["SHADOWS", "conflicts", "preflight"]

_INCREMENTS = (
    "continual.num_increments",
    "continual.increment_events",
    "continual.increment_window",
)
# a field a flag sets -> the fields whose YAML values that makes the run ignore, and why
SHADOWS = {
    **{f: (tuple(g for g in _INCREMENTS if g != f), "a run cuts increments one way only")
       for f in _INCREMENTS},
    "out_dir": (("run_name", "storage"), "--out names the run directory itself"),
}  # fmt: skip


def preflight(config, out: str | None = None, quarantine: str | None = None,
              follow: str | None = None) -> None:  # fmt: skip
    """Raise ValueError (one line, naming the flag or field) for the first problem found.

    `out`, `quarantine` and `follow` are the flags' values (None: not given); the config's own
    `storage`, `data.quarantine` and `data.dataset` are checked too."""
    _check_device("--device/device", config.device, config.cluster.backend)
    if config.graph_device != config.device:
        _check_device("graph_device", config.graph_device, config.cluster.backend)
    if out is not None:
        _check_dir_writable("--out", Path(out))
    elif "://" not in config.storage:
        _check_dir_writable("storage", Path(config.storage))
    q = quarantine if quarantine is not None else config.data.quarantine
    if q is not None:
        _check_file_writable("--quarantine" if quarantine is not None else "data.quarantine", q)
    if follow is not None:
        if not Path(follow).exists():
            raise ValueError(f"--follow: {follow} does not exist (give a directory or a file)")
        _check_readable("--follow", Path(follow))
        _check_follow_reading(config.data)
    else:
        _check_dataset(config.data.dataset)


def conflicts(raw_yaml: dict, overrides: dict[str, str]) -> list[str]:
    """What the flags in `overrides` (dotted field -> flag, e.g. {"continual.num_increments":
    "--increments"}) contradict in the YAML mapping `raw_yaml`: one line per conflict."""
    out = []
    for field, flag in overrides.items():
        shadowed, why = SHADOWS.get(field, ((), ""))
        for other in shadowed:
            value = _get(raw_yaml, other)
            if value is None or other in overrides:
                continue
            out.append(
                f"{flag} sets {field}, which conflicts with {other}: {value!r} in the --config "
                f"YAML ({why}): remove one of them"
            )
    return out


def _get(raw, dotted: str):
    for key in dotted.split("."):
        if not isinstance(raw, dict):
            return None
        raw = raw.get(key)
    return raw


def _check_follow_reading(data) -> None:
    given = [name for name in ("columns", "features", "header") if getattr(data, name) is not None]
    if given:
        fields = ", ".join(f"--{n}/data.{n}" for n in given)
        raise ValueError(f"{fields}: how to read a --dataset file; --follow reads each file by "
                         "its own header and format and would ignore it: remove it")  # fmt: skip


def _check_device(flag: str, device: str, backend: str) -> None:
    if not device.startswith("cuda") and device != "pinned":
        return
    if backend == "ray" and os.environ.get("RAY_ADDRESS"):
        return  # the trainers run on the cluster's nodes, not here
    if not torch.cuda.is_available():
        raise ValueError(
            f"{flag}: {device!r} needs CUDA, which this machine lacks "
            f"(torch {torch.__version__}); use cpu"
        )
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"{flag}: {device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(flag: str, target: Path, directory: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        raise ValueError(f"{flag}: cannot write to {target}: {directory}: {reason}") from None


def _check_dir_writable(flag: str, path: Path) -> None:
    base = _existing_parent(path)
    if not base.is_dir():
        raise ValueError(f"{flag}: cannot write to {path}: {base} is a file, not a directory")
    _probe(flag, path, base)


def _check_file_writable(flag: str, path: str) -> None:
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag}: {path} is a directory; give a file to write rejected rows to")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{flag}: cannot write to {path}: the file is read-only")
    base = _existing_parent(p.parent)
    if not base.is_dir():
        raise ValueError(f"{flag}: cannot write to {path}: {base} is a file, not a directory")
    _probe(flag, p, base)


def _check_readable(flag: str, path: Path) -> None:
    try:
        if path.is_dir():
            next(iter(os.scandir(path)), None)
        else:
            with path.open("rb") as f:
                f.read(1)
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror or e}") from None


def _check_dataset(dataset: str) -> None:
    from tidegraph.data import bundled_names, bundled_path

    try:
        bundled_path(dataset)
        return
    except KeyError:
        pass
    except FileNotFoundError as e:
        raise ValueError(f"--dataset/data.dataset: {e}") from None
    path = Path(dataset)
    if not path.exists():
        raise ValueError(
            f"--dataset/data.dataset: {dataset}: no such file, and not a bundled dataset "
            f"({', '.join(bundled_names())})"
        )
    _check_readable("--dataset/data.dataset", path)
