"""Checks shared by the multi-process tests (MultiWorkerMirroredStrategy and
MPI): they read what `tests/workers/distributed_worker.py` wrote and compare it
with `tf_adasum.reference` and the numpy simulation."""

import json
import os
import subprocess
import sys

import committed
import numpy as np
import pytest
import tensorflow as tf
from conftest import TOLERANCE, relative_error
from diagnostics_oracle import assert_statistics_equal, expected_statistics
from simulation import BATCH, SGD, _grads, simulate
from simulation import data as simulation_data

from tf_adasum import reference

TESTS = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(TESTS, "workers", "distributed_worker.py")


def load_worker(path: str):
    """A script (a worker, a benchmark) as a module, for its constants and functions."""
    return committed.load_script(path)


worker = load_worker(WORKER)


def _emulated_hosts_refusal() -> str | None:
    """Why this system cannot make `tf-adasum launch --hosts` hosts, or None when it can."""
    from tf_adasum.launcher import children

    try:
        fds, _ = children.emulated_hosts(1, "1gbit")
    except OSError as error:  # NetworkIsolationError, or a descriptor the system would not open
        return str(error)
    for fd in fds:
        os.close(fd)
    return None


EMULATED_HOSTS_REFUSAL = _emulated_hosts_refusal()
#: For tests on emulated hosts: skipped, with the reason, where namespaces cannot be made.
needs_emulated_hosts = pytest.mark.skipif(
    EMULATED_HOSTS_REFUSAL is not None, reason=f"no emulated hosts here: {EMULATED_HOSTS_REFUSAL}"
)


def build_native_mpi_ops() -> str:
    """Builds the native MPI ops once, in a process of its own, into the shared
    cache (or finds them there), so that the ranks only load them; returns what
    the build printed."""
    result = subprocess.run(
        [sys.executable, "-m", "tf_adasum.engines.mpi_native", "--build"],
        env=worker_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


#: The tasks of distributed_worker.py that one launch of 2 processes runs for
#: several tests, and its environment, per launcher: every launch pays
#: TensorFlow's start-up on each process, so the tests that read 2 processes'
#: reports share one (`shared_launch`). Each task writes files of its own;
#: ``mismatch``, whose error every process reports, comes last.
SHARED_LAUNCHES = {
    "mpirun": ("collective,train,diagnostics,weight_decay,processes,mismatch", {}),
    # test_multiworker's port test reads the collective's listener: TF's port plus this offset.
    "tf-adasum launch": ("collective,weight_decay,processes,mismatch", {"TF_ADASUM_WORKER_PORT_OFFSET": "1000"}),
}


def process_command(launcher: str, n: int) -> list[str]:
    """The command that starts `n` distributed workers under `launcher`
    ("tf-adasum launch" or "mpirun"), less the task and folder."""
    if launcher == "tf-adasum launch":
        return [sys.executable, "-m", "tf_adasum.launch", "-n", str(n), WORKER]
    from tf_adasum.launcher.mpirun import mpirun_command

    try:
        return mpirun_command(n) + [sys.executable, WORKER]
    except FileNotFoundError as error:
        pytest.fail(str(error))


def shared_launch(launcher: str, out) -> None:
    """Runs `SHARED_LAUNCHES[launcher]` on 2 processes, writing into `out`
    (the session's fixture `two_processes` calls it once per launcher)."""
    tasks, env = SHARED_LAUNCHES[launcher]
    command = process_command(launcher, 2) + [tasks, str(out)]
    result = subprocess.run(command, env=worker_env(**env), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def worker_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow", **extra)
    return env


#: Relative error against the reference of float32/float64 values sent in a
#: compressed format (a rounding per tree level, see `tf_adasum.comm.compression`).
COMPRESSED_TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2}


def check_collective(out: str, n: int, compression: str | None = None) -> None:
    """Every rank's result equals `adasum_tree` of the inputs rounded to their
    dtype (within `COMPRESSED_TOLERANCE` for float32/float64 sent in the
    `compression` format), and all ranks hold bitwise identical results."""
    dtypes = worker.tensor_dtypes()
    per_rank = [
        [np.asarray(tf.cast(tf.cast(x, dtype), tf.float64)) for x, dtype in zip(worker.collective_inputs(r), dtypes)]
        for r in range(n)
    ]
    expected = reference.adasum_tree(per_rank)
    results = [np.load(os.path.join(out, f"collective_rank{r}.npz")) for r in range(n)]
    for i, (dtype, want) in enumerate(zip(dtypes, expected)):
        got = results[0][f"value{i}"]
        tolerance = TOLERANCE[dtype]
        if compression and dtype in ("float32", "float64"):
            tolerance = COMPRESSED_TOLERANCE[compression]
        assert relative_error(got, want) < tolerance, (i, dtype, relative_error(got, want))
        for r in range(1, n):
            assert results[r][f"bits{i}"].tobytes() == results[0][f"bits{i}"].tobytes(), (i, dtype, r)


def transport_threads(out: str, n: int) -> list[list[str]]:
    """Per rank, the names of the socket transport's threads after the
    collective task (none where TF collective ops or MPI carried it)."""
    return [list(np.load(os.path.join(out, f"collective_rank{r}.npz"))["transport_threads"]) for r in range(n)]


def check_over_sockets(out: str, n: int) -> None:
    """The collective task crossed processes over the socket transport: a
    listener on every rank and a reader for each peer it talks to."""
    for rank, names in enumerate(transport_threads(out, n)):
        assert "tf_adasum listener" in names, (rank, names)
        assert any(name.startswith("tf_adasum reader") for name in names), (rank, names)


def check_train(out: str, n: int, hierarchical_combine) -> None:
    """Final weights equal the numpy simulation started from rank 0's initial
    weights, on every rank (bitwise identical across ranks); every rank reports
    the epoch's loss as the mean of each rank's own (`_epoch_loss`)."""
    x, y = simulation_data(worker.TRAIN_STEPS)
    results = [np.load(os.path.join(out, f"train_rank{r}.npz")) for r in range(n)]
    adacons = lambda per_rank: reference.adacons(per_rank, restore_magnitude=True)[0]  # noqa: E731 (delta mode)
    combines = (("plain", reference.adasum_tree), ("hierarchical", hierarchical_combine), ("adacons", adacons))
    for name, combine in combines:
        initial = [results[0][f"{name}_initial_kernel"], results[0][f"{name}_initial_bias"]]
        expected = simulate(initial, x, y, n, worker.TRAIN_STEPS, SGD(), combine)
        for r, result in enumerate(results):
            for key, want in zip(("kernel", "bias"), expected):
                np.testing.assert_allclose(result[f"{name}_{key}"], want, rtol=1e-5, atol=1e-6, err_msg=f"{name} {r}")
                assert result[f"{name}_{key}"].tobytes() == results[0][f"{name}_{key}"].tobytes()
            assert int(result[f"{name}_iterations"]) == worker.TRAIN_STEPS
            assert float(result[f"{name}_loss"]) == float(results[0][f"{name}_loss"])
        want_loss = _epoch_loss(initial, x, y, n, combine)
        np.testing.assert_allclose(float(results[0][f"{name}_loss"]), want_loss, rtol=1e-5, err_msg=name)


def _epoch_loss(initial, x, y, n: int, combine) -> float:
    """The mean over ranks of each rank's own epoch loss: the mean over steps of
    the MSE on its shard at the weights before the step (the simulation's)."""
    b = BATCH // n
    per_step = []
    for step in range(worker.TRAIN_STEPS):
        kernel, bias = simulate(initial, x, y, n, step, SGD(), combine)
        rows = slice(step * BATCH, (step + 1) * BATCH)
        error = x[rows].astype(np.float64) @ kernel + bias - y[rows]
        per_step.append((error**2).reshape(n, b, -1).mean(axis=(1, 2)))  # one loss per rank
    return float(np.mean(per_step))


def check_diagnostics(out: str, n: int) -> None:
    """Every rank's diagnostics of the first step equal numpy's on the replicas'
    deltas (SGD 0.1 from rank 0's initial weights, each rank on its shard)."""
    reports = read_reports(out, "diagnostics", n)
    x, y = simulation_data(1)
    initial = [np.asarray(w, np.float64) for w in reports[0]["initial"]]
    b = BATCH // n
    grads = [_grads(initial, x[r * b : (r + 1) * b].astype(np.float64), y[r * b : (r + 1) * b]) for r in range(n)]
    for rank, report in enumerate(reports):
        assert report["step"] == 0
        for t, path in enumerate(report["paths"]):
            expected = expected_statistics([-0.1 * g[t] for g in grads])
            assert_statistics_equal(report["record"][path], expected, f"rank {rank} {path}")


def read_reports(out: str, task: str, n: int) -> list[dict]:
    reports = []
    for r in range(n):
        path = os.path.join(out, f"{task}_rank{r}.json")
        assert os.path.exists(path), f"rank {r} wrote no report for {task}"
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    return reports


def check_evaluation_engine(engine: str, combiners: list[str], out) -> None:
    """A tiny `tf-adasum eval` run on `engine` (2 processes, 2 epochs): one
    complete record per combiner, and LeNet-5 well above chance."""
    from tf_adasum.eval import cli

    argv = [
        "--engine", engine, "--combiners", *combiners, "--replicas", "2", "--batch-per-replica", "16",
        "--epochs", "2", "--train-examples", "320", "--test-examples", "200", "--target", "0.99", "--no-stop",
        "--out", str(out),
    ]  # fmt: skip
    others = set(_running_evaluation_processes())  # another evaluation on this machine is not this run's
    assert cli.main(argv) == 0
    records = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"), encoding="utf-8")]
    assert [r["combiner"] for r in records] == combiners
    for record in records:
        assert record["engine"] == engine and record["replicas"] == 2 and record["effective_batch"] == 32
        assert len(record["accuracy_per_epoch"]) == 2 and len(record["seconds_per_epoch"]) == 2
        assert all(0.0 <= a <= 1.0 for a in record["accuracy_per_epoch"])
        assert record["accuracy_per_epoch"][-1] > 0.3  # 20 steps of LeNet-5 on MNIST: well above chance
    left = set(_running_evaluation_processes()) - others
    assert not left, f"the evaluation run left processes behind: {sorted(left)}"


def _running_evaluation_processes() -> list[str]:
    """The pids of processes running `tf_adasum/eval/processes.py` (Linux /proc)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"tf_adasum/eval/processes.py" in f.read():
                    pids.append(pid)
        except OSError:  # it ended meanwhile
            pass
    return pids
