"""The replicas of `tf_adasum.SimulatedReplicas` in this process: their state and the step over them.

`ReplicaLoop` holds what each replica keeps of its own, stacked over the
replicas ``[n, ...]`` (delta mode: the inner optimizer's slots and step
count; with K > 1 its weights, or in gradient mode its summed gradients),
and runs one training step: every replica in turn in a ``tf.while_loop``
(its rows of the batch, its state swapped into the model's and the inner
optimizer's variables), then the combine over the engine
(`tf_adasum.engines.simulated.SimulatedEngine`: this process's replicas, or
a block of them on each MPI rank), skipped by all when any replica's
gradient is not finite on any process.

**Random layers.** A Keras random generator's state is ``[seed, counter]``;
each draw takes the state as its seed and adds 1 to the counter, and Keras'
TensorFlow backend reduces each word modulo 2^31 - 2. At the step whose
state is ``[s, c]``, replica j starts from ``[s + j, c]`` and, after the
step, every generator holds ``[s + N, c]`` (N the replicas of the job): so
replica j's draws at step t come from ``[s0 + t*N + j, c + k]``, distinct
for every (step, replica) and the same whichever process computes the
replica (`tests/test_simulation.py`). Two generators of one model whose
seeds lie within (steps x N) of each other may share a stream.
"""

from __future__ import annotations

import tensorflow as tf

from tf_adasum.engines.simulated import CPU, components, per_replica
from tf_adasum.step import keras_step
from tf_adasum.step.combine import combine, combine_state

__all__ = ["ReplicaLoop", "StackRow", "replica_seed", "seed_after_step"]


def replica_seed(state: tf.Tensor, replica) -> tf.Tensor:
    """A generator's state for replica `replica` at the step whose state is `state` (see the module)."""
    return state + tf.stack([tf.cast(replica, tf.int64), tf.constant(0, tf.int64)])


def seed_after_step(state: tf.Tensor, num_replicas: int) -> tf.Tensor:
    """A generator's state after the step whose state was `state`, in a job of `num_replicas`."""
    return state + tf.constant([num_replicas, 0], tf.int64)


class StackRow:
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


class ReplicaLoop:
    """Every replica's own state in this process, and the step over all of them
    (the replicas of `tf_adasum.SimulatedReplicas`; `trainer` is one)."""

    def __init__(self, trainer, own: list[tf.Variable]):
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
            for state, base in zip(self.seeds, bases):
                state.assign(replica_seed(base, self.engine.first_replica + i))
            values, ok = body(i)
            return i + 1, tf.logical_and(finite, ok), [a.write(i, v) for a, v in zip(arrays, values)]

        _, finite, arrays = tf.while_loop(
            lambda i, *_: i < n, step, (tf.constant(0), tf.constant(True), arrays), parallel_iterations=1
        )
        with tf.control_dependencies([finite]):
            for state, base in zip(self.seeds, bases):
                state.assign(seed_after_step(base, self.engine.num_replicas))
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
