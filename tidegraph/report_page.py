"""The run report's page: figures (PNG, drawn with matplotlib, the `report` extra) and one
self-contained HTML file that embeds them (base64 `data:` images, inline CSS, no external
URL), from a `tidegraph.report.Run`.

A figure whose data the run lacks (no timeline, no feature cache) is left out with a note
saying why, never drawn empty. matplotlib is used through its object API (`Figure`), so
drawing the report sets no process-wide backend.
"""

from __future__ import annotations

import base64
import html
import io
from collections import defaultdict
from dataclasses import dataclass

from tidegraph.report import (
    MARKERS,
    SPLIT,
    STALL,
    Run,
    bottleneck,
    lone_trainers,
    most_forgotten,
    step_split,
    traffic,
)

__all__ = ["MissingExtra", "Plot", "figures", "page"]

_COLORS = {"recovery": "#d62728", "resize": "#1f77b4", "shard_resize": "#9467bd",
           "shard_move": "#8c564b"}  # fmt: skip
# one colour per phase of a step (matplotlib's tab10, then grey for the rest)
_PHASE_COLORS = dict(zip((*SPLIT, "other"), ["#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78",
                     "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bbbbbb"],
                     strict=True))  # fmt: skip


class MissingExtra(ImportError):
    """matplotlib is not installed."""


@dataclass
class Plot:
    key: str
    title: str
    png: bytes | None  # None: not drawn, `note` says why
    note: str = ""  # under the figure: what it shows, or why it is missing


def _figure(width: float = 9.0, height: float = 3.6, run_axis: bool = False):
    """A figure; `run_axis`: one over the increment axis, with the same margins as the other
    such figures, so that their increments line up on the page."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtra(
            "the report's figures need matplotlib: pip install 'tidegraph[report]' (or pip "
            "install matplotlib)"
        ) from None
    if not run_axis:
        return Figure(figsize=(width, height), dpi=100, layout="constrained")
    fig = Figure(figsize=(width, height), dpi=100)
    fig.subplots_adjust(left=0.08, right=0.76, bottom=0.15, top=0.90)  # tags above
    return fig


def _png(fig) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def figures(run: Run) -> list[Plot]:
    """Every figure of the report, drawn or with the note why not; MissingExtra without
    matplotlib."""
    _figure()  # fails first, and once, without matplotlib
    return [_quality(run), _throughput(run), _split(run), _traffic(run), _cache(run)]


def _marker_lines(ax, run: Run, labels: bool) -> None:
    """The run's markers as vertical lines on increment axis `ax` (with their tags when
    `labels`, above the axes), a legend entry per kind; markers between the same two records
    stand side by side, their tags one above the other."""
    shown, at = set(), defaultdict(list)
    for m in run.markers:
        at[m.x].append(m)
    for x, group in at.items():
        for i, m in enumerate(group):
            name = MARKERS[m.kind][0]
            dx = (i - (len(group) - 1) / 2) * 0.08
            ax.axvline(x + dx, color=_COLORS[m.kind], linestyle=":", linewidth=1.4,
                       label=None if name in shown else name)  # fmt: skip
            shown.add(name)
            if labels:
                ax.annotate(m.tag, (x + dx, 1.0), xycoords=("data", "axes fraction"),
                            xytext=(0, 1 + 9 * i), textcoords="offset points", va="bottom",
                            ha="center", fontsize=8, color=_COLORS[m.kind])  # fmt: skip


def _increment_axis(ax, run: Run) -> None:
    """Ticks 0 (phase 1, when recorded) and 1..N; every plot over the run spans the same
    range, markers included."""
    ks = [r["increment"] + 1 for r in run.increments]
    ticks = ([0] if run.phase1 is not None else []) + ks
    step = max(1, len(ticks) // 20)
    ax.set_xticks(ticks[::step], [("phase 1" if k == 0 else str(k)) for k in ticks[::step]])
    xs = ticks + [m.x for m in run.markers]
    ax.set_xlim(min(xs) - 0.6, max(xs) + 0.6)
    ax.set_xlabel("increment")
    ax.grid(alpha=0.3)


def _quality(run: Run) -> Plot:
    title = "Link prediction per increment"
    if not run.increments:
        return Plot("quality", title, None, "Not drawn: no increment finished yet.")
    fig = _figure(run_axis=True)
    ax = fig.add_subplot()
    ks = [r["increment"] + 1 for r in run.increments]
    p1 = run.phase1 or {}
    for key, label, style in (("ap", "AP", "-o"), ("auc", "AUC", "-s"), ("mrr", "MRR", "-^"),
                              ("old_ap", "old AP (earlier events)", "--o")):  # fmt: skip
        (line,) = ax.plot(ks, [r[key] for r in run.increments], style, label=label, markersize=4)
        if isinstance(p1.get(f"val_{key}"), int | float):  # phase 1's validation, hollow
            ax.plot([0], [p1[f"val_{key}"]], style[-1], markersize=6, fillstyle="none",
                    color=line.get_color())  # fmt: skip
    per = run.summary.get("forgetting_per_increment") or []
    if per:  # each increment's events again at the end: the gap to its AP is its forgetting
        ax.plot([f["increment"] + 1 for f in per], [f["ap_at_end"] for f in per], ":x",
                label="AP at the end", markersize=5, color="black")  # fmt: skip
    _marker_lines(ax, run, labels=True)
    _increment_axis(ax, run)
    ax.set_ylabel("score")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9, frameon=False)
    forgetting = run.summary.get("forgetting")
    note = (
        "AP, AUC and MRR on each increment's events, evaluated before retraining on them "
        "(hollow, at phase 1: its validation events); old AP: AP on a sample of earlier events "
        "after the increment was learned; AP at the end: each increment's events evaluated "
        "again by the final model, so its gap below AP is that increment's forgetting. "
        "Forgetting, the mean of those gaps (summary.json): "
        + (f"{forgetting:.4f}." if isinstance(forgetting, int | float) else "not known yet.")
        + _worst_forgetting(run.summary)
    )
    return Plot("quality", title, _png(fig), note)


def _worst_forgetting(summary: dict) -> str:
    """The increment forgotten most, when the summary lists them."""
    worst = most_forgotten(summary)
    if worst is None:
        return ""
    return (f" Most forgotten: increment {worst['increment'] + 1}, AP {worst['ap']:.4f} when "
            f"evaluated, {worst['ap_at_end']:.4f} at the end.")  # fmt: skip


def _throughput(run: Run) -> Plot:
    title = "Events per second over the run"
    fig = _figure(run_axis=True)
    ax = fig.add_subplot()
    xs, train = [], []
    if run.phase1 and "train_events_per_s" in run.phase1:
        xs, train = [0], [run.phase1["train_events_per_s"]]
    ks = [r["increment"] + 1 for r in run.increments]
    ax.plot(xs + ks, train + [r["train_events_per_s"] for r in run.increments], "-o",
            label="train", markersize=4)  # fmt: skip
    if ks:
        ax.plot(ks, [r["eval_events_per_s"] for r in run.increments], "-s", label="eval",
                markersize=4)  # fmt: skip
    _marker_lines(ax, run, labels=True)
    _increment_axis(ax, run)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("events/s")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9, frameon=False)
    note = (
        "Train: events (new and replayed, times retraining epochs) per second of "
        "retraining; eval: the increment's events per second of evaluation. Dotted lines: "
        "what the group did between two records (tags as in the table of events)."
    )
    return Plot("throughput", title, _png(fig), note)


def _split(run: Run) -> Plot:
    title = "Where a training step's time goes, per trainer"
    split = step_split(run.trace) if run.trace is not None else {}
    if not split:
        why = run.notes.get("timeline") or "the timeline holds no trainer's training step"
        return Plot("split", title, None, f"Not drawn: {why}.")
    names = list(split)
    fig = _figure(height=1.3 + 0.45 * len(names))
    ax = fig.add_subplot()
    left = [0.0] * len(names)
    for phase in (*SPLIT, "other"):
        widths = [split[n][phase] for n in names]
        if not any(widths):
            continue
        ax.barh(names, widths, left=left, color=_PHASE_COLORS[phase], label=phase)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, total in enumerate(left):
        ax.annotate(f"{total:.1f} ms", (total, y), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=8)  # fmt: skip
    ax.set_xlim(0, max(left) * 1.12 or 1)
    ax.invert_yaxis()
    ax.set_xlabel("ms per training step (mean over recorded steps)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    steps = ", ".join(f"{n}: {split[n]['steps']:.0f}" for n in names)
    stalled = sum(split[n]["stalled"] for n in names)
    note = (
        f"Mean over recorded training steps ({steps}). Other: the rest of a step's wall span, "
        "from its first span's start to its last span's end."
    )
    if stalled:
        note += (
            f" Left out: {stalled} stalled steps (over {STALL:g} times the trainer's median "
            "step: waits for a lost or starting peer, one-off costs)."
        )
    if run.backend == "local":
        note += " Local backend: trainers sum gradients in the driver (no all-reduce span)."
    return Plot("split", title, _png(fig), note)


def _bits(run: Run, sent: dict) -> tuple[list, list[list[int]], str]:
    """(x values, bits per bucket at each, where from): every recorded step of the first
    trainer (every rank decodes the same bits), else metrics.jsonl's comm_bits records (by
    trainer 0's step count), else 32 for an uncompressed run; no bits, and why, when
    neither config.yaml nor summary.json says the compression."""
    for t in sent.values():
        if any(t["bits"]):
            return t["steps"], t["bits"], "the timeline's recorded steps"
    if run.comm_bits:
        return ([r.get("steps", i) for i, r in enumerate(run.comm_bits)],
                [list(r["bits"]) for r in run.comm_bits],
                "metrics.jsonl's comm_bits records")  # fmt: skip
    compression = run.summary.get("comm", {}).get("config", {}).get("compression") or (
        run.config.get("comm", {}).get("compression", "none") if run.config else None)  # fmt: skip
    if compression is None:
        return [], [], "the compression is not known (no config.yaml or summary.json)"
    if compression == "none":
        return [0], [[32]], "comm.compression none: every bucket goes fp32"
    return [], [], ""


def _lone(run: Run) -> bool:
    """Whether the run never had two trainers: its recorded all-reduce spans were all a lone
    trainer's, or (none recorded: no timeline, or the local backend's) it had one trainer
    at phase 1 and at the end, and no resize."""
    if run.trace is not None and traffic(run.trace):
        return False
    if run.trace is not None and lone_trainers(run.trace):
        return True
    counts = {(run.phase1 or {}).get("trainers"), run.summary.get("trainers")} - {None}
    return counts == {1} and not run.count("resize")


_BITS = (0, 2, 4, 8, 16, 32)  # bits a gradient value can travel with (0: top-k)
_BITS_COLORS = ("#dddddd", "#fde725", "#5ec962", "#21918c", "#3b528b", "#440154")


def _bytes_per_bucket(ax, sent: dict) -> None:
    """Bars of each trainer's mean bytes per bucket (recorded with comm.overlap), or of what
    each sent a step against fp32."""
    if any(t["bucket_bytes"] for t in sent.values()):
        top = max(v for t in sent.values() for v in t["bucket_bytes"].values())
        unit, scale = ("MB", 1e6) if top >= 1e6 else ("KB", 1e3)
        width = 0.8 / len(sent)
        for i, (name, t) in enumerate(sent.items()):
            b = list(t["bucket_bytes"])
            xs = [x - 0.4 + (i + 0.5) * width for x in b]
            ax.bar(xs, [t["bucket_bytes"][x] / scale for x in b], width, label=name)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("bucket")
        ax.set_ylabel(f"{unit} a step, per bucket")
    else:
        names = list(sent)
        top = max(max(t["bytes"], t["bytes_fp32"]) for t in sent.values())
        unit, scale = ("MB", 1e6) if top >= 1e6 else ("KB", 1e3)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [sent[n]["bytes"] / scale for n in names], 0.4,
               label="sent")  # fmt: skip
        ax.bar([x + 0.2 for x in xs], [sent[n]["bytes_fp32"] / scale for n in names], 0.4,
               label="fp32 would send", color="#bbbbbb")  # fmt: skip
        ax.set_xticks(list(xs), names)
        ax.set_ylabel(f"{unit} a step, per trainer")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.2)  # room for the legend above the bars
    ax.legend(loc="upper center", ncol=len(sent) if len(sent) > 2 else 2, fontsize=8,
              frameon=False)  # fmt: skip
    ax.grid(axis="y", alpha=0.3)


def _bits_map(fig, ax, xs: list, cols: list[list[int]], xlabel: str) -> None:
    """Bits per bucket (rows) at each x (columns), a colour per bit width."""
    from matplotlib.colors import BoundaryNorm, ListedColormap

    n = max(len(c) for c in cols)
    grid = [[c[b] if b < len(c) else float("nan") for c in cols] for b in range(n)]  # blank
    cmap = ListedColormap(_BITS_COLORS)
    norm = BoundaryNorm([-1, 1, 3, 6, 12, 24, 40], cmap.N)
    image = ax.imshow(grid, aspect="auto", origin="lower", cmap=cmap, norm=norm,
                      interpolation="nearest")  # fmt: skip
    step = max(1, len(xs) // 6)
    ax.set_xticks(range(0, len(xs), step), [str(x) for x in xs[::step]])
    ax.set_yticks(range(0, n, max(1, n // 8)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("bucket")
    bar = fig.colorbar(image, ax=ax, ticks=[0, 2, 4.5, 9, 18, 32], fraction=0.08)
    bar.ax.set_yticklabels([str(b) for b in _BITS])
    bar.set_label("bits a value")
    if len(cols) <= 8 and n <= 8:  # few cells: each says its bits
        for b in range(n):
            for x, c in enumerate(cols):
                if b < len(c):
                    ax.text(x, b, str(c[b]), ha="center", va="center", fontsize=9,
                            color="white" if c[b] >= 8 else "black")  # fmt: skip


def _traffic(run: Run) -> Plot:
    title = "All-reduce: bytes sent a step and bits per bucket"
    sent = traffic(run.trace) if run.trace is not None else {}
    if not sent and _lone(run):
        return Plot("traffic", title, None, "Not drawn: a lone trainer (W = 1) all run, which "
                    "sends nothing: no all-reduce.")  # fmt: skip
    xs, cols, source = _bits(run, sent)
    if not sent and not cols:
        why = f"; {source}" if source else ""
        return Plot("traffic", title, None, f"Not drawn: no all-reduce was recorded{why}.")
    # the bits alone at one x (an uncompressed run, or a single record): a small figure
    fig = _figure() if sent or len(xs) > 1 else _figure(width=4.5, height=2.2)
    if sent:
        left, right = fig.subplots(1, 2, width_ratios=[1, 1])
        _bytes_per_bucket(left, sent)
    else:
        right = fig.add_subplot()
    xlabel = "recorded step" if sent else "trainer 0's steps at the record"
    _bits_map(fig, right, xs, cols, xlabel if len(xs) > 1 else "")
    if len(xs) == 1:
        right.set_xticks([0], ["the whole run"])
    note = f"Bits per bucket from {source}"
    alone = sum(t["alone"] for t in sent.values())
    if alone:
        note += f" (blank: {alone} steps of a lone trainer, which sends nothing)"
    if sent:
        per_bucket = any(t["bucket_bytes"] for t in sent.values())
        note += (
            "; bytes: what each trainer sent per bucket, mean over the recorded steps with peers"
            if per_bucket
            else "; bytes: what each trainer sent a step (mean over the recorded steps with "
            "peers), "
            "against what fp32 would (per bucket only with comm.overlap)"
        )
    return Plot("traffic", title, _png(fig), note + ".")


def _cache(run: Run) -> Plot:
    title = "Feature cache hit rate"
    rows = [r for r in run.increments if "edge_cache_hit_rate" in r]
    if not rows:
        return Plot("cache", title, None, "Not drawn: this run kept no feature cache (a "
                    "dataset without edge features, or data.feature_cache_ratio 0).")  # fmt: skip
    if not any(r.get("edge_cache_capacity", 1) for r in rows):
        why = "Not drawn: the feature cache had no capacity (a pass-through: it caches on CUDA)."
        return Plot("cache", title, None, why)
    fig = _figure(height=3.0, run_axis=True)
    ax = fig.add_subplot()
    ax.plot([r["increment"] + 1 for r in rows], [r["edge_cache_hit_rate"] for r in rows], "-o",
            markersize=4)  # fmt: skip
    _marker_lines(ax, run, labels=True)  # a replaced trainer starts with a cold cache
    _increment_axis(ax, run)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("hit rate (cumulative)")
    if run.markers:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9, frameon=False)
    return Plot("cache", title, _png(fig), "The trainers' edge-feature cache, since the start.")


# ---- the page -------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
img { max-width: 100%; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
td.text, th.text { text-align: left; }
.note { color: #555; font-size: 0.9em; }
.events td:nth-child(-n+4) { white-space: nowrap; }
"""


def _table(head: list[str], rows: list[list], text: set[int] = frozenset()) -> str:
    def cell(tag: str, i: int, v) -> str:
        cls = ' class="text"' if i in text else ""
        return f"<{tag}{cls}>{html.escape(str(v))}</{tag}>"

    out = ["<table><tr>", *(cell("th", i, h) for i, h in enumerate(head)), "</tr>"]
    for row in rows:
        out += ["<tr>", *(cell("td", i, v) for i, v in enumerate(row)), "</tr>"]
    return "".join(out) + "</table>"


_INCREMENT_HEAD = ["increment", "events", "AP", "AUC", "MRR", "old AP", "loss", "replayed",
                   "eval events/s", "train events/s"]  # fmt: skip


def _increments_table(run: Run) -> str:
    """A row per increment; the cache's hit rate when the run kept a cache."""
    cache = any("edge_cache_hit_rate" in r for r in run.increments)
    rows = []
    for r in run.increments:
        scores = [f"{r[k]:.4f}" for k in ("ap", "auc", "mrr", "old_ap")]
        row = [r["increment"] + 1, r["events"], *scores, f"{r.get('loss', float('nan')):.4f}",
               r.get("replayed", ""), f"{r['eval_events_per_s']:,.0f}",
               f"{r['train_events_per_s']:,.0f}"]  # fmt: skip
        if cache:
            hit = r.get("edge_cache_hit_rate")
            row.append("" if hit is None else f"{hit:.3f}")
        rows.append(row)
    return _table(_INCREMENT_HEAD + (["cache hit rate"] if cache else []), rows)


def page(
    run: Run, plots: list[Plot], summary: list[str], neck: tuple[str, list] | None = None
) -> str:
    """The report's HTML: `summary` (its text lines), the figures, the tables; `neck`: the
    run's `bottleneck` when it was found already."""
    line, path = neck if neck is not None else bottleneck(run)
    parts = [f"<h1>tidegraph run report: {html.escape(run.name)}</h1>",
             f"<pre>{html.escape(chr(10).join(summary))}</pre>"]  # fmt: skip
    for p in plots:
        parts.append(f"<h2>{html.escape(p.title)}</h2>")
        if p.png is not None:
            data = base64.b64encode(p.png).decode()
            parts.append(f'<img alt="{html.escape(p.title)}" src="data:image/png;base64,{data}">')
        parts.append(f'<p class="note">{html.escape(p.note)}</p>')
    parts.append("<h2>Increments</h2>")
    parts.append(_increments_table(run))
    parts.append("<h2>Recoveries, resizes and partition moves</h2>")
    if run.markers:
        rows = [[m.tag, MARKERS[m.kind][0], m.during, m.label, m.reason]
                for m in run.markers]  # fmt: skip
        table = _table(["tag", "kind", "during", "what", "reason"], rows, {1, 2, 3, 4})
        parts.append(f'<div class="events">{table}</div>')
    else:
        parts.append('<p class="note">None: the group kept its members all run.</p>')
    parts.append("<h2>Bottleneck</h2>")
    parts.append(f"<p>{html.escape(line)}</p>")
    if path:
        parts.append(_table(["critical path span", "ms"], [[k, f"{v:.2f}"] for k, v in path],
                            {0}))  # fmt: skip
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>tidegraph report: {html.escape(run.name)}</title><style>{_CSS}</style>"
            f"</head><body>\n{body}\n</body></html>\n")  # fmt: skip
