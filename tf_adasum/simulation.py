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
* Random layers (dropout, random augmentation) draw per replica from a
  stream of their own, set by the step and the replica's number, not by
  which process computes it or in what order (`tf_adasum.step.replica_loop`).
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
(``backend="auto"`` or ``"mpi"``), or on the workers of a cluster
(``TF_CONFIG``, ``tf-adasum launch -n M``; ``backend="auto"`` or
``"workers"``), the N replicas are spread over the M processes: process p
holds the N / M contiguous replicas ``p*N/M .. (p+1)*N/M - 1`` and
reads their rows of every global batch (each process reads the whole global
batch and keeps its rows: give every process the same input pipeline), the
tree's lower levels run inside each rank and the upper ones across ranks
(`tf_adasum.engines.simulated`). A step's result does not depend on M, bit
for bit: N stays the job's replica count, M where it runs (M must divide N so
that each process's replicas form a subtree of the tree; every divisor when N
is a power of two). Process 0's weights and optimizer state are broadcast
when `compile` builds the optimizer; the model's metrics are each process's
own replicas'. A backup (`tf_adasum.BackupAndRestore`) holds every
replica's optimizer state by its replica number, so a job resumes on
another M (`tf-adasum launch` with elastic options restarts it on the
processes alive), exactly for adasum, sum and mean with K = 1 (AdaCons' own
state and a cycle of K local steps restart). Every process must run the
same settings: a mismatch is a `ValueError` on every one at `compile`.

On workers, TensorFlow needs the program to create
``tf.distribute.MultiWorkerMirroredStrategy()`` at its start (before any
other TensorFlow call) for collective ops to reach the other workers; build
the model and `SimulatedReplicas` outside its scope (the replicas are
`SimulatedReplicas`', not the strategy's; `tf_adasum.engines.workers`).

At scale, e.g. MNIST on 256 replicas of 64 examples each (`SimulatedReplicas`
has a small example that runs as it stands):

```python
trainer = SimulatedReplicas(make_model(), num_replicas=256)
trainer.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy")
stream = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000).repeat().batch(256 * 64)
trainer.fit(stream, steps_per_epoch=60000 // (256 * 64), epochs=10)
trainer.model.evaluate(x_test, y_test)
```
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from tf_adasum import combiners as combiners_lib
from tf_adasum.engines import select
from tf_adasum.engines.simulated import SimulatedEngine
from tf_adasum.processes import Processes
from tf_adasum.step import keras_step
from tf_adasum.step import settings as settings_lib
from tf_adasum.step.replica_loop import ReplicaLoop, StackRow

__all__ = ["SimulatedReplicas"]


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
        ``"mpi"``, spread over the ranks of an MPI job; ``"workers"``, over
        the workers ``TF_CONFIG`` names (see the module); ``"auto"``
        (default): ``"mpi"`` when an MPI launcher started this process with
        several ranks, else ``"workers"`` when ``TF_CONFIG`` names several
        chief and worker tasks, else ``"local"``.
      name: the wrapper's name.

    The inner optimizer must not be built yet (its state is copied per
    replica when `compile` builds it) and must not be a LossScaleOptimizer.

    Examples:
      Four replicas of a small model, 2 rows each of every batch of 8; each
      replica keeps its own Adam moments and step count:

      >>> import keras
      >>> import numpy as np
      >>> import tf_adasum
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> trainer = tf_adasum.SimulatedReplicas(model, num_replicas=4)
      >>> trainer.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
      >>> x, y = np.ones((16, 3), "float32"), np.ones((16, 1), "float32")
      >>> history = trainer.fit(x, y, batch_size=8, epochs=1, verbose=0)  # 2 steps
      >>> [tuple(stack.shape) for stack in trainer.replica_variables]  # Adam's m and v per variable, iterations
      [(4, 3, 1), (4, 3, 1), (4, 1), (4, 1), (4,)]
      >>> [int(copy.numpy()) for copy in trainer.replica_copies(trainer.optimizer.iterations)]
      [2, 2, 2, 2]
      >>> trainer.model is model  # it holds the combined weights
      True
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
        if num_replicas < 1:
            raise ValueError(f"`num_replicas` must be an int >= 1. Received: num_replicas={num_replicas!r}")
        if not isinstance(model, keras.Model):
            raise TypeError(f"`model` must be a keras.Model. Received: model of type {type(model).__name__}")
        if not model.built:
            raise ValueError(
                f"`model` must be built (call it once, or give it an Input). Received: model={model.name!r}"
            )
        self._settings = settings_lib.StepSettings.create(
            combiner=combiner, mode=mode, backward_passes_per_step=backward_passes_per_step
        )
        self.model = model
        self.backend, processes = select.replica_processes(backend, num_replicas)  # every check first
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
        a ``mixed_float16`` policy (a LossScaleOptimizer) is refused.

        Examples:
          >>> import keras
          >>> import tf_adasum
          >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
          >>> trainer = tf_adasum.SimulatedReplicas(model, num_replicas=4)
          >>> trainer.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse", metrics=["mae"])
          >>> type(trainer.optimizer).__name__  # every replica's inner optimizer
          'SGD'
        """
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
        settings = {
            "num_replicas": self.num_replicas,
            "combiner": repr(self._settings.combiner.get_config()),
            "mode": self.mode,
            "backward_passes_per_step": self.backward_passes_per_step,
            "inner optimizer": type(inner).__name__,
        }
        self.engine.check_same_settings(settings, "SimulatedReplicas settings")
        self.engine.check_same_variables(self.model.trainable_variables)
        self.engine.broadcast_initial(self.model.variables, inner.variables)  # process 0's (over processes)
        self._state = ReplicaLoop(self, [keras_step.tf_variable(v) for v in own])

    @property
    def processes(self) -> Processes:
        """The processes this job's replicas are spread over, for a sum of a
        few numbers over them (`tf_adasum.processes.Processes`: what
        `tf_adasum.BackupAndRestore` agrees through; a test accuracy over
        shards): the workers, the MPI ranks, or this one process."""
        processes = self.engine.processes
        if processes is None:
            return Processes.alone()
        return Processes(processes.kind, processes.replica_id(), processes.num_replicas, processes.sum_floats)

    @property
    def replica_variables(self) -> list[tf.Variable]:
        """Delta mode: each variable of the inner optimizer's own state (what
        its build made, then ``iterations``) stacked over this process's
        replicas, ``[n, ...]`` in replica order from ``engine.first_replica``
        (what `tf_adasum.BackupAndRestore` saves per replica). Empty in
        gradient mode, where every replica shares the inner optimizer's.

        Examples:
          >>> import keras
          >>> import tf_adasum
          >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
          >>> trainer = tf_adasum.SimulatedReplicas(model, num_replicas=4)
          >>> trainer.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
          >>> [tuple(stack.shape) for stack in trainer.replica_variables]  # momentum per variable, iterations
          [(4, 3, 1), (4, 1), (4,)]
        """
        if self._state is None:
            raise RuntimeError("SimulatedReplicas: call compile() before reading its replicas' state.")
        return list(self._state.own_stacks)

    def replica_copies(self, variable) -> list:
        """This process's replicas' copies of one of the inner optimizer's
        variables, in replica order, for `tf_adasum.BackupAndRestore`: rows
        of its stack where each replica has its own (delta mode), else the
        variable itself, shared. A copy has ``numpy()``, ``shape``,
        ``dtype`` and ``assign``; assigning the first replica's also sets the
        inner optimizer's variable, which holds that replica's state.

        Examples:
          >>> import keras
          >>> import tf_adasum
          >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
          >>> trainer = tf_adasum.SimulatedReplicas(model, num_replicas=4)
          >>> trainer.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
          >>> copies = trainer.replica_copies(trainer.optimizer.iterations)
          >>> copies[2].assign(5)  # replica 2's step count
          >>> [int(copy.numpy()) for copy in copies], int(trainer.optimizer.iterations.numpy())
          ([0, 0, 5, 0], 0)
        """
        state = self._state
        if state is None:
            raise RuntimeError("SimulatedReplicas: call compile() before reading its replicas' state.")
        value = keras_step.tf_variable(variable)
        for own, stack in zip(state.own, state.own_stacks):
            if own is value:
                return [StackRow(stack, i, own if i == 0 else None) for i in range(self.engine.local_replicas)]
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
