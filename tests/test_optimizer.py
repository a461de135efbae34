"""AdasumOptimizer against a numpy simulation of the step (DESIGN.md section 2)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored

import tf_adasum
from tf_adasum import reference

IN, OUT, BATCH = 4, 3, 12


# -- the numpy simulation ------------------------------------------------------------


class SGD:
    def __init__(self, lr=0.1, momentum=0.9):
        self.lr, self.momentum = lr, momentum

    def init(self, weights):
        return [np.zeros_like(w) for w in weights]

    def delta(self, grads, state, iteration):
        state = [self.momentum * m - self.lr * g for m, g in zip(state, grads)]
        return list(state), state

    def keras(self):
        return keras.optimizers.SGD(self.lr, momentum=self.momentum)


class Adam:
    def __init__(self, lr=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        self.lr, self.b1, self.b2, self.eps = lr, beta_1, beta_2, epsilon

    def init(self, weights):
        return [(np.zeros_like(w), np.zeros_like(w)) for w in weights]

    def delta(self, grads, state, iteration):
        t = iteration + 1
        alpha = self.lr * np.sqrt(1 - self.b2**t) / (1 - self.b1**t)
        new_state, deltas = [], []
        for g, (m, v) in zip(grads, state):
            m = m + (g - m) * (1 - self.b1)
            v = v + (g * g - v) * (1 - self.b2)
            new_state.append((m, v))
            deltas.append(-(m * alpha) / (np.sqrt(v) + self.eps))
        return deltas, new_state

    def keras(self):
        return keras.optimizers.Adam(self.lr, beta_1=self.b1, beta_2=self.b2, epsilon=self.eps)


def _grads(weights, x, y):
    """MSE gradients of a Dense layer (mean over the shard and the outputs)."""
    kernel, bias = weights
    err = x @ kernel + bias - y
    scale = 2.0 / (len(x) * OUT)
    return [scale * x.T @ err, scale * err.sum(0)]


def simulate(weights, x, y, n, steps, inner, combine, mode="delta", k=1):
    """Weights after `steps` batches of BATCH rows, replica r taking rows r*b:(r+1)*b."""
    b = BATCH // n
    weights = [w.astype(np.float64) for w in weights]
    states = [inner.init(weights) for _ in range(n)]
    shared_state = inner.init(weights)
    iteration = 0

    def shard(step, r):
        rows = slice(step * BATCH + r * b, step * BATCH + (r + 1) * b)
        return x[rows].astype(np.float64), y[rows].astype(np.float64)

    for first in range(0, steps, k):
        if mode == "delta":
            local = [list(weights) for _ in range(n)]
            for step in range(first, first + k):
                for r in range(n):
                    deltas, states[r] = inner.delta(_grads(local[r], *shard(step, r)), states[r], iteration)
                    local[r] = [w + d for w, d in zip(local[r], deltas)]
                iteration += 1
            combined = combine([[lw - w for lw, w in zip(local[r], weights)] for r in range(n)])
            weights = [w + c for w, c in zip(weights, combined)]
        else:
            per_replica = []
            for r in range(n):
                grads = [_grads(weights, *shard(step, r)) for step in range(first, first + k)]
                per_replica.append([sum(g[i] for g in grads) / k for i in range(2)])
            deltas, shared_state = inner.delta(combine(per_replica), shared_state, iteration)
            weights = [w + d for w, d in zip(weights, deltas)]
            iteration += 1
    return weights


def _data(steps, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((steps * BATCH, IN)).astype(np.float32),
        rng.standard_normal((steps * BATCH, OUT)).astype(np.float32),
    )


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


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("inner", [SGD(), Adam()], ids=["sgd-momentum", "adam"])
def test_fit_matches_simulation(n, inner):
    model, optimizer, initial, x, y = _fit(n, inner)
    _assert_close(model, simulate(initial, x, y, n, 3, inner, reference.adasum_tree))
    assert int(optimizer.iterations.numpy()) == 3


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode, k", [("delta", 2), ("gradient", 1), ("gradient", 2)])
def test_modes_and_local_steps(n, mode, k):
    inner = SGD()
    model, optimizer, initial, x, y = _fit(n, inner, steps=4, mode=mode, backward_passes_per_step=k)
    _assert_close(model, simulate(initial, x, y, n, 4, inner, reference.adasum_tree, mode=mode, k=k))
    assert int(optimizer.iterations.numpy()) == (4 if mode == "delta" else 4 // k)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_baseline_combiners(combiner):
    inner = SGD()
    model, _, initial, x, y = _fit(3, inner, combiner=combiner)
    _assert_close(model, simulate(initial, x, y, 3, 3, inner, COMBINERS[combiner]))


def test_hierarchical_on_one_worker_is_averaging():
    inner = SGD()
    model, _, initial, x, y = _fit(2, inner, hierarchical=True)
    _assert_close(model, simulate(initial, x, y, 2, 3, inner, reference.mean))


@pytest.mark.parametrize("n", [2, 3])
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
