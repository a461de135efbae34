"""The TF engine: a tf.distribute strategy's replicas over TF collective ops.

One process with several devices (`MirroredStrategy`), or the worker processes
of a `MultiWorkerMirroredStrategy` (the same ops over gRPC). Each local
replica has its own `tf_adasum.comm.collective.TFCollectiveCommunicator`;
the vector-halving tree of all of them is built at once, and between the
CPUs of this process its exchanges are direct (no collective).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_adasum import combiners as combiners_lib
from tf_adasum.comm import cluster, collective
from tf_adasum.comm import compression as compression_lib
from tf_adasum.engines.base import (
    Components,
    Engine,
    combine_with_communicators,
    describe,
    digests_differ,
    small_digests,
)

__all__ = ["TFEngine", "sum_over_workers"]


def sum_over_workers(strategy, values: Sequence[float], timeout_seconds: float | None = None) -> list[float]:
    """Eagerly sums a few float64 numbers over the worker processes of
    `strategy` (each worker contributes once), with one raw collective on each
    worker's first device: usable before any variable exists and outside any
    replica context. Every worker must call it at the same point.

    It returns only once every worker holds the totals: a second, empty
    exchange follows the sum, so a worker may raise (or exit) on the totals
    right away without cutting off a peer still receiving them."""
    devices, ranks = cluster.cluster_devices(strategy)
    per_worker = len(ranks)
    leaders = [devices[w] for w in range(0, len(devices), per_worker)]
    if len(leaders) == 1:
        return [float(v) for v in values]
    mine = leaders[ranks[0] // per_worker]
    group_key = collective.KEYS.group_key(leaders)

    def add(numbers):
        return tf.raw_ops.CollectiveReduceV2(
            input=tf.constant(numbers, tf.float64),
            group_size=len(leaders),
            group_key=group_key,
            instance_key=collective.KEYS.instance_key(group_key, mine),
            ordering_token=[],
            merge_op="Add",
            final_op="Id",
            timeout_seconds=float(timeout_seconds or 0),
        )

    with tf.init_scope(), tf.device(mine):
        total = [float(v) for v in add(list(values)).numpy()]
        try:
            # A worker finishes this exchange only after every worker has
            # entered it, that is, has its totals. So it can fail only where
            # a peer has left after finishing it, and then this worker's
            # totals are complete. (A failed collective may leave this
            # process's collectives aborted; the next one then says so.)
            add([0.0]).numpy()
        except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError):
            pass
        return total


class TFEngine(Engine):
    """Replicas on `devices` (global replica order) over TF collective ops.

    Args:
      devices: every replica's device, in global replica order (all processes).
      ranks: the global ranks of this process's replicas (consecutive).
      options: a `tf.distribute.experimental.CommunicationOptions`:
        ``bytes_per_pack`` caps a fused bucket (0: one per dtype; large
        tensors may travel alone, see `tf_adasum.rvh.make_buckets`),
        ``timeout_seconds`` turns a missing peer into an error.
      strategy: the strategy the replicas belong to (for the small exchanges);
        default: the current one.
      compression: None, or ``"float16"``/``"bfloat16"``: float32 and float64
        buffers travel in that format (`tf_adasum.comm.compression`).
    """

    def __init__(
        self,
        devices: Sequence[str],
        ranks: Sequence[int],
        options: tf.distribute.experimental.CommunicationOptions | None = None,
        strategy: Any = None,
        compression: str | None = None,
    ):
        compression_lib.check_compression(compression)
        self.compression = compression
        self.devices, self.ranks = tuple(devices), tuple(ranks)
        if len(set(self.devices)) != len(self.devices) or not all(self.devices):
            raise ValueError(f"Each replica needs its own device. Received: devices {self.devices}")
        if not self.ranks or list(self.ranks) != list(range(self.ranks[0], self.ranks[0] + len(self.ranks))):
            raise ValueError(f"This process's ranks must be consecutive. Received: ranks {self.ranks}")
        self.num_replicas, self.local_replicas = len(self.devices), len(self.ranks)
        self.options = options or tf.distribute.experimental.CommunicationOptions()
        self.strategy = strategy if strategy is not None else tf.distribute.get_strategy()
        self._eager_fns: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_strategy(cls, strategy, options=None, compression=None) -> TFEngine:
        """The engine over every replica of `strategy`."""
        devices, ranks = cluster.cluster_devices(strategy)
        return cls(devices, ranks, options, strategy, compression)

    @property
    def num_workers(self) -> int:
        return self.num_replicas // self.local_replicas

    def scope_size(self, scope: str) -> int:
        return {"all": self.num_replicas, "local": self.local_replicas, "cross": self.num_workers}[scope]

    def _trees(self, scope: str) -> list[tuple[tuple[str, ...], int]]:
        """Per local replica: the devices of its tree for `scope`, and its rank there."""
        if scope == "all":
            return [(self.devices, r) for r in self.ranks]
        if scope == "local":
            local = tuple(self.devices[r] for r in self.ranks)
            return [(local, i) for i in range(self.local_replicas)]
        # The replicas with local index i on every worker form tree i.
        n, worker = self.local_replicas, self.ranks[0] // self.local_replicas
        return [(tuple(self.devices[w * n + i] for w in range(self.num_workers)), worker) for i in range(n)]

    def _build(self, values, combiner, scope):
        timeout = self.options.timeout_seconds
        comms = [collective.TFCollectiveCommunicator(tree, rank, timeout) for tree, rank in self._trees(scope)]
        comms = compression_lib.compressed(comms, self.compression)
        return combine_with_communicators(values, comms, combiner, self.options.bytes_per_pack)

    def _combine_implementation(self, values: list[Components], combiner: combiners_lib.Combiner, scope: str):
        if not tf.executing_eagerly():
            return self._build(values, combiner, scope)
        # Eagerly, the first replica's collective would wait forever for the others.
        key = (scope, combiner)
        with self._lock:
            if key not in self._eager_fns:
                self._eager_fns[key] = tf.function(lambda v: self._build(v, combiner, scope), autograph=False)
        outputs, partials = self._eager_fns[key](values)
        return [tuple(o) for o in outputs], tuple(partials)

    def sum_small(self, per_replica) -> tf.Tensor:
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def gather_small(self, per_replica) -> tf.Tensor:
        rows = self.strategy.extended.call_for_each_replica(lambda x: tf.expand_dims(x, 0), args=(per_replica,))
        shape = self.strategy.experimental_local_results(per_replica)[0].shape
        return tf.ensure_shape(self.strategy.gather(rows, axis=0), [self.num_replicas, *shape])

    @property
    def is_first_process(self) -> bool:
        return self.ranks[0] == 0

    def replica_id(self):
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    def check_same_variables(self, variables) -> None:
        if self.num_workers == 1:
            return
        digests = small_digests(variables)
        totals = sum_over_workers(
            self.strategy, [1.0] + [x for d in digests for x in (d, d * d)], self.options.timeout_seconds
        )
        if digests_differ(totals[0], totals[1::2], totals[2::2]):
            raise ValueError(
                "The trainable variables differ across the workers of the MultiWorkerMirroredStrategy "
                "(shapes, dtypes or order); every worker must build the same model. This worker "
                f"(task {cluster.task_index(self.strategy)}) has {describe(variables)}"
            )

    def broadcast_initial(self, model_variables, optimizer_variables) -> None:
        """Nothing to do: the strategy creates its variables with the first
        worker's initial values everywhere."""
