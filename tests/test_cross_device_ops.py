"""`AdasumCrossDeviceOps`: the fallback path and input validation."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import distribute, local_results, mirrored

import tf_adasum
from tf_adasum.comm import collective
from tf_adasum.engines.tf import TFEngine


def _reduce_everything(strategy):
    """SUM and MEAN the ways Keras and users do: strategy.reduce, batch_reduce_to,
    and a replica-context all_reduce inside a tf.function."""
    n = strategy.num_replicas_in_sync

    def value_fn(ctx):
        r = ctx.replica_id_in_sync_group
        return tf.constant([1.0 / 3.0 + r, 2.0**-r, 0.1 * r], tf.float32)

    with strategy.scope():
        per_replica = strategy.experimental_distribute_values_from_function(value_fn)
        results = [
            strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None),
            strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None),
        ]
        pairs = [(per_replica, per_replica)]
        results += strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, pairs)

        @tf.function
        def all_reduce_in_replica_context():
            def fn():
                ctx = tf.distribute.get_replica_context()
                x = tf.cast(ctx.replica_id_in_sync_group, tf.float32) + tf.constant([0.25, 1.0 / 7.0])
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, x)

            return strategy.run(fn)

        results.append(all_reduce_in_replica_context())
    assert n > 1
    return [np.stack([np.asarray(v) for v in strategy.experimental_local_results(r)]) for r in results]


_NATIVE_COMPARISON = """
import sys
sys.path.insert(0, {tests!r})
import conftest, numpy as np, tensorflow as tf
from test_cross_device_ops import _reduce_everything
n = {n}
ours, _ = conftest.mirrored(n)
native = tf.distribute.MirroredStrategy([f"/cpu:{{i}}" for i in range(n)])
mismatches = [i for i, (a, b) in enumerate(zip(_reduce_everything(ours), _reduce_everything(native)))
              if a.tobytes() != b.tobytes()]
print("MISMATCHES", mismatches)
"""


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sum_and_mean_are_exactly_the_native_default(n):
    # A process may hold native MirroredStrategies of one size only: each one's
    # CollectiveAllReduce starts at group key 1 (a TF limitation ours avoids).
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", _NATIVE_COMPARISON.format(tests=tests, n=n)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "MISMATCHES []" in out.stdout, out.stdout + out.stderr[-3000:]


def test_strategies_of_different_sizes_share_a_process():
    for n in (2, 3, 4, 2):
        total, mean, batch_mean, all_reduced = _reduce_everything(mirrored(n)[0])
        r = np.arange(n)
        expected_sum = np.array([np.sum(1.0 / 3.0 + r), np.sum(2.0**-r), np.sum(0.1 * r)], np.float32)
        np.testing.assert_allclose(total[0], expected_sum, rtol=1e-6)
        np.testing.assert_allclose(mean[0], expected_sum / n, rtol=1e-6)
        np.testing.assert_allclose(batch_mean, np.tile(expected_sum / n, (n, 1)), rtol=1e-6)
        expected_all = np.array([np.sum(r + 0.25), np.sum(r + 1.0 / 7.0)], np.float32)
        np.testing.assert_allclose(all_reduced, np.tile(expected_all, (n, 1)), rtol=1e-6)


def test_sum_and_mean_go_to_an_explicit_fallback():
    fallback = tf.distribute.ReductionToOneDevice(reduce_to_device="/cpu:1")
    ours, cross_device_ops = mirrored(2, fallback=fallback)
    native = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=fallback)
    assert cross_device_ops.fallback_for(["/cpu:0", "/cpu:1"]) is fallback
    for got, want in zip(_reduce_everything(ours), _reduce_everything(native)):
        assert got.tobytes() == want.tobytes()


def test_default_fallback_is_a_ring_collective_all_reduce_on_cpus():
    fallback = tf_adasum.AdasumCrossDeviceOps().fallback_for(["/cpu:0", "/cpu:1"])
    assert type(fallback).__name__ == "CollectiveAllReduce"
    assert fallback._options.implementation == tf.distribute.experimental.CommunicationImplementation.RING


def test_one_replica_is_the_identity():
    strategy, cross_device_ops = mirrored(1)
    with strategy.scope():
        values = distribute(strategy, [[np.array([1.0, 2.0], np.float32)]])
        out = cross_device_ops.batch_reduce_adasum(values)
    np.testing.assert_array_equal(local_results(strategy, out)[0][0], [1.0, 2.0])


def test_returns_mirrored_values():
    strategy, cross_device_ops = mirrored(2)
    with strategy.scope():
        (out,) = cross_device_ops.batch_reduce_adasum(distribute(strategy, [[np.ones(3)], [np.ones(3)]]))
    assert isinstance(out, tf.distribute.DistributedValues)
    assert type(out).__name__ == "Mirrored"


@pytest.fixture
def no_collective(monkeypatch):
    """Fails the test if any communicator (hence any collective) is built."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective was set up before the input was validated")

    monkeypatch.setattr(collective, "TFCollectiveCommunicator", forbidden)


def _per_replica(strategy, fn):
    with strategy.scope():
        return strategy.experimental_distribute_values_from_function(lambda ctx: fn(ctx.replica_id_in_sync_group))


@pytest.mark.usefixtures("no_collective")
class TestBadInput:
    def setup_method(self):
        self.strategy, self.ops = mirrored(2)

    def _call(self, values):
        with self.strategy.scope():
            return self.ops.batch_reduce_adasum(values)

    def test_empty_list(self):
        with pytest.raises(ValueError, match=r"Received: per_replica_values=\[\]"):
            self._call([])

    def test_not_a_list(self):
        with pytest.raises(TypeError, match="Received: per_replica_values of type str"):
            self._call("gradients")

    def test_integer_tensors(self):
        value = _per_replica(self.strategy, lambda r: tf.constant([1, 2]))
        with pytest.raises(TypeError, match=r"per_replica_values\[0\].dtype=int32"):
            self._call([value])

    def test_shapes_differ_across_replicas(self):
        ok = _per_replica(self.strategy, lambda r: tf.zeros([2]))
        bad = _per_replica(self.strategy, lambda r: tf.zeros([2 + r]))
        with pytest.raises(ValueError, match=r"per_replica_values\[1\] has different shapes.*replica 1 \(3,\)"):
            self._call([ok, bad])

    def test_dtypes_differ_across_replicas(self):
        bad = _per_replica(self.strategy, lambda r: tf.zeros([2], tf.float32 if r == 0 else tf.float64))
        with pytest.raises(TypeError, match="replica 0 float32, replica 1 float64"):
            self._call([bad])

    def test_wrong_value_type(self):
        with pytest.raises(TypeError, match=r"per_replica_values\[0\] of type list"):
            self._call([[1.0, 2.0]])

    def test_unknown_combiner(self):
        value = _per_replica(self.strategy, lambda r: tf.zeros([2]))
        with self.strategy.scope(), pytest.raises(ValueError, match="Received: combiner='median'"):
            self.ops.batch_reduce_combine([value], "median")


def test_constructor_arguments_are_checked():
    with pytest.raises(TypeError, match="Received: fallback='nccl'"):
        tf_adasum.AdasumCrossDeviceOps(fallback="nccl")
    with pytest.raises(TypeError, match="Received: options=5"):
        tf_adasum.AdasumCrossDeviceOps(options=5)
    with pytest.raises(ValueError, match="must not itself be"):
        tf_adasum.AdasumCrossDeviceOps(fallback=tf_adasum.AdasumCrossDeviceOps())


@pytest.mark.parametrize("workers, per_worker", [(2, 2), (3, 2), (2, 3)])
def test_hierarchical_with_several_devices_per_worker(workers, per_worker, rng):
    """Each "worker" (a group of local devices) builds its part as in a
    multi-worker process; here all of them live in one graph. The result is
    Adasum over the workers' means, on every device."""
    n = workers * per_worker
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)]
    sizes = [5, 300]
    per_rank = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]

    @tf.function(autograph=False)
    def run():
        outputs = []
        for w in range(workers):
            ranks = tuple(range(w * per_worker, (w + 1) * per_worker))
            values = []
            for t in range(len(sizes)):
                components = []
                for r in ranks:
                    with tf.device(devices[r]):
                        components.append(tf.constant(per_rank[r][t]))
                values.append(tuple(components))
            engine = TFEngine(devices, ranks, tf.distribute.experimental.CommunicationOptions(timeout_seconds=60.0))
            combined, _ = engine.combine_components(values, tf_adasum.combiners.Adasum(), hierarchical=True)
            outputs += [[value[local] for value in combined] for local in range(per_worker)]
        return outputs

    outputs = run()
    worker_means = [
        [np.mean([per_rank[r][t].astype(np.float64) for r in range(w * per_worker, (w + 1) * per_worker)], axis=0)
         for t in range(len(sizes))]
        for w in range(workers)
    ]  # fmt: skip
    expected = tf_adasum.reference.adasum_tree(worker_means)
    for rank_outputs in outputs:
        for t, (got, want) in enumerate(zip(rank_outputs, expected)):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
            assert got.numpy().tobytes() == outputs[0][t].numpy().tobytes()
