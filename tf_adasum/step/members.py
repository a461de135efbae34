"""What each public member of `keras.optimizers.Optimizer` is on `tf_adasum.AdasumOptimizer`.

The wrapper holds an inner optimizer, as `keras.optimizers.LossScaleOptimizer`
does. A member it inherited from Keras and never looked at would act on the
wrapper's own bookkeeping, which nothing reads: a call that silently changes
nothing (``exclude_from_weight_decay`` once did exactly that). So every public
member of the Keras class is declared here as one of:

* ``FORWARDED``: reads and calls reach the inner optimizer, which applies them
  (``weight_decay``, clipping, ``exclude_from_weight_decay``, ...);
* ``OWN``: the wrapper's own, for the reason given (its step, its EMA, its
  loss scale, its serialisation, ...);
* ``REFUSED``: calling it, or setting it to anything but its default, raises an
  error naming the member and what to do instead.

`InnerOptimizerMembers` holds the forwarded and refused members and those
whose Keras behaviour the wrapper changes; the rest of its own are in
`tf_adasum.optimizer`. `MEMBERS` covers the class's methods and properties and
the public attributes a Keras optimizer sets in its constructor;
``tests/test_optimizer_members.py``
holds each member to its kind and fails on a member Keras adds, so an upgrade
cannot slip one through unnoticed. The optimizer guide's table is this table.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FORWARDED", "MEMBERS", "OWN", "REFUSED", "ForwardedToInner", "InnerOptimizerMembers"]

FORWARDED = "forwarded"
OWN = "own"
REFUSED = "refused"

#: ``{member: (kind, why)}`` for every public member of `keras.optimizers.Optimizer`.
MEMBERS: dict[str, tuple[str, str]] = {
    # The inner optimizer's settings: it applies them in each local step.
    "weight_decay": (FORWARDED, "the inner optimizer applies weight decay in each local step"),
    "clipnorm": (FORWARDED, "the inner optimizer clips each replica's local gradient"),
    "clipvalue": (FORWARDED, "the inner optimizer clips each replica's local gradient"),
    "global_clipnorm": (FORWARDED, "the inner optimizer clips each replica's local gradient"),
    "exclude_from_weight_decay": (FORWARDED, "the inner optimizer decides which variables decay"),
    "learning_rate": (FORWARDED, "the inner optimizer's rate (or schedule), which its step uses"),
    "iterations": (FORWARDED, "the inner optimizer's step count: local steps, which schedules follow"),
    "finalize_variable_values": (
        FORWARDED,
        "the inner optimizer's, then the wrapper's own EMA overwrites the weights if `use_ema`",
    ),
    # The wrapper's own: what it adds around the inner optimizer.
    "name": (OWN, "the wrapper's name, which scopes its own variables"),
    "built": (OWN, "whether the wrapper (and so its engine and inner optimizer) is built"),
    "build": (OWN, "chooses the engine, builds the inner optimizer, then the wrapper's own state"),
    "apply": (OWN, "the step: local inner steps on every replica, then the combine"),
    "apply_gradients": (OWN, "`apply` with (gradient, variable) pairs, as in Keras"),
    "variables": (OWN, "the wrapper's own variables followed by the inner optimizer's (all saved)"),
    "set_weights": (OWN, "sets `variables`: the wrapper's own and the inner optimizer's, in that order"),
    "save_own_variables": (OWN, "saves `variables`, the inner optimizer's included"),
    "load_own_variables": (OWN, "loads `variables`; AdaCons state saved at another replica count restarts"),
    "get_config": (OWN, "the wrapper's settings with the inner optimizer serialised inside"),
    "from_config": (OWN, "rebuilds the inner optimizer, then the wrapper"),
    "loss_scale_factor": (OWN, "taken over from the inner optimizer, so gradients are unscaled once"),
    "scale_loss": (OWN, "scales by the wrapper's `loss_scale_factor` (the inner one is None)"),
    "use_ema": (OWN, "an EMA of the combined weights (the inner optimizer's own EMA is refused)"),
    "ema_momentum": (OWN, "the momentum of the wrapper's EMA"),
    "ema_overwrite_frequency": (OWN, "how often the wrapper's EMA overwrites the weights"),
    "add_variable": (OWN, "creates a variable of the wrapper's own state (saved with `variables`)"),
    "add_variable_from_reference": (OWN, "creates a variable of the wrapper's own state, shaped like a weight"),
    "add_optimizer_variables": (OWN, "creates variables of the wrapper's own state, shaped like weights"),
    "assign": (OWN, "assigns a value to a given variable; reads no optimizer state"),
    "assign_add": (OWN, "adds a value to a given variable; reads no optimizer state"),
    "assign_sub": (OWN, "subtracts a value from a given variable; reads no optimizer state"),
    # Refused: no meaning on a wrapper whose step combines replicas.
    "update_step": (
        REFUSED,
        "one variable's step without the combine; use `apply`, or the inner optimizer's `update_step`",
    ),
    "stateless_apply": (REFUSED, "unsupported on TensorFlow's Keras backend; use `apply` or `apply_gradients`"),
    "gradient_accumulation_steps": (REFUSED, "use the wrapper's `backward_passes_per_step` instead"),
}


class ForwardedToInner:
    """A public attribute of the inner optimizer, read and set through the wrapper.

    Keras' optimizer constructor sets each of these attributes to its default
    before the wrapper has attached its inner optimizer; that first assignment
    is dropped (the inner optimizer keeps its own value), any other before then
    is an error.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, wrapper: Any, owner: type | None = None) -> Any:
        if wrapper is None:
            return self
        return getattr(wrapper.inner_optimizer, self.name)

    def __set__(self, wrapper: Any, value: Any) -> None:
        inner = wrapper.__dict__.get("inner_optimizer")
        if inner is not None:
            setattr(inner, self.name, value)
        elif value is not None:
            raise ValueError(
                f"`{self.name}` is the inner optimizer's setting; set it there. Received: {self.name}={value!r}"
            )


class InnerOptimizerMembers:
    """The members of `keras.optimizers.Optimizer` that `tf_adasum.AdasumOptimizer`
    forwards to its ``inner_optimizer``, refuses, or whose Keras behaviour it
    changes (as `keras.optimizers.LossScaleOptimizer` forwards its own); placed
    before the Keras class among the wrapper's bases. `MEMBERS` says why for each.
    """

    weight_decay = ForwardedToInner()
    clipnorm = ForwardedToInner()
    clipvalue = ForwardedToInner()
    global_clipnorm = ForwardedToInner()

    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        """Excludes variables from the inner optimizer's weight decay, as
        `keras.optimizers.Optimizer.exclude_from_weight_decay` (forwarded: the
        inner optimizer applies the decay in each replica's local step)."""
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def finalize_variable_values(self, var_list) -> None:
        """The inner optimizer's, then the wrapper's EMA (if `use_ema`)
        overwrites `var_list` with its averages, as Keras does at the end of `fit`."""
        self.inner_optimizer.finalize_variable_values(var_list)
        super().finalize_variable_values(var_list)

    @property
    def gradient_accumulation_steps(self) -> None:
        """Always None: the wrapper accumulates with `backward_passes_per_step`."""
        return None

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value) -> None:
        if value is not None:
            raise ValueError(
                "AdasumOptimizer does not use `gradient_accumulation_steps`; set `backward_passes_per_step` "
                f"when constructing it instead. Received: gradient_accumulation_steps={value!r}"
            )

    def update_step(self, gradient, variable, learning_rate):
        """Refused: one variable's step would skip the combine. Use `apply` (or
        `apply_gradients`); the inner optimizer's `update_step` is its local step."""
        raise NotImplementedError(
            "AdasumOptimizer.update_step is not available: the wrapper's step combines every replica's "
            "update, in `apply()` or `apply_gradients()`. Call those, or the inner optimizer's `update_step` "
            "for a local step."
        )

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """Refused, as by every Keras optimizer on the TensorFlow backend."""
        raise ValueError(
            "AdasumOptimizer.stateless_apply is not supported: Keras' TensorFlow backend refuses it "
            "(it is incompatible with tf.distribute). Use `apply()` or `apply_gradients()`."
        )

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (forwarded; settable, as in Keras)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        """The inner optimizer's step count (forwarded): local steps, which its
        learning-rate schedule follows."""
        return self.inner_optimizer.iterations

    @property
    def variables(self):
        """The wrapper's own variables, then the inner optimizer's: what a
        checkpoint or `.keras` file saves (as `keras.optimizers.LossScaleOptimizer`)."""
        return self._variables + self.inner_optimizer.variables

    def set_weights(self, weights) -> None:
        """Sets `variables` (the wrapper's own, then the inner optimizer's) from
        `weights`, as many arrays in that order."""
        if not self.built:
            raise ValueError(
                "AdasumOptimizer.set_weights() needs a built optimizer; call `optimizer.build(trainable_variables)` "
                "first."
            )
        variables = self.variables
        if len(weights) != len(variables):
            raise ValueError(
                f"`weights` must hold one array per optimizer variable ({len(variables)}). "
                f"Received: {len(weights)} arrays"
            )
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != tuple(weight.shape):
                raise ValueError(
                    f"`weights` must match the shapes of `variables`: {variable.path} has shape "
                    f"{tuple(variable.shape)}. Received: an array of shape {tuple(weight.shape)}"
                )
            variable.assign(weight)
