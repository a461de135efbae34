"""`AdasumCrossDeviceOps`: Adasum as a `tf.distribute.CrossDeviceOps`.

Plain SUM/MEAN reductions (losses, metrics, Keras' own gradient all-reduce)
pass untouched to a fallback; `batch_reduce_adasum` (and, for any combiner,
`batch_reduce_combine`) run the vector-halving collective on TF collective ops
(between CPU worker processes, on tf_adasum's own sockets; see `tf_adasum.engines.tf`).
`AdasumCrossDeviceOps` has an example.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib

from tf_adasum import combiners as combiners_lib
from tf_adasum.comm import cluster, collective_keys
from tf_adasum.comm import compression as compression_lib
from tf_adasum.engines.base import check_values, pair_rule
from tf_adasum.engines.tf import TFEngine

__all__ = ["AdasumCrossDeviceOps"]


def _replica_devices(components: Sequence[tf.Tensor]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The device of every replica (global order) and the ranks of `components`:
    from the active strategy, else (outside any strategy) the devices the
    components live on. (Eager tensors made from host data sit on the first CPU
    whatever their replica.)"""
    if tf.distribute.has_strategy() or len(components) == 1:
        devices, ranks = cluster.cluster_devices(tf.distribute.get_strategy())
    else:
        devices = tuple(c.device for c in components)
        ranks = tuple(range(len(devices)))
    if len(ranks) != len(components) or len(set(devices)) != len(devices) or not all(devices):
        raise ValueError(
            f"Each of the {len(components)} local replicas needs its own device; call this inside the "
            f"strategy's scope or on values placed on distinct devices. Received: devices {devices}"
        )
    return devices, ranks


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
        dtype; a tensor of 4 MiB or more that needs no padding travels alone),
        ``timeout_seconds`` turns a missing peer into an error.
      compression: None (default), ``"float16"`` or ``"bfloat16"``: the
        Adasum collective sends float32 and float64 values in that format,
        with float64 arithmetic on the widened values
        (`tf_adasum.comm.compression`); for links slower than memory. Plain
        reductions through the fallback are not compressed.

    Examples:
      Two replicas on two logical CPUs of this machine (set up before
      TensorFlow's first operation), with orthogonal values, which Adasum
      adds; every replica gets the same result:

      >>> import tensorflow as tf
      >>> import tf_adasum
      >>> cpu = tf.config.list_physical_devices("CPU")[0]
      >>> if tf.config.get_logical_device_configuration(cpu) is None:
      ...     tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
      >>> cross_device_ops = tf_adasum.AdasumCrossDeviceOps()
      >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=cross_device_ops)
      >>> def value():  # [1, 0] on replica 0, [0, 2] on replica 1
      ...     replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      ...     return tf.one_hot(replica, 2) * tf.cast(replica + 1, tf.float32)
      >>> per_replica = strategy.run(value)
      >>> [x.numpy() for x in strategy.experimental_local_results(per_replica)]
      [array([1., 0.], dtype=float32), array([0., 2.], dtype=float32)]
      >>> (combined,) = cross_device_ops.batch_reduce_adasum([per_replica])
      >>> [x.numpy() for x in strategy.experimental_local_results(combined)]
      [array([1., 2.], dtype=float32), array([1., 2.], dtype=float32)]
      >>> (mean,) = cross_device_ops.batch_reduce_combine([per_replica], "mean")
      >>> strategy.experimental_local_results(mean)[0].numpy()
      array([0.5, 1. ], dtype=float32)
      >>> strategy.reduce("SUM", per_replica, axis=None).numpy()  # plain reductions: the fallback's
      array([1., 2.], dtype=float32)
    """

    def __init__(
        self,
        fallback: tf.distribute.CrossDeviceOps | None = None,
        options: tf.distribute.experimental.CommunicationOptions | None = None,
        compression: str | None = None,
    ):
        super().__init__()
        compression_lib.check_compression(compression)
        self._compression = compression
        if fallback is not None and not isinstance(fallback, tf.distribute.CrossDeviceOps):
            raise TypeError(
                "`fallback` must be a `tf.distribute.CrossDeviceOps` or None. "
                f"Received: fallback={fallback!r} of type {type(fallback).__name__}"
            )
        if isinstance(fallback, AdasumCrossDeviceOps):
            raise ValueError(
                f"`fallback` must not itself be an `AdasumCrossDeviceOps`. Received: fallback={fallback!r}"
            )
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
        self._engines: dict[tuple, TFEngine] = {}
        self._lock = threading.Lock()

    @property
    def options(self) -> tf.distribute.experimental.CommunicationOptions:
        return self._options

    @property
    def compression(self) -> str | None:
        """The Adasum collective's wire format (None: uncompressed)."""
        return self._compression

    # -- the Adasum path ------------------------------------------------------

    def batch_reduce_adasum(
        self,
        per_replica_values: Sequence[Any],
        options: tf.distribute.experimental.CommunicationOptions | None = None,
    ) -> list[Any]:
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

        Examples:
          Two replicas (on two logical CPUs) with the same value: Adasum
          returns it (a sum would double it).

          >>> import tensorflow as tf
          >>> import tf_adasum
          >>> cpu = tf.config.list_physical_devices("CPU")[0]
          >>> if tf.config.get_logical_device_configuration(cpu) is None:
          ...     tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
          >>> cross_device_ops = tf_adasum.AdasumCrossDeviceOps()
          >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=cross_device_ops)
          >>> per_replica = strategy.run(lambda: tf.constant([3.0, 4.0]))
          >>> (combined,) = cross_device_ops.batch_reduce_adasum([per_replica])
          >>> [x.numpy() for x in strategy.experimental_local_results(combined)]
          [array([3., 4.], dtype=float32), array([3., 4.], dtype=float32)]
        """
        return self.batch_reduce_combine(per_replica_values, "adasum", options)

    def batch_reduce_combine(
        self,
        per_replica_values: Sequence[Any],
        combiner: str | combiners_lib.Combiner = "adasum",
        options: tf.distribute.experimental.CommunicationOptions | None = None,
        with_partials: bool = False,
        hierarchical: bool = False,
    ) -> list[Any] | tuple[list[Any], Any]:
        """Like `batch_reduce_adasum`, with any pair-rule combiner: `"adasum"`,
        `"sum"`, `"mean"` or a `tf_adasum.combiners` object (AdaCons is not a
        pair rule: use it through `AdasumOptimizer`).

        With `with_partials`, returns ``(combined, partials)``: `partials` is a
        per-replica float64 ``[levels, len(values), 3]`` tensor of the partial
        sums [a.b, |a|^2, |b|^2] each replica holds per tree level (Adasum only;
        zeros otherwise), for diagnostics.

        With `hierarchical`, the replicas of each worker are averaged first and
        the combiner runs across workers on those means (one worker: the mean
        of its replicas). `with_partials` then describes the tree across workers.

        Examples:
          Two replicas (on two logical CPUs) holding [1, 0] and [0, 2]:

          >>> import tensorflow as tf
          >>> import tf_adasum
          >>> cpu = tf.config.list_physical_devices("CPU")[0]
          >>> if tf.config.get_logical_device_configuration(cpu) is None:
          ...     tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
          >>> cross_device_ops = tf_adasum.AdasumCrossDeviceOps()
          >>> strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=cross_device_ops)
          >>> def value():
          ...     replica = tf.distribute.get_replica_context().replica_id_in_sync_group
          ...     return tf.one_hot(replica, 2) * tf.cast(replica + 1, tf.float32)
          >>> per_replica = strategy.run(value)
          >>> (total,) = cross_device_ops.batch_reduce_combine([per_replica], "sum")
          >>> strategy.experimental_local_results(total)[0].numpy()
          array([1., 2.], dtype=float32)
          >>> (combined,), partials = cross_device_ops.batch_reduce_combine([per_replica], with_partials=True)
          >>> strategy.experimental_local_results(partials)[0].numpy()  # one level: [a.b, |a|^2, |b|^2]
          array([[[0., 1., 4.]]])
        """
        combiner = pair_rule(combiner)
        options = self._options.merge(options) if options is not None else self._options
        values = check_values(per_replica_values)
        devices, ranks = _replica_devices(values[0])
        return self._engine(devices, ranks, options).combine_validated(values, combiner, hierarchical, with_partials)

    def _engine(self, devices, ranks, options) -> TFEngine:
        """One engine per device set and options (it caches its eager functions)."""
        key = (devices, ranks, options.bytes_per_pack, options.timeout_seconds)
        with self._lock:
            if key not in self._engines:
                self._engines[key] = TFEngine(devices, ranks, options, tf.distribute.get_strategy(), self._compression)
            return self._engines[key]

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
        keys = collective_keys.KEYS.fallback_keys(devices)
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
