"""The engine layer: choice of engine, collective keys, cluster facts, MPI
ordering and thread level, and what a user's MPI job does on a fault."""

import gc
import subprocess
import sys
import time
import weakref

import pytest
import tensorflow as tf
from conftest import mirrored
from multiprocess import TESTS, worker_env

from tf_adasum.comm import cluster, collective_keys, mpi_transport
from tf_adasum.engines import select
from tf_adasum.launcher.mpirun import mpirun_command

RECIPE = f"{TESTS}/workers/mpi_recipe.py"


class _FakeExtended:
    worker_devices = ("/job:worker/replica:0/task:0/device:CPU:0",)


class _FakeMultiWorker:
    """What a MultiWorkerMirroredStrategy of 4 one-device workers shows publicly."""

    num_replicas_in_sync = 4
    extended = _FakeExtended()
    cluster_resolver = None


def test_num_workers_comes_from_public_facts():
    assert cluster.num_workers(_FakeMultiWorker()) == 4  # no private `_num_workers` to read
    assert cluster.num_workers(mirrored(2)[0]) == 1
    assert cluster.num_workers(tf.distribute.get_strategy()) == 1


def test_num_workers_refuses_what_it_cannot_tell():
    class Odd(_FakeMultiWorker):
        num_replicas_in_sync = 3

        class extended:  # noqa: N801
            worker_devices = ("/cpu:0", "/cpu:1")

    with pytest.raises(RuntimeError, match="3 replicas in sync over 2 local devices"):
        cluster.num_workers(Odd())


def test_a_multi_worker_strategy_under_srun_uses_the_tf_engine(monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")  # srun + Slurm's cluster resolver
    assert select.choose_backend("auto", _FakeMultiWorker()) == "tf"
    with pytest.raises(ValueError, match="cannot also combine the 4 replicas"):
        select.choose_backend("mpi", _FakeMultiWorker())


def test_mpirun_with_a_one_process_strategy_is_still_refused(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="cannot also combine the 2 replicas"):
        select.choose_backend("auto", mirrored(2)[0])


def test_group_keys_depend_only_on_the_devices():
    devices = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(2)]
    fresh, used = collective_keys.CollectiveKeys(), collective_keys.CollectiveKeys()
    used.group_key(["/job:localhost/replica:0/task:0/device:CPU:5", "/job:localhost/replica:0/task:0/device:CPU:6"])
    used.fallback_keys(["/job:localhost/replica:0/task:0/device:CPU:5"])
    assert used.group_key(devices) == fresh.group_key(devices) == fresh.group_key(list(reversed(devices)))
    assert used.fallback_keys(devices) is used.fallback_keys(list(reversed(devices)))  # one per device set


def test_the_mpi_chain_forgets_collected_graphs():
    chain = mpi_transport.Chain()

    def trace_once():
        graph = tf.Graph()
        with graph.as_default():
            chain.call(lambda x: x, [tf.constant(1.0)], tf.float32, [])
        return weakref.ref(graph)

    graph = trace_once()
    gc.collect()
    assert graph() is None, "the chain keeps a traced graph alive"
    assert len(chain._last) == 0


def test_mpi_below_serialized_threads_is_an_error(monkeypatch):
    class FakeWorld:
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 2

    class FakeMPI:
        COMM_WORLD = FakeWorld()
        THREAD_SINGLE, THREAD_FUNNELED, THREAD_SERIALIZED, THREAD_MULTIPLE = 0, 1, 2, 3

        @staticmethod
        def Query_thread():
            return FakeMPI.THREAD_FUNNELED

    monkeypatch.setattr(mpi_transport, "mpi", lambda: FakeMPI)
    with pytest.raises(RuntimeError, match="at least MPI_THREAD_SERIALIZED. Received: MPI_THREAD_FUNNELED"):
        mpi_transport.World(2)


def _mpirun_recipe(fault, timeout):
    command = mpirun_command(2) + [sys.executable, RECIPE, fault]
    start = time.monotonic()
    result = subprocess.run(
        command, env=worker_env(TF_ADASUM_MPI_TIMEOUT=str(timeout)), capture_output=True, text=True, timeout=300
    )
    return result, time.monotonic() - start


@pytest.mark.mpi
def test_readme_recipe_with_uneven_steps_ends_the_job_after_the_deadline():
    timeout = 10
    result, seconds = _mpirun_recipe("uneven", timeout)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "DeadlineExceededError" in output and f"did not complete within {timeout} s" in output, output[-3000:]
    assert "different numbers of steps" in output
    assert seconds < timeout + 60, seconds  # start-up (TensorFlow import, first trace) included


@pytest.mark.mpi
def test_readme_recipe_with_different_metric_names_says_so_on_every_rank():
    result, _ = _mpirun_recipe("names", 10)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert output.count("The metric names differ across MPI ranks") >= 2, output[-3000:]
    assert "val_loss" in output and "MPI_ERR_TRUNCATE" not in output
