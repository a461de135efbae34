"""The simulated engine: N replicas computed one after another in this process.

Where `tf_adasum.engines.tf` gives each replica a device of its own, this
engine holds all N replicas' tensors on one device and combines them with
the tree of the vector-halving collective, pair by pair over whole buffers
(`tf_adasum.tree.rvh.reduce_on_one_device`): the same pairs in the same order,
the same fused buffers and the same kernels (float64 dot products), in N - 1
pair combines whatever N, so 256 replicas build in seconds. It serves
`tf_adasum.simulation.SimulatedReplicas` ("what would Adasum do on 256
workers", on a laptop), and AdaCons runs over it unchanged
(`tf_adasum.step.adacons`), through `SimulatedEngine.strategy.extended`, a
stand-in for the part of a strategy that AdaCons uses.

Precision: as N replicas of a strategy, except that a pair's float64 partial
sums are accumulated over the whole buffer rather than per slice of the
halving; `tests/test_simulation.py` compares training with N = 4 replicas of
a MirroredStrategy.

Values are `tf.distribute` per-replica values (`PerReplica`, `Mirrored`) with
one component per simulated replica, as from a strategy, or lists built with
`per_replica`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from tf_adasum import combiners as combiners_lib
from tf_adasum.engines.base import Components, Engine, regroup
from tf_adasum.tree import rvh
from tf_adasum.tree.buckets import make_buckets, pack, unpack

__all__ = ["CPU", "SimulatedEngine", "components", "per_replica"]

#: The device every simulated replica lives on: this process's first CPU.
CPU = "/job:localhost/replica:0/task:0/device:CPU:0"


def per_replica(components: Sequence[tf.Tensor]):
    """One per-replica value (`PerReplica`) from its components, one per simulated replica."""
    return regroup(tuple(components), values_lib.PerReplica)


def components(value) -> tuple:
    """The components of a per-replica value, one per simulated replica (a
    plain tensor is the one component of a single replica's value)."""
    return tuple(value.values) if isinstance(value, values_lib.DistributedValues) else (value,)


class _Extended:
    """The part of `tf.distribute.StrategyExtended` the engine's callers use:
    `call_for_each_replica`, one replica after another, with
    `SimulatedEngine.replica_id` telling which."""

    def __init__(self, engine: SimulatedEngine):
        self._engine = engine

    def call_for_each_replica(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None):
        """``fn`` once per simulated replica, each with its own components of
        the per-replica arguments (other arguments as they are); the results
        regrouped into per-replica values, as a strategy returns them."""
        engine = self._engine
        outputs = []
        for replica in range(engine.num_replicas):

            def pick(value, r=replica):
                return value.values[r] if isinstance(value, values_lib.DistributedValues) else value

            engine._current = replica
            try:
                outputs.append(fn(*[pick(a) for a in args], **{k: pick(v) for k, v in (kwargs or {}).items()}))
            finally:
                engine._current = None
        return tf.nest.map_structure(lambda *c: per_replica(c), *outputs)


class _Replicas:
    """The stand-in strategy of a `SimulatedEngine` (only ``extended``)."""

    def __init__(self, engine: SimulatedEngine):
        self.extended = _Extended(engine)


class SimulatedEngine(Engine):
    """`num_replicas` replicas on one device of this process (see the module).

    Args:
      num_replicas: N >= 1.
      bytes_per_pack: the fusion cap of `tf_adasum.tree.buckets.make_buckets` (0: one
        bucket per dtype, as `AdasumCrossDeviceOps` by default).

    There are no processes to reach: the per-step finite check and the small
    sums and gathers are local arithmetic, and every replica is "this worker"
    (``hierarchical`` means the mean of all of them). No wire, so no
    compression, and no per-level partial sums (``with_partials``).
    """

    def __init__(self, num_replicas: int, bytes_per_pack: int = 0):
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"`num_replicas` must be an int >= 1. Received: num_replicas={num_replicas!r}")
        self.num_replicas = self.local_replicas = num_replicas
        self.bytes_per_pack = bytes_per_pack
        self.strategy = _Replicas(self)
        self._current: int | None = None

    def scope_size(self, scope: str) -> int:
        return {"all": self.num_replicas, "local": self.num_replicas, "cross": 1}[scope]

    def combine_validated(self, values, combiner="adasum", hierarchical=False, with_partials=False):
        if with_partials:
            raise NotImplementedError(
                "SimulatedEngine computes no per-level partial sums (the diagnostics of a combine). "
                "Received: with_partials=True"
            )
        return super().combine_validated(values, combiner, hierarchical, with_partials)

    def _combine_implementation(self, values: list[Components], combiner: combiners_lib.Combiner, scope: str):
        shapes = [v[0].shape for v in values]
        buckets = make_buckets(
            [v[0].dtype for v in values], [s.num_elements() for s in shapes], self.num_replicas, self.bytes_per_pack
        )
        combined = [v[0] for v in values]  # empty tensors stay as they are
        with tf.device(CPU):
            for bucket in buckets:
                flats = [pack(replica, bucket) for replica in zip(*values)]
                result = rvh.reduce_on_one_device(flats, bucket, combiner)
                for i, tensor in zip(bucket.indices, unpack(result, bucket, shapes)):
                    combined[i] = tensor
        no_partials = tf.zeros([0, len(values), 3], tf.float64)
        return [(c,) * self.num_replicas for c in combined], (no_partials,) * self.num_replicas

    def sum_small(self, per_replica_value) -> tf.Tensor:
        return tf.add_n([tf.convert_to_tensor(c) for c in components(per_replica_value)])

    def gather_small(self, per_replica_value) -> tf.Tensor:
        return tf.stack([tf.convert_to_tensor(c) for c in components(per_replica_value)])

    @property
    def is_first_process(self) -> bool:
        return True

    def replica_id(self) -> int:
        if self._current is None:
            raise RuntimeError("SimulatedEngine.replica_id() is only known inside call_for_each_replica.")
        return self._current

    def check_same_variables(self, variables: Sequence) -> None:
        """Nothing to check: every simulated replica holds this process's variables."""

    def broadcast_initial(self, model_variables: Sequence, optimizer_variables: Sequence) -> None:
        """Nothing to do: every simulated replica starts from this process's variables."""
