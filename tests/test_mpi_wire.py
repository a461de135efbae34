"""The MPI wire under a real `mpirun` (two ranks, `tests/workers/mpi_wire_worker.py`):
ranks that disagree on sizes get a clear error and no corrupted memory, every
rank takes the same path, and the user helpers `tf_adasum.mpi.broadcast_variables`
and `check_same_variables` do what they say; and, in this process, the
helpers' argument checks."""

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import TOLERANCE, relative_error
from multiprocess import TESTS, build_native_mpi_ops, load_worker, worker_env

import tf_adasum.mpi
from tf_adasum import reference
from tf_adasum.launcher.mpirun import mpirun_command

WORKER = os.path.join(TESTS, "workers", "mpi_wire_worker.py")
worker = load_worker(WORKER)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One launch of two ranks for every test below (they read its reports)."""
    built = build_native_mpi_ops()
    out = tmp_path_factory.mktemp("wire")
    try:
        command = mpirun_command(2)
    except FileNotFoundError as error:
        pytest.fail(str(error))
    # A short MPI deadline: a rank left waiting (the bugs these tests guard against) fails the launch quickly.
    env = worker_env(TF_ADASUM_MPI_TIMEOUT="60")
    result = subprocess.run(
        command + [sys.executable, WORKER, str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    loaded = []
    for rank in range(2):
        with open(out / f"wire_rank{rank}.json", encoding="utf-8") as f:
            loaded.append(json.load(f))
    with open(out / "build.log", "w", encoding="utf-8") as f:  # the native library's, for the last test
        f.write((pathlib.Path(built.strip().splitlines()[-1]).parent / "build.log").read_text())
    return out, loaded


@pytest.mark.mpi
def test_native_tree_with_mismatched_sizes_is_an_error_on_every_rank(reports):
    _, per_rank = reports
    messages = []
    for rank, report in enumerate(per_rank):
        sizes, dtypes, after = (report["native_mismatch"][k] for k in ("sizes", "dtypes", "after"))
        assert sizes["raised"] and sizes["type"] == "InvalidArgumentError", (rank, sizes)
        assert "rank 0 has 100000 float32 elements" in sizes["message"], sizes
        assert "rank 1 has 60000 float32 elements" in sizes["message"], sizes
        assert "no data was sent" in sizes["message"], sizes
        assert sizes["seconds"] < worker.TIMEOUT_SECONDS, sizes  # at once, not at a deadline
        assert dtypes["raised"] and "rank 1 has 1000 float64 elements" in dtypes["message"], (rank, dtypes)
        # A disagreement sends nothing, so the communicator stays usable.
        assert not after["raised"] and after["value"] is True, (rank, after)
        messages.append(sizes["message"].split("tf_adasum MPI engine:")[1])
        # The sum and gather ops agree on their size first, too.
        summed, gathered = report["native_mismatch"]["sum"], report["native_mismatch"]["gather"]
        assert summed["raised"] and summed["type"] == "InvalidArgumentError", (rank, summed)
        assert "disagree on the tensor of this sum" in summed["message"], summed
        assert "they have 3 to 5 elements" in summed["message"], summed
        assert gathered["raised"] and "they have 8 to 12 bytes" in gathered["message"], (rank, gathered)
        assert report["native_mismatch"]["sum_after"]["value"] == [2.0, 2.0, 2.0], report["native_mismatch"]
    assert messages[0] == messages[1]  # the same error on every rank


@pytest.mark.mpi
def test_mpi4py_path_with_mismatched_sizes_is_an_error_on_every_rank(reports):
    _, per_rank = reports
    for rank, report in enumerate(per_rank):
        sizes, after = report["python_mismatch"]["sizes"], report["python_mismatch"]["after"]
        assert sizes["raised"] and "InvalidArgumentError" in sizes["type"] + sizes["message"], (rank, sizes)
        message = sizes["message"]
        assert "rank 0 has 100000 float32 elements" in message and "rank 1 has 60000 float32" in message, message
        assert "disagree on the tensors of this tree call, so no data was sent" in message, message
        assert not after["raised"], (rank, after)
        # The agreeing swap after it (rows [0..3], [4..7] plus 10 * rank): the lower rank keeps its first
        # row and takes the other's first, the upper one takes the other's second; nothing stale.
        want = [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]] if rank == 0 else [[4.0, 5.0, 6.0], [14.0, 15.0, 16.0]]
        assert after["value"] == want, (rank, after)
    # Past the agreement: the receive's size is checked, and the failure is latched on that communicator.
    short, retry = per_rank[1]["python_mismatch"]["short"], per_rank[1]["python_mismatch"]["retry"]
    assert short["raised"] and short["type"] == "InvalidArgumentError", short
    assert "a message of 1000 bytes where 2000 were expected" in short["message"], short
    assert retry["raised"] and retry["type"] == "FailedPreconditionError", retry
    assert "stays failed" in retry["message"] and "1000 bytes where 2000" in retry["message"], retry
    assert not per_rank[0]["python_mismatch"]["short"]["raised"], per_rank[0]["python_mismatch"]


@pytest.mark.mpi
def test_mpi4py_path_where_only_the_last_of_three_ranks_differs_fails_every_rank_at_once(tmp_path):
    """One agreement over the whole communicator, not one per pair: ranks 0
    and 1 (whose pair agrees) raise as soon as rank 2 does, with its message."""
    try:
        command = mpirun_command(3)
    except FileNotFoundError as error:
        pytest.fail(str(error))
    result = subprocess.run(
        command + [sys.executable, WORKER, str(tmp_path), "last_differs"],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    messages = set()
    for rank in range(3):
        with open(tmp_path / f"last_rank{rank}.json", encoding="utf-8") as f:
            report = json.load(f)
        sizes, after = report["sizes"], report["after"]
        assert sizes["raised"] and "InvalidArgumentError" in sizes["type"] + sizes["message"], (rank, sizes)
        assert sizes["seconds"] < worker.LAST_TIMEOUT_SECONDS / 3, (rank, sizes)  # at once, not at the deadline
        found = re.search(r"tf_adasum MPI engine: the ranks disagree .*? in the same order\.", sizes["message"])
        assert found, sizes["message"]
        assert "rank 0 has 1024 float32 elements" in found[0] and "; rank 2 has 512 float32 elements" in found[0]
        messages.add(found[0])
        assert not after["raised"] and after["value"] is True, (rank, after)  # the communicator stays usable
    assert len(messages) == 1, messages  # the same error on every rank


@pytest.mark.mpi
def test_a_rank_without_the_native_ops_takes_every_rank_to_the_python_path(reports):
    out, per_rank = reports
    for rank, report in enumerate(per_rank):
        path = report["path"]
        assert path["native"] is False, (rank, path)
        assert len(path["warnings"]) == 1, (rank, path)
        assert "unavailable on rank 1 (TF_ADASUM_MPI_NATIVE=0)" in path["warnings"][0], path
        assert "rank 0" not in path["warnings"][0], path
    results = [np.load(out / f"path_rank{r}.npz") for r in range(2)]
    expected = reference.adasum_tree([[x.astype(np.float64) for x in worker.path_inputs(r)] for r in range(2)])
    for i, want in enumerate(expected):
        got = results[0][f"engine_{i}"]
        assert relative_error(got, want) < TOLERANCE["float32"], i
        for r in range(2):  # the same results as the Python path, bitwise, on every rank
            assert results[r][f"engine_{i}"].tobytes() == got.tobytes(), (i, r)
            assert results[r][f"python_{i}"].tobytes() == got.tobytes(), (i, r)


@pytest.mark.mpi
def test_broadcast_variables_and_check_same_variables_under_mpirun(reports):
    _, per_rank = reports
    rank1_initial = per_rank[1]["helpers"]["initial"]
    assert per_rank[0]["helpers"]["initial"] != rank1_initial  # so the broadcast has something to do
    for rank, report in enumerate(per_rank):
        helpers = report["helpers"]
        assert not helpers["check_same"]["raised"] and not helpers["broadcast"]["raised"], (rank, helpers)
        assert helpers["after"] == rank1_initial, (rank, helpers["after"])  # root_rank=1's values everywhere
        differing = helpers["check_differing"]
        assert differing["raised"] and differing["type"] == "ValueError", (rank, differing)
        assert "test variables differ across MPI ranks" in differing["message"], differing
        assert "rank 0 has 2, rank 1 has 3" in differing["message"], differing
        # Bad arguments are refused on every rank before any MPI call.
        assert (
            helpers["bad_sum"]["type"] == "TypeError"
            and "Received: values=<tf.Tensor" in (helpers["bad_sum"]["message"])
        ), helpers["bad_sum"]
        assert helpers["bad_root"]["type"] == "TypeError", helpers["bad_root"]


@pytest.mark.mpi
def test_the_native_mpi_library_compiled_without_warnings(reports):
    out, _ = reports
    command, output = (out / "build.log").read_text().split("\n", 1)
    assert "-Wall" in command and " -w " not in command, command
    assert "warning" not in output, output[-3000:]


# -- in this process: no MPI launcher --------------------------------------------------


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: tf_adasum.mpi.allreduce_sum(tf.ones([3])), TypeError, r"`values` must be a dict .*values=<tf.Tensor"),
        (lambda: tf_adasum.mpi.allreduce_sum([1.0, 2.0]), TypeError, r"Received: values=\[1.0, 2.0\]"),
        (lambda: tf_adasum.mpi.allreduce_mean({"loss": np.ones(2)}), ValueError, r"`values\['loss'\]` must be a"),
        (lambda: tf_adasum.mpi.allreduce_sum({"loss": "low"}), TypeError, r"values\['loss'\]='low'"),
        (lambda: tf_adasum.mpi.allreduce_sum({1: 2.0}), TypeError, "keys of `values` must be strings"),
        (lambda: tf_adasum.mpi.check_same_variables(tf.Variable(1.0)), TypeError, "`variables` must be a list"),
        (lambda: tf_adasum.mpi.check_same_variables([1.0]), TypeError, r"`variables\[0\]` must be a variable"),
        (lambda: tf_adasum.mpi.check_same_variables([], what=3), TypeError, "Received: what=3"),
        (lambda: tf_adasum.mpi.broadcast_variables([], root_rank=0.0), TypeError, "Received: root_rank=0.0"),
        (lambda: tf_adasum.mpi.broadcast_variables([], root_rank=1), ValueError, r"in \[0, 1\). Received: root_rank=1"),
        (lambda: tf_adasum.mpi.check_same_keys("loss"), TypeError, "Received: names='loss'"),
    ],
)
def test_helpers_name_the_bad_argument(call, error, match, monkeypatch):
    monkeypatch.setattr(tf_adasum.mpi.select, "launched_by_mpi", lambda: False)
    with pytest.raises(error, match=match):
        call()


def test_helpers_take_what_they_document_without_a_launcher(monkeypatch):
    monkeypatch.setattr(tf_adasum.mpi.select, "launched_by_mpi", lambda: False)
    assert tf_adasum.mpi.allreduce_sum({"loss": np.float32(0.5), "n": 3, "ok": True}) == {
        "loss": 0.5,
        "n": 3.0,
        "ok": 1.0,
    }
    assert tf_adasum.mpi.allreduce_mean({"loss": tf.constant(2.0)}) == {"loss": 2.0}
    variables = [tf.Variable([1.0, 2.0])]
    tf_adasum.mpi.check_same_variables(variables)
    tf_adasum.mpi.broadcast_variables(variables, root_rank=0)
    assert variables[0].numpy().tolist() == [1.0, 2.0]
