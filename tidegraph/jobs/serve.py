"""Entry point: `python -m tidegraph.jobs.serve --run-name R [--storage S] [flags]`.

Serves run R's freshest model over HTTP with Ray Serve (`tidegraph.serving.app`): its newest
checkpoint plus the events its durable log received since, swapping in newer checkpoints as
the run writes them. It joins the Ray cluster at `RAY_ADDRESS` (beside a training job) or
starts a local Ray bound to 127.0.0.1, serves on `--host` (127.0.0.1) `--port` (8000) until
interrupted (Ctrl-C, SIGTERM), then takes the application down. The application is named
`tidegraph-R` (`--route-prefix` puts a second run's routes beside the first's); `--detach`
leaves it running on a cluster and exits (`serve delete tidegraph-R` removes it).

Routes: POST /score, /topk, /embed and GET /status (see `tidegraph.serving.app`). Replicas:
`--replicas N`, or `--replicas MIN:MAX` for Ray Serve's autoscaling; each asks Ray for
`--num-cpus`, `--num-gpus` and `--resources '{"tg_serve": 1}'` (custom resources that only the
nodes meant for serving offer keep replicas off the training group's nodes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import traceback

from tidegraph.serving.engine import checked_run

__all__ = ["main"]

log = logging.getLogger("tidegraph.jobs.serve")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tidegraph.jobs.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--run-name", required=True, help="the run to serve")
    p.add_argument("--storage", default="runs", help="where its run directory lives (a path or "
                   "an s3://, gs:// URI; default runs)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument(
        "--route-prefix",
        default="/",
        help="where the routes start (default /; another run on one cluster: /R)",
    )
    p.add_argument("--replicas", default="1", help="N replicas, or MIN:MAX to autoscale")
    p.add_argument("--target-requests", type=float, default=2.0,
                   help="autoscaling: ongoing requests per replica to aim at")  # fmt: skip
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica")
    p.add_argument("--resources", default="{}", help="custom Ray resources per replica (JSON)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--poll-s", type=float, default=1.0,
                   help="seconds between looks at the log and the checkpoints")  # fmt: skip
    p.add_argument("--detach", action="store_true",
                   help="leave the application running on the cluster and exit")  # fmt: skip
    p.add_argument("--debug", action="store_true", help="errors with their traceback")
    return p


def _replicas(text: str, target: float) -> int | dict:
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":"))
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError
            return {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": target}
        n = int(text)
        if n < 1:
            raise ValueError
        return n
    except ValueError:
        raise ValueError(f"--replicas: N >= 1 or MIN:MAX expected, got {text!r}") from None


def _options(args) -> dict:
    """The application's settings from the flags (ValueError naming the flag)."""
    if not 0 < args.port < 65536:
        raise ValueError(f"--port: a port number expected, got {args.port}")
    if args.poll_s <= 0:
        raise ValueError(f"--poll-s: a positive number of seconds expected, got {args.poll_s}")
    if args.num_cpus < 0 or args.num_gpus < 0:
        raise ValueError("--num-cpus, --num-gpus: must be >= 0")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ValueError(f"--device: cpu or cuda expected, got {args.device!r}")
    if args.device != "cpu" and not args.num_gpus > 0:
        raise ValueError("--device cuda: give each replica a GPU share (--num-gpus 1, or 0.5)")
    if args.detach and not os.environ.get("RAY_ADDRESS"):
        raise ValueError("--detach: leaves the application on a cluster (RAY_ADDRESS); a local "
                         "Ray ends with this command")  # fmt: skip
    if not args.route_prefix.startswith("/"):
        raise ValueError(f"--route-prefix: must start with '/', got {args.route_prefix!r}")
    try:
        resources = json.loads(args.resources)
    except ValueError:
        resources = None
    if not isinstance(resources, dict) or not all(
        isinstance(v, int | float) and v >= 0 for v in resources.values()
    ):
        raise ValueError(f"--resources: a JSON object of amounts expected, got {args.resources!r}")
    storage = args.storage if "://" in args.storage else os.path.abspath(args.storage)
    return {
        "run_name": args.run_name, "storage": storage, "poll_s": args.poll_s,
        "device": args.device, "replicas": _replicas(args.replicas, args.target_requests),
        "num_cpus": args.num_cpus, "num_gpus": args.num_gpus, "resources": resources,
        "threads": args.threads,
    }  # fmt: skip


def _connect(options: dict) -> bool:
    """Join RAY_ADDRESS's cluster or start a local Ray on 127.0.0.1; True when started."""
    from tidegraph.orchestrator import cluster  # sets the loopback switches before ray loads

    ray = cluster.ray
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace="tidegraph-serve",
                 configure_logging=False)  # fmt: skip
        return False
    replicas = options["replicas"]
    most = replicas["max_replicas"] if isinstance(replicas, dict) else replicas
    cpus = max(os.cpu_count() or 1, int(most * options["num_cpus"]) + 1)
    plenty = cluster.local_resources([(most, options["resources"])])
    ray.init(_node_ip_address="127.0.0.1", num_cpus=cpus, resources=plenty or None,
             namespace="tidegraph-serve", include_dashboard=False,
             configure_logging=False)  # fmt: skip
    return True


def _check_serve_extra() -> None:
    """Ray Serve and the web framework under it (the `serve` extra) are importable; a
    ValueError that says how to install them when not."""
    from tidegraph.orchestrator import cluster  # noqa: F401  (loopback switches before ray)

    try:
        from ray import serve  # noqa: F401

        import tidegraph.serving.app  # noqa: F401  (fastapi, starlette)
    except ModuleNotFoundError as e:
        missing = (e.name or "?").split(".")[0]  # the package a user installs
        raise ValueError(f"serving needs Ray Serve and its web framework (no module named "
                         f"{missing!r}): pip install 'tidegraph[serve]'") from None  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        options = _options(args)
        _check_serve_extra()
        checked_run(options["storage"], options["run_name"])  # a missing run: here, at once
    except ValueError as err:
        return _error(err, args.debug)
    started = _connect(options)
    stop = threading.Event()  # Ctrl-C or SIGTERM, from now on: a clean stop
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    from ray import serve

    from tidegraph.serving.app import server_app

    name = f"tidegraph-{args.run_name}"  # one application per run served on a cluster
    try:
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            serve.run(server_app(**options), name=name, route_prefix=args.route_prefix,
                      blocking=False)  # fmt: skip
        except Exception as err:  # a port taken, a replica that cannot start: one line, 2
            return _error(RuntimeError(f"serve: could not start serving run {args.run_name!r}: "
                                       f"{type(err).__name__}: {err}"), args.debug)  # fmt: skip
        status = serve.status().applications[name]
        url = f"http://{args.host}:{args.port}{args.route_prefix.rstrip('/')}"
        print(f"serving run {args.run_name} on {url} ({status.status}); POST /score /topk "
              f"/embed, GET /status", flush=True)  # fmt: skip
        if args.detach:
            return 0
        stop.wait()
        print("stopping", flush=True)
        serve.delete(name)
        return 0
    finally:
        if started:
            serve.shutdown()
        if started or not args.detach:
            import ray  # loaded by `_connect` already

            ray.shutdown()


def _error(err: BaseException, debug: bool) -> int:
    if debug:
        traceback.print_exception(err, file=sys.stderr)
    print(f"error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
