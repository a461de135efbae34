"""`tf-adasum eval` (also `python -m tf_adasum.eval`): the scaling evaluation.

Trains each configuration of a grid to a target test accuracy and reports, per
run, epochs to target, minutes per epoch (median) and their product, the score.
Writes ``results.jsonl`` and ``results.csv`` (one record per run), ``accuracy.png``
and ``scaling.png`` to ``--out``, and prints a table.

Every input (the grid, the data, ``--out``, ``--resume``'s results) is checked
before anything is written and before TensorFlow is loaded: a wrong one is one
line on stderr and exit status 2. TensorFlow's log lines are hidden unless
``--verbose`` (`tf_adasum.eval.quiet`).

Kernels: TensorFlow 2.21 turns its oneDNN CPU kernels on by default only on
processors with AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX; elsewhere (e.g. an
AVX2-only AMD EPYC) it falls back to its Eigen kernels, built without AVX2 and
FMA: 3-4x slower for convolutions here. So that minutes per epoch mean the
same on every x86 machine, the evaluation sets ``TF_ENABLE_ONEDNN_OPTS=1``
unless it is set already (its worker processes inherit it); each record's
``kernels`` says what ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shlex
import sys

from tf_adasum.eval import provenance, quiet, summary
from tf_adasum.eval.config import (
    BASE_LR,
    COMBINERS,
    ENGINES,
    INNER_OPTIMIZERS,
    KERAS_BASELINES,
    MODES,
    SCHEDULES,
    TIMING_MODELS,
    RunConfig,
)
from tf_adasum.eval.inputs import InputError, check_data, check_output_folder, read_results

__all__ = ["EDGE_REPLICA_COUNTS", "EDGE_VARIANTS", "ONEDNN_KERNELS", "PRESETS", "REPLICA_COUNTS", "main"]

#: The evaluation's kernels (see the module docstring), unless the environment chooses.
ONEDNN_KERNELS = ("TF_ENABLE_ONEDNN_OPTS", "1")


def _quick() -> list[RunConfig]:
    """`make eval`: the scaling question at a target this machine reaches in
    minutes. LeNet-5 to 98% on 4 local replicas at effective batches 256,
    1024 and 4096: Adasum, and Keras' gradient averaging at the base and at
    the scaled learning rate (local steps are in the paper preset)."""
    common = dict(model="lenet5", dataset="mnist", replicas=4, lr=1e-3, target=0.98, epochs=8)
    configs = []
    for batch in (64, 256, 1024):
        for combiner in ("adasum", "keras", "keras-scaled"):
            configs.append(RunConfig(combiner=combiner, batch_per_replica=batch, **common))
    return configs


def _recipe() -> list[RunConfig]:
    """The recipe's single-replica check (run with ``--no-stop``): the model and
    schedule of the paper preset, one replica at batch 64, three seeds."""
    common = dict(model="lenet_caffe", combiner="keras", replicas=1, batch_per_replica=64, target=0.993, epochs=10)
    return [RunConfig(seed=seed, **common) for seed in (0, 1, 2)]


def _paper() -> list[RunConfig]:
    """The sweep at the evaluation's own target: LeNet (Caffe's sizes) to 99.3%
    MNIST test accuracy within 10 epochs, 4 replicas, effective batches 256 to
    16384 (batch per replica 64 to 4096; Adasum with 4 local steps at a quarter
    of that): Adasum, AdaCons, `mean` and both averaging baselines, seed 0."""
    common = dict(model="lenet_caffe", dataset="mnist", replicas=4, lr=1e-3, target=0.993, epochs=10)
    configs = []
    for batch in (64, 256, 1024, 4096):
        for combiner in ("adasum", "adacons", "mean", "keras", "keras-scaled"):
            configs.append(RunConfig(combiner=combiner, batch_per_replica=batch, **common))
        configs.append(RunConfig(combiner="adasum", batch_per_replica=batch // 4, local_steps=4, **common))
    return configs


#: The replica axis: N = 1 to 256 replicas, each at the recipe's batch.
REPLICA_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _replicas() -> list[RunConfig]:
    """The paper's axis: more replicas, each at the recipe's batch (64) and
    learning rate, N = 1 to 256 (effective batch 64 to 16384), seeds 0, 1, 2;
    Adasum, Adasum with 4 local steps of batch 64, AdaCons, and the averaging
    baselines at each effective batch. N replicas are simulated in one process
    (`tf_adasum.SimulatedReplicas`). Seed by seed, each in order of N: a
    grid cut short still spans every N, and `stops_early` can skip AdaCons and
    local steps past two consecutive N where every seed run so far failed (a
    later seed that reaches the target there brings them back on `--resume`)."""
    common = dict(model="lenet_caffe", dataset="mnist", engine="simulated", batch_per_replica=64, lr=1e-3)
    common.update(target=0.993, epochs=10)
    configs = []
    for seed in (0, 1, 2):
        for n in REPLICA_COUNTS:
            for combiner, k in (("adasum", 1), ("adasum", 4), ("adacons", 1), ("keras", 1), ("keras-scaled", 1)):
                configs.append(RunConfig(combiner=combiner, local_steps=k, replicas=n, seed=seed, **common))
    return configs


#: Where the replica sweep's Adasum stops: its N, and the variants tried there.
EDGE_REPLICA_COUNTS = (32, 64, 128, 256)
EDGE_VARIANTS = (
    dict(combiner="adasum", mode="gradient"),
    dict(combiner="adasum", inner="lamb", lr=BASE_LR["lamb"]),
    dict(combiner="keras-scaled", inner="lamb", lr=BASE_LR["lamb"]),  # the `lamb-scaled` baseline
    dict(combiner="adasum", lr_rule="warmup"),
    dict(combiner="adasum", lr_rule="scaled"),
)


def _edge() -> list[RunConfig]:
    """Where Adasum stops, and what moves the limit: the replicas preset's
    model, data, budget and seeds at N = 32 to 256, with Adasum's variants
    (`EDGE_VARIANTS`): gradient mode; LAMB as the inner optimizer (at its own
    single-worker rate, `BASE_LR`), beside LAMB under averaging at
    ``keras-scaled``'s rule (``lamb-scaled``); the warm-up
    ``keras-scaled`` uses, to the base rate; and ``keras-scaled``'s whole rule
    (scaled rate and warm-up), the same chance the baseline has. The sweep's
    own Adasum and averaging runs at those N come first (the same
    configurations: with ``--resume`` on their records they are not rerun).
    Seed by seed, each in order of N; a variant stops as the sweep's AdaCons
    does (`summary.stops_early`)."""
    configs = []
    for config in _replicas():
        if config.replicas in EDGE_REPLICA_COUNTS and config.local_steps == 1 and config.combiner != "adacons":
            configs.append(config)
    for seed in (0, 1, 2):
        for n in EDGE_REPLICA_COUNTS:
            for variant in EDGE_VARIANTS:
                configs.append(dataclasses.replace(configs[0], replicas=n, seed=seed, **variant))
    return configs


PRESETS = {"quick": _quick, "recipe": _recipe, "paper": _paper, "replicas": _replicas, "edge": _edge}


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="tf-adasum eval", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a ready grid (default: quick, if no grid is given)")
    parser.add_argument(
        "--models",
        nargs="+",
        help="lenet_caffe, lenet5, resnet, mlp (trained to the target); resnet50, bert (timed on synthetic data)",
    )
    parser.add_argument("--datasets", nargs="+", help="mnist, fashion_mnist")
    parser.add_argument("--combiners", nargs="+", help=", ".join(COMBINERS))
    parser.add_argument("--engine", help=f"{', '.join(ENGINES)} (default: the preset's, else local-devices)")
    parser.add_argument("--replicas", type=int, nargs="+")
    parser.add_argument("--batch-per-replica", type=int, nargs="+")
    parser.add_argument("--local-steps", type=int, nargs="+")
    parser.add_argument("--modes", nargs="+", help=f"{', '.join(MODES)} (what Adasum and AdaCons combine)")
    parser.add_argument("--inner-optimizers", nargs="+", help=", ".join(INNER_OPTIMIZERS))
    parser.add_argument(
        "--lr-rules",
        nargs="+",
        help="'' (the combiner's own), warmup (keras-scaled's warm-up to the base rate), scaled (keras-scaled's rule)",
    )
    parser.add_argument("--lr", type=float, help="base learning rate (Adam; default 1e-3)")
    parser.add_argument("--schedule", choices=SCHEDULES, help="cosine (default: to 0 over --epochs) or constant")
    parser.add_argument("--target", type=float)
    parser.add_argument("--epochs", type=int, help="epoch budget per run")
    parser.add_argument("--seed", type=int, nargs="+", help="random seeds (default: the preset's, else 0)")
    parser.add_argument("--train-examples", type=int, default=0, help="use only the first N training images (0: all)")
    parser.add_argument("--test-examples", type=int, default=0, help="use only the first N test images (0: all)")
    parser.add_argument(
        "--hosts",
        type=int,
        help="tf-collective: run the workers on this many emulated hosts (tf-adasum launch --hosts; root)",
    )
    parser.add_argument("--link", help="with --hosts: each host's link rate, e.g. 1gbit or 100mbit")
    parser.add_argument("--timing-steps", type=int, default=3, help="timed steps per combiner (resnet50, bert)")
    parser.add_argument("--data-dir", help="a folder of IDX files to use instead of the built-in data")
    parser.add_argument("--out", default="results/eval", help="output folder")
    parser.add_argument("--resume", action="store_true", help="skip configurations already in the results")
    parser.add_argument("--no-stop", action="store_true", help="train the whole budget even after the target")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's log lines and warnings")
    return parser.parse_args(argv)


def build_grid(args) -> list[RunConfig]:
    """The configurations to run: a preset, or the product of the grid options
    (each option overriding the preset's or the default value)."""
    grid_options = (
        args.models,
        args.datasets,
        args.combiners,
        args.replicas,
        args.batch_per_replica,
        args.local_steps,
        args.modes,
        args.inner_optimizers,
        args.lr_rules,
    )
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
        "mode": args.modes,
        "inner": args.inner_optimizers,
        "lr_rule": args.lr_rules,
        "seed": args.seed,
    }
    scalars = {
        "engine": args.engine,
        "lr": args.lr,
        "schedule": args.schedule,
        "target": args.target,
        "epochs": args.epochs,
        "train_examples": args.train_examples,
        "test_examples": args.test_examples,
        "hosts": args.hosts,
        "link": args.link,
    }
    configs = []
    for config in base:
        choices = [[(name, v) for v in values] for name, values in overrides.items() if values]
        for combination in itertools.product(*choices):
            changed = dict(combination, **{k: v for k, v in scalars.items() if v is not None})
            candidate = dataclasses.replace(config, **changed)
            if candidate.combiner in KERAS_BASELINES and (
                candidate.local_steps > 1 or candidate.mode != "delta" or candidate.lr_rule
            ):
                continue  # the Keras baselines have no local steps, no gradient mode and their own rate
            if candidate not in configs:
                configs.append(candidate.validate())
    if not configs:
        raise ValueError(
            "The grid is empty (the `keras` and `keras-scaled` combiners run only at --local-steps 1, "
            "in delta mode and at their own learning-rate rule)."
        )
    return configs


class _Progress:
    def __init__(self, index: int, total: int, config: RunConfig):
        settings = f"N={config.replicas} b={config.batch_per_replica} K={config.local_steps} seed={config.seed}"
        self.prefix = f"[{index}/{total}] {config.method:>12} {settings}"
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


RESULT_FILES = ("results.jsonl", "results.csv", "accuracy.png", "scaling.png")


@dataclasses.dataclass
class _Plan:
    """What a checked command line asks for."""

    timing_models: list[str]
    timing: dict  # combiners, replicas, batch_per_replica (lists)
    configs: list[RunConfig]
    previous: list[dict]  # records already in results.jsonl (--resume)


def _timing_settings(args) -> dict:
    settings = {
        "combiners": args.combiners or ["keras", "adasum"],
        "replicas": args.replicas or [4],
        "batch_per_replica": args.batch_per_replica or [8],
    }
    for combiner in settings["combiners"]:
        if combiner not in COMBINERS:
            raise InputError(f"Unknown `combiner`. Expected one of {COMBINERS}. Received: combiner={combiner!r}")
    for name in ("replicas", "batch_per_replica"):
        if any(v < 1 for v in settings[name]):
            raise InputError(f"`{name}` must be >= 1. Received: {name}={settings[name]}")
    if args.timing_steps < 1:
        raise InputError(f"`timing_steps` must be >= 1. Received: timing_steps={args.timing_steps}")
    if args.engine not in (None, "local-devices"):
        raise InputError(
            f"The timing models ({', '.join(TIMING_MODELS)}) run on local devices only. "
            f"Received: engine={args.engine!r}"
        )
    return settings


def check_inputs(args) -> _Plan:
    """Checks every input, writing nothing; raises `InputError` (one line)."""
    timing_models = [m for m in args.models or [] if m in TIMING_MODELS]
    timing = _timing_settings(args) if timing_models else {}
    configs: list[RunConfig] = []
    if not timing_models or len(timing_models) < len(args.models):
        grid_args = argparse.Namespace(**vars(args))
        grid_args.models = [m for m in args.models or [] if m not in TIMING_MODELS] or None
        try:
            configs = build_grid(grid_args)
        except (ValueError, NotImplementedError) as error:
            raise InputError(str(error)) from None
        check_data(configs, args.data_dir)
    check_output_folder(args.out, RESULT_FILES if configs else ("timing.jsonl",))
    previous = read_results(os.path.join(args.out, "results.jsonl")) if configs and args.resume else []
    return _Plan(timing_models, timing, configs, previous)


def _run_timing(args, plan: _Plan) -> None:
    """Time per step and communication share of the timing models (see `tf_adasum.eval.timing`)."""
    from tf_adasum.eval.runner import logical_cpus
    from tf_adasum.eval.timing import time_model

    devices = logical_cpus(max(plan.timing["replicas"]))

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "timing.jsonl")
    columns = ("model", "combiner", "N", "batch", "params", "s/step", "combine s", "comm.share")
    print(" ".join(f"{c:>{w}}" for c, w in zip(columns, (8, 8, 2, 5, 10, 7, 9, 10))))
    grid = itertools.product(
        plan.timing_models, plan.timing["combiners"], plan.timing["replicas"], plan.timing["batch_per_replica"]
    )
    for name, combiner, n, batch in grid:
        record = time_model(name, combiner, n, batch, devices, steps=args.timing_steps)
        record = {**record, **provenance.fields(args.command)}  # its date, commit, processor and command
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        print(
            f"{name:>8} {combiner:>8} {n:>2} {batch:>5} {record['params']:>10,} {record['seconds_per_step']:>7.3f} "
            f"{record['combine_seconds']:>9.3f} {record['communication_share']:>10.1%}",
            flush=True,
        )
    print(f"wrote {path}")


def _run_grid(args, plan: _Plan) -> None:
    results_path = os.path.join(args.out, "results.jsonl")
    done = {summary.config_of(record).key() for record in plan.previous}
    todo = [config for config in plan.configs if config.key() not in done]
    print(
        f"tf-adasum eval: {len(plan.configs)} configurations, {len(plan.configs) - len(todo)} already done; "
        f"results in {args.out}",
        flush=True,
    )
    from tf_adasum.eval.plots import plot
    from tf_adasum.eval.processes import run_in_processes

    os.makedirs(args.out, exist_ok=True)
    records = list(plan.previous)
    origin = {"commit": provenance.commit(), "command": args.command}  # beside the record's date and processor
    mode = "a" if args.resume else "w"  # earlier results are replaced only once a new record is ready
    for index, config in enumerate(todo, start=1):
        if args.preset in ("replicas", "edge") and summary.stops_early(config, records):
            print(
                f"[{index}/{len(todo)}] skipped: {config.method} K={config.local_steps} N={config.replicas} "
                "(every seed failed the target at two consecutive smaller N)",
                flush=True,
            )
            continue
        progress = _Progress(index, len(todo), config)
        record = run_in_processes(config, not args.no_stop, progress, args.data_dir, args.verbose)
        record = {**record, **origin}
        progress.close()
        records.append(record)
        with open(results_path, mode, encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        mode = "a"
    summary.write_csv(records, os.path.join(args.out, "results.csv"))  # every run in results.jsonl
    wanted = {c.key() for c in plan.configs}
    selected = [r for r in records if summary.config_of(r).key() in wanted]  # this command's grid
    print()
    print(summary.format_table(selected))
    print()
    if len({r["seed"] for r in selected}) > 1:
        print(summary.seed_summary(selected))
        print()
    if len({r["effective_batch"] for r in selected}) > 1:
        print("\n".join(summary.largest_reached(selected)))
        print()
    for path in [results_path, os.path.join(args.out, "results.csv"), *plot(selected, args.out)]:
        print(f"wrote {path}")


def command_of(argv: list[str], program: str = "tf-adasum eval") -> str:
    """The command line a record names: `program` (how the evaluation was
    started: ``tf-adasum eval``, or ``python -m tf_adasum.eval``, which loads
    TensorFlow before it starts and so keeps TensorFlow's own kernels) and
    `argv`, after the variables that chose the code it ran
    (`provenance.with_path_variables`)."""
    return provenance.with_path_variables(" ".join([program, *(shlex.quote(a) for a in argv)]))


def main(argv=None, program: str = "tf-adasum eval") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse_args(argv)
    args.command = command_of(argv, program)
    try:
        plan = check_inputs(args)
    except InputError as error:
        print(f"tf-adasum eval: error: {error}", file=sys.stderr)
        return 2
    if "tensorflow" not in sys.modules:  # TensorFlow reads it once, when imported
        os.environ.setdefault(*ONEDNN_KERNELS)
    quiet.import_tensorflow(verbose=args.verbose)
    if plan.timing_models:
        _run_timing(args, plan)
    if plan.configs:
        _run_grid(args, plan)
    return 0
