"""The TF engine: a tf.distribute strategy's replicas over TF collective ops.

One process with several devices (`MirroredStrategy`), or the worker processes
of a `MultiWorkerMirroredStrategy`. Each local replica has its own
communicator; the vector-halving tree of all of them is built at once, and
between the CPUs of this process its exchanges are direct (no collective).

Between worker processes whose replicas are CPUs, one per process in each
tree (one CPU per worker, or the cross-worker scope of the hierarchical
combine), the tree's messages travel over this process's socket mesh
(`tf_adasum.comm.sockets`, `tf_adasum.comm.socket_communicator`), set up on
the first such combine by `tf_adasum.comm.socket_setup` (its settings,
``TF_ADASUM_WORKER_TRANSPORT`` and ``TF_ADASUM_WORKER_PORT_OFFSET``, are
read there) with tiny sums over the workers (`sum_over_workers`: TF
collective ops); elsewhere, when ``TF_ADASUM_WORKER_TRANSPORT=collective``,
and on every worker together when a worker could not listen on or reach a
port (one warning), over TF collective ops
(`tf_adasum.comm.collective.TFCollectiveCommunicator`, gRPC between
processes).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_adasum import combiners as combiners_lib
from tf_adasum.comm import cluster, collective, collective_keys, socket_communicator, socket_setup
from tf_adasum.comm import compression as compression_lib
from tf_adasum.engines.base import (
    Components,
    Engine,
    combine_with_communicators,
    describe,
    digests_differ,
    small_digests,
)
from tf_adasum.tree import topology

__all__ = ["TFEngine", "sum_over_workers"]


def _partners(num_ranks: int, rank: int) -> set[int]:
    """The ranks `rank` exchanges messages with over the socket transport in
    the tree of `num_ranks`: its pairs, and whom its partial sums talk to."""
    groups = [g for g in topology.groups(num_ranks) if rank in g]  # pairs (a pair's sum is its swap partner) and sums
    return {m for g in groups for step in socket_communicator.sum_steps(g, rank) for m in step}


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
    group_key = collective_keys.KEYS.group_key(leaders)

    def add(numbers):
        return tf.raw_ops.CollectiveReduceV2(
            input=tf.constant(numbers, tf.float64),
            group_size=len(leaders),
            group_key=group_key,
            instance_key=collective_keys.KEYS.instance_key(group_key, mine),
            ordering_token=[],
            merge_op="Add",
            final_op="Id",
            timeout_seconds=float(timeout_seconds or 0),
        )

    with tf.init_scope(), tf.device(mine):
        total = [float(v) for v in add(list(values)).numpy()]
        collective.closing_exchange(lambda: add([0.0]).numpy())
        return total


class TFEngine(Engine):
    """Replicas on `devices` (global replica order) over TF collective ops, or,
    between CPU worker processes, over the socket transport (see the module).

    Args:
      devices: every replica's device, in global replica order (all processes).
      ranks: the global ranks of this process's replicas (consecutive).
      options: a `tf.distribute.experimental.CommunicationOptions`:
        ``bytes_per_pack`` caps a fused bucket (0: one per dtype; large
        tensors may travel alone, see `tf_adasum.tree.buckets.make_buckets`),
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
        self.transport = socket_setup.worker_transport()
        self.port_offset = socket_setup.worker_port_offset()
        # Each device's process, numbered in the workers' order (their order in `devices`).
        of = {d: cluster.process_of(d) for d in self.devices}
        numbers = {p: i for i, p in enumerate(dict.fromkeys(of.values()))}
        self._process_index = {d: numbers[p] for d, p in of.items()}
        # Whether trees spread over processes go over sockets (on GPUs the setting changes nothing).
        self._sockets_between_processes = self.transport == "sockets" and all(cluster.is_cpu(d) for d in self.devices)

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

    def _process_of(self, device: str) -> int:
        """The index of `device`'s process (job, replica, task) among the
        processes of `devices`, in their order (the workers' order)."""
        return self._process_index[device]

    def _over_sockets(self, trees) -> bool:
        """Whether `trees` go over the socket mesh: CPUs only, spread over
        processes, at most one rank of each tree per process."""
        return self._sockets_between_processes and all(
            len({self._process_of(d) for d in tree}) == len(tree) > 1 for tree, _ in trees
        )

    def _mesh_key(self) -> tuple:
        """Names this engine's workers and timeout for `tf_adasum.comm.socket_setup`."""
        return (self.devices, float(self.options.timeout_seconds or 0))

    def _sum_over_workers(self, values: Sequence[float]) -> list[float]:
        return sum_over_workers(self.strategy, values, self.options.timeout_seconds)

    def _build(self, values, combiner, scope):
        timeout = self.options.timeout_seconds
        trees = self._trees(scope)
        mesh = None
        if self._over_sockets(trees):
            # This process's mesh, made once per process (every worker makes it
            # at the same point: the first combine over sockets).
            mesh = socket_setup.worker_mesh(
                self._mesh_key(),
                self._process_of(self.devices[self.ranks[0]]),
                cluster.task_addresses(self.strategy),
                self.port_offset,
                float(timeout or 0),
                self._sum_over_workers,
            )
        if mesh is not None:
            # Every worker builds this combine at the same point: connect now,
            # so that a peer dying later closes a connection being read.
            peers = [self._process_of(tree[p]) for tree, rank in trees for p in _partners(len(tree), rank)]
            if not socket_setup.links_agreed(mesh, self._mesh_key(), peers, scope, timeout, self._sum_over_workers):
                mesh = None
        if mesh is not None:
            comms = [
                socket_communicator.SocketCommunicator(tree, rank, [self._process_of(d) for d in tree], mesh)
                for tree, rank in trees
            ]
        else:
            comms = [collective.TFCollectiveCommunicator(tree, rank, timeout) for tree, rank in trees]
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
        if self.num_workers == 1:  # every replica's value is at hand (see `_in_one_process`)
            return tf.add_n(self._in_one_process(per_replica))
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    def gather_small(self, per_replica) -> tf.Tensor:
        if self.num_workers == 1:
            return tf.stack(self._in_one_process(per_replica))
        rows = self.strategy.extended.call_for_each_replica(lambda x: tf.expand_dims(x, 0), args=(per_replica,))
        shape = self.strategy.experimental_local_results(per_replica)[0].shape
        return tf.ensure_shape(self.strategy.gather(rows, axis=0), [self.num_replicas, *shape])

    def _in_one_process(self, per_replica) -> list[tf.Tensor]:
        """Each replica's value, in replica order, for a small sum or gather
        in one process: read where they lie, no collective. (The strategy's
        own would be a collective under TF's default keys, which start at 1
        for every strategy: after a strategy of another size in the same
        process, the group has the wrong size and the step fails.)"""
        return list(self.strategy.experimental_local_results(per_replica))

    @property
    def is_first_process(self) -> bool:
        return self.ranks[0] == 0

    def replica_id(self):
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    def check_same_variables(self, variables) -> None:
        if self.num_workers == 1:
            return
        digests = small_digests(variables)
        over_sockets = float(self._sockets_between_processes)
        totals = sum_over_workers(
            self.strategy, [1.0, over_sockets] + [x for d in digests for x in (d, d * d)], self.options.timeout_seconds
        )
        if totals[1] not in (0.0, totals[0]):  # one transport on some workers, the other elsewhere: a hang later
            raise ValueError(
                f"{socket_setup.TRANSPORT_VARIABLE} must be the same on every worker. "
                f"Received: {socket_setup.TRANSPORT_VARIABLE}="
                f"{self.transport!r} on this worker (task {cluster.task_index(self.strategy)}), "
                f"'sockets' on {totals[1]:g} of {totals[0]:g} workers"
            )
        if digests_differ(totals[0], totals[2::2], totals[3::2]):
            raise ValueError(
                "The trainable variables differ across the workers of the MultiWorkerMirroredStrategy "
                "(shapes, dtypes or order); every worker must build the same model. This worker "
                f"(task {cluster.task_index(self.strategy)}) has {describe(variables)}"
            )

    def broadcast_initial(self, model_variables, optimizer_variables) -> None:
        """Nothing to do: the strategy creates its variables with the first
        worker's initial values everywhere."""
