"""Throughput of the id map (`tidegraph.storage.idmap.IdMap`): external ids -> dense ids.

    python benchmarks/bench_idmap.py [--ids 4000000] [--batch 131072] [--distinct 1000000]

Cases, each over `--ids` ids cut into batches of `--batch` (as events arrive), best of
`--repeat` runs, in ids per second:
- int64 new: ids drawn from the whole int64 range, almost all new (the map grows each batch);
- int64 seen: the same ids again through the grown map (lookups only);
- int64 mixed: `--distinct` ids drawn with repetition (a power-law-free uniform mix);
- dense stream: ids below the identity bound (the bundled datasets' case: a copy);
- strings new / seen: the same for string ids (`map_text`, pyarrow hash lookups).
Also the whole-stream path `stream_of` (bound choice plus mapping) on `--ids` / 2 events.
Writes benchmarks/out/idmap.json.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa
import torch
from common import print_table, write_json

from tidegraph.storage.events import EventBatch
from tidegraph.storage.idmap import IdMap
from tidegraph.training.data import stream_of

I64 = np.iinfo(np.int64)


def rate(fn, n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return n / best


def batches(ids, size: int):
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ids", type=int, default=4_000_000)
    p.add_argument("--batch", type=int, default=131_072)
    p.add_argument("--distinct", type=int, default=1_000_000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    n = args.ids
    wide = rng.integers(I64.min, I64.max, size=n, endpoint=True)
    mixed = rng.choice(rng.integers(I64.min, I64.max, size=args.distinct), size=n)
    dense = rng.integers(0, args.distinct, size=n)
    text = pa.array([f"user-{v:x}" for v in rng.integers(0, I64.max, size=n // 4)])
    rows = []

    def fill(ids, make):
        m = make()
        for b in batches(ids, args.batch):
            m.map(b)
        return m

    grown = fill(wide, IdMap)
    cases = {
        "int64 new": lambda: fill(wide, IdMap),
        "int64 seen": lambda: [grown.map(b) for b in batches(wide, args.batch)],
        "int64 mixed": lambda: fill(mixed, IdMap),
        "dense stream": lambda: fill(dense, lambda: IdMap(args.distinct)),
    }
    for name, fn in cases.items():
        rows.append({"case": name, "ids": n, "ids_per_s": rate(fn, n, args.repeat)})

    def fill_text():
        m = IdMap(kind="str")
        for i in range(0, len(text), args.batch):
            m.map_text(text.slice(i, args.batch))
        return m

    grown_text = fill_text()
    seen = lambda: [grown_text.map_text(text.slice(i, args.batch))  # noqa: E731
                    for i in range(0, len(text), args.batch)]  # fmt: skip
    for name, fn in {"strings new": fill_text, "strings seen": seen}.items():
        rows.append({"case": name, "ids": len(text), "ids_per_s": rate(fn, len(text), 1)})

    events = n // 2

    def whole():
        ev = EventBatch(src=torch.from_numpy(wide[:events]), dst=torch.from_numpy(wide[events:]),
                        t=torch.zeros(events, dtype=torch.float64),
                        eid=torch.zeros(events, dtype=torch.int64))  # fmt: skip
        stream_of(ev, "bench")

    rows.append({"case": "stream_of (whole stream)", "ids": 2 * events,
                 "ids_per_s": rate(whole, 2 * events, args.repeat)})  # fmt: skip
    print_table(rows)
    write_json("idmap.json", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
