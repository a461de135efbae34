"""AdasumOptimizer against a numpy simulation of the step (DESIGN.md section 2)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored
from diagnostics_oracle import expected_statistics
from simulation import BATCH, IN, OUT, SGD, Adam, simulate
from simulation import data as _data

import tf_adasum
from tf_adasum import reference


def _model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])


def _strategy(n):
    return mirrored(n)[0] if n > 1 else tf.distribute.get_strategy()


def _assert_replicas_identical(strategy, model):
    for variable in model.weights:
        values = [v.numpy() for v in strategy.experimental_local_results(variable)]
        for value in values[1:]:
            assert value.tobytes() == values[0].tobytes(), variable.name


def _fit(n, inner, steps=3, **kwargs):
    x, y = _data(steps)
    strategy = _strategy(n)
    with strategy.scope():
        model = _model()
        initial = [w.numpy() for w in model.weights]
        optimizer = tf_adasum.AdasumOptimizer(inner.keras(), **kwargs)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    _assert_replicas_identical(strategy, model)
    return model, optimizer, initial, x, y


def _assert_close(model, expected, rtol=1e-5):
    for got, want in zip(model.weights, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=rtol, atol=1e-6)


COMBINERS = {"adasum": reference.adasum_tree, "sum": reference.sum_, "mean": reference.mean}


@pytest.mark.parametrize("n", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("inner", [SGD(), Adam()], ids=["sgd-momentum", "adam"])
def test_fit_matches_simulation(n, inner):
    model, optimizer, initial, x, y = _fit(n, inner)
    _assert_close(model, simulate(initial, x, y, n, 3, inner, reference.adasum_tree))
    assert int(optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode, k", [("delta", 2), ("gradient", 1), ("gradient", 2)])
def test_modes_and_local_steps(n, mode, k):
    inner = SGD()
    model, optimizer, initial, x, y = _fit(n, inner, steps=4, mode=mode, backward_passes_per_step=k)
    _assert_close(model, simulate(initial, x, y, n, 4, inner, reference.adasum_tree, mode=mode, k=k))
    assert int(optimizer.iterations.numpy()) == (4 if mode == "delta" else 4 // k)


@pytest.mark.parametrize(
    "combiner, n, mode", [("sum", 3, "delta"), ("mean", 3, "delta"), ("sum", 4, "gradient")], ids=lambda v: str(v)
)
def test_baseline_combiners(combiner, n, mode):
    inner = SGD()
    model, _, initial, x, y = _fit(n, inner, combiner=combiner, mode=mode)
    _assert_close(model, simulate(initial, x, y, n, 3, inner, COMBINERS[combiner], mode=mode))


def test_hierarchical_on_one_worker_is_averaging():
    inner = SGD()
    model, _, initial, x, y = _fit(2, inner, hierarchical=True)
    _assert_close(model, simulate(initial, x, y, 2, 3, inner, reference.mean))


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_custom_training_loop(n):
    inner = SGD()
    x, y = _data(3)
    strategy = _strategy(n)
    with strategy.scope():
        model = _model()
        initial = [w.numpy() for w in model.weights]
        optimizer = tf_adasum.AdasumOptimizer(inner.keras())
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))

    @tf.function
    def train_step(xb, yb):
        def step_fn(xs, ys):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(xs, training=True) - ys) ** 2, axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(step_fn, args=(xb, yb))

    for xb, yb in dataset:
        train_step(xb, yb)
    _assert_replicas_identical(strategy, model)
    _assert_close(model, simulate(initial, x, y, n, 3, inner, reference.adasum_tree))


def test_one_replica_is_exactly_the_inner_optimizer():
    x, y = _data(3)
    results = []
    for wrap in (False, True):
        model = _model()
        inner = keras.optimizers.Adam(0.01)
        model.compile(optimizer=tf_adasum.AdasumOptimizer(inner) if wrap else inner, loss="mse")
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        results.append([w.numpy() for w in model.weights])
    for a, b in zip(*results):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("n, kwargs", [(1, {}), (2, {"hierarchical": True})], ids=["1-replica", "2-hierarchical"])
def test_num_replicas_combined_and_diagnostics_columns(n, kwargs):
    """The per-tensor columns only: no Adasum tree runs here (one replica, or
    the mean inside the one worker); tests/test_callbacks.py checks the
    per-level columns of N = 3 and 4, tests/test_adacons.py AdaCons'."""
    x, y = _data(1)
    strategy = _strategy(n)
    with strategy.scope():
        model = _model()
        optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1), **kwargs)
        assert optimizer.num_replicas_combined == n  # before it is built: the strategy's
        model.compile(optimizer=optimizer, loss="mse")
    callback = tf_adasum.AdasumDiagnostics(every_n_steps=1)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[callback])
    assert optimizer.num_replicas_combined == n
    expected = list(expected_statistics([np.ones(1)]))  # one delta: no tree, no levels
    assert optimizer.diagnostics_columns() == expected
    ((_, record),) = callback.records
    assert [list(stats) for stats in record.values()] == [expected] * len(model.trainable_variables)
