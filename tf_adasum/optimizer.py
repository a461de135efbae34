"""`AdasumOptimizer`: a Keras 3 optimizer that combines replicas' updates with Adasum.

Delta mode (default, as in the paper and Horovod), per step on every replica:

1. undo tf.distribute's loss scaling: gradients reaching the wrapper sum to the
   global mean gradient over replicas, so each is multiplied by the number of
   replicas to give the replica's local mean gradient;
2. take one local step of the inner optimizer with it (clipping, weight decay,
   the learning-rate schedule, ``iterations``; its slots stay local);
3. delta = weights after - weights before, per variable;
4. combine the deltas of all replicas with the combiner (Adasum by default);
5. every replica sets weights = weights before + combined.

Gradient mode combines the local gradients instead, and the inner optimizer
applies the combined gradient identically on every replica.

The inner optimizer's own ``apply()`` cannot be used: under a strategy it
SUM-all-reduces gradients. The wrapper drives its per-variable ``update_step``
and does itself what ``apply()`` does.

Engines: the strategy's replicas over TF collective ops (one process, or the
worker processes of a MultiWorkerMirroredStrategy), or MPI ranks (one replica
per process, `tf_adasum.comm.mpi`). Across processes the variable lists are
compared before any optimizer variable is created.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf
from keras.src.saving import serialization_lib

from tf_adasum import adacons as adacons_lib
from tf_adasum import combiners as combiners_lib
from tf_adasum import diagnostics as diagnostics_lib
from tf_adasum import engines
from tf_adasum.comm import mpi as mpi_engine
from tf_adasum.cross_device_ops import AdasumCrossDeviceOps

__all__ = ["AdasumOptimizer"]

MODES = ("delta", "gradient")
BACKENDS = ("auto", "tf", "mpi")


class _DiagnosticsState:
    """Diagnostics bookkeeping, deliberately not trackable (never checkpointed)."""

    def __init__(self):
        self.enabled = False
        self.variable: tf.Variable | None = None
        self.num_replicas = 1
        self.with_levels = False


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


@keras.saving.register_keras_serializable(package="tf_adasum")
class AdasumOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that data-parallel replicas combine with Adasum.

    Args:
      inner_optimizer: the `keras.optimizers.Optimizer` each replica runs
        locally (its learning rate, schedule, clipping and weight decay apply).
      combiner: ``"adasum"``, ``"sum"``, ``"mean"`` (sum / N), or a combiner
        object from `tf_adasum.combiners`.
      mode: ``"delta"`` (combine the local updates) or ``"gradient"`` (combine
        the local gradients, then apply the inner optimizer identically).
      backward_passes_per_step: K >= 1. Delta mode: K local inner steps, then
        one combine (``iterations`` counts local steps). Gradient mode: the K
        local gradients are averaged, then combined once.
      hierarchical: average the replicas of one worker (under MPI: the ranks
        of one node) first, then combine across workers. With a single worker
        (MirroredStrategy) this is plain averaging of the local replicas.
      backend: ``"tf"`` (TF collective ops over the strategy's replicas:
        MirroredStrategy, MultiWorkerMirroredStrategy), ``"mpi"`` (MPI ranks,
        one replica per process; gradients are each rank's local mean, and
        rank 0's variables are broadcast when the optimizer is built), or
        ``"auto"``: "tf" with a multi-replica strategy, else "mpi" when an MPI
        launcher started this process with several ranks, else one replica.
        Combinations that would train each process alone raise.
      use_ema, ema_momentum, ema_overwrite_frequency: exponential moving average
        of the combined weights (as in Keras optimizers). The inner optimizer's
        own ``use_ema`` would average diverged local weights and is refused.
      name: the optimizer's name.

    With one replica and K = 1 the wrapper is exactly the inner optimizer.

    Example:
      >>> with tf.distribute.MirroredStrategy().scope():
      ...     model = make_model()
      ...     model.compile(optimizer=AdasumOptimizer(keras.optimizers.Adam(1e-3)), loss="mse")
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        combiner: str | combiners_lib.Combiner = "adasum",
        mode: str = "delta",
        backward_passes_per_step: int = 1,
        hierarchical: bool = False,
        backend: str = "auto",
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        name: str | None = None,
        **kwargs: Any,
    ):
        if kwargs:
            raise ValueError(
                f"AdasumOptimizer does not support arguments: `{'`, `'.join(kwargs)}`. Set optimizer "
                "arguments such as `learning_rate`, `clipnorm` or `weight_decay` on `inner_optimizer`."
            )
        _check_inner(inner_optimizer)
        combiner = combiners_lib.get(combiner)
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
            raise TypeError(
                "`backward_passes_per_step` must be an int. "
                f"Received: backward_passes_per_step={backward_passes_per_step!r}"
            )
        if backward_passes_per_step < 1:
            raise ValueError(
                "`backward_passes_per_step` must be >= 1. "
                f"Received: backward_passes_per_step={backward_passes_per_step}"
            )
        if not isinstance(hierarchical, bool):
            raise TypeError(f"`hierarchical` must be a bool. Received: hierarchical={hierarchical!r}")
        if hierarchical and not combiner.pairwise:
            raise ValueError(
                f"`hierarchical=True` is not supported with {combiner!r}: its weights compare every replica "
                "with the consensus. Received: hierarchical=True"
            )
        if backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}. Received: backend={backend!r}")
        super().__init__(
            learning_rate=0.0,
            name=name,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
        )
        self.inner_optimizer = inner_optimizer
        self.combiner = combiner
        self.mode = mode
        self.backward_passes_per_step = backward_passes_per_step
        self.hierarchical = hierarchical
        self.backend = backend
        self._own_cross_device_ops: AdasumCrossDeviceOps | None = None
        self._mpi_ops: mpi_engine.MPIOps | None = None
        self._diagnostics = _DiagnosticsState()

    # -- forwarding, as keras.optimizers.LossScaleOptimizer does ---------------

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def build(self, var_list):
        self._check_same_variables(var_list)
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._local_steps = self.add_variable(
            shape=(), dtype="int64", initializer="zeros", aggregation="none", name="adasum_local_steps"
        )
        k = self.backward_passes_per_step
        self._start_weights = []
        self._accumulators = []
        if k > 1 and self.mode == "delta":
            self._start_weights = [self.add_variable_from_reference(v, name="adasum_start") for v in var_list]
        if k > 1 and self.mode == "gradient":
            self._accumulators = [self.add_variable_from_reference(v, name="adasum_accumulator") for v in var_list]
        self._adacons_state = None
        if not self.combiner.pairwise:
            groups = len(var_list) if self.combiner.per_tensor else 1
            shape = (groups, self._num_combined(self._distribution_strategy))
            make = lambda name, shape, dtype: _tf_variable(  # noqa: E731
                self.add_variable(shape=shape, dtype=dtype, initializer="zeros", aggregation="none", name=name)
            )
            self._adacons_state = adacons_lib.AdaConsState(
                momentum=make("adacons_momentum", shape, "float64"),
                weights=make("adacons_weights", shape, "float64"),
                steps=make("adacons_steps", (), "int64"),
                fallbacks=make("adacons_fallbacks", (), "int64"),
            )
        if self._diagnostics.enabled:
            self._create_diagnostics_variable()
        if self._uses_mpi(self._distribution_strategy):
            engines.broadcast_from_rank_0(var_list, self.variables)

    # -- engines -----------------------------------------------------------------

    def _uses_mpi(self, strategy) -> bool:
        """Whether this optimizer combines over MPI ranks (see `backend`)."""
        return engines.uses_mpi(self.backend, strategy)

    def _check_same_variables(self, var_list):
        over_mpi = self._uses_mpi(self._distribution_strategy)
        if over_mpi:
            self._mpi()  # MPI and its sub-communicators, made in the same order on every rank
        engines.check_same_variables(self._distribution_strategy, var_list, over_mpi)

    def _mpi(self) -> mpi_engine.MPIOps:
        if self._mpi_ops is None:
            with tf.init_scope():
                self._mpi_ops = mpi_engine.MPIOps()
        return self._mpi_ops

    # -- diagnostics (see tf_adasum.AdasumDiagnostics) ------------------------------

    def enable_diagnostics(self) -> None:
        """Records per-tensor statistics of every combine from now on (a few
        float64 scalars per tensor, no extra full-size communication). Traced
        train functions must be traced again for it to take effect."""
        strategy = self._distribution_strategy
        if self._uses_mpi(strategy) or engines.num_workers(strategy) > 1:
            raise NotImplementedError(
                "AdasumDiagnostics is available on one worker (MirroredStrategy) only: across worker "
                "processes or MPI ranks each process sees only its own replicas' deltas."
            )
        self._diagnostics.enabled = True
        if self.built and self._diagnostics.variable is None:
            self._create_diagnostics_variable()

    def _create_diagnostics_variable(self):
        strategy = self._distribution_strategy
        state = self._diagnostics
        state.num_replicas = strategy.num_replicas_in_sync
        state.with_levels = isinstance(self._effective_combiner(), combiners_lib.Adasum) and state.num_replicas > 1
        width = len(diagnostics_lib.columns(state.num_replicas, state.with_levels))
        with strategy.scope(), tf.init_scope():
            state.variable = tf.Variable(
                tf.fill([len(self._trainable_variables), width], tf.constant(float("nan"), tf.float64)),
                dtype=tf.float64,
                trainable=False,
                name="adasum_diagnostics",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )

    def diagnostics_columns(self) -> list[str]:
        """The names of the diagnostics variable's columns."""
        return diagnostics_lib.columns(self._diagnostics.num_replicas, self._diagnostics.with_levels)

    def read_adacons(self) -> dict | None:
        """AdaCons' last weights ``{variable path or "model": [w_0, ... w_N-1]}`` and
        its fallback count, or None for other combiners."""
        state = self._adacons_state
        if state is None:
            return None
        weights = state.weights.numpy()
        names = [v.path for v in self._trainable_variables] if self.combiner.per_tensor else ["model"]
        return {
            "weights": {name: [float(w) for w in row] for name, row in zip(names, weights)},
            "fallbacks": int(state.fallbacks.numpy()),
        }

    def read_diagnostics(self) -> dict[str, dict[str, float]]:
        """The statistics of the latest combine: ``{variable path: {column: value}}``."""
        if self._diagnostics.variable is None:
            raise ValueError("Diagnostics are not enabled: attach a tf_adasum.AdasumDiagnostics callback.")
        values = self._diagnostics.variable.numpy()
        columns = self.diagnostics_columns()
        return {
            variable.path: dict(zip(columns, map(float, row)))
            for variable, row in zip(self._trainable_variables, values)
        }

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    # -- the step ----------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError("AdasumOptimizer.apply() must be called in a replica context.")
        strategy = tf.distribute.get_strategy()
        num_replicas = strategy.num_replicas_in_sync
        if num_replicas == 1 and not self._uses_mpi(strategy) and self.backward_passes_per_step == 1:
            self.inner_optimizer.apply(grads, trainable_variables)
            self._update_ema()
            return
        grads, variables = self._filter_empty_gradients(list(grads), trainable_variables)
        if not grads:
            return
        unscale = float(num_replicas) / (self.inner_optimizer.loss_scale_factor or 1.0)
        with keras.name_scope(self.name, caller=self):
            local = [tf.convert_to_tensor(g) * tf.cast(unscale, g.dtype) for g in grads]
            tf.distribute.get_replica_context().merge_call(self._distributed_step, args=(local, variables))

    def _cross_device_ops(self, strategy):
        """What combines: MPI ranks, or the strategy's replicas over TF collectives
        (the strategy's AdasumCrossDeviceOps if it has one, else our own with the
        strategy's communication options, e.g. its collective timeout)."""
        if self._uses_mpi(strategy):
            return self._mpi()
        ours = getattr(strategy.extended, "_cross_device_ops", None)
        if isinstance(ours, AdasumCrossDeviceOps):
            return ours
        if self._own_cross_device_ops is None:
            options = getattr(strategy.extended, "_communication_options", None)
            self._own_cross_device_ops = AdasumCrossDeviceOps(options=options)
        return self._own_cross_device_ops

    def _num_combined(self, strategy) -> int:
        """The number of replicas whose updates are combined."""
        return self._mpi().num_replicas if self._uses_mpi(strategy) else strategy.num_replicas_in_sync

    def _effective_combiner(self) -> combiners_lib.Combiner:
        # For diagnostics, on one worker: the hierarchical combine is the mean of the local replicas.
        return combiners_lib.Mean() if self.hierarchical else self.combiner

    def _distributed_step(self, strategy, grads, keras_variables):
        """Cross-replica context: grads are per-replica local mean gradients of
        `keras_variables` (those that have gradients)."""
        combine = self._make_combine(strategy, keras_variables)
        cross = self._cross_device_ops(strategy)
        mpi_sum = cross.sum if isinstance(cross, mpi_engine.MPIOps) else None
        all_finite = engines.agree(strategy, grads, keras_variables, self._num_combined(strategy), mpi_sum)
        k = self.backward_passes_per_step

        def step():
            if k == 1:
                self._step(strategy, combine, grads, keras_variables)
            else:
                self._accumulating_step(strategy, combine, grads, keras_variables)
            return tf.constant(True)

        tf.cond(all_finite, step, lambda: tf.constant(False))

    def _make_combine(self, strategy, keras_variables):
        cross_device_ops = self._cross_device_ops(strategy)
        combiner = self.combiner
        record = self._diagnostics.variable is not None

        hierarchical = self.hierarchical

        def combine(per_replica):
            if isinstance(cross_device_ops, mpi_engine.MPIOps) and combiner.pairwise:
                return cross_device_ops.batch_reduce_combine(per_replica, combiner, hierarchical=hierarchical)
            if not combiner.pairwise:
                rows = [self._get_variable_index(v) for v in keras_variables] if combiner.per_tensor else [0]
                restore = combiner.restore_magnitude
                restore = self.mode == "delta" if restore is None else restore
                combined = adacons_lib.combine(
                    strategy, cross_device_ops, per_replica, combiner, self._adacons_state, rows, restore
                )
                partials = []
            elif record:
                combined, partials = cross_device_ops.batch_reduce_combine(
                    per_replica, self.combiner, with_partials=True, hierarchical=hierarchical
                )
            else:
                return cross_device_ops.batch_reduce_combine(per_replica, self.combiner, hierarchical=hierarchical)
            if record:
                self._record_diagnostics(strategy, per_replica, combined, partials)
            return combined

        return combine

    def _record_diagnostics(self, strategy, per_replica, combined, partials):
        """Per-tensor statistics of one combine, from values every replica already has."""
        local = strategy.experimental_local_results
        statistics = diagnostics_lib.statistics(
            deltas=[list(replica) for replica in zip(*[local(value) for value in per_replica])],
            combined=[local(value)[0] for value in combined],
            partials=list(local(partials)),
            with_levels=self._diagnostics.with_levels,
        )
        self._diagnostics.variable.assign(statistics)

    def _step(self, strategy, combine, grads, keras_variables):
        variables = [_tf_variable(v) for v in keras_variables]
        if self.mode == "gradient":
            self._local_update(strategy, combine(grads), variables)
        else:
            start = strategy.extended.call_for_each_replica(lambda: [tf.identity(v) for v in variables])
            self._local_update(strategy, grads, variables)
            self._combine_deltas(strategy, combine, start, variables)
        self._after_combine(strategy, keras_variables)

    def _accumulating_step(self, strategy, combine, grads, keras_variables):
        variables = [_tf_variable(v) for v in keras_variables]
        k = self.backward_passes_per_step
        local_step = self._local_steps.value
        is_last = tf.equal((local_step + 1) % k, 0)
        if self.mode == "delta":
            starts = [_tf_variable(self._start_weights[self._get_variable_index(v)]) for v in keras_variables]

            def snapshot():
                for start, variable in zip(starts, variables):
                    start.assign(variable)
                return tf.constant(True)

            tf.cond(tf.equal(local_step % k, 0), snapshot, lambda: tf.constant(False))
            self._local_update(strategy, grads, variables)

            def finish():
                start = strategy.extended.call_for_each_replica(lambda: [tf.identity(s) for s in starts])
                self._combine_deltas(strategy, combine, start, variables)
                self._after_combine(strategy, keras_variables)
                return tf.constant(True)

        else:
            accumulators = [_tf_variable(self._accumulators[self._get_variable_index(v)]) for v in keras_variables]
            for accumulator, grad in zip(accumulators, grads):
                strategy.extended.update(accumulator, lambda a, g: a.assign_add(g), args=(grad,), group=False)

            def finish():
                mean = strategy.extended.call_for_each_replica(lambda: [a / k for a in accumulators])
                self._local_update(strategy, combine(mean), variables)
                for accumulator in accumulators:
                    accumulator.assign(tf.zeros_like(accumulator))
                self._after_combine(strategy, keras_variables)
                return tf.constant(True)

        tf.cond(is_last, finish, lambda: tf.constant(False))
        self._local_steps.assign_add(1)

    def _local_update(self, strategy, grads, variables):
        """One inner step on every replica with its own gradients (what `apply()` does)."""
        inner = self.inner_optimizer
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

    def _combine_deltas(self, strategy, combine, start, variables):
        deltas = strategy.extended.call_for_each_replica(
            lambda s: [v - s_i for v, s_i in zip(variables, s)], args=(start,)
        )
        combined = combine(list(deltas))
        start = list(start)
        for variable, s, c in zip(variables, start, combined):
            strategy.extended.update(variable, lambda v, s, c: v.assign(s + c), args=(s, c), group=False)

    def _after_combine(self, strategy, keras_variables):
        for keras_variable in keras_variables:
            if keras_variable.constraint is not None:
                strategy.extended.update(
                    _tf_variable(keras_variable), lambda v, c=keras_variable.constraint: v.assign(c(v)), group=False
                )
        self._update_ema()

    def _update_ema(self):
        """EMA of the combined weights, after each combine, as Keras does after each step.

        The averages, one per variable the optimizer was built with (whatever
        subset a step updates), start at zero; the first combine copies the weights.
        """
        if not self.use_ema:
            return
        local_steps_per_combine = self.backward_passes_per_step if self.mode == "delta" else 1
        first = self.iterations <= local_steps_per_combine
        for variable, average in zip(self._trainable_variables, self._model_variables_moving_average):
            momentum = tf.where(first, tf.zeros([], variable.dtype), tf.cast(self.ema_momentum, variable.dtype))
            average.assign(momentum * average + (1 - momentum) * variable)
        if self.ema_overwrite_frequency:
            overwrite = tf.equal(self.iterations % self.ema_overwrite_frequency, 0)

            def do_overwrite():
                self._overwrite_model_variables_with_average_value(self._trainable_variables)
                return tf.constant(True)

            tf.cond(overwrite, do_overwrite, lambda: tf.constant(False))

    # -- serialisation -------------------------------------------------------------

    def get_config(self):
        combiner = self.combiner
        return {
            "name": self.name,
            "inner_optimizer": serialization_lib.serialize_keras_object(self.inner_optimizer),
            "combiner": combiners_lib.serialize(combiner),
            "mode": self.mode,
            "backward_passes_per_step": self.backward_passes_per_step,
            "hierarchical": self.hierarchical,
            "backend": self.backend,
            "use_ema": self.use_ema,
            "ema_momentum": self.ema_momentum,
            "ema_overwrite_frequency": self.ema_overwrite_frequency,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = serialization_lib.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)


def _check_inner(inner) -> None:
    if isinstance(inner, AdasumOptimizer):
        raise ValueError("`inner_optimizer` must not itself be an AdasumOptimizer.")
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` must not be a LossScaleOptimizer: put it outside, "
            "LossScaleOptimizer(AdasumOptimizer(inner)), so that the loss scale applies to the "
            "combined step (model.compile does this itself under the mixed_float16 policy). "
            f"Received: inner_optimizer={inner!r}"
        )
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer`. "
            f"Received: inner_optimizer={inner!r} of type {type(inner).__name__}"
        )
    if inner.use_ema:
        raise ValueError(
            "`inner_optimizer` must not use EMA: it would average each replica's diverged local weights. "
            "Set `use_ema=True` on the AdasumOptimizer instead, which averages the combined weights. "
            "Received: inner_optimizer.use_ema=True"
        )
    if inner.gradient_accumulation_steps:
        raise ValueError(
            "`inner_optimizer` must not use `gradient_accumulation_steps`; use the AdasumOptimizer's "
            "`backward_passes_per_step` instead. Received: inner_optimizer.gradient_accumulation_steps="
            f"{inner.gradient_accumulation_steps}"
        )
