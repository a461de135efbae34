"""`AdasumOptimizer`: a Keras 3 optimizer that combines replicas' updates with Adasum.

Delta mode (default, as in the paper and Horovod), per step on every replica:

1. undo tf.distribute's loss scaling: gradients reaching the wrapper sum to the
   global mean gradient over replicas, so each is multiplied by the number of
   replicas to give the replica's local mean gradient (under MPI they already
   are each rank's local mean);
2. take one local step of the inner optimizer with it (`tf_adasum.step.keras_step`);
3. delta = weights after - weights before, per variable;
4. combine the deltas of all replicas with the combiner (Adasum by default);
5. every replica sets weights = weights before + combined.

Gradient mode combines the local gradients instead, and the inner optimizer
applies the combined gradient identically on every replica.

How replicas reach each other is one `tf_adasum.engines.base.Engine`, chosen
when the optimizer is built (`tf_adasum.engines.select`) and never asked again.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_adasum import combiners as combiners_lib
from tf_adasum import ops
from tf_adasum.engines import base as engines_base
from tf_adasum.engines import select
from tf_adasum.step import diagnostics as diagnostics_lib
from tf_adasum.step import keras_step, members
from tf_adasum.step import settings as settings_lib
from tf_adasum.step.combine import combine, combine_state
from tf_adasum.step.local_steps import LocalSteps

__all__ = ["AdasumOptimizer"]


@keras.saving.register_keras_serializable(package="tf_adasum")
class AdasumOptimizer(members.InnerOptimizerMembers, keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that data-parallel replicas combine with Adasum.

    Args:
      inner_optimizer: the `keras.optimizers.Optimizer` each replica runs
        locally (its learning rate, schedule, clipping and weight decay apply).
        The wrapper takes over its ``loss_scale_factor`` (and sets the inner
        one to None), as `keras.optimizers.LossScaleOptimizer` does.
      combiner: ``"adasum"``, ``"sum"``, ``"mean"`` (sum / N), ``"adacons"``
        (AdaCons with its defaults), or a combiner object from
        `tf_adasum.combiners` (e.g. ``AdaCons(momentum=0.99)``).
      mode: ``"delta"`` (combine the local updates) or ``"gradient"`` (combine
        the local gradients, then apply the inner optimizer identically).
      backward_passes_per_step: K >= 1. Delta mode: K local inner steps, then
        one combine (``iterations`` counts local steps). Gradient mode: the K
        local gradients are averaged, then combined once.
      hierarchical: average the replicas of one worker (under MPI: the ranks
        of one node) first, then combine across workers.
      backend: ``"tf"`` (TF collective ops over the strategy's replicas),
        ``"mpi"`` (MPI ranks, one replica per process; rank 0's variables are
        broadcast when the optimizer is built), or ``"auto"``: "tf" with a
        multi-replica strategy, else "mpi" when an MPI launcher started this
        process with several ranks, else one replica. Combinations that would
        train each process alone raise.
      compression: None (default), ``"float16"`` or ``"bfloat16"``: float32
        and float64 values cross the wire in that format, for links slower than
        memory; the arithmetic stays float64 on the widened values and the
        replicas stay identical (`tf_adasum.comm.compression`). None takes the
        strategy's `AdasumCrossDeviceOps(compression=...)`, if any.
      use_ema: keep an exponential moving average of the combined weights (as
        in Keras optimizers; the inner optimizer's own `use_ema` is refused).
      ema_momentum: the moving average's momentum, in [0, 1].
      ema_overwrite_frequency: every how many steps the model's weights are
        overwritten by their moving average (None: never; as in Keras).
      loss_scale_factor: the loss scale (default: the inner optimizer's).
      name: the optimizer's name.

    With one replica and K = 1 the wrapper is exactly the inner optimizer (for
    adasum, sum and mean, which are the identity on one replica).

    Examples:
      Two replicas on two logical CPUs of this machine (set up before
      TensorFlow's first operation; with GPUs, ``MirroredStrategy()`` takes
      them all). Build the model and the optimizer in the strategy's scope:

      >>> import keras
      >>> import numpy as np
      >>> import tensorflow as tf
      >>> import tf_adasum
      >>> cpu = tf.config.list_physical_devices("CPU")[0]
      >>> if tf.config.get_logical_device_configuration(cpu) is None:
      ...     tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
      >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
      >>> with strategy.scope():
      ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      ...     optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.Adam(1e-3))
      ...     model.compile(optimizer=optimizer, loss="mse")
      >>> history = model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=8, epochs=1, verbose=0)
      >>> optimizer.engine.num_replicas, int(optimizer.iterations.numpy())  # 2 global batches of 8: 2 steps
      (2, 2)
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        combiner: str | combiners_lib.Combiner = "adasum",
        mode: str = "delta",
        backward_passes_per_step: int = 1,
        hierarchical: bool = False,
        backend: str = "auto",
        compression: str | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        loss_scale_factor: float | None = None,
        name: str | None = None,
        **kwargs: Any,
    ):
        if kwargs:
            raise ValueError(
                f"AdasumOptimizer does not support arguments: `{'`, `'.join(kwargs)}`. Set optimizer "
                "arguments such as `learning_rate`, `clipnorm` or `weight_decay` on `inner_optimizer`."
            )
        if isinstance(inner_optimizer, AdasumOptimizer):
            raise ValueError(
                "`inner_optimizer` must not itself be an AdasumOptimizer. "
                f"Received: inner_optimizer={inner_optimizer!r}"
            )
        settings_lib.check_inner(inner_optimizer)
        keras_step.check_keras_internals(inner_optimizer)
        settings = settings_lib.StepSettings.create(
            combiner=combiner,
            mode=mode,
            backward_passes_per_step=backward_passes_per_step,
            hierarchical=hierarchical,
            backend=backend,
            compression=compression,
        )
        settings_lib.check_bool("use_ema", use_ema)
        if loss_scale_factor is not None and inner_optimizer.loss_scale_factor is not None:
            raise ValueError(
                "Set `loss_scale_factor` on the AdasumOptimizer or on `inner_optimizer`, not both. Received: "
                f"loss_scale_factor={loss_scale_factor}, inner_optimizer.loss_scale_factor="
                f"{inner_optimizer.loss_scale_factor}"
            )
        super().__init__(
            learning_rate=0.0,
            name=name,
            use_ema=use_ema,
            ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor or inner_optimizer.loss_scale_factor,
        )
        inner_optimizer.loss_scale_factor = None  # ours now: nothing is unscaled twice
        self.inner_optimizer = inner_optimizer
        self._settings = settings
        self.engine: engines_base.Engine | None = None
        """How the replicas reach each other (a `tf_adasum.engines.base.Engine`,
        with ``num_replicas``), chosen once when the optimizer is built; None before."""
        self._diagnostics = diagnostics_lib.Recorder()

    # The settings, checked at construction (`tf_adasum.step.settings.StepSettings`).
    combiner = settings_lib.Setting()
    mode = settings_lib.Setting()
    backward_passes_per_step = settings_lib.Setting()
    hierarchical = settings_lib.Setting()
    backend = settings_lib.Setting()
    compression = settings_lib.Setting()

    def build(self, var_list):
        """The wrapper's own: chooses the engine (once), checks that every
        replica has the same variables, builds the inner optimizer, then the
        wrapper's state (local steps, AdaCons, diagnostics)."""
        strategy = self._distribution_strategy
        self.engine = select.make_engine(self.backend, strategy, self.compression)
        self.engine.check_same_variables(var_list)  # before any variable: creating one is a collective
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        count = self._zeros_per_replica("adasum_local_steps", (), "int64")
        self._local_steps = LocalSteps.create(self, var_list, self.backward_passes_per_step, self.mode, count)
        make = self._zeros_per_replica
        self._adacons_state = combine_state(self._settings, make, len(var_list), self.engine.num_replicas)
        if self._diagnostics.enabled:
            self._create_diagnostics()
        self.engine.broadcast_initial(var_list, self.variables)

    def _zeros_per_replica(self, name: str, shape: tuple, dtype: str) -> tf.Variable:
        variable = self.add_variable(shape=shape, dtype=dtype, initializer="zeros", aggregation="none", name=name)
        return keras_step.tf_variable(variable)

    # -- diagnostics (see tf_adasum.AdasumDiagnostics) ------------------------------

    @property
    def num_replicas_combined(self) -> int:
        """The number of replicas whose updates are combined (known once built)."""
        return self.engine.num_replicas if self.engine is not None else self._distribution_strategy.num_replicas_in_sync

    @property
    def diagnostics_enabled(self) -> bool:
        """Whether each combine's statistics are being recorded."""
        return self._diagnostics.variable is not None

    def enable_diagnostics(self) -> None:
        """Records per-tensor statistics of every combine from now on (a few
        float64 scalars per tensor and replica, gathered; no full-size
        communication). Every replica and process must enable them. Traced
        train functions must be traced again for it to take effect."""
        self._diagnostics.enabled = True
        if self.built and self._diagnostics.variable is None:
            self._create_diagnostics()

    def _create_diagnostics(self):
        n = self.engine.num_replicas
        with_levels = isinstance(self.combiner, combiners_lib.Adasum) and not self.hierarchical and n > 1
        self._diagnostics.create(self._distribution_strategy, len(self._trainable_variables), n, with_levels)

    def diagnostics_columns(self) -> list[str]:
        """The names of the diagnostics variable's columns."""
        return self._diagnostics.columns()

    def read_diagnostics(self) -> dict[str, dict[str, float]]:
        """The statistics of the latest combine: ``{variable path: {column: value}}``."""
        return self._diagnostics.read([v.path for v in self._trainable_variables])

    def read_adacons(self) -> dict | None:
        """AdaCons' last weights ``{variable path or "model": [w_0, ... w_N-1]}`` and
        its fallback count, or None for other combiners."""
        if self._adacons_state is None:
            return None
        names = [v.path for v in self._trainable_variables] if self.combiner.per_tensor else ["model"]
        return self._adacons_state.read(names)

    # -- the step ----------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        """The wrapper's own step (see the module docstring): local inner
        steps on every replica, then the combine. Call it in a replica context."""
        trainable_variables = list(self._trainable_variables if trainable_variables is None else trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.in_cross_replica_context():
            raise ValueError("AdasumOptimizer.apply() must be called in a replica context.")
        scale = self.loss_scale_factor
        if self.engine.num_replicas == 1 and self.backward_passes_per_step == 1 and self.combiner.pairwise:
            if scale is not None:  # the inner optimizer's factor is ours: divide exactly once
                grads = [g if g is None else g / scale for g in grads]
            self.inner_optimizer.apply(grads, trainable_variables)
            self._after_combine(tf.distribute.get_strategy(), [])
            return
        grads, variables = self._filter_empty_gradients(list(grads), trainable_variables)
        if not grads:
            return
        # tf.distribute scales each replica's loss by 1/replicas in sync (1 under MPI).
        unscale = tf.distribute.get_strategy().num_replicas_in_sync / (scale or 1.0)
        with keras.name_scope(self.name, caller=self):
            local, finite = zip(*(ops.scale_and_check(g, unscale) for g in grads))
            tf.distribute.get_replica_context().merge_call(
                self._distributed_step, args=(list(local), tf.reduce_all(finite), variables)
            )

    def _distributed_step(self, strategy, grads, finite, keras_variables):
        """Cross-replica context: `grads` are per-replica local mean gradients
        of `keras_variables` (those that have gradients), `finite` whether each
        replica's are all finite."""
        all_finite = engines_base.agree(self.engine, finite, keras_variables)
        step = self._step if self.backward_passes_per_step == 1 else self._accumulating_step

        def run():
            step(strategy, grads, keras_variables)
            return tf.constant(True)

        tf.cond(all_finite, run, lambda: tf.constant(False))

    def _combine(self, per_replica, keras_variables):
        """Combines per-replica values of `keras_variables` over every replica
        (`tf_adasum.step.combine`), then records the diagnostics if enabled."""
        rows = [self._get_variable_index(v) for v in keras_variables]
        state = self._adacons_state
        combined, partials = combine(self.engine, per_replica, self._settings, state, rows, with_partials=True)
        if self._diagnostics.variable is not None:
            self._diagnostics.record(self.engine, per_replica, combined, partials, rows)
        return combined

    def _step(self, strategy, grads, keras_variables):
        variables = [keras_step.tf_variable(v) for v in keras_variables]
        if self.mode == "gradient":
            keras_step.local_update(strategy, self.inner_optimizer, self._combine(grads, keras_variables), variables)
        else:
            start = strategy.extended.call_for_each_replica(lambda: [tf.identity(v) for v in variables])
            keras_step.local_update(strategy, self.inner_optimizer, grads, variables)
            self._combine_deltas(strategy, start, keras_variables)
        self._after_combine(strategy, keras_variables)

    def _accumulating_step(self, strategy, grads, keras_variables):
        variables = [keras_step.tf_variable(v) for v in keras_variables]
        state = self._local_steps
        k = state.k
        is_last = state.is_last()
        own = lambda slots: [keras_step.tf_variable(slots[self._get_variable_index(v)]) for v in keras_variables]  # noqa: E731
        if self.mode == "delta":
            starts = own(state.starts)

            def snapshot():
                for start, variable in zip(starts, variables):
                    start.assign(variable)
                return tf.constant(True)

            tf.cond(state.is_first(), snapshot, lambda: tf.constant(False))
            keras_step.local_update(strategy, self.inner_optimizer, grads, variables)

            def finish():
                start = strategy.extended.call_for_each_replica(lambda: [tf.identity(s) for s in starts])
                self._combine_deltas(strategy, start, keras_variables)
                self._after_combine(strategy, keras_variables)
                return tf.constant(True)

        else:
            accumulators = own(state.accumulators)
            for accumulator, grad in zip(accumulators, grads):
                strategy.extended.update(accumulator, lambda a, g: a.assign_add(g), args=(grad,), group=False)

            def finish():
                mean = strategy.extended.call_for_each_replica(lambda: [a / k for a in accumulators])
                keras_step.local_update(strategy, self.inner_optimizer, self._combine(mean, keras_variables), variables)
                for accumulator in accumulators:
                    accumulator.assign(tf.zeros_like(accumulator))
                self._after_combine(strategy, keras_variables)
                return tf.constant(True)

        tf.cond(is_last, finish, lambda: tf.constant(False))
        state.count.assign_add(1)

    def _combine_deltas(self, strategy, start, keras_variables):
        variables = [keras_step.tf_variable(v) for v in keras_variables]
        deltas = strategy.extended.call_for_each_replica(
            lambda s: [v - s_i for v, s_i in zip(variables, s)], args=(start,)
        )
        combined = self._combine(list(deltas), keras_variables)
        for variable, s, c in zip(variables, list(start), combined):
            strategy.extended.update(variable, lambda v, s, c: v.assign(s + c), args=(s, c), group=False)

    def _after_combine(self, strategy, keras_variables):
        keras_step.apply_constraints(strategy, keras_variables)
        if self.use_ema:
            first = self.iterations <= self._settings.local_steps_per_combine
            keras_step.update_ema(self, self._trainable_variables, first)

    # -- serialisation -------------------------------------------------------------

    def load_own_variables(self, store):
        """As Keras loads an optimizer's variables, except AdaCons' per-replica
        state saved at another replica count: it restarts (momentum from the
        next step's weights, as on a first step), with a warning."""
        state = self._adacons_state
        if state is None or len(store.keys()) != len(self.variables):
            return super().load_own_variables(store)
        values = [store[str(i)] for i in range(len(self.variables))]
        state.load(list(zip(map(keras_step.tf_variable, self.variables), values)), self.engine.num_replicas)

    def get_config(self):
        """The wrapper's settings, with the inner optimizer serialised inside.

        Examples:
          >>> import keras
          >>> import tf_adasum
          >>> optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1), combiner="mean")
          >>> config = optimizer.get_config()
          >>> config["combiner"], config["mode"], config["inner_optimizer"]["class_name"]
          ({'class_name': 'Mean', 'config': {}}, 'delta', 'SGD')
        """
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "combiner": combiners_lib.serialize(self.combiner),
            "mode": self.mode,
            "backward_passes_per_step": self.backward_passes_per_step,
            "hierarchical": self.hierarchical,
            "backend": self.backend,
            "compression": self.compression,
            "use_ema": self.use_ema,
            "ema_momentum": self.ema_momentum,
            "ema_overwrite_frequency": self.ema_overwrite_frequency,
            "loss_scale_factor": self.loss_scale_factor,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds the inner optimizer from `config`, then the wrapper.

        Examples:
          >>> import keras
          >>> import tf_adasum
          >>> optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.Adam(1e-3), backward_passes_per_step=4)
          >>> copy = tf_adasum.AdasumOptimizer.from_config(optimizer.get_config())
          >>> type(copy.inner_optimizer).__name__, copy.backward_passes_per_step, copy.combiner
          ('Adam', 4, Adasum())
        """
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
        return cls(inner, **config)
