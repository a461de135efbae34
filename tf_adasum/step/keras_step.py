"""What a Keras 3 optimizer's ``apply()`` does, done per replica: the one module
touching the inner optimizer's and Keras' private functions.

A Keras optimizer's own ``apply()`` SUM-all-reduces gradients under a
strategy, so `tf_adasum.AdasumOptimizer` cannot call it with replicas' local
gradients. These functions take over its parts, in cross-replica context,
each replica with its own gradients: clipping (``_clip_gradients``), weight
decay (``_use_weight_decay``), the per-variable ``update_step``, the
``iterations`` count, constraints, and the EMA of the combined weights
(``_model_variables_moving_average``, ``_overwrite_model_variables_with_average_value``);
the epoch a resumed `fit` starts from (``Model._initial_epoch``); and the
model's random-number generators (``Layer._seed_generators`` over
``Model._flatten_layers``).
Every private name used is checked once (`check_keras_internals`), so a Keras
release that renames one fails loudly at construction, never silently.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

__all__ = [
    "apply_constraints",
    "check_keras_internals",
    "has_initial_epoch",
    "local_update",
    "seed_states",
    "set_initial_epoch",
    "tf_variable",
    "update_ema",
]

_OPTIMIZER_INTERNALS = (
    "_clip_gradients",
    "_use_weight_decay",
    "_overwrite_model_variables_with_average_value",
    "_filter_empty_gradients",
)


def check_keras_internals(optimizer: keras.optimizers.Optimizer) -> None:
    """Raises if this Keras lacks a private optimizer method the wrapper drives."""
    missing = [name for name in _OPTIMIZER_INTERNALS if not hasattr(optimizer, name)]
    if missing:
        raise RuntimeError(
            f"tf_adasum needs keras.optimizers.Optimizer.{', '.join(missing)}, which this Keras "
            f"({keras.__version__}) does not have. Please report it with your Keras version."
        )


def tf_variable(variable):
    """The `tf.Variable` behind a `keras.Variable` (or the variable itself)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def local_update(strategy, inner: keras.optimizers.Optimizer, grads, variables: Sequence) -> None:
    """One inner step on every replica with its own `grads` (per-replica
    values): clipping, weight decay, ``update_step``, ``iterations`` + 1."""
    grads = strategy.extended.call_for_each_replica(lambda *g: inner._clip_gradients(list(g)), args=tuple(grads))
    learning_rate = inner.learning_rate
    if inner.weight_decay is not None:

        def decay(variable):
            if inner._use_weight_decay(variable):
                lr = tf.cast(learning_rate, variable.dtype)
                variable.assign_sub(variable * tf.cast(inner.weight_decay, variable.dtype) * lr)

        for variable in variables:
            strategy.extended.update(variable, decay, group=False)
    for grad, variable in zip(grads, variables):
        strategy.extended.update(
            variable, lambda v, g: inner.update_step(g, v, learning_rate), args=(grad,), group=False
        )
    inner.iterations.assign_add(1)


def apply_constraints(strategy, keras_variables: Sequence) -> None:
    """Each variable's Keras constraint, applied after a combine."""
    for keras_variable in keras_variables:
        if keras_variable.constraint is not None:
            strategy.extended.update(
                tf_variable(keras_variable), lambda v, c=keras_variable.constraint: v.assign(c(v)), group=False
            )


def update_ema(optimizer: keras.optimizers.Optimizer, variables: Sequence, first: tf.Tensor) -> None:
    """The EMA of `variables` (those the optimizer was built with), as Keras
    updates it after each step; `first` (a bool tensor) copies the weights.
    Every `ema_overwrite_frequency` iterations the weights take the averages."""
    for variable, average in zip(variables, optimizer._model_variables_moving_average):
        momentum = tf.where(first, tf.zeros([], variable.dtype), tf.cast(optimizer.ema_momentum, variable.dtype))
        average.assign(momentum * average + (1 - momentum) * variable)
    if optimizer.ema_overwrite_frequency:
        overwrite = tf.equal(optimizer.iterations % optimizer.ema_overwrite_frequency, 0)

        def do_overwrite():
            optimizer._overwrite_model_variables_with_average_value(variables)
            return tf.constant(True)

        tf.cond(overwrite, do_overwrite, lambda: tf.constant(False))


def seed_states(model: keras.Model) -> list[tf.Variable]:
    """The state variables (int64 ``[2]``) of every `keras.random.SeedGenerator`
    the model's layers hold (dropout, random augmentation), once each, in
    layer order. A generator's next seed is its state, which it then advances
    by ``[0, 1]``. Raises if this Keras lacks the private names it reads."""
    if not hasattr(model, "_flatten_layers"):
        raise RuntimeError(f"This Keras ({keras.__version__}) has no Model._flatten_layers; tf_adasum needs it.")
    states, seen = [], set()
    for layer in model._flatten_layers(include_self=True):
        if not hasattr(layer, "_seed_generators"):
            raise RuntimeError(f"This Keras ({keras.__version__}) has no Layer._seed_generators; tf_adasum needs it.")
        for generator in layer._seed_generators:
            if id(generator.state) not in seen:
                seen.add(id(generator.state))
                states.append(tf_variable(generator.state))
    return states


def has_initial_epoch(model: keras.Model) -> bool:
    """Whether this Keras has the private ``Model._initial_epoch`` that
    `keras.callbacks.BackupAndRestore` sets (and `set_initial_epoch` uses)."""
    return hasattr(model, "_initial_epoch")


def set_initial_epoch(model: keras.Model, epoch: int | None) -> None:
    """The epoch `fit` starts from, as `keras.callbacks.BackupAndRestore` sets it
    (None: `fit`'s own ``initial_epoch``)."""
    if not has_initial_epoch(model):
        raise RuntimeError(
            "tf_adasum sets the epoch to resume from through keras.Model._initial_epoch (as "
            f"keras.callbacks.BackupAndRestore does), which Keras {keras.__version__} no longer has."
        )
    model._initial_epoch = epoch


def skip_train_calls(model: keras.Model, calls: int) -> None:
    """Makes the next `calls` calls of `model.train_function` (which `fit`
    made before ``on_train_begin``) read their batches and train on none:
    the batches of a resumed epoch that its backup holds already. Then the
    train function is `fit`'s own again."""
    train_function = getattr(model, "train_function", None)
    if not callable(train_function):
        raise RuntimeError(
            "tf_adasum resumes inside an epoch through keras.Model.train_function, made by `fit` before "
            f"`on_train_begin`; with Keras {keras.__version__} it is {train_function!r} there."
        )
    left = [calls]

    def skipping(iterator):
        left[0] -= 1
        if left[0] <= 0:
            model.train_function = train_function
        for _ in range(model.steps_per_execution):
            next(iterator)  # the end of the data ends the epoch, as in `fit`
        return {}

    skipping.tf_adasum_original = train_function
    if calls > 0:
        model.train_function = skipping


def restore_train_function(model: keras.Model) -> None:
    """`fit`'s own train function again, if `skip_train_calls` left its
    wrapper in place (a `fit` that ended while skipping)."""
    original = getattr(getattr(model, "train_function", None), "tf_adasum_original", None)
    if original is not None:
        model.train_function = original
