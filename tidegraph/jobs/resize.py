"""Resize a running job: `python -m tidegraph.jobs.resize --run-name R --trainers N`.

Joins the Ray cluster the run is on (`RAY_ADDRESS`, `--address`, or the one started on this
machine), finds the run's coordinator actor in the run's namespace, and leaves the wanted
trainer count there; the driver takes it at its next look (`cluster.elastic_poll_s`) and
the trainers stop after their current step to resize (members above the count leave,
highest ranks first; for more, trainers start in slots Ray places and join once up). N must
lie within the run's `cluster.trainers: {min, max}`. `--shards N` sets the number of shard
actors within `cluster.shards: {min, max}` (partitions move between actors at a step boundary;
more actors start as Ray places them). `--move-shard P` moves partition P's shard
to a new actor wherever Ray has room (it starts in the background, then copies the shard at a
step boundary). Without either it prints the run's membership. Errors (no such run, N out
of range) print one line and exit with 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tidegraph.jobs.resize", description=__doc__)
    p.add_argument("--run-name", required=True, help="the run's name (its Ray namespace)")
    p.add_argument("--trainers", type=int, help="the wanted number of trainers")
    p.add_argument("--shards", type=int, help="the wanted number of shard actors")
    p.add_argument(
        "--move-shard", type=int, metavar="P",
        help="move partition P's shard to a new actor wherever Ray has room (off a node to "
        "be retired, say)",
    )  # fmt: skip
    p.add_argument("--address", help="the Ray cluster (default: RAY_ADDRESS, else 'auto')")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import ray

    started = False
    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
        try:
            ray.init(address=address, namespace=args.run_name, configure_logging=False,
                     log_to_driver=False)  # fmt: skip
        except (ConnectionError, RuntimeError, ValueError) as err:
            print(f"error: cannot join the Ray cluster at {address}: {err}", file=sys.stderr)
            return 2
        started = True
    try:
        try:
            coordinator = ray.get_actor("tidegraph-coordinator", namespace=args.run_name)
        except ValueError:
            print(f"error: no run named {args.run_name!r} is running on this cluster",
                  file=sys.stderr)  # fmt: skip
            return 2
        status = ray.get(coordinator.membership.remote())
        # (flag, wanted, status keys of its bounds and count, what, config field, method)
        asks = [("--trainers", args.trainers, "min", "max", "trainers", "trainers",
                 "trainers", coordinator.want_trainers),
                ("--shards", args.shards, "shards_min", "shards_max", "shard_actors",
                 "shard actors", "shards", coordinator.want_shards)]  # fmt: skip
        for flag, count, lo_key, hi_key, now_key, what, field, want in asks:
            if count is None:
                continue
            lo, hi = status.get(lo_key, 1), status.get(hi_key, count)
            if not lo <= count <= hi:
                print(f"error: {flag} {count}: run {args.run_name!r} allows {lo} to {hi} "
                      f"{what} (cluster.{field}: {{min, max}})", file=sys.stderr)  # fmt: skip
                return 2
            ray.get(want.remote(count, "operator (jobs.resize)"))
            print(f"run {args.run_name}: asked for {count} {what} (now {status.get(now_key)})")
        if args.move_shard is not None:
            shards = status.get("shards")
            if shards is not None and not 0 <= args.move_shard < shards:
                print(f"error: --move-shard {args.move_shard}: run {args.run_name!r} has "
                      f"shards 0..{shards - 1}", file=sys.stderr)  # fmt: skip
                return 2
            ray.get(coordinator.move_shard.remote(args.move_shard))
            print(f"run {args.run_name}: asked to move shard {args.move_shard}")
        print(json.dumps(status, indent=2, default=str))
        return 0
    finally:
        if started:
            ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
