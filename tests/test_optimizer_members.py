"""AdasumOptimizer is a Keras optimizer in every public respect.

Every public member of `keras.optimizers.Optimizer` is forwarded to the inner
optimizer, the wrapper's own, or refused (`tf_adasum.step.members`); no
member may be inherited and silently act on state nothing reads. With one
replica the wrapper is exactly its inner optimizer, as Keras' own users
exercise one: single steps, weight decay with exclusions, clipping,
schedules, learning-rate callbacks, saving and loading.
"""

import inspect
import os
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored
from multiprocess import worker
from simulation import BATCH, IN, OUT, data

import tf_adasum
from tf_adasum.step.members import FORWARDED, MEMBERS, OWN, REFUSED, ForwardedToInner

KERAS_OPTIMIZER = keras.optimizers.Optimizer
GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide" / "optimizer.md"


def _keras_public_members() -> set[str]:
    """The class's public methods and properties, and the public attributes its
    constructor sets (read from Keras, so a new one shows up here)."""
    names = {name for name in dir(KERAS_OPTIMIZER) if not name.startswith("_")}
    names |= {name for name in vars(KERAS_OPTIMIZER(learning_rate=0.1)) if not name.startswith("_")}
    return names


def _of_kind(kind):
    return sorted(name for name, (k, _) in MEMBERS.items() if k == kind)


def _wrapper():
    inner = keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.004)
    return tf_adasum.AdasumOptimizer(inner), inner


def _definition(name):
    """Where `AdasumOptimizer` takes `name` from: (class, raw member), or
    (None, None) for an attribute only its instances have (set by Keras' constructor)."""
    owner = next((c for c in tf_adasum.AdasumOptimizer.__mro__ if name in vars(c)), None)
    return (owner, vars(owner)[name]) if owner is not None else (None, None)


def _defined_by_tf_adasum(name) -> bool:
    owner, _ = _definition(name)
    return owner is not None and owner.__module__.startswith("tf_adasum.")


def _sentinel_arguments(name):
    """A distinct object for each parameter of the Keras method `name`."""
    parameters = list(inspect.signature(getattr(KERAS_OPTIMIZER, name)).parameters)[1:]
    return {parameter: object() for parameter in parameters}


# -- each public member holds to its declared kind ---------------------------------


def test_every_public_keras_member_is_declared():
    declared, public = set(MEMBERS), _keras_public_members()
    assert public - declared == set(), "declare these in tf_adasum/step/members.py"
    assert declared - public == set(), "no longer public members of keras.optimizers.Optimizer"
    assert all(kind in (FORWARDED, OWN, REFUSED) and why for kind, why in MEMBERS.values())


@pytest.mark.parametrize("name", _of_kind(FORWARDED) + _of_kind(REFUSED))
def test_forwarded_and_refused_members_are_not_inherited_from_keras(name):
    owner, _ = _definition(name)
    assert _defined_by_tf_adasum(name), f"AdasumOptimizer takes `{name}` from {owner or 'Keras'}: define it"


@pytest.mark.parametrize("name", [n for n in _of_kind(OWN) if _defined_by_tf_adasum(n)])
def test_own_members_defined_by_the_wrapper_say_why(name):
    _, member = _definition(name)
    member = member.__func__ if isinstance(member, classmethod) else member
    assert inspect.getdoc(member), f"AdasumOptimizer.{name} needs a docstring saying why it is the wrapper's own"


@pytest.mark.parametrize("name", [n for n in _of_kind(FORWARDED) if not callable(getattr(KERAS_OPTIMIZER, n, None))])
def test_forwarded_attributes_read_and_set_the_inner_optimizer(name):
    wrapper, inner = _wrapper()
    np.testing.assert_array_equal(np.asarray(getattr(wrapper, name)), np.asarray(getattr(inner, name)))
    keras_attribute = inspect.getattr_static(KERAS_OPTIMIZER, name, None)
    if isinstance(keras_attribute, property) and keras_attribute.fset is None:
        return  # read-only in Keras too (`iterations`)
    setattr(wrapper, name, 0.25)
    np.testing.assert_allclose(np.asarray(getattr(inner, name)), 0.25)
    np.testing.assert_allclose(np.asarray(getattr(wrapper, name)), 0.25)


@pytest.mark.parametrize("name", [n for n in _of_kind(FORWARDED) if callable(getattr(KERAS_OPTIMIZER, n, None))])
def test_forwarded_methods_call_the_inner_optimizer(name):
    wrapper, inner = _wrapper()
    calls = []
    setattr(inner, name, lambda *args, **kwargs: calls.append((args, kwargs)))
    arguments = _sentinel_arguments(name)
    getattr(wrapper, name)(**arguments)
    assert len(calls) == 1
    args, kwargs = calls[0]
    received = inspect.signature(getattr(KERAS_OPTIMIZER, name)).bind(None, *args, **kwargs).arguments
    assert all(received[p] is value for p, value in arguments.items())


@pytest.mark.parametrize("name", _of_kind(REFUSED))
def test_refused_members_raise_naming_the_member_and_the_remedy(name):
    wrapper, _ = _wrapper()
    if callable(getattr(KERAS_OPTIMIZER, name, None)):
        with pytest.raises((NotImplementedError, ValueError), match=rf"AdasumOptimizer\.{name} ") as info:
            getattr(wrapper, name)(**_sentinel_arguments(name))
        assert "apply" in str(info.value)
    else:
        assert getattr(wrapper, name) is None  # its Keras default
        setattr(wrapper, name, None)  # the default is accepted
        with pytest.raises(ValueError, match=rf"`{name}`.*Received: {name}=2"):
            setattr(wrapper, name, 2)


def test_inner_settings_cannot_be_set_before_there_is_an_inner_optimizer():
    class Holder:
        clipnorm = ForwardedToInner()

    holder = Holder()
    holder.clipnorm = None  # Keras' constructor setting its default: dropped
    with pytest.raises(ValueError, match=r"`clipnorm` is the inner optimizer's setting.*clipnorm=1.0"):
        holder.clipnorm = 1.0


def test_set_weights_sets_every_variable_the_wrapper_lists():
    wrapper, inner = _wrapper()
    variable = keras.Variable(np.ones(3, np.float32))
    wrapper.build([variable])
    weights = [np.asarray(v.numpy()) + 1 for v in wrapper.variables]
    wrapper.set_weights(weights)
    for v, w in zip(wrapper.variables, weights):
        np.testing.assert_array_equal(v.numpy(), w)
    assert any(v is inner.iterations for v in wrapper.variables)
    with pytest.raises(ValueError, match=r"`weights` must hold one array per optimizer variable.*Received: 1"):
        wrapper.set_weights(weights[:1])


def test_the_guide_lists_every_member_with_its_kind():
    rows = re.findall(r"^\| `(\w+)` \| (forwarded|own|refused) \| (.+?) \|$", GUIDE.read_text(), re.M)
    assert {name: (kind, why) for name, kind, why in rows} == MEMBERS


# -- exclude_from_weight_decay: the example, every mode and engine ----------


def test_the_excluded_variable_keeps_its_value_wrapped_or_not():
    results = []
    for wrap in (False, True):
        v1, v2 = keras.Variable(2.0), keras.Variable(2.0, name="exclude")
        inner = keras.optimizers.AdamW(learning_rate=1.0, weight_decay=0.004)
        optimizer = tf_adasum.AdasumOptimizer(inner) if wrap else inner
        optimizer.exclude_from_weight_decay(var_names=["exclude"])
        optimizer.apply_gradients(zip([tf.zeros(()), tf.zeros(())], [v1, v2]))
        results.append((float(v1.numpy()), float(v2.numpy())))
    assert results[1] == results[0]
    assert results[0][1] == 2.0 and results[0][0] == pytest.approx(2.0 - 2.0 * 0.004)


GRADS = [np.array([0.5, -0.25], np.float32), np.array([0.125], np.float32)]


def _plain_steps(steps, exclude):
    """What the plain AdamW does with GRADS for `steps` steps."""
    variables = [keras.Variable(np.full(2, 2.0, np.float32), name="kernel"), keras.Variable([2.0], name="bias")]
    optimizer = keras.optimizers.AdamW(learning_rate=0.5, weight_decay=0.1)
    exclude(optimizer, variables)
    optimizer.build(variables)
    for _ in range(steps):
        optimizer.apply_gradients(zip([tf.constant(g) for g in GRADS], variables))
    return [v.numpy() for v in variables]


def _wrapped_steps(n, steps, exclude, when, **kwargs):
    """The wrapper on n replicas, each replica with GRADS (scaled as tf.distribute
    scales them: their sum over replicas is the global mean)."""
    strategy = mirrored(n)[0] if n > 1 else tf.distribute.get_strategy()
    with strategy.scope():
        variables = [keras.Variable(np.full(2, 2.0, np.float32), name="kernel"), keras.Variable([2.0], name="bias")]
        optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.AdamW(learning_rate=0.5, weight_decay=0.1), **kwargs)
        if when == "before build":
            exclude(optimizer, variables)
        optimizer.build(variables)
        if when == "after build":
            exclude(optimizer, variables)

    @tf.function
    def step():
        grads = [tf.constant(g / n) for g in GRADS]
        strategy.run(lambda: optimizer.apply_gradients(zip(grads, variables)))

    for _ in range(steps):
        step()
    return [[v.numpy() for v in strategy.experimental_local_results(variable)] for variable in variables]


EXCLUSIONS = {
    "by name": lambda optimizer, variables: optimizer.exclude_from_weight_decay(var_names=["bias"]),
    "by variable": lambda optimizer, variables: optimizer.exclude_from_weight_decay(var_list=[variables[1]]),
}


@pytest.mark.parametrize("exclusion", sorted(EXCLUSIONS))
@pytest.mark.parametrize("when", ["before build", "after build"])
@pytest.mark.parametrize(
    "n, kwargs",
    [
        (1, {}),
        (2, {}),
        (2, {"mode": "gradient"}),
        (2, {"backward_passes_per_step": 2}),
        (2, {"combiner": "mean", "mode": "gradient", "backward_passes_per_step": 2}),
    ],
    ids=["one replica", "delta", "gradient", "delta K=2", "mean gradient K=2"],
)
def test_exclude_from_weight_decay_reaches_the_inner_optimizer(n, kwargs, when, exclusion):
    exclude = EXCLUSIONS[exclusion]
    steps = 2
    # Gradient mode with K local gradients takes one inner step per K calls.
    inner_steps = steps // kwargs.get("backward_passes_per_step", 1) if kwargs.get("mode") == "gradient" else steps
    expected = _plain_steps(inner_steps, exclude)
    got = _wrapped_steps(n, steps, exclude, when, **kwargs)
    undecayed = _plain_steps(inner_steps, lambda optimizer, variables: None)
    assert not np.allclose(expected[1], undecayed[1])  # the exclusion matters here
    for replicas, want in zip(got, expected):
        for value in replicas:  # every replica, identical to the plain optimizer
            if n == 1:
                assert value.tobytes() == want.tobytes()
            else:
                np.testing.assert_allclose(value, want, rtol=1e-6)


@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param("tf-adasum launch", marks=pytest.mark.multiworker),  # the worker engine (sockets)
        pytest.param("mpirun", marks=pytest.mark.mpi),  # the MPI engine
    ],
)
def test_exclude_from_weight_decay_across_processes(launcher, two_processes):
    """The ``weight_decay`` task of the launch of 2 processes that other tests read too."""
    n, tmp_path = 2, two_processes(launcher)
    results = {}
    for decay in ("excluded", "everywhere"):
        model = worker.dense_model(seed=30)
        adamw = keras.optimizers.AdamW(0.1, weight_decay=0.5)
        if decay == "excluded":
            adamw.exclude_from_weight_decay(var_names=["bias"])
        for _ in range(2):
            adamw.apply_gradients(zip([tf.constant(g) for g in worker.weight_decay_gradients()], model.weights))
        results[decay] = [w.numpy() for w in model.weights]
    assert not np.allclose(results["excluded"][1], results["everywhere"][1])
    for rank in range(n):
        got = np.load(tmp_path / f"weight_decay_rank{rank}.npz")
        for i, want in enumerate(results["excluded"]):
            np.testing.assert_allclose(got[f"arr_{i}"], want, rtol=1e-6, err_msg=f"rank {rank}")


# -- one replica: exactly the inner optimizer, as Keras' users exercise one -----------


def _model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])


INNERS = {
    "sgd nesterov clipvalue": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True, clipvalue=0.1),
    "adam amsgrad clipnorm": lambda: keras.optimizers.Adam(0.01, amsgrad=True, clipnorm=0.2),
    "adamw global_clipnorm": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, global_clipnorm=0.3),
    "rmsprop centered": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "lion schedule": lambda: keras.optimizers.Lion(keras.optimizers.schedules.CosineDecay(0.003, decay_steps=4)),
    "lamb": lambda: keras.optimizers.Lamb(0.01, weight_decay=0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
}


def _fit_pair(inner_fn, before_fit=None, epochs=2, **fit_kwargs):
    """(plain, wrapped): the same model fitted with inner_fn() and with it wrapped."""
    x, y = data(4)
    trained = []
    for wrap in (False, True):
        model = _model()
        inner = inner_fn()
        optimizer = tf_adasum.AdasumOptimizer(inner) if wrap else inner
        if before_fit is not None:
            before_fit(optimizer, model)
        model.compile(optimizer=optimizer, loss="mse")
        history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
        trained.append((model, history))
    return trained


def _assert_bitwise(plain, wrapped):
    assert len(plain.weights) == len(wrapped.weights)
    for a, b in zip(plain.weights, wrapped.weights):
        assert a.numpy().tobytes() == b.numpy().tobytes(), a.path


@pytest.mark.parametrize("inner", sorted(INNERS))
def test_one_replica_fits_exactly_as_the_inner_optimizer(inner):
    (plain, _), (wrapped, _) = _fit_pair(INNERS[inner])
    _assert_bitwise(plain, wrapped)
    assert int(wrapped.optimizer.iterations.numpy()) == int(plain.optimizer.iterations.numpy()) == 8


def test_one_replica_weight_decay_exclusions_as_keras():
    exclude = lambda optimizer, model: optimizer.exclude_from_weight_decay(var_names=["bias"])  # noqa: E731
    (plain, _), (wrapped, _) = _fit_pair(lambda: keras.optimizers.AdamW(0.05, weight_decay=0.5), before_fit=exclude)
    _assert_bitwise(plain, wrapped)
    (decayed, _), _ = _fit_pair(lambda: keras.optimizers.AdamW(0.05, weight_decay=0.5), epochs=2)
    assert decayed.weights[1].numpy().tobytes() != plain.weights[1].numpy().tobytes()  # the exclusion mattered


def test_one_replica_learning_rate_callbacks_as_keras():
    callbacks = lambda: [  # noqa: E731
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5 if epoch else lr),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.2, patience=0, min_delta=1e9),
    ]
    x, y = data(4)
    trained = []
    for wrap in (False, True):
        model = _model()
        inner = keras.optimizers.SGD(0.1, momentum=0.9)
        model.compile(optimizer=tf_adasum.AdasumOptimizer(inner) if wrap else inner, loss="mse")
        history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=callbacks())
        trained.append((model, history.history["learning_rate"], float(np.asarray(inner.learning_rate))))
    (plain, plain_rates, plain_final), (wrapped, wrapped_rates, wrapped_final) = trained
    assert wrapped_rates == plain_rates and wrapped_final == plain_final
    assert plain_final == pytest.approx(0.1 * 0.5 * 0.2 * 0.5 * 0.2)  # both callbacks reached the rate
    _assert_bitwise(plain, wrapped)


def test_one_replica_save_load_and_train_on_as_keras(tmp_path):
    (plain, _), (wrapped, _) = _fit_pair(lambda: keras.optimizers.Adam(0.01), epochs=1)
    x, y = data(4)
    loaded = []
    for name, model in (("plain", plain), ("wrapped", wrapped)):
        path = os.path.join(tmp_path, f"{name}.keras")
        model.save(path)
        again = keras.models.load_model(path)
        again.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        loaded.append(again)
    assert isinstance(loaded[1].optimizer, tf_adasum.AdasumOptimizer)
    _assert_bitwise(*loaded)
    assert int(loaded[1].optimizer.iterations.numpy()) == 8
