"""`tf-adasum eval` (also `python -m tf_adasum.eval`): the scaling evaluation.

Trains each configuration of a grid to a target test accuracy and reports, per
run, epochs to target, minutes per epoch (median) and their product, the score.
Writes ``results.jsonl`` and ``results.csv`` (one record per run), ``accuracy.png``
and ``scaling.png`` to ``--out``, and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
import sys

from tf_adasum.eval import metrics
from tf_adasum.eval.models import TIMING_MODELS
from tf_adasum.eval.runner import COMBINERS, ENGINES, RunConfig

__all__ = ["PRESETS", "main"]


def _quick() -> list[RunConfig]:
    """Effective batch 1024 on 4 in-process replicas: Adasum, averaging (through
    the same collective), Keras' own averaging, Adasum with 4 local steps, and AdaCons."""
    common = dict(model="lenet5", dataset="mnist", replicas=4, lr=1e-3, target=0.98, epochs=12)
    return [
        RunConfig(combiner="adasum", batch_per_replica=256, **common),
        RunConfig(combiner="mean", batch_per_replica=256, **common),
        RunConfig(combiner="keras", batch_per_replica=256, **common),
        RunConfig(combiner="adasum", batch_per_replica=64, local_steps=4, **common),
        RunConfig(combiner="adacons", batch_per_replica=256, **common),
    ]


def _paper() -> list[RunConfig]:
    """The long grid: effective batches from 64 to 4096, LeNet-5 on MNIST to 99.3%."""
    configs = []
    for replicas, batch, local_steps, combiner in itertools.product((2, 4, 8), (32, 128), (1, 4), COMBINERS):
        if combiner == "keras" and local_steps > 1:
            continue
        configs.append(
            RunConfig(
                combiner=combiner,
                replicas=replicas,
                batch_per_replica=batch,
                local_steps=local_steps,
                lr=1e-3,
                target=0.993,
                epochs=30,
            )
        )
    return configs


PRESETS = {"quick": _quick, "paper": _paper}


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="tf-adasum eval", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a ready grid (default: quick, if no grid is given)")
    parser.add_argument(
        "--models", nargs="+", help="lenet5, resnet (trained to the target); resnet50, bert (timed on synthetic data)"
    )
    parser.add_argument("--datasets", nargs="+", help="mnist, fashion_mnist")
    parser.add_argument("--combiners", nargs="+", help=", ".join(COMBINERS))
    parser.add_argument("--engine", default="local-devices", help=", ".join(ENGINES))
    parser.add_argument("--replicas", type=int, nargs="+")
    parser.add_argument("--batch-per-replica", type=int, nargs="+")
    parser.add_argument("--local-steps", type=int, nargs="+")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--target", type=float)
    parser.add_argument("--epochs", type=int, help="epoch budget per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-examples", type=int, default=0, help="use only the first N training images (0: all)")
    parser.add_argument("--test-examples", type=int, default=0, help="use only the first N test images (0: all)")
    parser.add_argument("--timing-steps", type=int, default=3, help="timed steps per combiner (resnet50, bert)")
    parser.add_argument("--data-dir", help="a folder of IDX files to use instead of the built-in data")
    parser.add_argument("--out", default="results/eval", help="output folder")
    parser.add_argument("--resume", action="store_true", help="skip configurations already in the results")
    parser.add_argument("--no-stop", action="store_true", help="train the whole budget even after the target")
    return parser.parse_args(argv)


def build_grid(args) -> list[RunConfig]:
    """The configurations to run: a preset, or the product of the grid options
    (each option overriding the preset's or the default value)."""
    grid_options = (args.models, args.datasets, args.combiners, args.replicas, args.batch_per_replica, args.local_steps)
    if args.preset or not any(grid_options):
        base = PRESETS[args.preset or "quick"]()
    else:
        base = [RunConfig()]
    overrides = {
        "model": args.models,
        "dataset": args.datasets,
        "combiner": args.combiners,
        "replicas": args.replicas,
        "batch_per_replica": args.batch_per_replica,
        "local_steps": args.local_steps,
    }
    scalars = {
        "engine": args.engine,
        "lr": args.lr,
        "target": args.target,
        "epochs": args.epochs,
        "seed": args.seed,
        "train_examples": args.train_examples,
        "test_examples": args.test_examples,
    }
    configs = []
    for config in base:
        choices = [[(name, v) for v in values] for name, values in overrides.items() if values]
        for combination in itertools.product(*choices):
            changed = dict(combination, **{k: v for k, v in scalars.items() if v is not None})
            candidate = dataclasses.replace(config, **changed)
            if candidate.combiner == "keras" and candidate.local_steps > 1:
                continue  # the Keras baseline has no local steps
            if candidate not in configs:
                configs.append(candidate.validate())
    if not configs:
        raise ValueError("The grid is empty (the `keras` combiner runs only at --local-steps 1).")
    return configs


def _config_of(record: dict) -> RunConfig:
    return RunConfig(**{f.name: record[f.name] for f in dataclasses.fields(RunConfig)})


def load_results(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


CSV_FIELDS = [
    "model", "dataset", "combiner", "engine", "replicas", "batch_per_replica", "local_steps", "effective_batch",
    "lr", "target", "epochs", "epochs_until_convergence", "minutes_per_epoch", "score", "final_acc", "best_acc",
    "accuracy_per_epoch",
]  # fmt: skip


def write_csv(records: list[dict], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for record in records:
            writer.writerow(
                {**record, "accuracy_per_epoch": " ".join(f"{a:.4f}" for a in record["accuracy_per_epoch"])}
            )


def format_table(records: list[dict]) -> str:
    header = [
        "model",
        "data",
        "combiner",
        "N",
        "batch",
        "local",
        "eff.batch",
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
                r["model"], r["dataset"], r["combiner"], str(r["replicas"]), str(r["batch_per_replica"]),
                str(r["local_steps"]), str(r["effective_batch"]), f"{r['target']:.3f}",
                str(epochs) if epochs > 0 else f">{len(r['accuracy_per_epoch'])}",
                f"{r['minutes_per_epoch']:.2f}", metrics.format_score(r["score"]), f"{r['best_acc']:.4f}",
            ]
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _label(record: dict) -> str:
    return f"{record['combiner']} N={record['replicas']} b={record['batch_per_replica']} K={record['local_steps']}"


def plot(records: list[dict], out: str) -> list[str]:
    """accuracy.png (test accuracy per epoch) and scaling.png (against effective batch)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    paths = [os.path.join(out, "accuracy.png"), os.path.join(out, "scaling.png")]
    fig, axis = plt.subplots(figsize=(7, 4.5))
    for record in records:
        epochs = range(1, len(record["accuracy_per_epoch"]) + 1)
        axis.plot(epochs, record["accuracy_per_epoch"], marker="o", label=_label(record))
    for target in sorted({r["target"] for r in records}):
        axis.axhline(target, color="gray", lw=0.7, ls="--")
    axis.set(xlabel="epoch", ylabel="test accuracy", title="Test accuracy per epoch")
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    series = dict.fromkeys((r["combiner"], r["local_steps"]) for r in records)
    batches = sorted({r["effective_batch"] for r in records})
    for (combiner, local_steps), color in zip(series, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4):
        runs = sorted(
            (r for r in records if (r["combiner"], r["local_steps"]) == (combiner, local_steps)),
            key=lambda r: r["effective_batch"],
        )
        label = f"{combiner} K={local_steps}"
        reached = [r for r in runs if r["score"] is not None]
        missed = [r for r in runs if r["score"] is None]
        axes[0].plot([r["effective_batch"] for r in reached], [r["epochs_until_convergence"] for r in reached],
                     marker="o", color=color, label=label)  # fmt: skip
        axes[1].plot([r["effective_batch"] for r in reached], [r["score"] for r in reached], marker="o", color=color,
                     label=label)  # fmt: skip
        if missed:  # drawn one epoch above the budget
            note = f"{label}: not reached within {missed[0]['epochs']} epochs"
            axes[0].scatter([r["effective_batch"] for r in missed], [r["epochs"] + 1 for r in missed], marker="x",
                            s=60, color=color, label=note)  # fmt: skip
    for axis, ylabel, title in zip(
        axes, ("epochs to target", "minutes"), ("Epochs to target", "Minutes to target (score)")
    ):
        axis.set(xlabel="effective batch", ylabel=ylabel, title=title)
        if len(batches) > 1:
            axis.set_xscale("log", base=2)
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


class _Progress:
    def __init__(self, index: int, total: int, config: RunConfig):
        settings = f"N={config.replicas} b={config.batch_per_replica} K={config.local_steps}"
        self.prefix = f"[{index}/{total}] {config.combiner:>6} {settings}"
        self.epochs = config.epochs
        self.tty = sys.stdout.isatty()

    def __call__(self, epoch: int, accuracy: float, seconds: float) -> None:
        done = int(20 * epoch / self.epochs)
        bar = "#" * done + "." * (20 - done)
        line = f"{self.prefix} [{bar}] epoch {epoch}/{self.epochs} acc {accuracy:.4f} ({seconds:.1f} s)"
        print(line, end="\r" if self.tty else "\n", flush=True)

    def close(self) -> None:
        if self.tty:
            print(flush=True)


def _logical_cpus(count: int) -> list[str]:
    """`count` logical CPU devices (configured here unless TF already started with enough)."""
    import tensorflow as tf

    try:
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:  # already initialised, e.g. inside a test process
        pass
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) < count:
        raise RuntimeError(
            f"{count} logical CPU devices are needed, but TensorFlow already started with {len(devices)}."
        )
    return devices


def _run_timing(args, models: list[str]) -> None:
    """Time per step and communication share of `models` (see `tf_adasum.eval.timing`)."""
    combiners = args.combiners or ["keras", "adasum"]
    replicas = args.replicas or [4]
    batches = args.batch_per_replica or [8]
    for combiner in combiners:
        if combiner not in COMBINERS:
            raise ValueError(f"Unknown `combiner`. Expected one of {COMBINERS}. Received: combiner={combiner!r}")
    for name, values in (("replicas", replicas), ("batch_per_replica", batches)):
        if any(v < 1 for v in values):
            raise ValueError(f"`{name}` must be >= 1. Received: {name}={values}")
    devices = _logical_cpus(max(replicas))
    from tf_adasum.eval.timing import time_model

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "timing.jsonl")
    columns = ("model", "combiner", "N", "batch", "params", "s/step", "combine s", "comm.share")
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, (8, 8, 2, 5, 10, 7, 9, 10))))
    for name, combiner, n, batch in itertools.product(models, combiners, replicas, batches):
        record = time_model(name, combiner, n, batch, devices, steps=args.timing_steps)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        print(
            f"{name:>8} {combiner:>8} {n:>2} {batch:>5} {record['params']:>10,} {record['seconds_per_step']:>7.3f} "
            f"{record['combine_seconds']:>9.3f} {record['communication_share']:>10.1%}",
            flush=True,
        )
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = _parse_args(argv)
    timing_models = [m for m in args.models or [] if m in TIMING_MODELS]
    if timing_models:
        try:
            _run_timing(args, timing_models)
        except ValueError as error:
            print(f"tf-adasum eval: {error}", file=sys.stderr)
            return 2
        args.models = [m for m in args.models if m not in TIMING_MODELS]
        if not args.models:
            return 0
    try:
        configs = build_grid(args)
    except (ValueError, NotImplementedError) as error:
        print(f"tf-adasum eval: {error}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    results_path = os.path.join(args.out, "results.jsonl")
    previous = load_results(results_path) if args.resume else []
    if not args.resume and os.path.exists(results_path):
        os.remove(results_path)
    done = {_config_of(record).key() for record in previous}
    todo = [config for config in configs if config.key() not in done]
    print(
        f"tf-adasum eval: {len(configs)} configurations, {len(configs) - len(todo)} already done; results in {args.out}"
    )

    local = [c for c in configs if c.engine == "local-devices"]
    devices = _logical_cpus(max(c.replicas for c in local)) if local else []
    from tf_adasum.eval.data import load_dataset
    from tf_adasum.eval.runner import run

    datasets = {}
    records = list(previous)
    for index, config in enumerate(todo, start=1):
        if config.engine == "local-devices" and config.dataset not in datasets:
            datasets[config.dataset] = load_dataset(config.dataset, args.data_dir)
        progress = _Progress(index, len(todo), config)
        record = run(
            config,
            datasets.get(config.dataset),
            devices,
            stop_at_target=not args.no_stop,
            progress=progress,
            data_dir=args.data_dir,
        )
        progress.close()
        records.append(record)
        with open(results_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    selected = [r for r in records if _config_of(r).key() in {c.key() for c in configs}]
    write_csv(selected, os.path.join(args.out, "results.csv"))
    print()
    print(format_table(selected))
    print()
    for path in [results_path, os.path.join(args.out, "results.csv"), *plot(selected, args.out)]:
        print(f"wrote {path}")
    return 0
