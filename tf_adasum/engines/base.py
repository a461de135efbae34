"""The `Engine` interface: how the replicas of a training job reach each other.

An engine is chosen once, when `tf_adasum.AdasumOptimizer` is built
(`tf_adasum.engines.select`), and held as one attribute. Both engines, the
replicas of a tf.distribute strategy over TF collective ops
(`tf_adasum.engines.tf`) and MPI ranks (`tf_adasum.engines.mpi`), implement it
as peers:

* `Engine.combine` (the template method): validates, takes the shortcuts,
  runs the hierarchical combine (the mean within each worker, then the
  combiner across workers) once for every engine, and leaves the combine over
  one group of ranks to `Engine._combine_implementation`;
* `sum_small`, `gather_small`: tiny float64 all-reduces and gathers (the
  per-step finite check, AdaCons' weights, diagnostics);
* `replica_id`, `check_same_variables`, `broadcast_initial`.

Values travel as a list with one entry per tensor, each either a
`tf.distribute.DistributedValues` (one component per local replica) or a tensor
(one local replica); internally as tuples of per-replica tensors.
"""

from __future__ import annotations

import abc
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import values as values_lib

from tf_adasum import combiners as combiners_lib
from tf_adasum import ops
from tf_adasum.tree import rvh, topology
from tf_adasum.tree.buckets import make_buckets, pack, unpack
from tf_adasum.tree.communicator import Communicator

__all__ = [
    "SCOPES",
    "Engine",
    "agree",
    "check_values",
    "combine_with_communicators",
    "pair_rule",
    "regroup",
    "signature_digest",
    "variable_signature",
]

#: The groups of ranks a combine can span: every replica, the replicas of this
#: worker (or MPI node), or one replica per worker (the same local index).
SCOPES = ("all", "local", "cross")

#: Three 10-bit digests of the variable list: sums of d and d^2 stay exact in
#: float64 for up to 4096 replicas, and n * sum(d^2) == sum(d)^2 exactly when
#: every replica has the same d.
_DIGESTS, _DIGEST_BITS = 3, 10

Components = tuple[tf.Tensor, ...]


def _replica_tensors(value: Any, index: int) -> Components:
    """The per-replica components of one value (a tensor is one replica)."""
    if isinstance(value, tf.distribute.DistributedValues):
        components = value.values
    elif isinstance(value, (tf.Tensor, tf.Variable, tf.IndexedSlices)):
        components = (value,)
    else:
        raise TypeError(
            "Each value must be a `tf.distribute.DistributedValues` (e.g. from `strategy.run`) or a "
            f"tensor. Received: per_replica_values[{index}] of type {type(value).__name__}"
        )
    return tuple(tf.convert_to_tensor(c) for c in components)


def check_values(per_replica_values: Sequence[Any]) -> list[Components]:
    """Validates the inputs of a combine; raises before any collective is issued."""
    if not isinstance(per_replica_values, (list, tuple)):
        raise TypeError(
            "`per_replica_values` must be a list of per-replica values. "
            f"Received: per_replica_values of type {type(per_replica_values).__name__}"
        )
    if not per_replica_values:
        raise ValueError("`per_replica_values` must not be empty. Received: per_replica_values=[]")
    values = [_replica_tensors(v, i) for i, v in enumerate(per_replica_values)]
    num_replicas = len(values[0])
    for i, components in enumerate(values):
        if len(components) != num_replicas:
            raise ValueError(
                f"Every value must have one component per replica. Received: per_replica_values[0] has "
                f"{num_replicas}, per_replica_values[{i}] has {len(components)}"
            )
        first = components[0]
        ops.check_float_dtype(first.dtype, f"per_replica_values[{i}]")
        if not first.shape.is_fully_defined():
            raise ValueError(f"Adasum needs static shapes. Received: per_replica_values[{i}] with shape {first.shape}")
        for r, component in enumerate(components[1:], start=1):
            if component.dtype != first.dtype:
                raise TypeError(
                    f"per_replica_values[{i}] has different dtypes across replicas. Received: "
                    f"replica 0 {first.dtype.name}, replica {r} {component.dtype.name}"
                )
            if component.shape != first.shape:
                raise ValueError(
                    f"per_replica_values[{i}] has different shapes across replicas. Received: "
                    f"replica 0 {first.shape}, replica {r} {component.shape}"
                )
    return values


def pair_rule(combiner: str | combiners_lib.Combiner) -> combiners_lib.Combiner:
    """The combiner `combiner` names, which must be a pair rule of the tree."""
    combiner = combiners_lib.get(combiner)
    if not combiner.pairwise:
        raise ValueError(
            f"{combiner!r} is not a pair rule of the tree; use it through tf_adasum.AdasumOptimizer. "
            f"Received: combiner={combiner!r}"
        )
    return combiner


def regroup(components: Components, wrap_class=values_lib.Mirrored):
    """One value from its per-replica components: a mirrored value (equal
    everywhere; `wrap_class` PerReplica otherwise), or the tensor itself for
    one replica."""
    return distribute_utils.regroup(tuple(components), wrap_class=wrap_class)


def combine_with_communicators(
    values: list[Components],
    comms: Sequence[Communicator],
    combiner: combiners_lib.Combiner,
    bytes_per_bucket: int = 0,
) -> tuple[list[Components], Components]:
    """Builds the vector-halving combine of `values` over the local ranks of `comms`.

    Args:
      values: per value, one tensor per local rank (validated by `check_values`).
      comms: one communicator per local rank, in the order of the components.
      combiner: the pair rule.
      bytes_per_bucket: fusion cap (0: one bucket per dtype; see `tf_adasum.tree.buckets.make_buckets`).

    With several local ranks this must run inside a `tf.function`: eagerly, the
    first rank's collective would wait forever for the others.

    Returns:
      Per value, the combined tensor of every local rank (bitwise identical
      across ranks); and per local rank the float64 partial sums
      ``[levels, values, 3]`` the rule computed at each tree level (zeros
      where that rank holds none; see `topology.level_representatives`).
    """
    num_ranks = comms[0].size
    shapes = [v[0].shape for v in values]
    buckets = make_buckets(
        [v[0].dtype for v in values], [s.num_elements() for s in shapes], num_ranks, bytes_per_bucket
    )
    outputs = [[components[local] for components in values] for local in range(len(comms))]
    levels = topology.num_levels(num_ranks)
    recorded = [[[None] * len(values) for _ in range(levels)] for _ in comms]
    for bucket in buckets:

        def record(level, partials, local, bucket=bucket):
            for row, i in enumerate(bucket.indices):
                recorded[local][level][i] = partials[row]

        flats = []
        for local, comm in enumerate(comms):
            with tf.device(comm.device):
                flats.append(pack(outputs[local], bucket))
        records = [functools.partial(record, local=local) for local in range(len(comms))]
        for local, (comm, flat) in enumerate(zip(comms, rvh.allreduce(comms, flats, bucket, combiner, records))):
            with tf.device(comm.device):
                for i, tensor in zip(bucket.indices, unpack(flat, bucket, shapes)):
                    outputs[local][i] = tensor
    partials = []
    for comm, rank_levels in zip(comms, recorded):
        with tf.device(comm.device):
            zeros = tf.zeros([3], tf.float64)
            rows = [tf.stack([zeros if r is None else r for r in level]) for level in rank_levels]
            partials.append(tf.stack(rows) if rows else tf.zeros([0, len(values), 3], tf.float64))
    per_value = [tuple(outputs[local][i] for local in range(len(comms))) for i in range(len(values))]
    return per_value, tuple(partials)


def variable_signature(variables: Sequence) -> list[tuple[tuple[int, ...], str]]:
    """What must agree across processes: each variable's shape and dtype, in order."""
    signature = []
    for v in variables:
        dtype = getattr(v, "dtype", None)
        dtype = getattr(dtype, "as_numpy_dtype", dtype)
        signature.append((tuple(int(d) for d in v.shape), str(np.dtype(dtype))))
    return signature


def signature_digest(signature) -> bytes:
    """A 32-byte digest of a `variable_signature`."""
    return hashlib.sha256(repr(signature).encode()).digest()


def describe(variables) -> str:
    signature = variable_signature(variables)
    return f"{len(signature)}: {signature[:8]}{' ...' if len(signature) > 8 else ''}"


def small_digests(variables) -> list[float]:
    """Three 10-bit numbers from the digest of `variables`' signature."""
    digest = int.from_bytes(signature_digest(variable_signature(variables)), "big")
    mask = (1 << _DIGEST_BITS) - 1
    return [float((digest >> (_DIGEST_BITS * i)) & mask) for i in range(_DIGESTS)]


def digests_differ(n: float, sums: Sequence[float], squares: Sequence[float]) -> bool:
    """Whether n processes' `small_digests` d differ, from the sums of d and d^2."""
    return any(n * q != s * s for s, q in zip(sums, squares))


class Engine(abc.ABC):
    """How this process's replicas reach all the others (see the module docstring).

    Attributes:
      num_replicas: the replicas combined, over all processes.
      local_replicas: the replicas living in this process.
      strategy: the `tf.distribute` strategy whose replica context the
        optimizer runs in (the default strategy for MPI).
    """

    num_replicas: int
    local_replicas: int
    strategy: Any

    # -- the combine (template method) -------------------------------------------

    def combine(
        self,
        per_replica_values: Sequence[Any],
        combiner: str | combiners_lib.Combiner = "adasum",
        hierarchical: bool = False,
        with_partials: bool = False,
    ):
        """Combines each value over the replicas (cross-replica context).

        Args:
          per_replica_values: a list of per-replica values (or tensors for one
            local replica), float16/bfloat16/float32/float64, static shapes.
          combiner: a pair rule of the tree ("adasum", "sum", "mean" or object).
          hierarchical: the mean of each worker's replicas first, then the
            combiner across workers.
          with_partials: also return the per-replica float64 partial sums
            ``[levels, values, 3]`` of the (last) tree, for diagnostics.

        Returns:
          A list of mirrored values (tensors for one local replica), bitwise
          identical on every replica; with `with_partials`, a pair.
        """
        return self.combine_validated(check_values(per_replica_values), combiner, hierarchical, with_partials)

    def combine_validated(
        self,
        values: list[Components],
        combiner: str | combiners_lib.Combiner = "adasum",
        hierarchical: bool = False,
        with_partials: bool = False,
    ):
        """`combine` of values already validated by `check_values`."""
        combiner = pair_rule(combiner)
        if len(values[0]) != self.local_replicas:
            raise ValueError(
                f"Expected one component per local replica ({self.local_replicas}). "
                f"Received: per_replica_values[0] with {len(values[0])}"
            )
        outputs, partials = self.combine_components(values, combiner, hierarchical)
        combined = [regroup(components) for components in outputs]
        return (combined, regroup(partials, values_lib.PerReplica)) if with_partials else combined

    def combine_components(
        self, values: list[Components], combiner: combiners_lib.Combiner, hierarchical: bool = False
    ) -> tuple[list[Components], Components]:
        """`combine` on validated per-replica tuples: the combined tuples and the
        partials of every local replica."""
        scope = "all"
        if hierarchical:
            if self.scope_size("local") > 1:
                values, _ = self._combine_implementation(values, combiners_lib.Mean(), "local")
            scope = "cross"
        if self.scope_size(scope) == 1:
            empty = tf.zeros([0, len(values), 3], tf.float64)
            return [tuple(combiner.prepare(c, 1) for c in v) for v in values], (empty,) * self.local_replicas
        return self._combine_implementation(values, combiner, scope)

    @abc.abstractmethod
    def scope_size(self, scope: str) -> int:
        """The number of ranks in this process's group of `scope` (see `SCOPES`)."""

    @abc.abstractmethod
    def _combine_implementation(
        self, values: list[Components], combiner: combiners_lib.Combiner, scope: str
    ) -> tuple[list[Components], Components]:
        """Combines over this process's groups of `scope`; see `combine_with_communicators`."""

    # -- small exchanges (cross-replica context) --------------------------------------

    @abc.abstractmethod
    def sum_small(self, per_replica: Any) -> tf.Tensor:
        """The float64 sum over all replicas of a small per-replica vector."""

    @abc.abstractmethod
    def gather_small(self, per_replica: Any) -> tf.Tensor:
        """``[num_replicas, *shape]``: every replica's small tensor, in replica order."""

    @property
    @abc.abstractmethod
    def is_first_process(self) -> bool:
        """Whether this process holds replica 0 (the one that writes logs and files)."""

    @abc.abstractmethod
    def replica_id(self) -> tf.Tensor | int:
        """In a replica context: this replica's global index."""

    # -- once, eagerly, when the optimizer is built ------------------------------------

    @abc.abstractmethod
    def check_same_variables(self, variables: Sequence) -> None:
        """Raises ValueError on every process unless all processes hold the same
        variable list (shapes, dtypes, order). One tiny exchange across processes."""

    @abc.abstractmethod
    def broadcast_initial(self, model_variables: Sequence, optimizer_variables: Sequence) -> None:
        """Makes every process start from the same values (where the strategy does not)."""


def agree(engine: Engine, finite, variables) -> tf.Tensor:
    """Cross-replica context, before any combine: True when `finite` (per
    replica: whether its gradients are all finite) holds on every replica (the
    same answer on every replica), after one small all-reduce that also
    carries a digest of `variables`; an error on every replica when the
    replicas' variable lists differ."""
    digests = small_digests(variables)

    def local_vector(ok):
        values = [tf.cast(tf.logical_not(ok), tf.float64)]
        for d in digests:
            values += [tf.constant(d, tf.float64), tf.constant(d * d, tf.float64)]
        return tf.stack(values)

    total = engine.sum_small(engine.strategy.extended.call_for_each_replica(local_vector, args=(finite,)))
    n = tf.constant(float(engine.num_replicas), tf.float64)
    same = tf.reduce_all(tf.equal(n * total[2::2], tf.square(total[1::2])))
    check = tf.debugging.Assert(
        same,
        [
            "AdasumOptimizer: the replicas' variable lists differ (shapes, dtypes or order); every "
            f"replica must build the same model. This replica has {describe(variables)}"
        ],
    )
    with tf.control_dependencies([check]):
        return tf.equal(total[0], 0.0)
