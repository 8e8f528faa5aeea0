"""A run's report: `python -m tidegraph.jobs.report RUN_DIR [--out FILE]`.

Writes one self-contained HTML page (default RUN_DIR/report.html: figures embedded, no
external URL) with AP/AUC/MRR and old AP per increment, events/s over the run with markers
where recoveries, resizes and partition moves happened (and a table of their reasons), the
split of a training step per trainer, the all-reduce's bytes and bits per bucket, the
feature cache's hit rate and the recorded step's bottleneck (with --timeline runs); prints a
one-screen summary. The figures need matplotlib (`pip install 'tidegraph[report]'`); without
it the summary still prints and the command exits with 2. A run directory it cannot read:
one line naming the file and field, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tidegraph.report import ReportError, bottleneck, load_run, summary_lines

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tidegraph.jobs.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("run_dir", help="the run directory (runs/RUN_NAME, or the job's --out)")
    p.add_argument("--out", help="the HTML file to write (default: RUN_DIR/report.html)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        run = load_run(args.run_dir)
        neck = bottleneck(run)
    except ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unreadable files
        print(f"report: cannot read {e.filename or args.run_dir}: {e.strerror or e}",
              file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out) if args.out else run.path / "report.html"
    from tidegraph.report_page import MissingExtra, figures, page

    try:
        plots = figures(run)
    except MissingExtra as e:
        print("\n".join(summary_lines(run, None, neck[0])))
        print(f"report: {e}", file=sys.stderr)
        return 2
    lines = summary_lines(run, str(out), neck[0])
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page(run, plots, lines, neck))
    except OSError as e:
        print(f"report: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
