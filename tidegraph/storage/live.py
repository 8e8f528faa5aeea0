"""A live source: a directory that receives event files while the run goes on.

`DirectorySource(path)` hands out the files that appear in `path`, each once, in name order,
read with the loaders (any format they detect, bad rows rejected or quarantined as for a
dataset). A writer makes a file appear whole: it writes under a hidden name (`.name`) or a
temporary suffix (`.tmp`, `.part`) and renames it when done; such names are never read.
`next_events(timeout)` polls (bounded) until a new file arrives or the timeout passes.
"""

from __future__ import annotations

import time
from pathlib import Path

from tidegraph.storage.events import EventBatch
from tidegraph.storage.loaders import load_events

__all__ = ["DirectorySource"]

_PARTIAL = (".tmp", ".part")


class DirectorySource:
    poll_interval = 0.5  # seconds between looks at the directory (tests lower it)

    def __init__(self, path: str, format: str = "auto", quarantine: str | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"--follow: {path} is not a directory")
        self.format, self.quarantine = format, quarantine
        self.consumed: list[str] = []

    def _ready(self) -> list[Path]:
        done = set(self.consumed)
        files = [
            p for p in self.path.iterdir()
            if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_PARTIAL)
            and p.name not in done
        ]  # fmt: skip
        return sorted(files)

    def next_events(self, timeout: float) -> tuple[str, EventBatch] | None:
        """The next new file's events (sorted by time), or None when none came in time."""
        deadline = time.monotonic() + timeout
        while True:
            ready = self._ready()
            if ready:
                path = ready[0]
                events = load_events(path, self.format, sort="full", quarantine=self.quarantine)
                self.consumed.append(path.name)
                return path.name, events
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.poll_interval)

    def state_dict(self) -> dict:
        return {"consumed": list(self.consumed)}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = list(state["consumed"])
