"""`AdasumCrossDeviceOps`: Adasum as a `tf.distribute.CrossDeviceOps`.

Plain SUM/MEAN reductions (losses, metrics, Keras' own gradient all-reduce)
pass untouched to a fallback; `batch_reduce_adasum` (and, for any combiner,
`batch_reduce_combine`) run the vector-halving collective on TF collective ops.

Example:
  >>> strategy = tf.distribute.MirroredStrategy(
  ...     ["/cpu:0", "/cpu:1"], cross_device_ops=tf_adasum.AdasumCrossDeviceOps())
  >>> per_replica = strategy.run(lambda: tf.random.normal([10]))
  >>> combined = strategy.extended._cross_device_ops.batch_reduce_adasum([per_replica])
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.distribute import collective_util, cross_device_utils, distribute_utils
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import values as values_lib

from tf_adasum import combiners as combiners_lib
from tf_adasum import ops, rvh
from tf_adasum.comm import collective

__all__ = ["AdasumCrossDeviceOps"]

# Group keys reserved for each default fallback's own CollectiveAllReduce.
_FALLBACK_GROUP_KEYS = 64


def _replica_tensors(value: Any, index: int) -> tuple[tf.Tensor, ...]:
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


def _check_values(per_replica_values: Sequence[Any]) -> list[tuple[tf.Tensor, ...]]:
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


def num_workers(strategy) -> int:
    """The number of worker processes of `strategy` (1 unless multi-worker)."""
    return getattr(strategy.extended, "_num_workers", 1)


def cluster_devices(strategy) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """All replica devices of `strategy` in global replica order, and the
    global ranks of this process's replicas.

    One process: its worker devices, ranks 0..N-1. `MultiWorkerMirroredStrategy`
    across processes: every task's devices (chief first, then workers by
    index; each worker has as many devices as this one, as the strategy
    itself assumes), this process's at ``id_in_cluster * local count``.
    """
    extended = strategy.extended
    local = tuple(extended.worker_devices)
    if num_workers(strategy) == 1:
        return local, tuple(range(len(local)))
    cluster = extended._cluster_spec.as_dict()
    tasks = [("chief", i) for i in range(len(cluster.get("chief", [])))]
    tasks += [("worker", i) for i in range(len(cluster.get("worker", [])))]
    specs = [tf.DeviceSpec.from_string(d) for d in local]
    devices = tuple(spec.replace(job=job, replica=0, task=task).to_string() for job, task in tasks for spec in specs)
    offset = extended._id_in_cluster * len(local)
    return devices, tuple(range(offset, offset + len(local)))


def sum_over_workers(strategy, values: Sequence[float], timeout_seconds: float | None = None) -> list[float]:
    """Eagerly sums a few float64 numbers over the worker processes of
    `strategy` (each worker contributes once), with one raw collective on each
    worker's first device: usable before any variable exists and outside any
    replica context. Every worker must call it at the same point."""
    devices, ranks = cluster_devices(strategy)
    per_worker = len(ranks)
    leaders = [devices[w] for w in range(0, len(devices), per_worker)]
    if len(leaders) == 1:
        return [float(v) for v in values]
    mine = leaders[ranks[0] // per_worker]
    group_key = collective.KEYS.group_key(leaders)
    instance_key = collective.KEYS.instance_key(group_key, mine)
    with tf.init_scope(), tf.device(mine):
        total = tf.raw_ops.CollectiveReduceV2(
            input=tf.constant(list(values), tf.float64),
            group_size=len(leaders),
            group_key=group_key,
            instance_key=instance_key,
            ordering_token=[],
            merge_op="Add",
            final_op="Id",
            timeout_seconds=float(timeout_seconds or 0),
        )
        return [float(v) for v in total.numpy()]


def _replica_devices(components: Sequence[tf.Tensor]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The device of every replica (global order) and the ranks of `components`:
    from the active strategy, else (outside any strategy) the devices the
    components live on. (Eager tensors made from host data sit on the first CPU
    whatever their replica.)"""
    if tf.distribute.has_strategy():
        devices, ranks = cluster_devices(tf.distribute.get_strategy())
    else:
        devices = tuple(c.device for c in components)
        ranks = tuple(range(len(devices)))
    if len(ranks) != len(components) or len(set(devices)) != len(devices) or not all(devices):
        raise ValueError(
            f"Each of the {len(components)} local replicas needs its own device; call this inside the "
            f"strategy's scope or on values placed on distinct devices. Received: devices {devices}"
        )
    return devices, ranks


def combine_on_devices(
    values: list[tuple[tf.Tensor, ...]],
    comms: Sequence[rvh.Communicator],
    combiner: combiners_lib.Combiner,
    bytes_per_bucket: int = 0,
    with_partials: bool = False,
):
    """Builds the combine of `values` over the local ranks of `comms`.

    Args:
      values: per value, one tensor per local rank (validated by `_check_values`).
      comms: one communicator per local rank, in the order of the components.
      combiner: the pair rule.
      bytes_per_bucket: fusion cap (0: one bucket per dtype).
      with_partials: also return, per local rank, the float64 partial sums
        ``[levels, values, 3]`` the rule computed at each tree level (zeros
        where that rank holds none; see `rvh.level_representatives`).

    With several local ranks this must run inside a `tf.function`: eagerly, the
    first rank's collective would wait forever for the others.

    Returns:
      Per local rank, the list of combined tensors (bitwise identical across
      ranks); with `with_partials`, a pair (that list, the partials per rank).
    """
    num_ranks = comms[0].size
    shapes = [v[0].shape for v in values]
    buckets = rvh.make_buckets(
        [v[0].dtype for v in values], [s.num_elements() for s in shapes], num_ranks, bytes_per_bucket
    )
    outputs = [[components[local] for components in values] for local in range(len(comms))]
    levels = rvh.num_levels(num_ranks)
    recorded = [[[None] * len(values) for _ in range(levels)] for _ in comms]
    for bucket in buckets:
        for local, comm in enumerate(comms):

            def record(level, partials, local=local, bucket=bucket):
                for row, i in enumerate(bucket.indices):
                    recorded[local][level][i] = partials[row]

            with tf.device(comm.device):
                flat = rvh.allreduce(
                    comm, rvh.pack(outputs[local], bucket), bucket, combiner, record if with_partials else None
                )
                for i, tensor in zip(bucket.indices, rvh.unpack(flat, bucket, shapes)):
                    outputs[local][i] = tensor
    if not with_partials:
        return outputs
    partials = []
    for comm, rank_levels in zip(comms, recorded):
        with tf.device(comm.device):
            zeros = tf.zeros([3], tf.float64)
            rows = [tf.stack([zeros if r is None else r for r in level]) for level in rank_levels]
            partials.append(tf.stack(rows) if rows else tf.zeros([0, len(values), 3], tf.float64))
    return outputs, partials


def local_communicators(
    devices: Sequence[str], timeout_seconds: float | None, ranks: Sequence[int] | None = None
) -> list[collective.TFCollectiveCommunicator]:
    """TF collective communicators for this process's replicas.

    Args:
      devices: every replica's device, in global rank order (all processes).
      timeout_seconds: collective timeout (None or 0: wait forever).
      ranks: the global ranks living in this process (default: all of them).
    """
    ranks = range(len(devices)) if ranks is None else ranks
    collective.register_groups(devices, rvh.groups(len(devices)))
    return [collective.TFCollectiveCommunicator(devices, r, timeout_seconds) for r in ranks]


def _build(values, devices, ranks, combiner, bytes_per_bucket, timeout_seconds, with_partials, hierarchical):
    if not hierarchical:
        comms = local_communicators(devices, timeout_seconds, ranks)
        return combine_on_devices(values, comms, combiner, bytes_per_bucket, with_partials)
    # The mean of this worker's replicas, then the combine across workers: the
    # replicas with local index l on every worker form tree l (identical inputs,
    # so every replica ends with the same result).
    local_devices = [devices[r] for r in ranks]
    if len(local_devices) > 1:
        local_comms = local_communicators(local_devices, timeout_seconds)
        means = combine_on_devices(values, local_comms, combiners_lib.Mean(), bytes_per_bucket)
        values = [tuple(means[local][i] for local in range(len(ranks))) for i in range(len(values))]
    num_local = len(ranks)
    worker = ranks[0] // num_local
    cross_comms = []
    for local in range(num_local):
        tree = [devices[w * num_local + local] for w in range(len(devices) // num_local)]
        collective.register_groups(tree, rvh.groups(len(tree)))
        cross_comms.append(collective.TFCollectiveCommunicator(tree, worker, timeout_seconds))
    return combine_on_devices(values, cross_comms, combiner, bytes_per_bucket, with_partials)


class AdasumCrossDeviceOps(tf.distribute.CrossDeviceOps):
    """Cross-device ops that carry Adasum's vector-halving collective.

    Args:
      fallback: the `tf.distribute.CrossDeviceOps` used for plain SUM/MEAN
        reductions, broadcasts and gathers. Default: what `MirroredStrategy`
        picks for the devices in use, a `CollectiveAllReduce` (ring on CPUs,
        the runtime's choice, e.g. NCCL, on GPUs; `ReductionToOneDevice` for a
        mix of CPUs and GPUs), with its own collective keys so that strategies
        of different sizes can live in one process.
      options: a `tf.distribute.experimental.CommunicationOptions`:
        ``bytes_per_pack`` caps the size of a fused bucket (0: one bucket per
        dtype), ``timeout_seconds`` turns a missing peer into an error.
    """

    def __init__(
        self,
        fallback: tf.distribute.CrossDeviceOps | None = None,
        options: tf.distribute.experimental.CommunicationOptions | None = None,
    ):
        super().__init__()
        if fallback is not None and not isinstance(fallback, tf.distribute.CrossDeviceOps):
            raise TypeError(
                "`fallback` must be a `tf.distribute.CrossDeviceOps` or None. "
                f"Received: fallback={fallback!r} of type {type(fallback).__name__}"
            )
        if isinstance(fallback, AdasumCrossDeviceOps):
            raise ValueError("`fallback` must not itself be an `AdasumCrossDeviceOps`. Received: fallback={fallback!r}")
        if options is None:
            options = tf.distribute.experimental.CommunicationOptions()
        if not isinstance(options, collective_util.Options):
            raise TypeError(
                "`options` must be a `tf.distribute.experimental.CommunicationOptions`. "
                f"Received: options={options!r} of type {type(options).__name__}"
            )
        self._fallback = fallback
        self._fallbacks: dict[tuple[str, ...], tf.distribute.CrossDeviceOps] = {}
        self._options = options
        self._eager_fns: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    @property
    def options(self) -> tf.distribute.experimental.CommunicationOptions:
        return self._options

    # -- the Adasum path ------------------------------------------------------

    def batch_reduce_adasum(self, per_replica_values: Sequence[Any], options=None) -> list[Any]:
        """Combines each value over all replicas with Adasum.

        Args:
          per_replica_values: a list of per-replica values (e.g. outputs of
            `strategy.run`), each float16, bfloat16, float32 or float64 with a
            static shape, the same on every replica.
          options: optional `CommunicationOptions` merged over the instance's.

        Returns:
          A list of mirrored values: the Adasum tree of each value over the
          replicas (`tf_adasum.reference.adasum_tree`), bitwise identical on
          every replica.
        """
        return self.batch_reduce_combine(per_replica_values, "adasum", options)

    def batch_reduce_combine(
        self,
        per_replica_values: Sequence[Any],
        combiner="adasum",
        options=None,
        with_partials: bool = False,
        hierarchical: bool = False,
    ):
        """Like `batch_reduce_adasum`, with any combiner (name or object).

        With `with_partials`, returns ``(combined, partials)``: `partials` is a
        per-replica float64 ``[levels, len(values), 3]`` tensor of the partial
        sums [a.b, |a|^2, |b|^2] each replica holds per tree level (Adasum only;
        zeros otherwise), for diagnostics.

        With `hierarchical`, the replicas of each worker are averaged first and
        the combiner runs across workers on those means (one worker: the mean
        of its replicas). `with_partials` then describes the tree across workers.
        """
        combiner = combiners_lib.get(combiner)
        if not combiner.pairwise:
            raise ValueError(
                f"{combiner!r} is not a pair rule of the tree; use it through tf_adasum.AdasumOptimizer. "
                f"Received: combiner={combiner!r}"
            )
        options = self._options.merge(options) if options is not None else self._options
        values = _check_values(per_replica_values)
        single = len(values[0]) == 1 and num_workers(tf.distribute.get_strategy()) == 1
        devices, ranks = ((None,), (0,)) if single else _replica_devices(values[0])
        if len(devices) == 1:
            combined = [distribute_utils.regroup(components, wrap_class=values_lib.Mirrored) for components in values]
            if with_partials:
                return combined, tf.zeros([0, len(values), 3], tf.float64)
            return combined
        build_args = (
            devices,
            ranks,
            combiner,
            options.bytes_per_pack,
            options.timeout_seconds,
            with_partials,
            hierarchical,
        )
        if tf.executing_eagerly():
            built = self._eager_fn(*build_args)(values)
        else:
            built = _build(values, *build_args)
        outputs, partials = built if with_partials else (built, None)
        combined = [
            distribute_utils.regroup(tuple(outputs[r][i] for r in range(len(ranks))), wrap_class=values_lib.Mirrored)
            for i in range(len(values))
        ]
        if with_partials:
            return combined, distribute_utils.regroup(tuple(partials), wrap_class=values_lib.PerReplica)
        return combined

    def _eager_fn(self, *build_args):
        """A cached `tf.function`: eagerly, devices would wait on each other forever."""
        with self._lock:
            if build_args not in self._eager_fns:
                self._eager_fns[build_args] = tf.function(lambda values: _build(values, *build_args), autograph=False)
            return self._eager_fns[build_args]

    # -- everything else goes to the fallback ----------------------------------

    def fallback_for(self, devices: Sequence[str]) -> tf.distribute.CrossDeviceOps:
        """The cross-device ops that plain reductions on `devices` go to."""
        if self._fallback is not None:
            return self._fallback
        devices = tuple(devices)
        with self._lock:
            if devices not in self._fallbacks:
                self._fallbacks[devices] = self._default_fallback(devices)
            return self._fallbacks[devices]

    def _default_fallback(self, devices: tuple[str, ...]) -> tf.distribute.CrossDeviceOps:
        """As `MirroredStrategy` chooses its default (TF 2.21), with our own keys."""
        device_types = {tf.DeviceSpec.from_string(d).device_type for d in devices}
        if len(device_types) != 1:
            return tf.distribute.ReductionToOneDevice()
        implementation = tf.distribute.experimental.CommunicationImplementation.AUTO
        if device_types == {"CPU"}:
            implementation = tf.distribute.experimental.CommunicationImplementation.RING
        options = tf.distribute.experimental.CommunicationOptions(implementation=implementation).merge(self._options)
        keys = cross_device_utils.CollectiveKeys(group_key_start=collective.KEYS.reserve(_FALLBACK_GROUP_KEYS))
        return cross_device_ops_lib.CollectiveAllReduce(
            devices=devices, group_size=len(devices), options=options, collective_keys=keys
        )

    def _fallback_for_value(self, value) -> tf.distribute.CrossDeviceOps:
        components = value.values if isinstance(value, tf.distribute.DistributedValues) else (value,)
        return self.fallback_for(_replica_devices(components)[0])

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self._fallback_for_value(per_replica_value).reduce_implementation(
            reduce_op, per_replica_value, destinations, options
        )

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return self._fallback_for_value(value_destination_pairs[0][0]).batch_reduce_implementation(
            reduce_op, value_destination_pairs, options
        )

    def broadcast_implementation(self, tensor, destinations):
        return self.fallback_for(cross_device_ops_lib.get_devices_from(destinations)).broadcast_implementation(
            tensor, destinations
        )

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        return self._fallback_for_value(per_replica_value)._gather_implementation(
            per_replica_value, destinations, axis, options
        )

    def _all_reduce(self, reduce_op, value, replica_id, options):
        return self.fallback_for(tf.distribute.get_strategy().extended.worker_devices)._all_reduce(
            reduce_op, value, replica_id, options
        )
