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

**Over processes (logical replicas).** Given ``processes``
(`ReplicaProcesses`: `tf_adasum.engines.mpi.MPIEngine` over M ranks, or
`tf_adasum.engines.workers.WorkerProcesses` over the M workers of a cluster),
the N replicas are spread over the M processes: process p holds the b = N / M
contiguous replicas ``p*b .. (p+1)*b - 1``, which must form a subtree of the
tree (`tf_adasum.reference.block_sizes`: every divisor of N when N is a power
of two). Each process computes its block's subtree, every block's value is
gathered (``processes.gather_small``: (M - 1) buffers received per process,
where the vector-halving collective receives 2 (M - 1) / M of one), and every
process computes the levels above alike. The pairs and their operands are
those of one process, so the result does not depend on M, bit for bit
(`tests/test_logical_replicas.py`); the price is the gather and the top
levels' arithmetic repeated on every process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

from tf_adasum import combiners as combiners_lib
from tf_adasum.engines.base import Components, Engine, regroup
from tf_adasum.reference import block_sizes
from tf_adasum.tree import rvh
from tf_adasum.tree.buckets import make_buckets, pack, unpack

__all__ = ["CPU", "ReplicaProcesses", "SimulatedEngine", "components", "per_replica", "replicas_per_process"]

#: The device every simulated replica lives on: this process's first CPU
#: (no job: "localhost" in one process, the worker's own in a cluster).
CPU = "/device:CPU:0"


class ReplicaProcesses(Protocol):
    """What `SimulatedEngine` asks of the processes it spreads replicas over,
    one replica each (`tf_adasum.engines.mpi.MPIEngine`,
    `tf_adasum.engines.workers.WorkerProcesses`). Every process makes the
    same calls in the same order."""

    kind: str  # "rank", "worker": one process, in messages and in `tf_adasum.processes.Processes`
    num_replicas: int  # the process count M
    local_replicas: int  # 1

    def replica_id(self) -> int: ...  # this process's position

    @property
    def is_first_process(self) -> bool: ...

    def gather_small(self, x) -> tf.Tensor: ...  # [M, *x.shape], bitwise the values sent

    def sum_small(self, x) -> tf.Tensor: ...  # float64, the same bits everywhere

    def sum_floats(self, values: Sequence[float], what: str = ...) -> list[float]: ...  # eagerly

    def check_same_variables(self, variables: Sequence) -> None: ...

    def check_same_settings(self, settings: dict, what: str) -> None: ...

    def broadcast_initial(self, model_variables: Sequence, optimizer_variables: Sequence) -> None: ...


def per_replica(components: Sequence[tf.Tensor]):
    """One per-replica value (`PerReplica`) from its components, one per simulated replica."""
    return regroup(tuple(components), values_lib.PerReplica)


def components(value) -> tuple:
    """The components of a per-replica value, one per simulated replica (a
    plain tensor is the one component of a single replica's value)."""
    return tuple(value.values) if isinstance(value, values_lib.DistributedValues) else (value,)


def replicas_per_process(num_replicas: int, count: int) -> int:
    """The replicas each of `count` processes holds (num_replicas / count); a
    `ValueError` naming the counts that can when these cannot hold
    `num_replicas` as blocks of the tree (`tf_adasum.reference.block_sizes`)."""
    sizes = block_sizes(num_replicas)
    if num_replicas % count or num_replicas // count not in sizes:
        counts = sorted(num_replicas // b for b in sizes)
        raise ValueError(
            f"{count} processes cannot hold num_replicas={num_replicas} as blocks of Adasum's tree: the process "
            f"counts that can are {counts} (each process holds num_replicas / count contiguous replicas, which "
            f"must form a subtree). Received: num_replicas={num_replicas} over {count} processes"
        )
    return num_replicas // count


def _check_processes(num_replicas: int, processes: ReplicaProcesses | None) -> int:
    """The replicas each process holds (see `replicas_per_process`)."""
    if processes is None:
        return num_replicas
    if processes.local_replicas != 1:
        raise ValueError(
            "`processes` must hold one replica per process (MPIEngine, WorkerProcesses). Received: "
            f"{type(processes).__name__} with {processes.local_replicas} replicas per process"
        )
    return replicas_per_process(num_replicas, processes.num_replicas)


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
        for replica in range(engine.local_replicas):

            def pick(value, r=replica):
                return value.values[r] if isinstance(value, values_lib.DistributedValues) else value

            engine._current = engine.first_replica + replica
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
    """`num_replicas` replicas on one device of this process, or spread over
    the processes of `processes` (see the module).

    Args:
      num_replicas: N >= 1.
      bytes_per_pack: the fusion cap of `tf_adasum.tree.buckets.make_buckets` (0: one
        bucket per dtype, as `AdasumCrossDeviceOps` by default).
      processes: None (every replica in this process), or `ReplicaProcesses`
        whose count M can hold N as blocks of the tree.

    In one process there are no processes to reach: the small sums and
    gathers are local arithmetic. Every replica is "this worker"
    (``hierarchical`` means the mean of all of them; over processes it is
    refused: it would depend on M). No wire of its own, so no compression,
    and no per-level partial sums (``with_partials``).

    Attributes:
      first_replica: the first of this process's replicas (0 in one process).
    """

    def __init__(self, num_replicas: int, bytes_per_pack: int = 0, processes: ReplicaProcesses | None = None):
        if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"`num_replicas` must be an int >= 1. Received: num_replicas={num_replicas!r}")
        self.num_replicas = num_replicas
        self.local_replicas = _check_processes(num_replicas, processes)
        self.processes = processes
        self.first_replica = 0 if processes is None else processes.replica_id() * self.local_replicas
        self.bytes_per_pack = bytes_per_pack
        self.strategy = _Replicas(self)
        self._current: int | None = None

    def scope_size(self, scope: str) -> int:
        if scope != "all" and self.processes is not None:
            raise ValueError(
                "Replicas spread over processes have no hierarchical combine (it would depend on the "
                f"process count). Received: scope={scope!r}"
            )
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
        gather = None if self.processes is None else self.processes.gather_small
        with tf.device(CPU):
            for bucket in buckets:
                flats = [pack(replica, bucket) for replica in zip(*values)]
                result = rvh.reduce_on_one_device(
                    flats, bucket, combiner, self.num_replicas, self.first_replica, gather
                )
                for i, tensor in zip(bucket.indices, unpack(result, bucket, shapes)):
                    combined[i] = tensor
        no_partials = tf.zeros([0, len(values), 3], tf.float64)
        return [(c,) * self.local_replicas for c in combined], (no_partials,) * self.local_replicas

    def sum_small(self, per_replica_value) -> tf.Tensor:
        local = tf.add_n([tf.convert_to_tensor(c) for c in components(per_replica_value)])
        return local if self.processes is None else self.processes.sum_small(local)

    def gather_small(self, per_replica_value) -> tf.Tensor:
        local = tf.stack([tf.convert_to_tensor(c) for c in components(per_replica_value)])
        if self.processes is None:
            return local
        gathered = self.processes.gather_small(local)  # [M, b, ...]
        return tf.reshape(gathered, [self.num_replicas, *local.shape[1:]])

    def all_processes(self, flag: tf.Tensor) -> tf.Tensor:
        """Whether the boolean `flag` holds on every process (one tiny sum over
        them; `flag` itself in one process)."""
        if self.processes is None:
            return flag
        return tf.equal(self.processes.sum_small(tf.cast(tf.logical_not(flag), tf.float64)[None]), 0.0)[0]

    @property
    def is_first_process(self) -> bool:
        return self.processes is None or self.processes.is_first_process

    def replica_id(self) -> int:
        if self._current is None:
            raise RuntimeError("SimulatedEngine.replica_id() is only known inside call_for_each_replica.")
        return self._current

    def check_same_variables(self, variables: Sequence) -> None:
        """Every process holds the same variable list (one tiny exchange; nothing in one process)."""
        if self.processes is not None:
            self.processes.check_same_variables(variables)

    def check_same_settings(self, settings: dict, what: str) -> None:
        """Every process holds the same `settings` (a ValueError on every one
        naming both otherwise; one tiny exchange, nothing in one process)."""
        if self.processes is not None:
            self.processes.check_same_settings(settings, what)

    def broadcast_initial(self, model_variables: Sequence, optimizer_variables: Sequence) -> None:
        """Every process takes process 0's values (nothing to do in one process)."""
        if self.processes is not None:
            self.processes.broadcast_initial(model_variables, optimizer_variables)
