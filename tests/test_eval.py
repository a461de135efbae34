"""The scaling evaluation: metrics, grid validation, outputs, --resume, IDX data."""

import argparse
import csv
import dataclasses
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tf_adasum.eval import cli, data, metrics, plots, provenance, quiet, summary
from tf_adasum.eval.runner import RunConfig

# -- metrics on synthetic accuracy curves ------------------------------------------------


@pytest.mark.parametrize(
    "curve, target, expected",
    [
        ([0.5, 0.9, 0.99, 0.995], 0.95, 3),
        ([0.97, 0.96], 0.95, 1),
        ([0.9, 0.95], 0.95, 2),  # reaching the target exactly counts
        ([0.9, 0.93, 0.94], 0.95, -1),
        ([], 0.5, -1),
    ],
)
def test_epochs_until_convergence(curve, target, expected):
    assert metrics.epochs_until_convergence(curve, target) == expected


def test_score():
    assert metrics.score(3, 0.5) == 1.5
    assert metrics.score(-1, 0.5) is None
    assert metrics.format_score(None) == "inf"
    assert metrics.format_score(1.5) == "1.50"


# -- the grid -------------------------------------------------------------------------------


def _args(*argv):
    return cli._parse_args(list(argv))


def test_quick_preset_shows_scaling():
    configs = cli.build_grid(_args())
    batches = sorted({c.effective_batch for c in configs})
    assert batches == [256, 1024, 4096]
    for batch in batches:
        series = sorted((c.combiner, c.local_steps) for c in configs if c.effective_batch == batch)
        assert series == [("adasum", 1), ("keras", 1), ("keras-scaled", 1)]
    assert len({(c.lr, c.schedule, c.target, c.epochs, c.seed) for c in configs}) == 1  # same base settings


def test_paper_preset_sweeps_the_effective_batch_at_99_3():
    configs = cli.build_grid(_args("--preset", "paper"))
    assert sorted({c.effective_batch for c in configs}) == [256, 1024, 4096, 16384]
    for batch in (256, 1024, 4096, 16384):
        series = sorted((c.combiner, c.local_steps) for c in configs if c.effective_batch == batch)
        assert series == sorted(
            [("adasum", 1), ("adasum", 4), ("adacons", 1), ("mean", 1), ("keras", 1), ("keras-scaled", 1)]
        )
    assert {(c.model, c.replicas, c.lr, c.schedule, c.target, c.epochs) for c in configs} == {
        ("lenet_caffe", 4, 1e-3, "cosine", 0.993, 10)
    }


def test_recipe_preset_is_one_replica_three_seeds():
    configs = cli.build_grid(_args("--preset", "recipe"))
    assert [c.seed for c in configs] == [0, 1, 2]
    assert {(c.model, c.combiner, c.replicas, c.batch_per_replica, c.epochs) for c in configs} == {
        ("lenet_caffe", "keras", 1, 64, 10)
    }
    assert [c.seed for c in cli.build_grid(_args("--preset", "recipe", "--seed", "5"))] == [5]


def test_replicas_preset_grows_n_at_the_recipe_batch():
    configs = cli.build_grid(_args("--preset", "replicas"))
    assert len(configs) == 9 * 3 * 5
    assert sorted({c.replicas for c in configs}) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    for n in cli.REPLICA_COUNTS:
        for seed in (0, 1, 2):
            series = sorted((c.combiner, c.local_steps) for c in configs if c.replicas == n and c.seed == seed)
            assert series == [("adacons", 1), ("adasum", 1), ("adasum", 4), ("keras", 1), ("keras-scaled", 1)]
    assert {(c.model, c.engine, c.batch_per_replica, c.lr, c.schedule, c.target, c.epochs) for c in configs} == {
        ("lenet_caffe", "simulated", 64, 1e-3, "cosine", 0.993, 10)
    }
    order = [(c.seed, c.replicas) for c in configs]
    assert order == sorted(order)  # seed by seed, each in order of N (stops_early)


def test_edge_preset_runs_the_variants_beside_the_sweeps_own_runs():
    configs = cli.build_grid(_args("--preset", "edge"))
    sweep = {c.key() for c in cli.build_grid(_args("--preset", "replicas"))}
    assert len(configs) == len(set(configs)) == 4 * 3 * (3 + len(cli.EDGE_VARIANTS))
    shared = [c for c in configs if c.key() in sweep]  # run by the sweep: --resume on its records skips them
    assert sorted({c.method for c in shared}) == ["adasum", "keras", "keras-scaled"]
    assert {c.replicas for c in shared} == set(cli.EDGE_REPLICA_COUNTS) and len(shared) == 36
    variants = [c for c in configs if c.key() not in sweep]
    methods = ["adasum gradient", "adasum lamb", "lamb-scaled", "adasum warmup", "adasum scaled"]
    for n in cli.EDGE_REPLICA_COUNTS:
        for seed in (0, 1, 2):
            assert [c.method for c in variants if (c.replicas, c.seed) == (n, seed)] == methods
    assert {(c.model, c.batch_per_replica, c.target, c.epochs, c.local_steps) for c in configs} == {
        ("lenet_caffe", 64, 0.993, 10, 1)
    }
    assert {(c.inner, c.lr) for c in configs} == {("adam", 1e-3), ("lamb", 3e-3)}  # each its own rate
    order = [(c.seed, c.replicas) for c in variants]
    assert order == sorted(order)  # seed by seed, each in order of N


@pytest.mark.parametrize(
    "settings, method",
    [
        ({}, "adasum"),
        ({"mode": "gradient"}, "adasum gradient"),
        ({"inner": "lamb", "lr_rule": "warmup", "lr": 3e-3}, "adasum lamb warmup"),
        ({"combiner": "keras-scaled", "inner": "lamb", "lr": 3e-3}, "lamb-scaled"),
        ({"combiner": "keras-scaled", "inner": "lamb"}, "lamb-scaled lr=0.001"),  # not LAMB's base rate
        ({"combiner": "keras", "lr": 0.02}, "keras lr=0.02"),
    ],
)
def test_method_names_what_differs_from_the_defaults(settings, method):
    assert RunConfig(**settings).validate().method == method


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--modes", "sparse"], r"Unknown `mode`. Expected one of \('delta', 'gradient'\). Received: mode='sparse'"),
        (["--inner-optimizers", "sgd"], "Received: inner='sgd'"),
        (["--lr-rules", "linear"], "Received: lr_rule='linear'"),
        (["--combiners", "keras", "--modes", "gradient"], "grid is empty"),
        (["--combiners", "keras-scaled", "--lr-rules", "warmup"], "grid is empty"),
    ],
)
def test_bad_variant_values(argv, match, capsys):
    assert cli.main(argv) == 2
    assert re.search(match, capsys.readouterr().err)


def test_warmup_and_scaled_rules_of_the_variants():
    """``warmup``: keras-scaled's ramp, from the same fraction of the peak, to
    the base rate; ``scaled``: keras-scaled's own schedule, for Adasum."""
    from tf_adasum.eval.config import WARMUP_EPOCHS
    from tf_adasum.eval.runner import learning_rate

    steps, warmup = 10, WARMUP_EPOCHS * 10
    wide = dict(batch_per_replica=1024, epochs=6)  # 4 x 1024 = 64 x BASE_BATCH: sqrt scaling gives 8x
    ramp = learning_rate(RunConfig(lr_rule="warmup", **wide), steps)
    assert [round(float(ramp(s)), 9) for s in (0, warmup, 60)] == [1.25e-4, 1e-3, 0.0]
    scaled = learning_rate(RunConfig(lr_rule="scaled", **wide), steps)
    assert [round(float(scaled(s)), 9) for s in (0, warmup // 2, warmup, 60)] == [1e-3, 4.5e-3, 8e-3, 0.0]
    assert float(learning_rate(RunConfig(lr_rule="warmup", batch_per_replica=16), steps)(0)) == pytest.approx(1e-3)
    flat = learning_rate(RunConfig(lr_rule="warmup", schedule="constant", **wide), steps)
    assert [round(float(flat(s)), 9) for s in (0, warmup, 1000)] == [1.25e-4, 1e-3, 1e-3]  # up to the rate, kept


def test_gradient_mode_lays_the_schedule_over_combined_steps():
    """In gradient mode the inner optimizer steps once per K training steps:
    the schedule spans the same epochs in those iterations."""
    from tf_adasum.eval.runner import learning_rate

    delta = learning_rate(RunConfig(local_steps=4, epochs=4), steps_per_epoch=10)
    gradient = learning_rate(RunConfig(local_steps=4, epochs=4, mode="gradient"), steps_per_epoch=10)
    assert float(delta(20)) == pytest.approx(5e-4)  # half-way after 2 epochs of 10 local steps
    assert float(gradient(6)) == pytest.approx(5e-4)  # ... and after 2 epochs of ceil(10 / 4) = 3 combines
    assert float(gradient(12)) == pytest.approx(0.0)


def test_variants_reach_the_optimizer_and_the_simulated_replicas():
    import keras

    from tf_adasum.eval.runner import compiled_model, optimizer_for

    wrapped = optimizer_for(RunConfig(mode="gradient", inner="lamb"), steps_per_epoch=10)
    assert (wrapped.mode, type(wrapped.inner_optimizer)) == ("gradient", keras.optimizers.Lamb)
    assert isinstance(optimizer_for(RunConfig(combiner="keras-scaled", inner="lamb"), 10), keras.optimizers.Lamb)
    simulated = RunConfig(model="lenet_caffe", engine="simulated", replicas=2, mode="gradient", inner="lamb")
    trainer = compiled_model(simulated, steps_per_epoch=10)
    assert (trainer.mode, type(trainer.optimizer)) == ("gradient", keras.optimizers.Lamb)


def _outcome(combiner, n, seed, reached, local_steps=1):
    record = _record(combiner, n, 64, local_steps, [0.95] if reached else [0.5])
    return {**record, "seed": seed, "engine": "simulated"}


def test_stops_early_after_two_consecutive_n_where_every_seed_failed():
    config = lambda combiner, n, k=1: RunConfig(  # noqa: E731
        combiner=combiner, replicas=n, batch_per_replica=64, local_steps=k, target=0.9, epochs=4, engine="simulated"
    )
    records = [_outcome("adacons", 4, seed, seed == 1) for seed in (0, 1, 2)]  # one seed reached it
    records += [_outcome("adacons", 8, seed, False) for seed in (0, 1, 2)]
    assert not summary.stops_early(config("adacons", 16), records)  # only one N failed every seed
    records += [_outcome("adacons", 16, seed, False) for seed in (0, 1, 2)]
    assert summary.stops_early(config("adacons", 32), records)
    assert not summary.stops_early(config("adacons", 16), records)  # judged on smaller N only
    failed_adasum = [_outcome("adasum", n, seed, False) for n in (4, 8) for seed in (0, 1, 2)]
    assert not summary.stops_early(config("adasum", 16), failed_adasum)  # Adasum always runs to the end
    local = [_outcome("adasum", n, seed, False, local_steps=4) for n in (4, 8) for seed in (0, 1, 2)]
    assert summary.stops_early(config("adasum", 16, 4), local)
    assert not summary.stops_early(config("adasum", 16, 4), local + [_outcome("adasum", 8, 3, True, 4)])
    assert not summary.stops_early(config("adasum", 16), local)  # K = 1 is another method
    gradient = [{**record, "mode": "gradient"} for record in failed_adasum]  # an edge variant stops too
    assert summary.stops_early(dataclasses.replace(config("adasum", 16), mode="gradient"), gradient)
    assert not summary.stops_early(config("adasum", 16), gradient)  # delta mode is another method
    failed_keras = [{**record, "combiner": "keras-scaled"} for record in failed_adasum]
    assert not summary.stops_early(config("keras-scaled", 16), failed_keras)  # the baselines run to the end


def test_seed_summary_reports_median_and_range():
    records = [
        {**_record("adasum", 8, 64, 1, [0.5, 0.95, 0.97]), "seed": 0},
        {**_record("adasum", 8, 64, 1, [0.5, 0.6, 0.92]), "seed": 1},
        {**_record("adasum", 8, 64, 1, [0.5, 0.6, 0.7]), "seed": 2},
        {**_record("keras", 8, 64, 1, [0.91]), "seed": 0},
    ]
    lines = summary.seed_summary(records).splitlines()
    assert lines[0].split()[:7] == ["model", "data", "method", "K", "N", "eff.batch", "seeds"]
    row = ["lenet5", "mnist", "adasum", "1", "8", "512", "3", "3", "2", "to", ">4", "0.9200", "0.7000", "to", "0.9700"]
    assert lines[2].split() == row
    assert lines[3].split()[7:] == ["1", "1", "to", "1", "0.9100", "0.9100", "to", "0.9100"]
    other_schedule = [{**record, "schedule": "constant"} for record in records[:3]]  # same label, another method
    assert len(summary.seed_summary(records + other_schedule).splitlines()) == 5
    half_missed = [{**_record("mean", 2, 64, 1, curve), "seed": s} for s, curve in enumerate([[0.5], [0.95]])]
    assert summary.seed_summary(half_missed).splitlines()[2].split()[7:11] == [">4", "1", "to", ">4"]


def test_learning_rate_schedules():
    from tf_adasum.eval.config import WARMUP_EPOCHS
    from tf_adasum.eval.runner import learning_rate

    steps = 10  # per epoch
    cosine = learning_rate(RunConfig(combiner="adasum", lr=1e-3, epochs=4), steps)
    assert [round(float(cosine(s)), 9) for s in (0, 20, 40)] == [1e-3, 5e-4, 0.0]
    assert learning_rate(RunConfig(combiner="keras", schedule="constant"), steps) == 1e-3
    # keras-scaled: 4 x 1024 = 4096 = 64 x BASE_BATCH, so sqrt scaling gives 8x, reached after the warm-up
    scaled = learning_rate(RunConfig(combiner="keras-scaled", batch_per_replica=1024, epochs=6), steps)
    warmup = WARMUP_EPOCHS * steps
    assert [round(float(scaled(s)), 9) for s in (0, warmup // 2, warmup, 60)] == [1e-3, 4.5e-3, 8e-3, 0.0]
    constant = learning_rate(RunConfig(combiner="keras-scaled", batch_per_replica=1024, schedule="constant"), steps)
    assert round(float(constant(warmup)), 9) == round(float(constant(1000)), 9) == 8e-3


def test_largest_reached():
    records = [
        _record("adasum", 4, 64, 1, [0.5, 0.95]),
        _record("adasum", 4, 256, 1, [0.5, 0.95]),
        _record("keras", 4, 64, 1, [0.5, 0.95]),
        _record("keras", 4, 256, 1, [0.5, 0.6]),
    ]
    lines = summary.largest_reached(records + [_record("mean", 4, 64, 1, [0.5, 0.6])])
    assert len(lines) == 3
    assert lines[2].endswith("mean K=1: largest effective batch reaching 0.900: none (of 256)")
    seeds = [_record("adasum", 4, 64, 1, [0.95]), {**_record("adasum", 4, 64, 1, [0.5]), "seed": 1}]
    assert summary.largest_reached(seeds)[0].endswith(": none (of 256)")  # every seed must reach it
    assert lines[0].endswith("adasum K=1: largest effective batch reaching 0.900: 1024 (N=4 x 256) (of 256, 1024)")
    assert lines[1].endswith("keras K=1: largest effective batch reaching 0.900: 256 (N=4 x 64) (of 256, 1024)")


def test_lr_and_schedule_reach_every_run_and_its_optimizer():
    """--lr and --schedule set every configuration, of a custom grid or of a
    preset, and the learning rate of the optimizer each run trains with."""
    import keras

    from tf_adasum.eval.runner import optimizer_for

    def learning_rate_at(config, iteration):  # at 10 steps per epoch
        optimizer = optimizer_for(config, steps_per_epoch=10)
        inner = getattr(optimizer, "inner_optimizer", optimizer)  # the Keras baselines are not wrapped
        assert isinstance(inner, keras.optimizers.Adam)
        inner.iterations.assign(iteration)
        return float(optimizer.learning_rate)

    grid = ["--combiners", "adasum", "keras", "--epochs", "4"]
    (default, _) = cli.build_grid(_args(*grid))
    assert (default.lr, default.schedule) == (1e-3, "cosine")
    assert learning_rate_at(default, 20) == pytest.approx(5e-4)  # half-way down the cosine
    (cosine, _) = cli.build_grid(_args(*grid, "--lr", "0.02"))
    assert (cosine.lr, cosine.schedule) == (0.02, "cosine")
    assert [learning_rate_at(cosine, i) for i in (0, 20, 40)] == pytest.approx([0.02, 0.01, 0.0])
    for preset in ([], ["--preset", "paper"]):
        configs = cli.build_grid(_args(*preset, *grid, "--lr", "0.02", "--schedule", "constant"))
        assert {c.combiner for c in configs} == {"adasum", "keras"}
        assert {(c.lr, c.schedule) for c in configs} == {(0.02, "constant")}
        assert [learning_rate_at(c, 35) for c in configs] == pytest.approx([0.02] * len(configs))


def test_custom_grid_skips_keras_with_local_steps():
    configs = cli.build_grid(_args("--combiners", "adasum", "keras", "--local-steps", "1", "4", "--replicas", "2"))
    assert sorted((c.combiner, c.local_steps) for c in configs) == [("adasum", 1), ("adasum", 4), ("keras", 1)]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--replicas", "0"], "Received: replicas=0"),
        (["--target", "0"], r"`target` must be in \(0, 1\]. Received: target=0.0"),
        (["--target", "1.5"], "Received: target=1.5"),
        (["--models", "vgg"], "Received: model='vgg'"),
        (["--datasets", "cifar10"], "Received: dataset='cifar10'"),
        (["--combiners", "median"], "Received: combiner='median'"),
        (["--engine", "mpi", "--combiners", "keras"], "Received: combiner='keras', engine='mpi'"),
        (["--engine", "nccl"], "Received: engine='nccl'"),
        (["--combiners", "keras", "--local-steps", "2"], "grid is empty"),
        (["--engine", "mpi", "--combiners", "keras-scaled"], "Received: combiner='keras-scaled', engine='mpi'"),
        (["--combiners", "keras-scaled", "--local-steps", "2"], "grid is empty"),
        (["--hosts", "2", "--link", "1gbit"], r"Received: hosts=2, engine='local-devices', replicas=4, link='1gbit'"),
        (["--engine", "tf-collective", "--hosts", "5", "--link", "1gbit"], "hosts=5, engine='tf-collective', rep"),
        (["--engine", "tf-collective", "--hosts", "2"], r"replicas=4, link=''"),
        (["--engine", "tf-collective", "--link", "1gbit"], r"`link` needs `hosts`. Received: link='1gbit', hosts=0"),
    ],
)
def test_bad_grid_values(argv, match, capsys):
    assert cli.main(argv) == 2
    assert re.search(match, capsys.readouterr().err)


def test_records_from_before_the_hosts_field_read_as_this_machine():
    """Committed records lack ``hosts`` and ``link``: `--resume` reads them as 0 and ""."""
    import dataclasses

    from tf_adasum.eval import summary
    from tf_adasum.eval.config import RunConfig

    fields = [f.name for f in dataclasses.fields(RunConfig) if f.name not in ("hosts", "link")]
    old = {name: getattr(RunConfig(), name) for name in fields}
    assert summary.config_of(old) == RunConfig()
    assert summary.config_of({**old, "engine": "tf-collective", "hosts": 2, "link": "1gbit"}).hosts == 2


def test_resume_reads_the_published_records_from_before_the_hosts_field(tmp_path):
    from tf_adasum.eval import inputs, summary

    published = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "eval_replicas", "results.jsonl")
    with open(published) as f:
        first = json.loads(f.readline())
    del first["hosts"]  # as the records of 2026-12-05 were written
    (tmp_path / "results.jsonl").write_text(json.dumps(first) + "\n")
    (record,) = inputs.read_results(str(tmp_path / "results.jsonl"))
    assert summary.config_of(record).hosts == 0


# -- a tiny end-to-end run --------------------------------------------------------------------

REQUIRED_FIELDS = {
    "model", "dataset", "combiner", "engine", "replicas", "batch_per_replica", "local_steps", "effective_batch",
    "seed", "lr", "schedule", "target", "accuracy_per_epoch", "epochs_until_convergence", "minutes_per_epoch",
    "final_acc", "best_acc", "score",
}  # fmt: skip


@pytest.mark.slow
def test_tiny_end_to_end_and_resume(tmp_path, capsys):
    argv = [
        "--combiners", "adasum", "keras-scaled", "--replicas", "2", "--batch-per-replica", "16",
        "--epochs", "1",
        "--train-examples", "320", "--test-examples", "200", "--target", "0.5", "--out", str(tmp_path),
    ]  # fmt: skip
    (tmp_path / "results.jsonl").write_text('{"from": "an earlier run"}\n')  # replaced by the first new record
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in open(tmp_path / "results.jsonl", encoding="utf-8")]
    assert [r["combiner"] for r in records] == ["adasum", "keras-scaled"]
    for record in records:
        assert REQUIRED_FIELDS <= set(record)
        assert record["effective_batch"] == 32 and len(record["accuracy_per_epoch"]) == 1
        assert 0.0 <= record["final_acc"] <= 1.0 and record["minutes_per_epoch"] > 0
        expected_epochs = 1 if record["final_acc"] >= 0.5 else -1
        assert record["epochs_until_convergence"] == expected_epochs
        assert (record["score"] is None) == (expected_epochs == -1)
        assert record["command"] == "tf-adasum eval " + " ".join(argv)  # provenance beside date and processor
        in_checkout = os.path.exists(os.path.join(os.path.dirname(__file__), os.pardir, ".git"))
        commit = r"[0-9a-f]{7,}(-dirty)?" if in_checkout else ""
        assert re.fullmatch(commit, record["commit"]) and record["date"] and record["machine"]
        assert record["processor"] == provenance.processor(), record["processor"]
    rows = list(csv.DictReader(open(tmp_path / "results.csv", encoding="utf-8")))
    assert [row["combiner"] for row in rows] == ["adasum", "keras-scaled"]
    assert "eff.batch" in out and "min/epoch" in out
    for name in ("accuracy.png", "scaling.png"):
        assert os.path.getsize(tmp_path / name) > 1000

    assert cli.main([*argv, "--resume"]) == 0
    assert "2 configurations, 2 already done" in capsys.readouterr().out
    again = [json.loads(line) for line in open(tmp_path / "results.jsonl", encoding="utf-8")]
    assert again == records


@pytest.mark.slow
def test_replicas_preset_survives_an_interruption_and_resumes(tmp_path):
    """The replica sweep, cut to N = 2 and one epoch on a few images: killed
    (its whole process group) once its first run is recorded, then resumed:
    every configuration ends up recorded once, the first record unchanged."""
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "tf_adasum.eval", "--preset", "replicas", "--replicas", "2", "--seed", "0",
        "--combiners", "adasum", "keras", "--epochs", "1", "--train-examples", "256", "--test-examples", "200",
        "--out", str(out),
    ]  # fmt: skip
    results = out / "results.jsonl"
    first = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not (results.exists() and results.read_text().count("\n") >= 1):
            assert first.poll() is None, "the sweep ended before it was interrupted"
            assert time.monotonic() < deadline, "no run finished within 240 s"
            time.sleep(0.5)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    (recorded,) = [json.loads(line) for line in results.read_text().splitlines()]
    resumed = subprocess.run([*argv, "--resume"], capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "3 configurations, 1 already done" in resumed.stdout
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert records[0] == recorded
    keys = sorted((r["replicas"], r["combiner"], r["local_steps"]) for r in records)
    assert keys == [(2, "adasum", 1), (2, "adasum", 4), (2, "keras", 1)]
    assert {r["engine"] for r in records} == {"simulated"}
    # Started as `python -m`, which loads TensorFlow first: the records say so, and which kernels ran.
    assert all(r["command"].startswith("python -m tf_adasum.eval --preset replicas ") for r in records), records
    kernels = f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'default')}"
    assert {r["kernels"] for r in records} == {kernels}
    assert "epochs (median)" not in resumed.stdout  # one seed: no summary over seeds
    assert (out / "scaling.png").stat().st_size > 10_000


def test_time_to_accuracy_per_interconnect():
    """benchmarks/time_to_accuracy.py: the cost model's combine per link, and
    scores from the median epochs over seeds and a step timed at N = 1."""
    from multiprocess import TESTS, load_worker

    tta = load_worker(os.path.join(TESTS, os.pardir, "benchmarks", "time_to_accuracy.py"))
    constants = tta.DEFAULT_CONSTANTS
    a, u = constants["a"], constants["u"]
    size = 1e6
    assert tta.combine_seconds("adasum", 1, size, constants, None) == 0.0
    assert tta.combine_seconds("adasum", 4, size, constants, None) == pytest.approx((4 + 3) * a + u * size * 0.75)
    ten_gbe = tta.LINKS["10 GbE"]
    assert tta.combine_seconds("adasum", 4, size, constants, ten_gbe) == pytest.approx(
        7 * a + (u + 2 / ten_gbe) * size * 0.75
    )
    ring = tta.combine_seconds("keras", 8, size, constants, None)
    assert ring == pytest.approx(14 * constants["a_ring"] + constants["u_ring"] * size * 7 / 8)

    recipe = [{**_record("keras", 1, 64, 1, [0.95]), "seed": s, "minutes_per_epoch": 0.25} for s in (0, 1, 2)]
    adasum = [
        {**_record("adasum", 4, 64, 1, curve), "seed": s}
        for s, curve in enumerate([[0.5, 0.5, 0.95], [0.5, 0.5, 0.5, 0.95], [0.5] * 4])
    ]
    local = [{**_record("adasum", 4, 64, 4, [0.5] * 4), "seed": s} for s in (0, 1, 2)]
    rows = tta.scores(recipe + adasum + local, constants)
    row = {(r["link"], r["combiner"], r["local_steps"], r["replicas"]): r for r in rows}
    steps = -(-60_000 // 256)
    t_step = 0.25 * 60 / 938
    combine = tta.combine_seconds("adasum", 4, tta.gradient_bytes("lenet5"), constants, ten_gbe)
    mine = row[("10 GbE", "adasum", 1, 4)]
    assert mine["epochs_to_target"] == 4  # the median of 3, 4 and "not reached"
    assert mine["minutes_per_epoch"] == pytest.approx((steps * t_step + steps * combine) / 60, rel=1e-3)
    assert mine["score"] == pytest.approx(4 * mine["minutes_per_epoch"], rel=1e-3)
    assert row[("10 GbE", "adasum", 4, 4)]["score"] is None
    assert row[("this machine", "adasum", 1, 4)]["score"] < row[("100 GbE", "adasum", 1, 4)]["score"] < mine["score"]
    assert row[("10 GbE", "keras", 1, 1)]["combine_ms"] == 0.0

    gradient = [{**record, "mode": "gradient", "accuracy_per_epoch": [0.95]} for record in adasum]
    (variant,) = [r for r in tta.scores(recipe + adasum + gradient, constants) if r["link"] == "10 GbE"][-1:]
    assert (variant["method"], variant["mode"], variant["seeds"]) == ("adasum gradient", "gradient", 3)
    assert variant["combine_ms"] == mine["combine_ms"]  # the same wire, its own epochs


# -- IDX data -------------------------------------------------------------------------------------


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def _write_idx_folder(folder, rng, train, test):
    """Random images and labels as the four IDX files; returns the arrays."""
    arrays = [
        rng.integers(0, 256, (train, 28, 28)),
        rng.integers(0, 10, train),
        rng.integers(0, 256, (test, 28, 28)),
        rng.integers(0, 10, test),
    ]
    for name, array in zip(data.IDX_FILES, arrays):
        _write_idx(folder / f"{name}.gz", array)
    return arrays


def test_idx_folder_round_trip(tmp_path):
    arrays = _write_idx_folder(tmp_path, np.random.default_rng(0), 5, 3)
    (x_train, y_train), (x_test, y_test) = data.load_idx_dir(str(tmp_path))
    for got, want in zip((x_train, y_train, x_test, y_test), arrays):
        np.testing.assert_array_equal(got, want)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        data.load_idx_dir(str(tmp_path))


def test_fashion_mnist_missing_says_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        data.load_fashion_mnist(str(tmp_path / "nowhere"))


def test_run_config_fields_match_the_record():
    assert {f for f in RunConfig.__dataclass_fields__} <= REQUIRED_FIELDS | {
        "epochs",
        "seed",
        "train_examples",
        "test_examples",
        "hosts",
        "link",
        "mode",
        "inner",
        "lr_rule",
    }
    assert isinstance(cli._parse_args([]), argparse.Namespace)


@pytest.mark.slow
def test_small_resnet_on_idx_data(tmp_path, capsys):
    folder = tmp_path / "fashion"
    folder.mkdir()
    _write_idx_folder(folder, np.random.default_rng(1), 64, 32)
    argv = [
        "--models", "resnet", "--datasets", "fashion_mnist", "--data-dir", str(folder), "--combiners", "adasum",
        "--replicas", "2", "--batch-per-replica", "8", "--epochs", "1", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    (record,) = [json.loads(line) for line in open(tmp_path / "out" / "results.jsonl", encoding="utf-8")]
    assert record["model"] == "resnet" and record["dataset"] == "fashion_mnist"
    assert (record["replicas"], record["batch_per_replica"], record["effective_batch"]) == (2, 8, 16)
    (accuracy,) = record["accuracy_per_epoch"]
    # Measured on the folder's 32 test images (not the 10,000 of Fashion-MNIST): a multiple of 1/32.
    assert accuracy * 32 == pytest.approx(round(accuracy * 32), abs=1e-9)
    assert record["final_acc"] == record["best_acc"] == accuracy


@pytest.mark.slow
def test_timing_models(tmp_path, capsys):
    argv = [
        "--models", "bert", "--combiners", "adasum", "--replicas", "2", "--batch-per-replica", "2",
        "--timing-steps", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    (record,) = [json.loads(line) for line in open(tmp_path / "timing.jsonl", encoding="utf-8")]
    expected = {"model": "bert", "combiner": "adasum", "engine": "local-devices", "replicas": 2, "batch_per_replica": 2}
    assert {k: record[k] for k in expected} == expected
    from tf_adasum.eval.models import build

    assert record["params"] == sum(int(np.prod(w.shape)) for w in build("bert").trainable_weights)
    assert record["seconds_per_step"] > 0 and record["combine_seconds"] > 0
    assert record["command"] == "tf-adasum eval " + " ".join(argv) and record["date"]  # provenance, as every record
    assert record["processor"] == provenance.processor() and "commit" in record
    share = min(record["combine_seconds"] / record["seconds_per_step"], 1.0)
    assert record["communication_share"] == pytest.approx(share)
    out = capsys.readouterr().out
    assert "comm.share" in out and f"{record['params']:,}" in out and f"{share:.1%}" in out
    assert not (tmp_path / "results.jsonl").exists()  # only timing was asked for


# -- inputs are checked before anything is written -------------------------------------------

_EARLIER = '{"kept": true}\n'


def _bad_inputs(tmp_path):
    """(argv, expected message) pairs; each run's --out holds an earlier results.jsonl."""
    out = tmp_path / "out"
    regular_file = tmp_path / "a_file"
    regular_file.write_text("not a folder")
    broken = tmp_path / "broken"
    broken.mkdir()
    _write_idx_folder(broken, np.random.default_rng(0), 4, 4)
    _write_idx(broken / "t10k-labels-idx1-ubyte.gz", np.zeros(3))  # 4 test images, 3 labels
    short = ["--combiners", "adasum", "--replicas", "2", "--epochs", "1"]
    return [
        (
            [*short, "--data-dir", str(tmp_path / "nowhere"), "--out", str(out)],
            r"--data-dir .*nowhere.* is not a folder",
        ),
        ([*short, "--data-dir", str(broken), "--out", str(out)], r"--data-dir .*holds labels of shape \[3\]"),
        ([*short, "--out", str(regular_file)], r"--out must be a folder, but names a file"),
        ([*short, "--out", str(regular_file / "sub")], r"--out is under .*a_file, which is a file"),
        ([*short, "--resume", "--out", str(out)], r"--resume: line 1 of .*results.jsonl is not a result record"),
        (["--models", "bert", "lenet5", "--datasets", "cifar10", "--out", str(out)], r"Received: dataset='cifar10'"),
        (["--models", "bert", "--timing-steps", "0", "--out", str(out)], r"Received: timing_steps=0"),
    ]


def test_inputs_are_checked_before_any_output(tmp_path, capsys):
    for argv, message in _bad_inputs(tmp_path):
        (tmp_path / "out").mkdir(exist_ok=True)
        (tmp_path / "out" / "results.jsonl").write_text(_EARLIER)
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.fullmatch(rf"tf-adasum eval: error: .*{message}.*\n", err), err
        assert os.listdir(tmp_path / "out") == ["results.jsonl"], argv  # nothing written, nothing removed
        assert (tmp_path / "out" / "results.jsonl").read_text() == _EARLIER
        assert (tmp_path / "a_file").read_text() == "not a folder"


# -- pictures --------------------------------------------------------------------------------


def _record(combiner, replicas, batch, local_steps, accuracy, target=0.9):
    reached = next((e for e, a in enumerate(accuracy, start=1) if a >= target), -1)
    return {
        **RunConfig(combiner=combiner, replicas=replicas, batch_per_replica=batch, local_steps=local_steps,
                    target=target, epochs=4).__dict__,
        "effective_batch": replicas * batch * local_steps, "accuracy_per_epoch": accuracy,
        "epochs_until_convergence": reached, "minutes_per_epoch": 0.1, "score": reached * 0.1 if reached > 0 else None,
        "final_acc": accuracy[-1], "best_acc": max(accuracy),
    }  # fmt: skip


def test_plots_of_a_grid(tmp_path):
    """Every series (combiner, K) keeps one colour and marker; K changes the
    line style and fill; runs that missed the target are open markers."""
    records = [
        _record(combiner, replicas, batch, k, [0.5, 0.8, 0.95] if combiner == "adasum" else [0.5, 0.7, 0.8, 0.85])
        for combiner in ("adasum", "mean", "keras")
        for replicas in (2, 4)
        for batch in (32, 128)
        for k in (1, 4)
        if not (combiner == "keras" and k > 1)
    ]
    paths = plots.plot(records, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["accuracy.png", "scaling.png"]
    assert all(os.path.getsize(p) > 10_000 for p in paths)
    style = plots._Style(records)
    looks = {s: (style(s)["color"], style(s)["marker"], style(s)["linestyle"], style(s)["fillstyle"])
             for s in plots._series(records)}  # fmt: skip
    assert len(set(looks.values())) == len(looks) == 5
    assert style(("mean", 1), reached=False)["fillstyle"] == "none"


def test_plots_of_a_replica_sweep(tmp_path):
    """Several N at one batch per replica, three seeds: scaling.png shows epochs
    and best accuracy against N; accuracy.png has one panel per N."""
    curves = ([0.5, 0.95], [0.5, 0.6, 0.92], [0.5, 0.6, 0.7])
    records = [
        {**_record(combiner, n, 64, k, curves[(seed + n) % 3]), "seed": seed}
        for combiner, k in (("adasum", 1), ("adasum", 4), ("keras", 1))
        for n in (1, 2, 4, 8)
        for seed in (0, 1, 2)
    ]
    paths = plots.plot(records, str(tmp_path))
    assert all(os.path.getsize(p) > 10_000 for p in paths)
    assert plots._series(records) == [("adasum", 1), ("adasum", 4), ("keras", 1)]


# -- quiet output ---------------------------------------------------------------------------

#: What TensorFlow and Keras wrote into `tf-adasum eval`'s output before it was quiet.
NOISE = (
    "oneDNN custom operations",
    "cpu_feature_guard",
    "All log messages before absl::InitializeLog()",
    "GeneratorDatasetOp",
    "will be ignored",  # Keras: `shuffle=True` was passed, but will be ignored ...
)


def test_stderr_filter_keeps_everything_else(capfd):
    lines = [
        b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        b"I0000 00:00:1796062053.364874    6223 port.cc:153] oneDNN custom operations are on. You may see ...\n",
        b"I0000 00:00:1796061958.373276    5299 cpu_feature_guard.cc:227] This TensorFlow binary is optimized ...\n",
        b"To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow ...\n",
        b"E0000 00:00:1796063004.854892   30247 ring_alg.cc:291] Aborting RingReduce with UNAVAILABLE\n",
        b"Traceback (most recent call last):\n",
        b"W1130 18:02:11.123456   42 dataset.cc:997] Input of GeneratorDatasetOp::Dataset will not be optimized\n",
    ]
    with quiet.stderr_filtered():
        for line in lines:
            os.write(2, line)
    assert capfd.readouterr().err == lines[4].decode() + lines[5].decode()


def _tf_adasum(*argv, **env):
    """`tf-adasum` as a user starts it: without the test session's TF_CPP_MIN_LOG_LEVEL
    (nor a TF_ENABLE_ONEDNN_OPTS of the machine's)."""
    script = os.path.join(os.path.dirname(sys.executable), "tf-adasum")
    environment = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS")}
    return subprocess.Popen(
        [sys.executable, script, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**environment, **env},
    )  # fmt: skip


def test_help_and_argument_errors_load_no_tensorflow():
    for argv, code in ((["--help"], 0), (["eval", "--help"], 0), (["eval", "--replicas", "0"], 2)):
        process = _tf_adasum(*argv, PYTHONPROFILEIMPORTTIME="1")
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == code, stderr
        assert "usage: tf-adasum" in stdout if code == 0 else "Received: replicas=0" in stderr
        imported = {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}
        assert imported and not imported & {"tensorflow", "keras"}, argv


@pytest.mark.slow
def test_default_output_is_quiet_and_verbose_keeps_the_logs(tmp_path):
    """A tiny `tf-adasum eval`: progress, table and paths only, unless --verbose.
    The command sets TF_ENABLE_ONEDNN_OPTS=1 (the evaluation's kernels), which
    makes TensorFlow print its oneDNN line on any CPU."""
    folder = tmp_path / "data"
    folder.mkdir()
    _write_idx_folder(folder, np.random.default_rng(2), 64, 32)
    argv = ["eval", "--combiners", "adasum", "--replicas", "2", "--batch-per-replica", "16", "--epochs", "1",
            "--data-dir", str(folder)]  # fmt: skip
    runs = {  # both at once
        verbose: _tf_adasum(*argv, "--out", str(tmp_path / f"out{int(verbose)}"), *["--verbose"] * verbose)
        for verbose in (False, True)
    }
    outputs = {verbose: "".join(process.communicate(timeout=300)) for verbose, process in runs.items()}
    for verbose, process in runs.items():
        assert process.returncode == 0, outputs[verbose]
    quiet_output = outputs[False]
    assert "epoch 1/1 acc" in quiet_output and "eff.batch" in quiet_output and "wrote " in quiet_output
    assert [noise for noise in NOISE if noise in quiet_output] == [], quiet_output
    assert all(noise in outputs[True] for noise in NOISE[:1] + NOISE[2:4]), outputs[True]
    records = [json.loads(line) for line in (tmp_path / "out0" / "results.jsonl").read_text().splitlines()]
    assert [r["kernels"] for r in records] == ["TF_ENABLE_ONEDNN_OPTS=1"]


@pytest.mark.parametrize(
    "records, pages",
    [
        ("docs/eval_replicas/results.jsonl", ["README.md", "docs/guide/evaluation.md"]),
        ("docs/eval_edge/results.jsonl", ["docs/guide/evaluation.md"]),
    ],
)
def test_replica_tables_are_their_records(records, pages):
    """The published replica tables are `summary.replica_table` of their
    committed records, cell for cell."""
    root = os.path.join(os.path.dirname(__file__), os.pardir)
    with open(os.path.join(root, records), encoding="utf-8") as f:
        table = summary.replica_table([json.loads(line) for line in f if line.strip()])
    for page in pages:
        with open(os.path.join(root, page), encoding="utf-8") as f:
            assert table in f.read(), f"{page} does not show the table of {records}:\n{table}"


def test_replica_table_cells():
    runs = [
        {**_outcome("adasum", 4, seed, reached), "accuracy_per_epoch": curve, "best_acc": max(curve)}
        for seed, (reached, curve) in enumerate([(True, [0.5, 0.95]), (True, [0.95]), (False, [0.5, 0.8])])
    ]
    for run in runs:
        run["epochs_until_convergence"] = metrics.epochs_until_convergence(run["accuracy_per_epoch"], 0.9)
    rows = summary.replica_table(runs + [{**runs[2], "replicas": 8, "seed": s} for s in (0, 1)]).splitlines()
    assert rows[0] == "| method | N=4 | 8 | largest N, every seed |"
    assert rows[2] == "| adasum | **2** (1 to >4) | >4, 80.00% | none |"
    assert summary.replica_table(runs[:2]).splitlines()[2] == "| adasum | **2** (1 to 2) | 4 (256) |"
