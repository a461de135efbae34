"""AdasumOptimizer with what Keras optimizer users rely on: schedules, clipping,
weight decay, embeddings, EMA, mixed precision, serialisation, checkpoints."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import TOLERANCE, mirrored
from simulation import BATCH, IN, OUT, SGD, Adam, data, simulate

import tf_adasum
from tf_adasum import combiners, reference


def _model(seed=7):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])


def _replica_values(strategy, variable):
    return [v.numpy() for v in strategy.experimental_local_results(variable)]


def _assert_identical(strategy, variables):
    for variable in variables:
        values = _replica_values(strategy, variable)
        for value in values[1:]:
            assert value.tobytes() == values[0].tobytes(), variable.name


def _fit(n, optimizer_fn, x, y, model_fn=_model, **fit_kwargs):
    strategy = mirrored(n)[0]
    with strategy.scope():
        model = model_fn()
        initial = [w.numpy() for w in model.weights]
        model.compile(optimizer=optimizer_fn(), loss="mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, **fit_kwargs)
    _assert_identical(strategy, model.weights)
    return strategy, model, initial


def _check_against_simulation(inner, n=2, steps=3, **kwargs):
    x, y = data(steps)
    _, model, initial = _fit(n, lambda: tf_adasum.AdasumOptimizer(inner.keras(), **kwargs), x, y)
    expected = simulate(initial, x, y, n, steps, inner, reference.adasum_tree)
    for got, want in zip(model.weights, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_learning_rate_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    _check_against_simulation(SGD(lr=lambda i: 0.2 * 0.5**i, keras_lr=schedule))


def test_clipnorm_applies_to_the_local_gradient():
    _check_against_simulation(SGD(clipnorm=0.05))


def test_weight_decay_adamw():
    _check_against_simulation(Adam(weight_decay=0.1), n=3)


def test_learning_rate_and_iterations_are_forwarded():
    inner = keras.optimizers.SGD(0.25)
    optimizer = tf_adasum.AdasumOptimizer(inner)
    assert float(optimizer.learning_rate) == 0.25
    optimizer.learning_rate = 0.5
    assert float(inner.learning_rate) == 0.5
    assert optimizer.iterations is inner.iterations


def test_embeddings_with_indexed_slices_gradients():
    # Gradient mode with the mean combiner is plain gradient averaging: it must
    # equal Keras' own SGD under the same strategy, through IndexedSlices too.
    rng = np.random.default_rng(3)
    x = rng.integers(0, 20, size=(2 * BATCH, 5))
    y = rng.standard_normal((2 * BATCH, 1)).astype(np.float32)

    def model_fn():
        keras.utils.set_random_seed(1)
        return keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(20, 4),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )

    _, ours, _ = _fit(
        2,
        lambda: tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1), combiner="mean", mode="gradient"),
        x,
        y,
        model_fn,
    )
    _, native, _ = _fit(2, lambda: keras.optimizers.SGD(0.1), x, y, model_fn)
    for a, b in zip(ours.weights, native.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_ema_averages_the_combined_weights():
    inner, steps, momentum = SGD(), 3, 0.5
    x, y = data(steps)
    strategy, model, initial = _fit(
        2, lambda: tf_adasum.AdasumOptimizer(inner.keras(), use_ema=True, ema_momentum=momentum), x, y
    )
    average = None
    for step in range(1, steps + 1):
        weights = simulate(initial, x, y, 2, step, inner, reference.adasum_tree)
        average = weights if average is None else [momentum * a + (1 - momentum) * w for a, w in zip(average, weights)]
    averages = model.optimizer._model_variables_moving_average
    _assert_identical(strategy, averages)
    for got, want in zip(averages, average):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


class _DenseWithUnusedWeight(keras.layers.Layer):
    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(IN, OUT), name="kernel")
        self.unused = self.add_weight(shape=(2,), name="unused", initializer="ones")

    def call(self, inputs):
        return inputs @ self.kernel


def test_variables_without_gradients_are_left_alone():
    x, y = data(2)
    strategy = mirrored(2)[0]
    with strategy.scope():
        keras.utils.set_random_seed(2)
        layer = _DenseWithUnusedWeight()
        model = keras.Sequential([keras.Input((IN,)), layer])
        kernel_before = layer.kernel.numpy()
        model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_array_equal(layer.unused.numpy(), np.ones(2))
    assert not np.array_equal(layer.kernel.numpy(), kernel_before)
    _assert_identical(strategy, model.weights)


def test_diagnostics_with_a_variable_without_gradients():
    x, y = data(2)
    strategy = mirrored(2)[0]
    with strategy.scope():
        layer = _DenseWithUnusedWeight()
        model = keras.Sequential([keras.Input((IN,)), layer])
        model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    callback = tf_adasum.AdasumDiagnostics(every_n_steps=1)
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[callback])
    record = callback.records[-1][1]
    assert np.isfinite(record[layer.kernel.path]["orthogonality"])
    assert np.isnan(record[layer.unused.path]["orthogonality"])  # never combined


def _poisoned_data(replica, value):
    """Two batches; in the second, replica `replica`'s shard (of 2) holds `value`."""
    x, y = data(2)
    x[BATCH + replica * BATCH // 2] = value
    return x, y


@pytest.mark.parametrize("replica", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_non_finite_step_is_skipped_on_every_replica(replica):
    x, y = _poisoned_data(replica, np.nan)
    strategy = mirrored(2)[0]
    with strategy.scope():
        model = _model()
        optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    after_first = [w.numpy() for w in model.weights]
    slots_after_first = [v.numpy() for v in optimizer.inner_optimizer.variables]
    model.fit(x[BATCH:], y[BATCH:], batch_size=BATCH, shuffle=False, verbose=0)
    _assert_identical(strategy, model.weights + optimizer.inner_optimizer.variables)
    for before, after in zip(after_first, model.weights):
        np.testing.assert_array_equal(before, after.numpy())
    for before, after in zip(slots_after_first, optimizer.inner_optimizer.variables):
        np.testing.assert_array_equal(before, after.numpy())  # iterations too: the step did not happen


@pytest.fixture
def mixed_policy():
    def set_policy(name):
        keras.mixed_precision.set_global_policy(name)

    yield set_policy
    keras.mixed_precision.set_global_policy("float32")


def test_mixed_bfloat16(mixed_policy):
    mixed_policy("mixed_bfloat16")
    x, y = data(4)
    strategy, model, initial = _fit(2, lambda: tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.05)), x, y)
    assert model.layers[0].compute_dtype == "bfloat16"
    assert all(w.dtype == "float32" for w in model.weights)
    expected = simulate(initial, x, y, 2, 4, SGD(lr=0.05, momentum=0.0), reference.adasum_tree)
    for got, want, start in zip(model.weights, expected, initial):
        # Forward and backward passes in bfloat16 (unit roundoff 2^-8) over 4
        # steps: within 3% of the distance moved (measured 0.4-0.6%; the sum
        # instead of Adasum is 15% off, the mean 60%).
        assert np.linalg.norm(got.numpy() - want) <= 3 * TOLERANCE["bfloat16"] * np.linalg.norm(want - start)


@pytest.mark.parametrize("replica", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_mixed_float16_skips_an_overflowing_step_everywhere(mixed_policy, replica):
    # model.compile wraps the optimizer in a LossScaleOptimizer, which looks at
    # replica 0 only; the wrapper makes every replica agree.
    mixed_policy("mixed_float16")
    x, y = _poisoned_data(replica, 6e4)  # float16 overflow on one replica only
    strategy = mirrored(2)[0]
    with strategy.scope():
        model = _model()
        model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, tf_adasum.AdasumOptimizer)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    after_first = [w.numpy() for w in model.weights]
    model.fit(x[BATCH:], y[BATCH:], batch_size=BATCH, shuffle=False, verbose=0)
    _assert_identical(strategy, model.weights)
    for before, after in zip(after_first, model.weights):
        np.testing.assert_array_equal(before, after.numpy())


def _one_step(n, make_optimizer, x, y):
    """The kernel after one step of `make_optimizer()` on n replicas."""
    strategy = mirrored(n)[0]
    with strategy.scope():
        model = _model()
        optimizer = make_optimizer()
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model.weights[0].numpy().astype(np.float64), optimizer


@pytest.mark.parametrize("n", [1, 2])
def test_the_inner_loss_scale_factor_is_owned_and_divided_once(n):
    x, y = data(1)
    plain, _ = _one_step(n, lambda: tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1)), x, y)
    scaled, optimizer = _one_step(
        n, lambda: tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1, loss_scale_factor=128.0)), x, y
    )
    assert optimizer.loss_scale_factor == 128.0 and optimizer.inner_optimizer.loss_scale_factor is None
    np.testing.assert_allclose(scaled, plain, rtol=1e-5, atol=1e-7)


def test_mixed_float16_step_equals_float32(mixed_policy):
    """model.compile wraps the wrapper in a LossScaleOptimizer, which scales the
    loss by its own dynamic scale and clears the factor it wraps: the inner 128
    must not divide the step again (it moved the kernel 128x too little)."""
    x, y = data(1)
    make = lambda: tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1, loss_scale_factor=128.0))  # noqa: E731
    initial = _model().weights[0].numpy()
    float32, _ = _one_step(2, make, x, y)
    mixed_policy("mixed_float16")
    float16, optimizer = _one_step(2, make, x, y)
    assert optimizer.loss_scale_factor is None  # the LossScaleOptimizer owns the scale
    moved32, moved16 = np.abs(float32 - initial).max(), np.abs(float16 - initial).max()
    assert moved32 > 1e-3
    np.testing.assert_allclose(float16, float32, rtol=0, atol=5e-3 * moved32 + 1e-3)
    assert 0.9 < moved16 / moved32 < 1.1


def test_loss_scale_factor_survives_a_keras_file(tmp_path):
    x, y = data(1)
    strategy = mirrored(2)[0]
    with strategy.scope():
        model = _model()
        model.compile(
            optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1, loss_scale_factor=64.0)), loss="mse"
        )
    model.fit(x, y, batch_size=BATCH, verbose=0)
    path = os.path.join(tmp_path, "scaled.keras")
    model.save(path)
    restored = keras.models.load_model(path)
    assert restored.optimizer.loss_scale_factor == 64.0
    assert restored.optimizer.inner_optimizer.loss_scale_factor is None
    assert tf_adasum.AdasumOptimizer.from_config(model.optimizer.get_config()).loss_scale_factor == 64.0


def test_loss_scale_optimizer_inside_is_refused():
    with pytest.raises(ValueError, match="LossScaleOptimizer\\(AdasumOptimizer\\(inner\\)\\)"):
        tf_adasum.AdasumOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


# -- serialisation and checkpoints ------------------------------------------------------


@pytest.mark.parametrize("combiner", ["adasum", "mean", combiners.Sum()])
def test_config_round_trip(combiner):
    optimizer = tf_adasum.AdasumOptimizer(
        keras.optimizers.Adam(0.003, clipnorm=1.0), combiner=combiner, mode="gradient", backward_passes_per_step=2
    )
    config = optimizer.get_config()
    restored = tf_adasum.AdasumOptimizer.from_config(config)
    assert restored.get_config() == config
    assert restored.combiner == combiners.get(combiner)
    assert isinstance(restored.inner_optimizer, keras.optimizers.Adam)
    assert restored.inner_optimizer.clipnorm == 1.0
    again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(again, tf_adasum.AdasumOptimizer) and again.get_config() == config


def test_save_and_load_keras_file(tmp_path):
    x, y = data(2)
    strategy, model, _ = _fit(2, lambda: tf_adasum.AdasumOptimizer(keras.optimizers.Adam(0.01)), x, y)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, tf_adasum.AdasumOptimizer)
    assert loaded.optimizer.get_config() == model.optimizer.get_config()
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    saved = [v.numpy() for v in model.optimizer.variables]
    restored = [v.numpy() for v in loaded.optimizer.variables]
    assert len(saved) == len(restored)
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)  # replica 0's slots
    # It trains on as the inner Adam would from those weights and slots (one
    # replica: the wrapper is its inner optimizer), counting on from 2 steps.
    plain = keras.models.clone_model(loaded)
    plain.set_weights(loaded.get_weights())
    adam = keras.optimizers.Adam(0.01)
    adam.build(plain.trainable_variables)
    inner = loaded.optimizer.inner_optimizer
    assert [tuple(v.shape) for v in adam.variables] == [tuple(v.shape) for v in inner.variables]
    for mine, theirs in zip(adam.variables, inner.variables):
        mine.assign(theirs)
    plain.compile(optimizer=adam, loss="mse")
    for trained in (loaded, plain):
        trained.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 4
    for a, b, before in zip(loaded.weights, plain.weights, model.weights):
        assert not np.array_equal(a.numpy(), before.numpy())
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def _train_with_restart(tmp_path, n, inner_fn, restart, **kwargs):
    """4 steps, optionally checkpointing after 2 and continuing in a new strategy."""
    x, y = data(4)
    strategy = mirrored(n)[0]
    with strategy.scope():
        model = _model()
        optimizer = tf_adasum.AdasumOptimizer(inner_fn(), **kwargs)
        model.compile(optimizer=optimizer, loss="mse")
    if not restart:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        return strategy, model, optimizer
    model.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    slots_replica0 = [_replica_values(strategy, v)[0] for v in optimizer.inner_optimizer.variables]
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(os.path.join(tmp_path, "ckpt"))
    strategy = mirrored(n)[0]
    with strategy.scope():
        model = _model(seed=99)  # different initial weights: the restore must overwrite them
        optimizer = tf_adasum.AdasumOptimizer(inner_fn(), **kwargs)
        model.compile(optimizer=optimizer, loss="mse")
        optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path).assert_existing_objects_matched()
    for variable, saved in zip(optimizer.inner_optimizer.variables, slots_replica0):
        for value in _replica_values(strategy, variable):
            np.testing.assert_array_equal(value, saved)  # replica 0's slots everywhere
    model.fit(x[2 * BATCH :], y[2 * BATCH :], batch_size=BATCH, shuffle=False, verbose=0)
    return strategy, model, optimizer


@pytest.mark.parametrize(
    "inner_fn, kwargs",
    [
        (lambda: keras.optimizers.SGD(0.1, momentum=0.9), {"mode": "gradient"}),
        (lambda: keras.optimizers.SGD(0.1), {"mode": "delta"}),
    ],
    ids=["gradient-mode-momentum", "delta-mode-plain-sgd"],
)
def test_checkpoint_restore_continues_exactly(tmp_path, inner_fn, kwargs):
    _, continuous, _ = _train_with_restart(tmp_path, 2, inner_fn, restart=False, **kwargs)
    strategy, restarted, optimizer = _train_with_restart(tmp_path, 2, inner_fn, restart=True, **kwargs)
    assert int(optimizer.iterations.numpy()) == 4
    _assert_identical(strategy, restarted.weights)
    for a, b in zip(continuous.weights, restarted.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_checkpoint_restore_in_delta_mode_gives_replica_0_slots_everywhere(tmp_path):
    strategy, model, _ = _train_with_restart(tmp_path, 2, lambda: keras.optimizers.SGD(0.1, momentum=0.9), restart=True)
    _assert_identical(strategy, model.weights)


# -- arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"combiner": "median"}, ValueError, "Received: combiner='median'"),
        ({"combiner": 3}, TypeError, "Received: combiner=3"),
        ({"mode": "weights"}, ValueError, "Received: mode='weights'"),
        ({"backward_passes_per_step": 0}, ValueError, "Received: backward_passes_per_step=0"),
        ({"backward_passes_per_step": 1.5}, TypeError, "Received: backward_passes_per_step=1.5"),
        ({"hierarchical": "yes"}, TypeError, "Received: hierarchical='yes'"),
        ({"backend": "nccl"}, ValueError, "Received: backend='nccl'"),
        ({"use_ema": "yes"}, TypeError, "Received: use_ema='yes'"),
        ({"learning_rate": 0.1}, ValueError, "does not support arguments: `learning_rate`"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        tf_adasum.AdasumOptimizer(keras.optimizers.SGD(), **kwargs)


def test_settings_are_checked_once_and_fixed():
    optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(), combiner="mean", mode="gradient")
    assert (optimizer.combiner, optimizer.mode, optimizer.backward_passes_per_step) == (combiners.Mean(), "gradient", 1)
    with pytest.raises(AttributeError, match="`mode` is fixed at construction. Received: mode='delta'"):
        optimizer.mode = "delta"


def test_invalid_inner_optimizers():
    with pytest.raises(TypeError, match="Received: inner_optimizer='sgd' of type str"):
        tf_adasum.AdasumOptimizer("sgd")
    with pytest.raises(ValueError, match="Set `use_ema=True` on the AdasumOptimizer"):
        tf_adasum.AdasumOptimizer(keras.optimizers.SGD(use_ema=True))
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        tf_adasum.AdasumOptimizer(keras.optimizers.SGD(gradient_accumulation_steps=2))
    with pytest.raises(ValueError, match="must not itself be an AdasumOptimizer. Received: inner_optimizer=<"):
        tf_adasum.AdasumOptimizer(tf_adasum.AdasumOptimizer(keras.optimizers.SGD()))
    with pytest.raises(ValueError, match="not both. Received: loss_scale_factor=4.0"):
        tf_adasum.AdasumOptimizer(keras.optimizers.SGD(loss_scale_factor=2.0), loss_scale_factor=4.0)


def test_tree_shape_refuses_a_non_integer():
    with pytest.raises(TypeError, match="Received: num_ranks=2.5"):
        reference.tree_shape(2.5)


@pytest.mark.parametrize("jit_compile", [False, "auto"])
def test_jit_compile_settings_under_a_strategy(jit_compile):
    x, y = data(3)
    strategy = mirrored(2)[0]
    with strategy.scope():
        model = _model()
        initial = [w.numpy() for w in model.weights]
        model.compile(optimizer=tf_adasum.AdasumOptimizer(SGD().keras()), loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert model.jit_compile is False  # "auto" resolves to False under a strategy
    for got, want in zip(model.weights, simulate(initial, x, y, 2, 3, SGD(), reference.adasum_tree)):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_one_replica_compiles_with_xla():
    x, y = data(3)
    results = []
    for jit_compile in (False, True):
        model = _model()
        model.compile(
            optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.Adam(0.01)), loss="mse", jit_compile=jit_compile
        )
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        results.append([w.numpy() for w in model.weights])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_constraints_and_slots_follow_the_right_variables(k):
    # An unused weight comes first, so the variables with gradients are a
    # shifted subset: constraints and per-variable slots must follow them.
    x, y = data(4)

    class Layer(keras.layers.Layer):
        def build(self, input_shape):
            self.unused = self.add_weight(shape=(OUT,), name="unused", initializer="ones")
            self.kernel = self.add_weight(shape=(IN, OUT), name="kernel", constraint=keras.constraints.NonNeg())

        def call(self, inputs):
            return inputs @ self.kernel

    strategy = mirrored(2)[0]
    with strategy.scope():
        keras.utils.set_random_seed(4)
        layer = Layer()
        model = keras.Sequential([keras.Input((IN,)), layer])
        optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.5), backward_passes_per_step=k)
        model.compile(optimizer=optimizer, loss="mse")
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    np.testing.assert_array_equal(layer.unused.numpy(), np.ones(OUT))
    assert (layer.kernel.numpy() >= 0).all() and (layer.kernel.numpy() > 0).any()
    _assert_identical(strategy, model.weights)


def test_ema_follows_the_right_variables_when_a_subset_is_applied():
    # One replica: the wrapper is the inner optimizer plus its own EMA; applying
    # gradients to the second variable only must average that variable.
    first = keras.Variable(np.zeros(2, np.float32), name="first")
    second = keras.Variable(np.ones(3, np.float32), name="second")
    optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.5), use_ema=True, ema_momentum=0.5)
    optimizer.build([first, second])
    optimizer.apply_gradients([(tf.ones(3), second)])
    first_average, second_average = optimizer._model_variables_moving_average
    np.testing.assert_array_equal(second_average.numpy(), second.numpy())  # the first update copies the weights
    np.testing.assert_array_equal(first_average.numpy(), first.numpy())
