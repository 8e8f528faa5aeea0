"""The what-if model (`tidegraph.whatif`) against measurements: predicted vs measured events/s.

Each trace file a benchmark wrote (bench_scaling's trace_*.json, bench_link's link_*.json)
holds a measured timed pass (otherData: events_per_s or events/wall_s, trainers, compression,
overlap, link_gbps, link_latency_us). For each base (one trace, or several joined by '+':
the first is replayed, the rest calibrate), every trace's setting is predicted and set beside
its measurement. `--cluster` adds predictions for W = 8, 16, 64 on a link, global batch kept
and grown with W (`scale_rule: linear`), from the first base.

    python benchmarks/bench_whatif.py 'benchmarks/out/trace_ray_P2_W*_t1_*.json' \\
        --bases W2 W4 W2+W8 [--cluster 10:50] [--out whatif_16core.json]
    python benchmarks/bench_whatif.py 'benchmarks/out/link_*.json' --bases unlimited_none_off

A trace is named in --bases by the end of its file name's stem, or a part of it, that
matches exactly one file.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_json  # noqa: E402

from tidegraph.timeline import read_trace  # noqa: E402
from tidegraph.whatif import Setting, calibrate, predict, profile  # noqa: E402


def _setting(meta: dict, **over) -> Setting:
    gbps = meta.get("link_gbps")
    return Setting(trainers=int(meta["trainers"]), compression=meta.get("compression", "none"),
                   overlap=bool(meta.get("overlap")),
                   link_gbps=None if gbps in (None, float("inf")) else float(gbps),
                   link_latency_us=meta.get("link_latency_us") or None, **over)  # fmt: skip


def _measured(meta: dict) -> float:
    return meta.get("events_per_s") or meta["events"] / meta["wall_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("traces", help="a glob of trace files")
    p.add_argument("--bases", nargs="+", required=True)
    p.add_argument("--cluster", nargs="*", default=[], metavar="GBPS:LATENCY_US",
                   help="links to predict W = 8, 16, 64 over, e.g. 10:50 100:5")  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()
    files = sorted(glob.glob(args.traces))
    docs = {Path(f).stem: read_trace(f) for f in files}
    profiles = {k: profile(d) for k, d in docs.items()}

    def pick(part: str) -> str:
        hits = [k for k in docs if k.endswith(part)] or [k for k in docs if part in k]
        if len(hits) != 1:
            raise SystemExit(f"--bases {part!r} matches {len(hits)} traces: {hits}")
        return hits[0]

    rows, cluster = [], []
    for spec in args.bases:
        names = [pick(x) for x in spec.split("+")]
        model = calibrate([profiles[n] for n in names])
        print(f"base {' + '.join(names)}")
        for k, d in docs.items():
            meta = d["otherData"]
            out = predict(model, _setting(meta))
            measured = _measured(meta)
            err = out.events_per_s / measured - 1
            rows.append({"base": names, "target": k, "predicted": out.events_per_s,
                         "measured": measured, "error": err,
                         "bottleneck": out.bottleneck})  # fmt: skip
            flag = " (a base)" if k in names else ""
            print(f"  {k:42s} predicted {out.events_per_s:8,.0f}  measured {measured:8,.0f}"
                  f"  {err * 100:+6.1f}%  {out.bottleneck}{flag}")  # fmt: skip
        for link in args.cluster:
            gbps, lat = (float(x) for x in link.split(":"))
            for rule in ("keep", "linear"):
                for w in (8, 16, 64):
                    s = Setting(trainers=w, link_gbps=gbps, link_latency_us=lat, scale_rule=rule)
                    out = predict(model, s)
                    cluster.append({"base": names, "link_gbps": gbps, "latency_us": lat,
                                    "scale_rule": rule, "trainers": w, "step_ms": out.step_ms,
                                    "events_per_s": out.events_per_s,
                                    "bottleneck": out.bottleneck,
                                    "path": out.path, "assumptions": out.assumptions})  # fmt: skip
                    print(f"  predicted, {gbps:g} Gbit/s {lat:g} us, {rule}: W = {w}: "
                          f"{out.step_ms:.2f} ms a step, {out.events_per_s:,.0f} events/s, "
                          f"bottleneck {out.bottleneck}")  # fmt: skip
    if args.out:
        write_json(args.out, {"traces": args.traces, "rows": rows, "cluster": cluster})


if __name__ == "__main__":
    main()
