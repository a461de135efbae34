"""`tf_adasum.SimulatedReplicas` against N real replicas, and the averaging
baselines' equivalence across N x b at one effective batch.

The simulation must give what a MirroredStrategy of N replicas on logical CPU
devices gives with `tf_adasum.AdasumOptimizer`. It runs the same kernels on
the same inputs in the same order (the forward and backward passes at batch
b, the inner step, the tree's pairs); only a pair's float64 partial sums are
accumulated over the whole buffer instead of per slice of the halving, which
could change a coefficient's last float64 bits. Here the results are bitwise
equal, and the tests hold them to that.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored

import tf_adasum
from tf_adasum import reference
from tf_adasum.engines.simulated import SimulatedEngine, components, per_replica

N = 4
PER_REPLICA = 8
STEPS = 3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model():
    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((6, 6, 1)),
            keras.layers.Conv2D(3, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(5),
        ]
    )


def _data(examples):
    rng = np.random.default_rng(3)
    return rng.standard_normal((examples, 6, 6, 1)).astype("float32"), rng.integers(0, 5, examples)


def _real_replicas(combiner, mode, k, lr=1e-2):
    strategy, _ = mirrored(N)
    with strategy.scope():
        model = _model()
        optimizer = tf_adasum.AdasumOptimizer(
            keras.optimizers.Adam(lr), combiner=combiner, mode=mode, backward_passes_per_step=k
        )
        model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    x, y = _data(N * PER_REPLICA * STEPS)
    model.fit(x, y, batch_size=N * PER_REPLICA, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def _simulated(combiner, mode, k, lr=1e-2):
    trainer = tf_adasum.SimulatedReplicas(_model(), N, combiner=combiner, mode=mode, backward_passes_per_step=k)
    trainer.compile(optimizer=keras.optimizers.Adam(lr), loss=LOSS)
    x, y = _data(N * PER_REPLICA * STEPS)
    trainer.fit(x, y, batch_size=N * PER_REPLICA, epochs=1, shuffle=False, verbose=0)
    return trainer.model.get_weights()


@pytest.mark.parametrize(
    "combiner, mode, k",
    [
        ("adasum", "delta", 1),
        ("adasum", "gradient", 1),
        pytest.param("adasum", "delta", 2, marks=pytest.mark.slow),
        pytest.param("adasum", "gradient", 2, marks=pytest.mark.slow),
        pytest.param("mean", "delta", 1, marks=pytest.mark.slow),
        pytest.param("mean", "gradient", 1, marks=pytest.mark.slow),
        pytest.param("mean", "delta", 2, marks=pytest.mark.slow),
        pytest.param("adacons", "delta", 1, marks=pytest.mark.slow),
        ("adacons", "gradient", 1),
        pytest.param("adacons", "delta", 2, marks=pytest.mark.slow),
    ],
)
def test_simulation_is_bitwise_the_real_replicas(combiner, mode, k):
    real, simulated = _real_replicas(combiner, mode, k), _simulated(combiner, mode, k)
    start = _model().get_weights()
    assert any(not np.array_equal(a, b) for a, b in zip(start, simulated)), "training did not move the weights"
    for i, (a, b) in enumerate(zip(real, simulated)):
        np.testing.assert_array_equal(a, b, err_msg=f"weight {i}: {combiner}, {mode}, K={k}")


def test_each_replica_keeps_its_own_optimizer_state():
    """Delta mode: the replicas' Adam moments differ (each saw its own data);
    the optimizer shows replica 0's, as a checkpoint of real replicas stores."""
    trainer = tf_adasum.SimulatedReplicas(_model(), N)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS)
    x, y = _data(N * PER_REPLICA)
    trainer.fit(x, y, batch_size=N * PER_REPLICA, epochs=1, shuffle=False, verbose=0)
    state = trainer._state
    stacks = [s.numpy() for s in state.own_stacks]
    momentum = stacks[0]
    assert not np.array_equal(momentum[0], momentum[1])
    for variable, stack in zip(state.own, stacks):
        np.testing.assert_array_equal(variable.numpy(), stack[0])
    assert int(trainer.optimizer.iterations.numpy()) == 1  # one local step per replica, not N


def test_combine_matches_the_reference_at_many_replicas(rng):
    n = 11  # a fold (11 = 8 + 3), and more ranks than the tests' logical devices
    per_rank = [[rng.standard_normal(50).astype("float64"), rng.standard_normal((3, 4))] for _ in range(n)]
    engine = SimulatedEngine(n)
    values = [per_replica([tf.constant(per_rank[r][t]) for r in range(n)]) for t in range(2)]
    combined = tf.function(lambda: [components(c)[0] for c in engine.combine(values, "adasum")])()
    expected = reference.adasum_tree(per_rank)
    for got, want in zip(combined, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-14)


def test_a_restored_optimizer_state_is_every_replicas_start():
    """A checkpoint holds replica 0's optimizer state; restored into a fresh
    trainer it is where every replica goes on from (the step count too)."""
    x, y = _data(N * PER_REPLICA * STEPS)
    first = tf_adasum.SimulatedReplicas(_model(), N)
    first.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS)
    first.fit(x, y, batch_size=N * PER_REPLICA, epochs=1, shuffle=False, verbose=0)
    resumed = tf_adasum.SimulatedReplicas(_model(), N)
    resumed.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS)
    resumed.model.set_weights(first.model.get_weights())
    for mine, saved in zip(resumed.optimizer.variables, first.optimizer.variables):
        mine.assign(saved)  # as a checkpoint restore does
    resumed.fit(x[: N * PER_REPLICA], y[: N * PER_REPLICA], batch_size=N * PER_REPLICA, verbose=0, shuffle=False)
    assert int(resumed.optimizer.iterations.numpy()) == STEPS + 1
    iterations = [s for s in resumed._state.own_stacks if s.dtype == tf.int64]
    assert iterations and all(int(v) == STEPS + 1 for v in iterations[-1].numpy())


def test_the_engine_has_no_per_level_partials():
    values = [per_replica([tf.ones([3])] * 2)]
    with pytest.raises(NotImplementedError, match="with_partials=True"):
        SimulatedEngine(2).combine(values, "adasum", with_partials=True)


def test_a_non_finite_replica_skips_the_step_for_all():
    trainer = tf_adasum.SimulatedReplicas(_model(), N)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS)
    before = trainer.model.get_weights()
    x, y = _data(N * PER_REPLICA)
    x[PER_REPLICA * 2] = np.inf  # replica 2
    trainer.fit(x, y, batch_size=N * PER_REPLICA, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(before, trainer.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(trainer.optimizer.iterations.numpy()) == 0


def test_bad_arguments_are_named():
    model = _model()
    with pytest.raises(ValueError, match="num_replicas=0"):
        tf_adasum.SimulatedReplicas(model, 0)
    with pytest.raises(ValueError, match="mode='sideways'"):
        tf_adasum.SimulatedReplicas(model, 2, mode="sideways")
    with pytest.raises(ValueError, match="must be built"):
        tf_adasum.SimulatedReplicas(keras.Sequential([keras.layers.Dense(2)]), 2)
    built = keras.optimizers.Adam()
    built.build(model.trainable_variables)
    with pytest.raises(ValueError, match="must not be built"):
        tf_adasum.SimulatedReplicas(model, 2).compile(optimizer=built, loss=LOSS)
    trainer = tf_adasum.SimulatedReplicas(_model(), N)
    trainer.compile(optimizer=keras.optimizers.Adam(), loss=LOSS)
    x, y = _data(N * PER_REPLICA - 1)
    with pytest.raises(ValueError, match="multiple of num_replicas=4 rows. Received: a batch of 31"):
        trainer.fit(x, y, batch_size=len(x), epochs=1, verbose=0)


# -- the averaging baselines: N x b at one effective batch is one method ------------------


def _averaging(replicas, combiner, lr=1e-2):
    """Keras' own gradient averaging (``keras``), or AdasumOptimizer's `mean`
    of gradients, over `replicas` real replicas at effective batch 32."""
    strategy, _ = mirrored(replicas)
    with strategy.scope():
        model = _model()
        optimizer = keras.optimizers.Adam(lr)
        if combiner != "keras":
            optimizer = tf_adasum.AdasumOptimizer(optimizer, combiner="mean", mode="gradient")
        model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    x, y = _data(32 * STEPS)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.slow
@pytest.mark.parametrize("combiner", ["keras", "mean-gradient"])
def test_averaging_baselines_depend_only_on_the_effective_batch(combiner):
    """1 x 32, 2 x 16, 4 x 8 and 8 x 4 replicas x batch: the same mean
    gradient of the same 32 examples, so the same training up to the order of
    float32 sums (``keras-scaled`` differs from ``keras`` only by a learning
    rate that depends on the effective batch alone). Not so for `mean` of
    deltas: each replica's Adam normalises its own gradient."""
    runs = {n: _averaging(n, combiner) for n in (1, 2, 4, 8)}
    start = _model().get_weights()
    for n in (2, 4, 8):
        for i, (a, b) in enumerate(zip(runs[1], runs[n])):
            moved = np.max(np.abs(runs[1][i] - start[i]))
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * max(moved, 1e-3), err_msg=f"N={n}, weight {i}")
