"""Test setup: 8 logical CPU devices, so multi-replica tests run in one process."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_LOGICAL_CPUS = 8

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS)
# Start the runtime now, so that no code under test can change the devices (a test that
# calls the evaluation's `logical_cpus(2)` first would otherwise leave 2 of them, and
# the collective tests after it would wait for devices that no longer exist).
tf.config.list_logical_devices("CPU")

#: Collective timeout for tests: a bug fails the test instead of hanging it.
TEST_TIMEOUT_SECONDS = 60.0

#: Relative L2 tolerances against the float64 reference (DESIGN.md section 1).
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def relative_error(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    norm = np.linalg.norm(expected)
    diff = np.linalg.norm(actual - expected)
    return float(diff / norm) if norm > 0 else float(diff)


@pytest.fixture(scope="session")
def two_processes(tmp_path_factory):
    """``two_processes(launcher)``: the folder of the one launch of 2 processes
    that runs `multiprocess.SHARED_LAUNCHES[launcher]` ("mpirun" or "tf-adasum
    launch") for every test that reads its tasks' reports; it starts when a
    test first asks for it."""
    folders = {}

    def folder(launcher):
        if launcher not in folders:
            from multiprocess import shared_launch

            out = tmp_path_factory.mktemp("two_processes")
            shared_launch(launcher, out)
            folders[launcher] = out
        return folders[launcher]

    return folder


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def mirrored(num_replicas: int, devices=None, fallback=None, **options):
    """A MirroredStrategy over logical CPUs with an `AdasumCrossDeviceOps`."""
    import tf_adasum

    devices = devices or [f"/cpu:{i}" for i in range(num_replicas)]
    options.setdefault("timeout_seconds", TEST_TIMEOUT_SECONDS)
    cross_device_ops = tf_adasum.AdasumCrossDeviceOps(
        fallback=fallback, options=tf.distribute.experimental.CommunicationOptions(**options)
    )
    return tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops), cross_device_ops


def distribute(strategy, per_rank):
    """Per-replica values from numpy data: ``per_rank[r][t]`` is tensor t of replica r."""
    return [
        strategy.experimental_distribute_values_from_function(
            lambda ctx, t=t: tf.constant(per_rank[ctx.replica_id_in_sync_group][t])
        )
        for t in range(len(per_rank[0]))
    ]


def local_results(strategy, values):
    """``out[t][r]``: the numpy value of tensor t on replica r."""
    return [[np.asarray(x) for x in strategy.experimental_local_results(v)] for v in values]
