"""Predict a training step under other settings from a recorded timeline (`tidegraph.whatif`).

    python -m tidegraph.jobs.whatif RUN_DIR|TRACE.json --trainers W [--link-gbps B]
        [--link-latency-us L] [--compression none|q8|q4|adaptive] [--overlap on|off]
        [--scale-rule keep|linear] [--calibrate RUN_DIR|TRACE.json ...]

prints the recorded step, the predicted step time and events/s, the spans of the critical
path and the one that takes longest. Several --trainers values give one line each.
--calibrate adds recorded runs of the same job at other W (or compression): compute's fixed
part and the costs that grow with W are then fitted over all of them.
"""

from __future__ import annotations

import argparse
import os
import sys

from tidegraph.timeline import load_trace, read_trace
from tidegraph.whatif import Setting, calibrate, predict, profile

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tidegraph.jobs.whatif", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("source", help="a run directory with timeline/, or one trace JSON file")
    p.add_argument("--trainers", type=int, nargs="+", required=True, metavar="W")
    p.add_argument("--link-gbps", type=float, help="a link of B Gbit/s (default: as recorded)")
    p.add_argument("--link-latency-us", type=float, help="its latency per message")
    p.add_argument("--compression", help="none, q8, q4 or adaptive (default: as recorded)")
    p.add_argument("--overlap", choices=["on", "off"], help="default: as recorded")
    p.add_argument(
        "--scale-rule",
        default="keep",
        choices=["keep", "linear"],
        help="keep the global batch, or grow it with W (cluster.scale_rule linear)",
    )
    p.add_argument(
        "--calibrate",
        nargs="+",
        default=[],
        metavar="SOURCE",
        help="more recorded runs of the same job (other W, compression)",
    )
    return p


def _load(source: str) -> dict:
    if os.path.isdir(source):
        return load_trace(source)
    try:
        return read_trace(source)
    except FileNotFoundError:
        raise FileNotFoundError(f"{source}: no such run directory or trace file") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        profiles = [profile(_load(src)) for src in [args.source, *args.calibrate]]
        settings = [Setting(trainers=w, link_gbps=args.link_gbps,
                            link_latency_us=args.link_latency_us,
                            compression=args.compression,
                            overlap=None if args.overlap is None else args.overlap == "on",
                            scale_rule=args.scale_rule) for w in args.trainers]  # fmt: skip
    except (OSError, ValueError) as e:
        print(f"whatif: {e}", file=sys.stderr)
        return 2
    for src, p in zip([args.source, *args.calibrate], profiles, strict=True):
        print(f"recorded ({src}): W = {p.world}, {p.steps} steps of {p.global_batch:.0f} "
              f"events, {p.period_ms:.2f} ms a step, {p.events_per_s:,.0f} events/s; a rank: "
              f"compute {sum(p.span_ms.values()):.2f} ms, all-reduce {p.allreduce_ms:.2f}, "
              f"exchange {p.exchange_ms:.2f}, optimizer and apply {p.tail_ms:.2f}, between "
              f"steps {p.beyond_ms:.2f}; slowest rank x{p.spread_a:.3f} before the "
              f"exchange, x{p.spread_b:.3f} in backward")  # fmt: skip
    model = calibrate(profiles)
    fits = ", ".join(f"{k} {a:.2f}+{b:.4f}n" for k, (a, b) in model.fit.items())
    print(f"  compute per slice of n events (ms): {fits}")
    for s in settings:
        out = predict(model, s)
        path = " -> ".join(f"{name} {ms:.2f}" for name, ms in out.path)
        print(f"W = {s.trainers}: {out.step_ms:.2f} ms a step, {out.events_per_s:,.0f} "
              f"events/s; bottleneck: {out.bottleneck}\n  path (ms): {path}")  # fmt: skip
    print("assumptions: " + "; ".join(predict(model, settings[0]).assumptions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
