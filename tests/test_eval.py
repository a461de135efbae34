"""The scaling evaluation: metrics, grid validation, outputs, --resume, IDX data."""

import argparse
import csv
import gzip
import json
import os
import re

import numpy as np
import pytest

from tf_adasum.eval import cli, data, metrics
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


def test_quick_preset_compares_at_one_effective_batch():
    configs = cli.build_grid(_args())
    assert [(c.combiner, c.local_steps) for c in configs] == [
        ("adasum", 1),
        ("mean", 1),
        ("keras", 1),
        ("adasum", 4),
        ("adacons", 1),
    ]
    assert {c.effective_batch for c in configs} == {1024}
    assert len({(c.lr, c.target, c.epochs) for c in configs}) == 1  # same base settings for every combiner


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
    ],
)
def test_bad_grid_values(argv, match, capsys):
    assert cli.main(argv) == 2
    assert re.search(match, capsys.readouterr().err)


# -- a tiny end-to-end run --------------------------------------------------------------------

REQUIRED_FIELDS = {
    "model", "dataset", "combiner", "engine", "replicas", "batch_per_replica", "local_steps", "effective_batch",
    "lr", "target", "accuracy_per_epoch", "epochs_until_convergence", "minutes_per_epoch", "final_acc", "best_acc",
    "score",
}  # fmt: skip


def test_tiny_end_to_end_and_resume(tmp_path, capsys):
    argv = [
        "--combiners", "adasum", "keras", "--replicas", "2", "--batch-per-replica", "16", "--epochs", "1",
        "--train-examples", "320", "--test-examples", "200", "--target", "0.5", "--out", str(tmp_path),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in open(tmp_path / "results.jsonl", encoding="utf-8")]
    assert [r["combiner"] for r in records] == ["adasum", "keras"]
    for record in records:
        assert REQUIRED_FIELDS <= set(record)
        assert record["effective_batch"] == 32 and len(record["accuracy_per_epoch"]) == 1
        assert 0.0 <= record["final_acc"] <= 1.0 and record["minutes_per_epoch"] > 0
        expected_epochs = 1 if record["final_acc"] >= 0.5 else -1
        assert record["epochs_until_convergence"] == expected_epochs
        assert (record["score"] is None) == (expected_epochs == -1)
    rows = list(csv.DictReader(open(tmp_path / "results.csv", encoding="utf-8")))
    assert [row["combiner"] for row in rows] == ["adasum", "keras"]
    assert "eff.batch" in out and "min/epoch" in out
    for name in ("accuracy.png", "scaling.png"):
        assert os.path.getsize(tmp_path / name) > 1000

    assert cli.main([*argv, "--resume"]) == 0
    assert "2 configurations, 2 already done" in capsys.readouterr().out
    again = [json.loads(line) for line in open(tmp_path / "results.jsonl", encoding="utf-8")]
    assert again == records


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
    }
    assert isinstance(cli._parse_args([]), argparse.Namespace)


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


def test_timing_models(tmp_path, capsys):
    argv = [
        "--models", "bert", "--combiners", "keras", "adasum", "--replicas", "2", "--batch-per-replica", "2",
        "--timing-steps", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in open(tmp_path / "timing.jsonl", encoding="utf-8")]
    assert [r["combiner"] for r in records] == ["keras", "adasum"]
    for record in records:
        assert record["seconds_per_step"] > 0 and 0 < record["communication_share"] <= 1
        assert record["params"] > 1_000_000
    assert "comm.share" in capsys.readouterr().out
    assert not (tmp_path / "results.jsonl").exists()  # only timing was asked for
