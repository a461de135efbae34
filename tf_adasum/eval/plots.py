"""The evaluation's pictures: ``accuracy.png`` and ``scaling.png`` (needs matplotlib).

A series is a method (a combiner and its settings, `RunConfig.method`) at a
number of local steps K: its colour and marker come from the method, its line
style from K, the same in every panel and
both pictures. Panels are small multiples (one per model, dataset, replicas
and, for accuracy, effective batch); within a panel the series are shifted a
little sideways so that no marker hides another. A run that did not reach its
target is an open marker on a "not reached" row above the others.
"""

from __future__ import annotations

import math
import os
import statistics

from tf_adasum.eval.summary import config_of

__all__ = ["plot"]

_COLORS = {
    "adasum": "#1f77b4",
    "mean": "#d62728",
    "keras": "#2ca02c",
    "keras-scaled": "#8c564b",
    "adacons": "#9467bd",
    "sum": "#ff7f0e",
}
_MARKERS = {"adasum": "o", "mean": "s", "keras": "^", "keras-scaled": "v", "adacons": "D", "sum": "X"}
_OTHER_COLORS = ("#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a")
_LINESTYLES = ("-", "--", ":", "-.")
_FILLSTYLES = ("full", "left", "bottom", "right")  # per local steps K; an open marker is "not reached"


def _method(record: dict) -> str:
    """The record's method: its ``method`` where it names one (the rows of
    ``benchmarks/time_to_accuracy.py``), else `RunConfig.method` of its
    fields (those it lacks take their defaults)."""
    return record["method"] if "method" in record else config_of(record).method


def _key(record: dict) -> tuple[str, int]:
    """The series of `record`: (method, local steps)."""
    return _method(record), record["local_steps"]


def _series(records: list[dict]) -> list[tuple[str, int]]:
    """(method, local steps): methods in order of first appearance, then K."""
    combiners = list(dict.fromkeys(_method(r) for r in records))
    series = {_key(r) for r in records}
    return sorted(series, key=lambda s: (combiners.index(s[0]), s[1]))


class _Style:
    """Colour, marker and line style of every series, fixed for both pictures."""

    def __init__(self, records: list[dict]):
        combiners = list(dict.fromkeys(_method(r) for r in records))
        others = iter(_OTHER_COLORS * len(combiners))
        self.color = {c: _COLORS.get(c) or next(others) for c in combiners}
        self.marker = {c: _MARKERS.get(c, "P") for c in combiners}
        steps = sorted({r["local_steps"] for r in records})
        self.linestyle = {k: _LINESTYLES[i % len(_LINESTYLES)] for i, k in enumerate(steps)}
        self.fillstyle = {k: _FILLSTYLES[i % len(_FILLSTYLES)] for i, k in enumerate(steps)}

    def __call__(self, series: tuple[str, int], reached: bool = True) -> dict:
        combiner, local_steps = series
        color = self.color[combiner]
        return {
            "color": color,
            "marker": self.marker[combiner],
            "linestyle": self.linestyle[local_steps],
            "fillstyle": self.fillstyle[local_steps] if reached else "none",
            "markerfacecoloralt": "white",
            "markersize": 5.5,
        }


def _label(series: tuple[str, int]) -> str:
    return f"{series[0]} K={series[1]}"


def _offsets(count: int, spread: float) -> list[float]:
    """`count` sideways shifts centred on 0, `spread` apart."""
    return [(i - (count - 1) / 2) * spread for i in range(count)]


def _grid(plt, panels: int, width: float, height: float):
    columns = min(3, panels)
    rows = math.ceil(panels / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows + 0.9), squeeze=False)
    for axis in axes.flat[panels:]:
        axis.set_visible(False)
    return fig, list(axes.flat)


def _legend(fig, style: _Style, series: list[tuple[str, int]], extra: list | None = None) -> None:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], label=_label(s), **style(s)) for s in series] + (extra or [])
    per_row = max(1, int(fig.get_figwidth() / 1.6))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), per_row), fontsize=8, frameon=False)


def _accuracy(plt, records: list[dict], style: _Style, path: str, per_replica_count: bool = False) -> None:
    """One panel per model, dataset, replica count and effective batch, or,
    with `per_replica_count`, per model, dataset and replica count (the
    replica sweep, where K local steps change the effective batch)."""
    if per_replica_count:
        key = lambda r: (r["model"], r["dataset"], r["replicas"], None)  # noqa: E731
    else:
        key = lambda r: (r["model"], r["dataset"], r["replicas"], r["effective_batch"])  # noqa: E731
    groups = list(dict.fromkeys(key(r) for r in records))
    fig, axes = _grid(plt, len(groups), 5.2, 3.6)
    for axis, group in zip(axes, groups):
        runs = [r for r in records if key(r) == group]
        series = _series(runs)
        for shift, s in zip(_offsets(len(series), min(0.15, 0.7 / len(series))), series):
            for run in (r for r in runs if _key(r) == s):
                epochs = [e + 1 + shift for e in range(len(run["accuracy_per_epoch"]))]
                axis.plot(epochs, run["accuracy_per_epoch"], lw=1.3, **style(s))
        for target in sorted({r["target"] for r in runs}):
            axis.axhline(target, color="gray", lw=0.8, ls=(0, (4, 3)))
        model, dataset, replicas, batch = group
        shown = f"effective batch {batch}" if batch is not None else f"batch {runs[0]['batch_per_replica']} per replica"
        axis.set_title(f"{model} / {dataset}, N={replicas}, {shown}", fontsize=9)
        axis.set(xlabel="epoch", ylabel="test accuracy")
        axis.grid(alpha=0.3)
        longest = max(len(r["accuracy_per_epoch"]) for r in runs)
        axis.set_xticks(range(1, longest + 1, max(1, longest // 12)))
    from matplotlib.lines import Line2D

    target = Line2D([], [], color="gray", lw=0.8, ls=(0, (4, 3)), label="target")
    _legend(fig, style, _series(records), [target])
    fig.suptitle("Test accuracy per epoch", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shifted(runs: list[dict], shift: float) -> list[float]:
    """The runs' effective batches, shifted by `shift` on a log2 axis."""
    return [r["effective_batch"] * 2**shift for r in runs]


def _scaling(plt, records: list[dict], style: _Style, path: str) -> None:
    from matplotlib.ticker import MaxNLocator

    key = lambda r: (r["model"], r["dataset"], r["replicas"])  # noqa: E731
    groups = list(dict.fromkeys(key(r) for r in records))
    fig, axes = plt.subplots(2, len(groups), figsize=(5.2 * len(groups), 7.4), squeeze=False)
    budget = max(r["epochs"] for r in records)
    scores = [r["score"] for r in records if r["score"] is not None]
    rows = (  # (value of a run that reached its target, y of the "not reached" row, y label)
        (lambda r: r["epochs_until_convergence"], budget + max(1.0, 0.12 * budget), "epochs to target"),
        (lambda r: r["score"], 1.15 * max(scores) if scores else 1.0, "minutes to target (score)"),
    )
    for column, group in enumerate(groups):
        runs = [r for r in records if key(r) == group]
        series = _series(runs)
        batches = sorted({r["effective_batch"] for r in runs})
        for row, ((value, missed_y, ylabel), axis) in enumerate(zip(rows, axes[:, column])):
            for shift, s in zip(_offsets(len(series), 0.06), series):
                mine = [r for r in runs if _key(r) == s]
                mine.sort(key=lambda r: r["effective_batch"])
                reached = [r for r in mine if r["score"] is not None]
                missed = [r for r in mine if r["score"] is None]
                axis.plot(_shifted(reached, shift), [value(r) for r in reached], lw=1.3, **style(s))
                axis.plot(_shifted(missed, shift), [missed_y] * len(missed), lw=0, **style(s, reached=False))
            ticks = [t for t in MaxNLocator(nbins=7, integer=row == 0).tick_values(0, missed_y) if t < missed_y * 0.9]
            if any(r["score"] is None for r in records):
                axis.axhline(missed_y, color="gray", lw=0.6, ls=":")
                axis.set_yticks(ticks + [missed_y], [f"{t:g}" for t in ticks] + ["not reached"])
            else:
                axis.set_yticks(ticks)
            axis.set_ylim(0, missed_y * 1.08)
            axis.set_xscale("log", base=2)
            axis.set_xlim(batches[0] / 1.5, batches[-1] * 1.5)
            axis.set_xticks(batches, [str(b) for b in batches])
            axis.minorticks_off()
            axis.set(xlabel="effective batch", ylabel=ylabel)
            axis.grid(alpha=0.3)
        model, dataset, replicas = group
        axes[0, column].set_title(f"{model} / {dataset}, N={replicas}", fontsize=9)
    from matplotlib.lines import Line2D

    missed = Line2D([], [], lw=0, marker="o", color="gray", fillstyle="none", label="target not reached")
    _legend(fig, style, _series(records), [missed] if any(r["score"] is None for r in records) else [])
    fig.suptitle("Epochs and minutes to the target accuracy", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _replica_axis(plt, records: list[dict], style: _Style, path: str) -> None:
    """Epochs to target and best accuracy against N (the replica sweep): the
    median over seeds (the higher middle value for an even count), a bar from
    the smallest to the largest; a point whose median run missed the target
    sits on the "not reached" row (its bar still shows the seeds that reached it)."""
    budget = max(r["epochs"] for r in records)
    missed_y = budget + max(1.0, 0.12 * budget)
    counts = sorted({r["replicas"] for r in records})
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 4.4))
    series = _series(records)
    epochs = lambda r: r["epochs_until_convergence"] if r["epochs_until_convergence"] > 0 else missed_y  # noqa: E731
    for shift, s in zip(_offsets(len(series), 0.05), series):
        mine = [r for r in records if _key(r) == s]
        ns = sorted({r["replicas"] for r in mine})
        for axis, value in zip(axes, (epochs, lambda r: r["best_acc"])):
            values = [[value(r) for r in mine if r["replicas"] == n] for n in ns]
            middle = [statistics.median_high(v) for v in values]
            low = [m - min(v) for m, v in zip(middle, values)]
            high = [max(v) - m for m, v in zip(middle, values)]
            x = [n * 2**shift for n in ns]
            axis.errorbar(x, middle, yerr=[low, high], lw=1.3, capsize=2, elinewidth=0.9, **style(s))
    axes[0].axhline(missed_y, color="gray", lw=0.6, ls=":")
    ticks = list(range(0, budget + 1, max(1, budget // 5)))
    axes[0].set_yticks(ticks + [missed_y], [str(t) for t in ticks] + ["not reached"])
    axes[0].set_ylim(0, missed_y * 1.08)
    axes[0].set(ylabel="epochs to target (median, range over seeds)")
    targets = sorted({r["target"] for r in records})
    for target in targets:
        axes[1].axhline(target, color="gray", lw=0.8, ls=(0, (4, 3)))
    axes[1].set(ylabel="best test accuracy (median, range)")
    batch = "/".join(str(b) for b in sorted({r["batch_per_replica"] for r in records}))
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_xticks(counts, [str(n) for n in counts])
        axis.minorticks_off()
        axis.set(xlabel=f"replicas N (batch {batch} each)")
        axis.grid(alpha=0.3)
    model = ", ".join(sorted({f"{r['model']} / {r['dataset']}" for r in records}))
    _legend(fig, style, series)
    fig.suptitle(f"{model}: more replicas at the same batch per replica, target {targets[-1]:g}", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(records: list[dict], out: str) -> list[str]:
    """Writes ``accuracy.png`` (test accuracy per epoch) and ``scaling.png`` to
    `out`; returns their paths. ``scaling.png`` shows epochs and minutes to
    target against the effective batch, or, for a sweep over the number of
    replicas at one batch per replica, epochs to target and best accuracy
    against N (median and range over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    style = _Style(records)
    paths = [os.path.join(out, "accuracy.png"), os.path.join(out, "scaling.png")]
    replica_axis = len({r["replicas"] for r in records}) > 1 and len({r["batch_per_replica"] for r in records}) == 1
    _accuracy(plt, records, style, paths[0], per_replica_count=replica_axis)
    if replica_axis:
        _replica_axis(plt, records, style, paths[1])
    else:
        _scaling(plt, records, style, paths[1])
    return paths
