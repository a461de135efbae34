"""`SimulatedReplicas`: N data-parallel replicas of a Keras model, in one process.

"What would Adasum do on 256 workers?", answered on a laptop. Each training
step takes a global batch of N x b examples; replica i takes rows
``[i*b, (i+1)*b)`` (as `tf.distribute.MirroredStrategy` splits a batch), and
the replicas are computed one after another with the semantics of
`tf_adasum.AdasumOptimizer` on N real replicas:

* delta mode (default): each replica has its own state of the inner optimizer
  (its moments and its ``iterations``), takes its local step (K local steps
  with ``backward_passes_per_step=K``) from the weights of the last combine,
  and the N deltas are combined;
* gradient mode: the N local mean gradients (over K passes) are combined and
  the inner optimizer applies the result once;
* a step in which any replica's gradient is not finite is skipped by all;
* the combine is `tf_adasum.engines.simulated.SimulatedEngine`'s: the same
  tree, float64 partial sums and AdaCons as N replicas (tested bitwise against
  a 4-replica MirroredStrategy).

Precision: the model's own dtype for the forward and backward passes and the
inner step; the combine's dot products and coefficients in float64, as in
`tf_adasum.reference`.

Where it differs from N real replicas:

* Every batch must hold a multiple of N rows (a strategy spreads an uneven
  last batch); give `fit` a ``tf.data`` stream batched with
  ``drop_remainder=True`` or that repeats, as the example does.
* Non-trainable state (e.g. BatchNormalization's moving statistics) is one
  copy that every replica's forward pass updates in turn, not N copies
  updated from the same start: a model with such state trains differently.
* Random layers (dropout, random augmentation) draw per replica from a seed
  of their own: at step t replica j's generators start from the state at
  the first step plus ``[t, j * 2**32]`` (`tf_adasum.step.keras_step.seed_states`),
  so a replica's draws depend on its number and the step, not on which
  process computes it or in what order.
* Every trainable variable needs a gradient (`AdasumOptimizer` skips one
  without, as Keras does).

Checkpoints: the wrapped model holds the combined weights, or replica 0's
between combines of K local steps, and the inner optimizer replica 0's state,
as a checkpoint of a strategy's replicas stores them. After a restore (any
change of the inner optimizer's variables from outside, e.g. by
`keras.callbacks.BackupAndRestore`), every replica starts from the restored
state, as real replicas do, and a cycle of K local steps starts afresh.

Memory: per replica one copy of the inner optimizer's state (and with K > 1
of the weights, or in gradient mode of the gradients); time: about N times one
replica's step at batch b, plus the tree.

**Logical replicas: one job, any number of processes.** Under ``mpirun``
(``backend="auto"`` or ``"mpi"``) the N replicas are spread over the M ranks:
rank p holds the N / M contiguous replicas ``p*N/M .. (p+1)*N/M - 1`` and
reads their rows of every global batch (each process reads the whole global
batch and keeps its rows: give every process the same input pipeline), the
tree's lower levels run inside each rank and the upper ones across ranks
(`tf_adasum.engines.simulated`). A step's result does not depend on M, bit
for bit: N stays the job's replica count, M where it runs (M must divide N so
that each rank's replicas form a subtree of the tree; every divisor when N is
a power of two). Rank 0's weights and optimizer state are broadcast when
`compile` builds the optimizer; the model's metrics are each rank's own
replicas'. A backup (`tf_adasum.BackupAndRestore`) holds every replica's
optimizer state by its replica number, so a job resumes exactly on another M
(`tf-adasum launch --mpirun` with elastic options restarts it on the ranks
alive).

Example:
  >>> trainer = SimulatedReplicas(make_model(), num_replicas=256)
  >>> trainer.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
  >>> stream = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000).repeat().batch(256 * 64)
  >>> trainer.fit(stream, steps_per_epoch=60000 // (256 * 64), epochs=10)
  >>> trainer.model.evaluate(x_test, y_test)
"""

from __future__ import annotations

import os
from typing import Any

import keras
import tensorflow as tf

from tf_adasum import combiners as combiners_lib
from tf_adasum.engines import select
from tf_adasum.engines.mpi import MPIEngine
from tf_adasum.engines.simulated import CPU, SimulatedEngine, components, per_replica
from tf_adasum.launcher.elastic import REPLICAS_VARIABLE
from tf_adasum.step import keras_step
from tf_adasum.step import settings as settings_lib
from tf_adasum.step.combine import combine, combine_state

__all__ = ["BACKENDS", "SimulatedReplicas"]

#: Where `SimulatedReplicas` runs its replicas (see its ``backend`` argument).
BACKENDS = ("auto", "local", "mpi")


class SimulatedReplicas(keras.Model):
    """Trains `model` as `num_replicas` replicas combined by `combiner` would
    (see the module docstring); `compile` it with the inner optimizer.

    Args:
      model: a built Keras model (its variables are the replicas' weights).
      num_replicas: N >= 1 simulated replicas; each step's batch must be a
        multiple of N.
      combiner: ``"adasum"``, ``"sum"``, ``"mean"``, ``"adacons"`` or a combiner
        object from `tf_adasum.combiners`, as for `tf_adasum.AdasumOptimizer`.
      mode: ``"delta"`` or ``"gradient"``, as for `tf_adasum.AdasumOptimizer`.
      backward_passes_per_step: K >= 1 local steps (delta) or averaged
        gradients (gradient mode) per combine.
      backend: where the replicas run: ``"local"``, all in this process;
        ``"mpi"``, spread over the ranks of an MPI job (see the module);
        ``"auto"`` (default), ``"mpi"`` when an MPI launcher started this
        process with several ranks, else ``"local"``.
      name: the wrapper's name.

    The inner optimizer must not be built yet (its state is copied per
    replica when `compile` builds it) and must not be a LossScaleOptimizer.
    """

    def __init__(
        self,
        model: keras.Model,
        num_replicas: int,
        combiner: str | combiners_lib.Combiner = "adasum",
        mode: str = "delta",
        backward_passes_per_step: int = 1,
        backend: str = "auto",
        name: str | None = None,
    ):
        super().__init__(name=name)
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int):
            raise TypeError(f"`num_replicas` must be an int. Received: num_replicas={num_replicas!r}")
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model. Received: model of type {type(model).__name__}")
        if not model.built:
            raise ValueError(
                f"`model` must be built (call it once, or give it an Input). Received: model={model.name!r}"
            )
        self._settings = settings_lib.StepSettings.create(
            combiner=combiner, mode=mode, backward_passes_per_step=backward_passes_per_step
        )
        if backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {BACKENDS}. Received: backend={backend!r}")
        if backend == "auto":
            backend = "mpi" if select.launched_by_mpi() else "local"
        announced = os.environ.get(REPLICAS_VARIABLE, "")
        if announced and announced != str(num_replicas):
            raise ValueError(
                f"The launcher runs this job with {REPLICAS_VARIABLE}={announced} (tf-adasum launch "
                f"--logical-replicas), and this model has num_replicas={num_replicas}: give both the same count."
            )
        self.backend = backend
        self.model = model
        processes = MPIEngine(select.mpi_world()) if backend == "mpi" else None
        self.engine = SimulatedEngine(num_replicas, processes=processes)
        self.num_replicas = num_replicas
        self._state = None
        self.built = True

    # The settings, checked at construction (`tf_adasum.step.settings.StepSettings`).
    combiner = settings_lib.Setting()
    mode = settings_lib.Setting()
    backward_passes_per_step = settings_lib.Setting()

    def call(self, inputs: Any, training: bool = False) -> Any:
        return self.model(inputs, training=training)

    def compile(self, optimizer: str | keras.optimizers.Optimizer = "rmsprop", **kwargs: Any) -> None:
        """As `keras.Model.compile`; `optimizer` is every replica's inner
        optimizer. ``jit_compile`` defaults to False (XLA cannot compile the
        replica loop's variable swaps on every device). No mixed precision:
        a ``mixed_float16`` policy (a LossScaleOptimizer) is refused."""
        if isinstance(optimizer, keras.optimizers.Optimizer) and optimizer.built:
            raise ValueError(
                "`optimizer` must not be built yet: SimulatedReplicas copies its state per replica when it "
                f"builds it. Received: optimizer={optimizer.name!r}, already built"
            )
        kwargs.setdefault("jit_compile", False)
        super().compile(optimizer=optimizer, **kwargs)
        inner = self.optimizer
        if isinstance(inner, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "SimulatedReplicas does not simulate loss scaling (mixed precision): compile it under a float32 "
                f"dtype policy. Received: an optimizer wrapped in {type(inner).__name__} "
                f"(dtype policy {keras.config.dtype_policy().name!r})"
            )
        settings_lib.check_inner(inner)
        keras_step.check_keras_internals(inner)
        before = {id(v) for v in inner.variables}
        inner.build(self.model.trainable_variables)
        # Per replica: what build() made (moments, ...) and the step count; the learning rate stays shared.
        own = [v for v in inner.variables if id(v) not in before] + [inner.iterations]
        self.engine.check_same_variables(self.model.trainable_variables)
        self.engine.broadcast_initial(self.model.variables, inner.variables)  # process 0's (over processes)
        self._state = _ReplicaState(self, [keras_step.tf_variable(v) for v in own])

    @property
    def replica_variables(self) -> list[tf.Variable]:
        """Delta mode: each variable of the inner optimizer's own state (what
        its build made, then ``iterations``) stacked over this process's
        replicas, ``[n, ...]`` in replica order from ``engine.first_replica``
        (what `tf_adasum.BackupAndRestore` saves per replica). Empty in
        gradient mode, where every replica shares the inner optimizer's."""
        if self._state is None:
            raise RuntimeError("SimulatedReplicas: call compile() before reading its replicas' state.")
        return list(self._state.own_stacks)

    def replica_copies(self, variable) -> list:
        """This process's replicas' copies of one of the inner optimizer's
        variables, in replica order, for `tf_adasum.BackupAndRestore`: rows
        of its stack where each replica has its own (delta mode), else the
        variable itself, shared. A copy has ``numpy()``, ``shape``,
        ``dtype`` and ``assign``; assigning the first replica's also sets the
        inner optimizer's variable, which holds that replica's state."""
        state = self._state
        if state is None:
            raise RuntimeError("SimulatedReplicas: call compile() before reading its replicas' state.")
        value = keras_step.tf_variable(variable)
        for own, stack in zip(state.own, state.own_stacks):
            if own is value:
                return [_Row(stack, i, own if i == 0 else None) for i in range(self.engine.local_replicas)]
        return [value] * self.engine.local_replicas

    def train_step(self, data: Any) -> dict:
        if self._state is None:
            raise RuntimeError("SimulatedReplicas: call compile() before training.")
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        shards = tf.nest.map_structure(self._shards, (x, y, sample_weight))
        self._state.step(shards)
        return self.get_metrics_result()

    def _shards(self, t):
        """``[n, b, ...]``: the rows of each of this process's n replicas, in
        order (all N in one process; None stays None)."""
        if t is None:
            return None
        t = tf.convert_to_tensor(t)
        n = self.num_replicas
        if t.shape.rank and t.shape[0] is not None and t.shape[0] % n:
            raise ValueError(
                f"SimulatedReplicas: each batch must be a multiple of num_replicas={n} rows. "
                f"Received: a batch of {t.shape[0]}"
            )
        check = tf.debugging.assert_equal(
            tf.shape(t)[0] % n,
            0,
            message=f"SimulatedReplicas: each batch must be a multiple of num_replicas={n} rows",
        )
        with tf.control_dependencies([check]):
            rows = tf.reshape(t, tf.concat([[n, -1], tf.shape(t)[1:]], axis=0))
        engine = self.engine
        return rows[engine.first_replica : engine.first_replica + engine.local_replicas]


class _Row:
    """Row `index` of a replica stack, as `tf_adasum.resume.replica_states` reads
    and assigns a replica's copy of a variable (also to `mirror`, if any)."""

    def __init__(self, stack: tf.Variable, index: int, mirror: tf.Variable | None):
        self.stack, self.index, self.mirror = stack, index, mirror
        self.shape, self.dtype, self.name = stack.shape[1:], stack.dtype, f"{stack.name}[{index}]"

    def numpy(self):
        return self.stack[self.index].numpy()

    def assign(self, value) -> None:
        self.stack[self.index].assign(value)
        if self.mirror is not None:
            self.mirror.assign(value)


class _ReplicaState:
    """Every simulated replica's own state, and the step over all of them."""

    def __init__(self, trainer: SimulatedReplicas, own: list[tf.Variable]):
        self.trainer = trainer
        self.inner = trainer.optimizer
        self.keras_variables = list(trainer.model.trainable_variables)
        self.variables = [keras_step.tf_variable(v) for v in self.keras_variables]
        self.own = own
        self.engine = trainer.engine
        n, k, delta = trainer.engine.local_replicas, trainer.backward_passes_per_step, trainer.mode == "delta"

        def stacked(variables, name, zeros=False):
            values = [tf.zeros([n, *v.shape], v.dtype) if zeros else tf.stack([v] * n) for v in variables]
            return [tf.Variable(x, trainable=False, name=f"{name}_{i}") for i, x in enumerate(values)]

        with tf.device(CPU):
            self.own_stacks = stacked(own, "replica_optimizer") if delta else []
            self.weight_stacks = stacked(self.variables, "replica_weights") if delta and k > 1 else []
            self.starts = []  # the weights at the last combine (delta mode, K > 1)
            if delta and k > 1:
                self.starts = [
                    tf.Variable(v, trainable=False, name=f"cycle_start_{i}") for i, v in enumerate(self.variables)
                ]
            self.accumulators = stacked(self.variables, "replica_gradients", zeros=True) if not delta and k > 1 else []
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False, name="local_steps")
            make = lambda name, shape, dtype: tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)  # noqa: E731
            self.adacons = combine_state(trainer._settings, make, len(self.variables), trainer.num_replicas)
        self.seeds = keras_step.seed_states(trainer.model)

    # -- one replica's part ------------------------------------------------------------

    def _gradients(self, x, y, sample_weight):
        trainer = self.trainer
        with tf.GradientTape() as tape:
            y_pred = trainer.model(x, training=True)
            loss = trainer.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        grads = tape.gradient(loss, self.variables)
        missing = [v.path for v, g in zip(self.keras_variables, grads) if g is None]
        if missing:
            raise ValueError(
                "SimulatedReplicas needs a gradient for every trainable variable (freeze the others: "
                f"`trainable=False`). Received: no gradient for {missing}"
            )
        for metric in trainer.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
        trainer.compute_metrics(x, y, y_pred, sample_weight)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        return grads, finite

    def _replica_delta_step(self, i, shard, start, is_first):
        """Replica i's local step from its own weights (the combined ones at the
        first step of a cycle) and its own optimizer state; returns its new
        weights, its new state and whether its gradients were finite."""
        if self.weight_stacks:
            own_weights = lambda: [w[i] for w in self.weight_stacks]  # noqa: E731
            sources = tf.cond(is_first, lambda: list(start), own_weights)
        else:
            sources = start
        for variable, value in zip(self.variables, sources):
            variable.assign(value)
        for variable, stack in zip(self.own, self.own_stacks):
            variable.assign(stack[i])
        grads, finite = self._gradients(*shard)
        self._inner_step(grads)
        return [tf.identity(v) for v in self.variables], [tf.identity(v) for v in self.own], finite

    def _replica_gradients(self, i, shard):
        grads, finite = self._gradients(*shard)
        if self.accumulators:
            grads = [a[i] + g for a, g in zip(self.accumulators, grads)]
        return grads, finite

    # -- the step -----------------------------------------------------------------------

    def _over_replicas(self, body, outputs_like):
        """Runs ``body(i) -> (tensors, finite)`` for this process's replicas
        i = 0..n-1 in a loop, each with its own seeds (see the module); returns
        each output stacked ``[n, ...]`` and whether all were finite on every
        process."""
        n = self.engine.local_replicas
        arrays = [tf.TensorArray(t.dtype, size=n, element_shape=t.shape) for t in outputs_like]
        bases = [tf.identity(state) for state in self.seeds]

        def step(i, finite, arrays):
            replica = tf.cast(self.engine.first_replica + i, tf.int64)
            for state, base in zip(self.seeds, bases):
                state.assign(base + tf.stack([tf.constant(0, tf.int64), replica * 2**32]))
            values, ok = body(i)
            return i + 1, tf.logical_and(finite, ok), [a.write(i, v) for a, v in zip(arrays, values)]

        _, finite, arrays = tf.while_loop(
            lambda i, *_: i < n, step, (tf.constant(0), tf.constant(True), arrays), parallel_iterations=1
        )
        with tf.control_dependencies([finite]):
            for state, base in zip(self.seeds, bases):
                state.assign(base + tf.constant([1, 0], tf.int64))
        return [a.stack() for a in arrays], self.engine.all_processes(finite)

    def step(self, shards):
        """One training step of every replica (every K-th also combines)."""
        x, y, sample_weight = shards
        shard = lambda i: tf.nest.map_structure(lambda t: None if t is None else t[i], (x, y, sample_weight))  # noqa: E731
        k = self.trainer.backward_passes_per_step
        if self.own_stacks:
            self._adopt_restored_state()
        is_first, is_last = tf.equal(self.count % k, 0), tf.equal((self.count + 1) % k, 0)
        # The model holds the combined weights, or replica 0's within a cycle of K.
        start = [tf.identity(v) for v in self.variables]
        if self.trainer.mode == "delta":

            def body(i):
                weights, own, finite = self._replica_delta_step(i, shard(i), start, is_first)
                return weights + own, finite

            stacked, finite = self._over_replicas(body, self.variables + self.own)
            weights, own = stacked[: len(self.variables)], stacked[len(self.variables) :]

            def apply():
                for stack, value in zip(self.own_stacks, own):
                    stack.assign(value)
                if k == 1:
                    self._combine_deltas(weights, start)
                else:
                    tf.cond(is_first, lambda: self._begin_cycle(start), lambda: tf.constant(False))
                    for stack, value in zip(self.weight_stacks, weights):
                        stack.assign(value)
                    tf.cond(is_last, lambda: self._end_cycle(weights), lambda: self._hold_replica_zero(weights))
                self.count.assign_add(1)
                return tf.constant(True)

            def skip():
                for variable, value in zip(self.variables, start):
                    variable.assign(value)
                return tf.constant(False)

            tf.cond(finite, apply, skip)
            for variable, stack in zip(self.own, self.own_stacks):  # replica 0's, as a checkpoint stores
                variable.assign(stack[0])
        else:
            grads, finite = self._over_replicas(lambda i: self._replica_gradients(i, shard(i)), self.variables)

            def apply():
                if k == 1:
                    self._apply_combined_gradients(grads)
                else:
                    for stack, value in zip(self.accumulators, grads):
                        stack.assign(value)

                    def finish():
                        self._apply_combined_gradients([g / k for g in grads])
                        for stack in self.accumulators:
                            stack.assign(tf.zeros_like(stack))
                        return tf.constant(True)

                    tf.cond(is_last, finish, lambda: tf.constant(False))
                self.count.assign_add(1)
                return tf.constant(True)

            tf.cond(finite, apply, lambda: tf.constant(False))

    def _adopt_restored_state(self) -> None:
        """Delta mode: the inner optimizer holds replica 0's state after every
        step; if it holds another now, it was restored (or set) from outside,
        and every replica starts from it, in a fresh cycle of K local steps."""
        unchanged = tf.reduce_all([tf.reduce_all(tf.equal(v, s[0])) for v, s in zip(self.own, self.own_stacks)])
        unchanged = self.engine.all_processes(unchanged)  # every process counts its cycle alike

        def adopt():
            for variable, stack in zip(self.own, self.own_stacks):
                stack.assign(tf.broadcast_to(tf.expand_dims(variable, 0), stack.shape))
            self.count.assign(0)
            return tf.constant(True)

        tf.cond(unchanged, lambda: tf.constant(False), adopt)

    def _combine(self, stacked: list[tf.Tensor]) -> list[tf.Tensor]:
        """The combine of per-replica ``[N, ...]`` values; one copy of the result."""
        values = [per_replica(tf.unstack(s)) for s in stacked]
        rows = list(range(len(stacked)))
        combined = combine(self.engine, values, self.trainer._settings, self.adacons, rows)
        return [components(c)[0] for c in combined]

    def _combine_deltas(self, weights, start):
        deltas = [w - tf.expand_dims(s, 0) for w, s in zip(weights, start)]
        for variable, s, c in zip(self.variables, start, self._combine(deltas)):
            variable.assign(s + c)
        self._after_combine()

    def _begin_cycle(self, start):
        for s, value in zip(self.starts, start):
            s.assign(value)
        return tf.constant(True)

    def _end_cycle(self, weights):
        self._combine_deltas(weights, [tf.identity(s) for s in self.starts])
        return tf.constant(True)

    def _hold_replica_zero(self, weights):
        for variable, w in zip(self.variables, weights):
            variable.assign(w[0])
        return tf.constant(False)

    def _apply_combined_gradients(self, grads):
        self._inner_step(self._combine(grads))
        self._after_combine()

    def _inner_step(self, grads):
        """The inner optimizer's step with `grads`, as `tf_adasum.AdasumOptimizer`
        takes it (in the default strategy's cross-replica context)."""
        update = lambda strategy: keras_step.local_update(strategy, self.inner, grads, self.variables)  # noqa: E731
        tf.distribute.get_replica_context().merge_call(update)

    def _after_combine(self):
        constrain = lambda strategy: keras_step.apply_constraints(strategy, self.keras_variables)  # noqa: E731
        tf.distribute.get_replica_context().merge_call(constrain)
