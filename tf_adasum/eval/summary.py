"""The evaluation's summaries of its records: the table, the CSV file, the
table over seeds, the largest effective batch reaching the target, and which
runs the replica sweep skips (`stops_early`)."""

from __future__ import annotations

import csv
import dataclasses
import math
import statistics

from tf_adasum.eval import metrics
from tf_adasum.eval.config import RunConfig

__all__ = [
    "COMPLETE_ROWS",
    "CSV_FIELDS",
    "config_of",
    "format_table",
    "largest_reached",
    "seed_summary",
    "stops_early",
    "write_csv",
]


def config_of(record: dict) -> RunConfig:
    """The configuration a result record was run with (a field that records
    from before it existed lack takes its default)."""
    return RunConfig(**{f.name: record[f.name] for f in dataclasses.fields(RunConfig) if f.name in record})


def _same_method(config: RunConfig, *axes: str) -> tuple:
    """What identifies a method along the replica axis: everything but N and
    the seed (and the other `axes` named)."""
    defaults = RunConfig()
    return dataclasses.replace(config, **{name: getattr(defaults, name) for name in ("replicas", "seed", *axes)}).key()


#: The methods the replica sweep always runs to its last N (at one local step).
COMPLETE_ROWS = ("adasum", "keras", "keras-scaled")


def stops_early(config: RunConfig, records: list[dict]) -> bool:
    """Whether the replica sweep (and its edge) skips `config`: every method
    but Adasum and the averaging baselines at one local step (`COMPLETE_ROWS`,
    whose rows are complete), so AdaCons, local steps and the edge's variants,
    stops once every seed recorded so far failed the target at two
    consecutive N below (a larger N does not rescue them). Judged on
    `records` each time: a skipped run comes back once a seed reaches the
    target at one of those N."""
    if config.method in COMPLETE_ROWS and config.local_steps == 1:
        return False
    outcomes: dict[int, list[bool]] = {}
    for record in records:
        other = config_of(record)
        if _same_method(other) == _same_method(config) and other.replicas < config.replicas:
            outcomes.setdefault(other.replicas, []).append(record["epochs_until_convergence"] > 0)
    tried = sorted(outcomes)
    failed = [n for n in tried if not any(outcomes[n])]
    return any(a in failed and b in failed for a, b in zip(tried, tried[1:]))


CSV_FIELDS = [
    "model", "dataset", "combiner", "engine", "replicas", "batch_per_replica", "local_steps", "effective_batch",
    "seed", "lr", "schedule", "target", "epochs", "epochs_until_convergence", "minutes_per_epoch", "score",
    "final_acc", "best_acc", "accuracy_per_epoch", "hosts", "link", "mode", "inner", "lr_rule",
]  # fmt: skip


def write_csv(records: list[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for record in records:
            writer.writerow(
                {**record, "accuracy_per_epoch": " ".join(f"{a:.4f}" for a in record["accuracy_per_epoch"])}
            )


def _aligned(rows: list[list[str]]) -> str:
    """`rows` (the first a header) as right-aligned columns, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def format_table(records: list[dict]) -> str:
    header = [
        "model",
        "data",
        "method",
        "N",
        "batch",
        "local",
        "eff.batch",
        "seed",
        "target",
        "epochs",
        "min/epoch",
        "score",
        "best",
    ]
    rows = [header]
    for r in records:
        epochs = r["epochs_until_convergence"]
        rows.append(
            [
                r["model"], r["dataset"], config_of(r).method, str(r["replicas"]), str(r["batch_per_replica"]),
                str(r["local_steps"]), str(r["effective_batch"]), str(r["seed"]), f"{r['target']:.3f}",
                str(epochs) if epochs > 0 else f">{len(r['accuracy_per_epoch'])}",
                f"{r['minutes_per_epoch']:.2f}", metrics.format_score(r["score"]), f"{r['best_acc']:.4f}",
            ]
        )  # fmt: skip
    return _aligned(rows)


def largest_reached(records: list[dict]) -> list[str]:
    """Per model, dataset, method (`RunConfig.method`), local steps and target: the largest
    effective batch (N x b x K) whose runs (every seed) reached the target,
    one line each, with its N x b and the batches tried (a smaller batch may
    have failed where a larger one succeeded; the table shows each). Runs of
    one grid share the learning rate, schedule and budget."""
    groups: dict[tuple, dict[int, bool]] = {}
    shapes: dict[tuple, set[str]] = {}
    for r in records:
        config = config_of(r)
        same = _same_method(config, "batch_per_replica")
        key = (r["model"], r["dataset"], config.method, r["local_steps"], r["target"], same)
        reached = groups.setdefault(key, {})
        batch = r["effective_batch"]
        reached[batch] = reached.get(batch, True) and r["epochs_until_convergence"] > 0
        shapes.setdefault((*key, batch), set()).add(f"N={r['replicas']} x {r['batch_per_replica']}")
    lines = []
    for key, reached in groups.items():
        model, dataset, combiner, k, target, _ = key
        batches = sorted(b for b, ok in reached.items() if ok)
        tried = f"of {', '.join(map(str, sorted(reached)))}"
        largest = f"{batches[-1]} ({', '.join(sorted(shapes[(*key, batches[-1])]))})" if batches else "none"
        lines.append(
            f"{model} / {dataset}, {combiner} K={k}: largest effective batch reaching {target:.3f}: {largest} ({tried})"
        )
    return lines


def seed_summary(records: list[dict]) -> str:
    """A table over seeds: per model, dataset, method (`RunConfig.method`), K, N and batch, the
    median and range of the epochs to the target (a run that missed it counts
    as more than its budget, shown ``>E``) and of the best test accuracy. With
    an even number of seeds the median is the higher middle value, so a point
    where half the seeds missed the target counts as missed."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        config = config_of(r)
        key = (r["model"], r["dataset"], config.method, r["local_steps"], r["replicas"], r["batch_per_replica"])
        groups.setdefault((*key, _same_method(config)), []).append(r)

    def shown(value, budget):
        return f">{budget}" if math.isinf(value) else f"{value:g}"

    header = ["model", "data", "method", "K", "N", "eff.batch", "seeds", "epochs (median)", "range", "best (median)"]
    rows = [header + ["range"]]
    for (model, dataset, combiner, k, n, _, _), runs in groups.items():
        budget = max(r["epochs"] for r in runs)
        reached = [metrics.epochs_or_inf(r) for r in runs]
        best = [r["best_acc"] for r in runs]
        rows.append([
            model, dataset, combiner, str(k), str(n), str(runs[0]["effective_batch"]), str(len(runs)),
            shown(statistics.median_high(reached), budget),
            f"{shown(min(reached), budget)} to {shown(max(reached), budget)}",
            f"{statistics.median_high(best):.4f}", f"{min(best):.4f} to {max(best):.4f}",
        ])  # fmt: skip
    return _aligned(rows)


def replica_table(records: list[dict]) -> str:
    """The replica sweep's table, in Markdown, as the evaluation guide shows
    it: one row per method and K (in order of first appearance), one column
    per N; a cell is the median epochs to the target over the seeds, bold,
    with their range where the seeds differ, or, where the median run missed
    the target, ``>budget`` (with the range where some seed reached it) and
    the median best accuracy. The last column is the largest N where every
    seed of the table ran and reached the target, with its effective batch
    (``none``). Rows are methods with all their fields (but N and the seed)
    the same, named by `RunConfig.method`."""
    rows: dict[tuple, dict[int, list[dict]]] = {}
    for r in records:
        config = config_of(r)
        key = (config.method, r["local_steps"], _same_method(config))
        rows.setdefault(key, {}).setdefault(r["replicas"], []).append(r)
    counts = sorted({r["replicas"] for r in records})
    seeds = {r["seed"] for r in records}
    header = ["method", *(f"N={n}" if i == 0 else str(n) for i, n in enumerate(counts)), "largest N, every seed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (method, k, _), by_n in rows.items():
        label = method if k == 1 else f"{method}, {k} local steps"
        cells, largest = [], "none"
        for n in counts:
            runs = by_n.get(n, [])
            cells.append(_replica_cell(runs))
            if {r["seed"] for r in runs} == seeds and all(r["epochs_until_convergence"] > 0 for r in runs):
                largest = f"{n} ({runs[0]['effective_batch']})"
        lines.append("| " + " | ".join([label, *cells, largest]) + " |")
    return "\n".join(lines)


def _replica_cell(runs: list[dict]) -> str:
    """One cell of `replica_table` (empty without runs)."""
    if not runs:
        return ""
    budget = max(r["epochs"] for r in runs)
    reached = [metrics.epochs_or_inf(r) for r in runs]
    median, low, high = statistics.median_high(reached), min(reached), max(reached)

    def shown(value):
        return f">{budget}" if math.isinf(value) else f"{value:g}"

    spread = f" ({shown(low)} to {shown(high)})" if low != high else ""
    if math.isfinite(median):
        return f"**{shown(median)}**{spread}"
    return f">{budget}{spread}, {100 * statistics.median_high(r['best_acc'] for r in runs):.2f}%"
