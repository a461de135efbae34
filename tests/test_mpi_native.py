"""The native MPI ops (`tf_adasum.engines.mpi_native`) under a real `mpirun`,
against `tf_adasum.reference`, numpy and the Python path of the MPI engine;
and, in this process, their fallback and argument checks."""

import itertools
import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import tensorflow as tf
from conftest import TOLERANCE, relative_error
from multiprocess import TESTS, build_native_mpi_ops, load_worker, worker_env

from tf_adasum import reference
from tf_adasum.engines import mpi_native
from tf_adasum.launcher.mpirun import mpirun_command

WORKER = os.path.join(TESTS, "workers", "mpi_native_worker.py")


worker = load_worker(WORKER)


@pytest.fixture(scope="module")
def built_library():
    """Builds the library once here (the shared cache), so ranks only load it."""
    start = time.monotonic()
    built = build_native_mpi_ops()
    print(f"native MPI ops built or found in {time.monotonic() - start:.1f} s: {built.strip()}")


def _mpirun(n: int, *args: str) -> None:
    try:
        command = mpirun_command(n)
    except FileNotFoundError as error:
        pytest.fail(str(error))
    command += [sys.executable, WORKER, *args]
    result = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


def _rounded(dtype: str, rank: int) -> list[np.ndarray]:
    return [np.asarray(tf.cast(tf.cast(x, dtype), tf.float64)) for x in worker.tree_inputs(rank)]


def _rounded_tree(per_rank: list[list[np.ndarray]], dtype: str, pair) -> list[np.ndarray]:
    """The tree in numpy with every level's result rounded to `dtype`, as the
    collectives do (DESIGN.md section 1)."""
    np_dtype = tf.as_dtype(dtype).as_numpy_dtype
    per_tensor = [[rank[t].astype(np_dtype) for rank in per_rank] for t in range(len(per_rank[0]))]
    return [reference.tree_reduce(values, pair).astype(np.float64) for values in per_tensor]


def _close_partials(native: np.ndarray, python: np.ndarray) -> bool:
    """Equal to 1e-12 relative to each [a.b, |a|^2, |b|^2] triple's largest entry."""
    scale = np.max(np.abs(python), axis=-1, keepdims=True)
    return native.shape == python.shape and bool(np.all(np.abs(native - python) <= 1e-12 * scale))


def _check_tree(out, k: int) -> None:
    results = [np.load(os.path.join(out, f"tree_k{k}_rank{r}.npz")) for r in range(k)]
    for dtype in worker.DTYPES:
        per_rank = [_rounded(dtype, r) for r in range(k)]
        expected = {"adasum": reference.adasum_tree(per_rank), "sum": reference.sum_(per_rank)}
        rounded = {
            "adasum": _rounded_tree(per_rank, dtype, reference.adasum_pair),
            "sum": _rounded_tree(per_rank, dtype, lambda a, b: a + b),
        }
        for rule in worker.RULES:
            for i, want in enumerate(expected[rule]):
                got, python = results[0][f"{dtype}_{rule}_{i}"], results[0][f"{dtype}_{rule}_{i}_python"]
                where = (k, dtype, rule, i)
                assert got.shape == want.shape, where
                # 16-bit values rounded at each level drift from the float64 tree where a
                # small tensor cancels; the rounded tree bounds them all, the float64 one the large.
                if dtype in ("float32", "float64") or want.size >= 1000:
                    assert relative_error(got, want) < TOLERANCE[dtype], (where, relative_error(got, want))
                assert relative_error(got, rounded[rule][i]) < TOLERANCE[dtype], where
                assert relative_error(got, python) < TOLERANCE[dtype], (where, relative_error(got, python))
                if rule == "sum" or k < 2:  # the same additions in the same order
                    assert got.tobytes() == python.tobytes(), where
                for r in range(1, k):
                    assert results[r][f"{dtype}_{rule}_{i}"].tobytes() == got.tobytes(), (where, r)
            if rule == "adasum":  # exact: Adasum(a, a) == a; Adasum(0, b) == b == Adasum(b, 0)
                same = results[0][f"{dtype}_adasum_{worker.SAME_ON_ALL_RANKS}"]
                assert same.tobytes() == per_rank[0][worker.SAME_ON_ALL_RANKS].tobytes(), dtype
                if k in (2, 3):
                    zero = results[0][f"{dtype}_adasum_{worker.ZERO_ON_EVEN_RANKS}"]
                    assert zero.tobytes() == per_rank[1][worker.ZERO_ON_EVEN_RANKS].tobytes(), dtype
            _, folded = reference.tree_shape(k)
            for r in range(k):
                native, python = results[r][f"{dtype}_{rule}_partials"], results[r][f"{dtype}_{rule}_partials_python"]
                assert _close_partials(native, python), (k, dtype, rule, r, native, python)
                computes = rule == "adasum" and k > 1 and not (r < 2 * folded and r % 2)
                assert np.any(native) == computes, (k, dtype, rule, r)
    for i in range(len(worker.SHAPES)):
        assert results[0][f"graph_{i}"].tobytes() == results[0][f"float32_adasum_{i}"].tobytes(), i
    # Pipelined levels (messages summed in their order, whatever the arrival): the same bits every call,
    # in place or not, on every rank.
    big = reference.adasum_tree([worker.big_inputs(r) for r in range(k)])
    for i, want in enumerate(big):
        got = results[0][f"big_first_{i}"]
        assert relative_error(got, want) < TOLERANCE["float32"], (k, i, relative_error(got, want))
        for r, name in itertools.product(range(k), ("first", "again", "graph")):
            assert results[r][f"big_{name}_{i}"].tobytes() == got.tobytes(), (k, i, r, name)


def _check_collectives(out, k: int) -> None:
    results = [np.load(os.path.join(out, f"tree_k{k}_rank{r}.npz")) for r in range(k)]
    for j, (dtype, shape) in enumerate(worker.SUM_CASES):
        inputs = np.array([worker.sum_input(r, dtype, shape) for r in range(k)], np.float64)
        # MPI's summation order is its own: rounding errors of k additions in `dtype`.
        bound = k * np.finfo(dtype).eps * np.sum(np.abs(inputs), axis=0)
        for r in range(k):
            got = results[r][f"sum_{j}"]
            assert got.dtype == dtype and got.shape == shape, (dtype, shape, got.dtype, got.shape)
            assert np.all(np.abs(got - np.sum(inputs, axis=0)) <= bound), (dtype, shape)
            assert got.tobytes() == results[0][f"sum_{j}"].tobytes(), (dtype, shape, r)
            if j == 0:  # in place, in a traced function
                assert np.all(np.abs(results[r]["sum_graph"] - np.sum(inputs, axis=0)) <= bound), r
    want = np.stack([worker.gather_input(r) for r in range(k)])
    for r in range(k):
        for dtype in worker.GATHER_DTYPES:
            np.testing.assert_array_equal(results[r][f"gather_{dtype}"], want, err_msg=dtype)
        assert results[r]["gather_empty"].shape == (k, 0, 2)


@pytest.mark.mpi
def test_native_ops_under_mpirun(built_library, tmp_path):
    """Communicators of 1 (COMM_SELF) to 6 ranks (no, one and two folded pairs)
    in one launch, then a missed call."""
    sizes = (1, 2, 3, 4, 5, 6)
    _mpirun(max(sizes), str(tmp_path), ",".join(map(str, sizes)), "--deadline")
    for k in sizes:
        _check_tree(tmp_path, k)
        _check_collectives(tmp_path, k)
    with open(tmp_path / "deadline.json", encoding="utf-8") as f:
        report = json.load(f)
    first, retry = report["first"], report["retry"]
    assert first["raised"] and first["type"] == "DeadlineExceededError", first
    message = first["message"]
    assert "the layout agreement with rank 1 did not complete within 3 s" in message, message
    assert "different numbers of steps" in message and "TF_ADASUM_MPI_TIMEOUT" in message, message
    # What the code promises: not before the deadline (the function was traced before the clock started;
    # the upper bound only says that it did not hang, on a busy machine).
    assert worker.DEADLINE_SECONDS <= first["seconds"] < worker.DEADLINE_SECONDS + 60, first
    # The failure is latched: the retry fails at once, naming the first failure, and waits for nobody.
    assert retry["raised"] and retry["type"] == "FailedPreconditionError", retry
    assert "stays failed" in retry["message"] and "did not complete within 3 s" in retry["message"], retry
    assert retry["seconds"] < worker.DEADLINE_SECONDS, retry


# -- in this process: no MPI is initialised ----------------------------------------


@pytest.mark.parametrize(
    "env, cause",
    [({"TF_ADASUM_MPI_NATIVE": "0"}, "TF_ADASUM_MPI_NATIVE=0"), ({"CXX": "/nonexistent/c++"}, "no C++ compiler")],
)
def test_unavailable_library_falls_back_with_one_warning(env, cause, monkeypatch, tmp_path):
    monkeypatch.setenv("TF_ADASUM_CACHE_DIR", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(mpi_native, "_loaded", [])  # as in a fresh process
    monkeypatch.setattr(mpi_native, "_warned", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mpi_native.load() is None
        assert mpi_native.load() is None
    assert len(caught) == 1 and caught[0].category is RuntimeWarning, [str(w.message) for w in caught]
    assert cause in str(caught[0].message) and "Python path" in str(caught[0].message)
    assert not os.listdir(tmp_path)


def test_arguments_are_checked_before_any_mpi_call():
    x = tf.ones([3])
    with pytest.raises(ValueError, match="`rule` must be one of"):
        mpi_native.tree([x], None, rule="mean")
    with pytest.raises(ValueError, match="`timeout_seconds` must be >= 0"):
        mpi_native.tree([x], None, timeout_seconds=-1)
    with pytest.raises(ValueError, match="at least one tensor"):
        mpi_native.tree([], None)
    with pytest.raises(TypeError, match=r"values\[1\].dtype=float64"):
        mpi_native.tree([x, tf.ones([2], tf.float64)], None)
    with pytest.raises(TypeError, match="x.dtype=int32"):
        mpi_native.allreduce_sum(tf.ones([2], tf.int32), None)
    with pytest.raises(TypeError, match="x.dtype=bool"):
        mpi_native.allgather(tf.ones([2], tf.bool), None)
