"""AdaCons: the reference's special cases, and the TF path against the reference."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored
from diagnostics_oracle import expected_statistics
from simulation import BATCH, IN, OUT, SGD, data, simulate

import tf_adasum
from tf_adasum import combiners, reference
from tf_adasum.eval import cli

# -- the reference ---------------------------------------------------------------------


def _alphas(gs):
    s = sum(gs)
    n = len(gs)
    return np.array([np.dot(g, s) / (n * (np.linalg.norm(g) + reference.ADACONS_EPS)) for g in gs])


def test_identical_updates_give_the_unit_vector():
    g = np.array([3.0, 4.0, 0.0])
    (result,), state = reference.adacons([[g], [g], [g]])
    np.testing.assert_allclose(result, g / 5.0, rtol=1e-7)
    np.testing.assert_allclose(state["weights"], [[1 / 3, 1 / 3, 1 / 3]])


def test_orthogonal_updates():
    gs = [np.array([2.0, 0.0, 0.0]), np.array([0.0, -1.0, 0.0]), np.array([0.0, 0.0, 0.5])]
    (result,), _ = reference.adacons([[g] for g in gs])
    np.testing.assert_allclose(result, sum(gs) / sum(np.linalg.norm(g) for g in gs), rtol=1e-7)


def test_rank_preserving_assignment_with_momentum():
    beta = 0.5
    first = [np.array([3.0, 0.1]), np.array([1.0, 0.0]), np.array([2.0, 0.3])]
    second = [np.array([0.2, 1.0]), np.array([1.0, 3.0]), np.array([0.1, 2.0])]
    _, state = reference.adacons([[g] for g in first], momentum=beta)
    m1 = np.sort(_alphas(first))
    np.testing.assert_allclose(state["m"][0], m1)
    _, state = reference.adacons([[g] for g in second], state=state, momentum=beta)
    a2 = _alphas(second)
    m2 = beta * m1 + (1 - beta) * np.sort(a2)
    np.testing.assert_allclose(state["m"][0], m2)
    expected = np.empty(3)
    expected[np.argsort(a2, kind="stable")] = m2  # the k-th smallest alpha gets m2[k]
    np.testing.assert_allclose(state["weights"][0], expected / expected.sum())


def test_ties_keep_replica_order():
    beta = 0.5
    state = {"m": np.array([[1.0, 2.0, 3.0]]), "steps": 1, "fallbacks": 0}
    g = np.array([1.0, 1.0])
    _, state = reference.adacons([[g], [g], [g]], state=state, momentum=beta)
    alpha = _alphas([g, g, g])[0]
    expected = beta * np.array([1.0, 2.0, 3.0]) + (1 - beta) * alpha
    np.testing.assert_allclose(state["weights"][0], expected / expected.sum())


def test_fallback_to_averaging():
    x = np.array([1.0, 2.0])
    (result,), state = reference.adacons([[x], [x], [-3.0 * x]])  # alphas -|x|/3, -|x|/3, |x|/3: sum < 0
    assert state["fallbacks"] == 1
    np.testing.assert_allclose(state["weights"], [[1 / 3, 1 / 3, 1 / 3]])
    np.testing.assert_allclose(result, x / (3 * np.linalg.norm(x)), rtol=1e-7)


def test_restore_magnitude_and_per_tensor():
    rng = np.random.default_rng(0)
    per_rank = [[rng.standard_normal(4), rng.standard_normal(3) * 10] for _ in range(3)]
    (a, b), _ = reference.adacons(per_rank, restore_magnitude=True)
    mean = [sum(r[t] for r in per_rank) / 3 for t in range(2)]
    np.testing.assert_allclose(np.sqrt(np.sum(a**2) + np.sum(b**2)), np.sqrt(sum(np.sum(m**2) for m in mean)))
    (a, b), state = reference.adacons(per_rank, per_tensor=True, restore_magnitude=True)
    assert state["m"].shape == (2, 3)
    np.testing.assert_allclose(np.linalg.norm(b), np.linalg.norm(mean[1]))


# -- TF against the reference, through the optimizer ------------------------------------


class ReferenceAdaCons:
    """A stateful combine for the simulation."""

    def __init__(self, **kwargs):
        self.kwargs, self.state = kwargs, None

    def __call__(self, per_rank):
        result, self.state = reference.adacons(per_rank, state=self.state, **self.kwargs)
        return result


def _model():
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])


def _assert_identical(strategy, variables):
    for variable in variables:
        values = [v.numpy() for v in strategy.experimental_local_results(variable)]
        for value in values[1:]:
            assert value.tobytes() == values[0].tobytes(), variable.name


@pytest.mark.parametrize("n", [pytest.param(n, marks=pytest.mark.slow) if n != 3 else n for n in (2, 3, 4)])
@pytest.mark.parametrize("mode", ["delta", "gradient"])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_matches_reference(n, mode, per_tensor):
    inner, steps, momentum = SGD(lr=0.05, momentum=0.0), 3, 0.5
    x, y = data(steps)
    strategy = mirrored(n)[0]
    with strategy.scope():
        model = _model()
        initial = [w.numpy() for w in model.weights]
        combiner = combiners.AdaCons(momentum=momentum, per_tensor=per_tensor)
        optimizer = tf_adasum.AdasumOptimizer(inner.keras(), combiner=combiner, mode=mode)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _assert_identical(strategy, model.weights + optimizer.variables)
    oracle = ReferenceAdaCons(momentum=momentum, per_tensor=per_tensor, restore_magnitude=mode == "delta")
    expected = simulate(initial, x, y, n, steps, inner, oracle, mode=mode)
    for got, want in zip(model.weights, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    adacons = optimizer.read_adacons()
    np.testing.assert_allclose(np.array(list(adacons["weights"].values())), oracle.state["weights"], rtol=1e-5)
    assert adacons["fallbacks"] == oracle.state["fallbacks"]


def test_native_mirrored_strategies_of_two_sizes_in_one_process():
    """Under TF's own MirroredStrategy (its default all-reduce), at 2 replicas
    and then at 4 in one process, AdaCons matches the reference at each size.
    TF's default collective keys start at 1 for every strategy; the engine's
    small gathers draw tf_adasum's keys (with the strategy's, the second size
    failed: "joining a group with size 4, but that group has size 2")."""
    inner, steps = SGD(lr=0.05), 2
    x, y = data(steps)
    for n in (2, 4):
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
        with strategy.scope():
            model = _model()
            initial = [w.numpy() for w in model.weights]
            model.compile(optimizer=tf_adasum.AdasumOptimizer(inner.keras(), combiner="adacons"), loss="mse")
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        expected = simulate(initial, x, y, n, steps, inner, ReferenceAdaCons(restore_magnitude=True))
        for got, want in zip(model.weights, expected):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def _train(tmp_path, restart, n=2):
    x, y = data(4)
    kwargs = dict(combiner=combiners.AdaCons(momentum=0.5), mode="gradient")

    def build():
        with strategy.scope():
            model = _model()
            optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), **kwargs)
            model.compile(optimizer=optimizer, loss="mse")
            optimizer.build(model.trainable_variables)
        return model, optimizer

    strategy = mirrored(n)[0]
    model, optimizer = build()
    if not restart:
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        return model, optimizer
    model.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(os.path.join(tmp_path, "ckpt"))
    strategy = mirrored(n)[0]
    model, optimizer = build()
    tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path).assert_existing_objects_matched()
    assert int(optimizer._adacons_state.steps.numpy()) == 2
    model.fit(x[2 * BATCH :], y[2 * BATCH :], batch_size=BATCH, shuffle=False, verbose=0)
    return model, optimizer


def test_state_restored_from_a_checkpoint_continues_identically(tmp_path):
    continuous, _ = _train(tmp_path, restart=False)
    restarted, optimizer = _train(tmp_path, restart=True)
    for a, b in zip(continuous.weights, restarted.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(optimizer._adacons_state.steps.numpy()) == 4


def test_diagnostics_show_weights_and_fallbacks():
    n, steps = 3, 2
    x, y = data(steps)
    strategy = mirrored(n)[0]
    with strategy.scope():
        model = _model()
        initial = [w.numpy() for w in model.weights]
        model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.05), combiner="adacons"), loss="mse")
    keys = [f"adasum/adacons/weight_{r}" for r in range(n)] + ["adasum/adacons/fallbacks"]
    logged = []  # what the diagnostics put in each step's logs
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda _, logs: logged.append([logs[k] for k in keys]))
    diagnostics = tf_adasum.AdasumDiagnostics(every_n_steps=1)
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[diagnostics, record])
    # The reference on the same deltas (SGD without momentum; delta mode restores the magnitude).
    oracle, expected = ReferenceAdaCons(restore_magnitude=True), []

    def combine(per_rank):
        result = oracle(per_rank)
        expected.append([*oracle.state["weights"][0], oracle.state["fallbacks"]])
        return result

    simulate(initial, x, y, n, steps, SGD(lr=0.05, momentum=0.0), combine)
    np.testing.assert_allclose(logged, expected, rtol=1e-5, atol=1e-7)
    assert model.optimizer.diagnostics_columns() == list(expected_statistics([np.ones(1)]))  # no tree: no levels
    assert [history.history[k][-1] for k in keys] == logged[-1]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"momentum": 1.0}, ValueError, r"`momentum` must be in \[0, 1\). Received: momentum=1.0"),
        ({"momentum": "high"}, TypeError, "Received: momentum='high'"),
        ({"restore_magnitude": 1}, TypeError, "Received: restore_magnitude=1"),
        ({"per_tensor": "yes"}, TypeError, "Received: per_tensor='yes'"),
    ],
)
def test_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        combiners.AdaCons(**kwargs)


def test_where_adacons_is_refused():
    with pytest.raises(ValueError, match="hierarchical=True"):
        tf_adasum.AdasumOptimizer(keras.optimizers.SGD(), combiner="adacons", hierarchical=True)
    strategy, cross_device_ops = mirrored(2)
    with strategy.scope(), pytest.raises(ValueError, match="not a pair rule"):
        cross_device_ops.batch_reduce_combine([tf.zeros([2])], "adacons")


def test_config_round_trip_and_eval_grid():
    optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(), combiner=combiners.AdaCons(0.99, True, True))
    restored = tf_adasum.AdasumOptimizer.from_config(optimizer.get_config())
    assert restored.combiner == combiners.AdaCons(momentum=0.99, restore_magnitude=True, per_tensor=True)
    configs = cli.build_grid(cli._parse_args(["--combiners", "adacons", "adasum", "mean"]))
    assert [c.combiner for c in configs] == ["adacons", "adasum", "mean"]


@pytest.mark.parametrize("mode", ["gradient", "delta"])
def test_one_replica_is_the_method_of_identical_replicas(mode):
    """Going from 1 to 2 machines must not change the method: one replica gives
    g/(|g| + eps) without restore_magnitude (the gradient-mode default) and the
    inner step with it (the delta-mode default), as two identical replicas do."""
    x, y = data(1)

    def step(n):
        strategy = mirrored(n)[0] if n > 1 else tf.distribute.get_strategy()
        with strategy.scope():
            keras.utils.set_random_seed(3)
            model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
            initial = [w.numpy().astype(np.float64) for w in model.weights]
            model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1), "adacons", mode), loss="mse")
        model.fit(np.concatenate([x] * n), np.concatenate([y] * n), batch_size=BATCH * n, shuffle=False, verbose=0)
        return [w.numpy() - i for w, i in zip(model.weights, initial)], initial

    one, initial = step(1)
    two, _ = step(2)
    for a, b in zip(one, two):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    grads = _local_grads(initial, x, y)
    norm = np.sqrt(sum(np.sum(g**2) for g in grads))
    expected = [-0.1 * g / (norm + reference.ADACONS_EPS) if mode == "gradient" else -0.1 * g for g in grads]
    for got, want in zip(one, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _local_grads(weights, x, y):
    from simulation import _grads

    return _grads(weights, x.astype(np.float64), y.astype(np.float64))


@pytest.mark.parametrize("replicas", [1, 4])
def test_checkpoint_loads_at_another_replica_count(replicas, tmp_path):
    """Saved at 2 replicas, an AdaCons model loads at 1 or 4: the weights and
    the inner optimizer's state load, AdaCons' momentum restarts with a warning."""
    x, y = data(2)
    path = str(tmp_path / "adacons.keras")
    strategy = mirrored(2)[0]
    with strategy.scope():
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
        model.compile(
            optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), "adacons"), loss="mse"
        )
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    model.save(path)
    strategy = mirrored(replicas)[0] if replicas > 1 else tf.distribute.get_strategy()
    with strategy.scope(), pytest.warns(UserWarning, match="saved with 2 replicas and this run has"):
        restored = keras.models.load_model(path)
    for saved, loaded in zip(model.weights, restored.weights):
        np.testing.assert_array_equal(saved.numpy(), loaded.numpy())
    assert int(restored.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy())
    assert int(restored.optimizer._adacons_state.steps.numpy()) == 0
    # It trains on from there: each replica's SGD from the saved momentum (replica
    # 0's), AdaCons from a fresh start, as the reference does it.
    slots = [m.numpy() for m in restored.optimizer.inner_optimizer.momentums]  # in the variables' order
    assert all(np.any(m != 0) for m in slots)
    start = [w.numpy() for w in restored.weights]
    restored.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    oracle = ReferenceAdaCons(restore_magnitude=True)  # delta mode
    expected = simulate(start, x, y, replicas, 2, _SGDFrom(slots, lr=0.1, momentum=0.9), oracle)
    for got, want in zip(restored.weights, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


class _SGDFrom(SGD):
    """The simulation's SGD, every replica starting from the given momentum buffers."""

    def __init__(self, momentums, **kwargs):
        super().__init__(**kwargs)
        self.momentums = momentums

    def init(self, weights):
        return [np.asarray(m, np.float64) for m in self.momentums]
