"""Shared pieces of the benchmark scripts: synthetic streams, timing, the machine, JSON output."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

OUT_DIR = Path(__file__).resolve().parent / "out"


def power_law_stream(
    num_edges: int, num_nodes: int, alpha: float = 0.8, seed: int = 0, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, t): endpoints drawn with weight rank**-alpha over shuffled ids (alpha 0.8 gives
    degrees distributed as d**-2.25, like large interaction graphs), t increasing."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = torch.arange(1, num_nodes + 1, device=device, dtype=torch.float64).pow(-alpha)
    perm = torch.randperm(num_nodes, generator=gen, device=device)
    chunks_src, chunks_dst = [], []
    step = 1 << 24  # torch.multinomial draws at most 2**24 samples per call
    for start in range(0, num_edges, step):
        n = min(step, num_edges - start)
        chunks_src.append(perm[torch.multinomial(weights, n, True, generator=gen)])
        chunks_dst.append(perm[torch.multinomial(weights, n, True, generator=gen)])
    t = torch.arange(num_edges, device=device, dtype=torch.float64)
    return torch.cat(chunks_src), torch.cat(chunks_dst), t


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str | torch.device = "cpu") -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({os.cpu_count()} CPU cores)"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU"


def write_json(name: str, payload: dict) -> Path:
    """Write benchmarks/out/NAME, and a copy to $OUT when set (the GPU machine's result folder:
    written as each benchmark ends, so results survive a later timeout)."""
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / name
    payload = {"machine": machine(), "torch": torch.__version__, **payload}
    text = json.dumps(payload, indent=2)
    path.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(text)
    return path


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r[c]).rjust(w) for c, w in zip(cols, widths, strict=True)))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"
    return str(x)
