"""The worker processes of a MultiWorkerMirroredStrategy, one replica each,
as the processes of `tf_adasum.engines.simulated.SimulatedEngine`.

`tf_adasum.SimulatedReplicas(backend="workers")` spreads its logical
replicas over the workers of a cluster (``TF_CONFIG``, ``tf-adasum
launch``) the way ``backend="mpi"`` spreads them over MPI ranks. The model
runs outside the strategy's scope, in every worker alike (each reads the
whole global batch and keeps its replicas' rows); what crosses the workers
is what `SimulatedEngine` asks of its processes: the blocks' values
(`WorkerProcesses.gather_small`), a few small sums, and at `compile` the
checks and the broadcast of worker 0's start. All are raw TF collective ops
between the workers' first CPUs (gRPC), under the process-wide keys of
`tf_adasum.comm.collective_keys`; in a `tf.function` they carry the CPU's
ordering token, so they run in program order on every worker.

TensorFlow enables collective ops between workers only at a program's
start: the program creates ``tf.distribute.MultiWorkerMirroredStrategy()``
before any other TensorFlow call, as every multi-worker program does, and
keeps it (it connects the workers and watches their heartbeats; nothing else
of it is used). `WorkerProcesses.from_tf_config` finds the workers in
``TF_CONFIG`` and says so when this process cannot reach them. (It does not
make a strategy of its own: a second one's set-up raced the peers' first
collective and hung it in our runs.)

Between CPU workers the TF engine's trees travel over tf_adasum's sockets
(`tf_adasum.engines.tf`); these few exchanges, one gather of each bucket's
block values a step, stay on TF collective ops (gRPC), whatever
``TF_ADASUM_WORKER_TRANSPORT`` says.

No deadlines: TensorFlow spends a sleeping thread per timed op, and a
worker that dies is ended by the elastic launcher, or reported by the
strategy's heartbeat to the others. Every worker checks the same things in
the same order, so a mismatch is the same `ValueError` on every worker,
raised after a closing exchange (`tf_adasum.comm.collective.closing_exchange`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_adasum.comm import cluster, collective
from tf_adasum.comm.collective_keys import KEYS
from tf_adasum.engines import agreement

__all__ = ["WorkerProcesses"]


class WorkerProcesses:
    """This worker among the workers of a cluster, one replica each (see the module).

    Args:
      devices: every worker's first CPU, in worker order (the chief first,
        then workers by index).
      rank: this worker's position in `devices`.

    Attributes:
      kind: ``"worker"`` (what a process is called in messages and in
        `tf_adasum.processes.Processes`).
      num_replicas: the worker count M.
      local_replicas: 1.
    """

    kind = "worker"
    local_replicas = 1

    def __init__(self, devices: Sequence[str], rank: int):
        self.devices = tuple(devices)
        if len(self.devices) < 2 or not 0 <= rank < len(self.devices):
            raise ValueError(
                "WorkerProcesses needs two or more workers and this one's rank among them. Received: "
                f"devices={self.devices}, rank={rank}"
            )
        self.num_replicas = len(self.devices)
        self.rank = rank
        self.device = self.devices[rank]
        self._group_key = KEYS.group_key(self.devices)

    @classmethod
    def from_tf_config(cls) -> WorkerProcesses:
        """The workers ``TF_CONFIG`` names (a chief or worker task's view); a
        RuntimeError saying what to do when this process cannot reach them
        (no MultiWorkerMirroredStrategy created at the program's start)."""
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        tasks = cluster.resolver_tasks(resolver)
        me = (resolver.task_type, int(resolver.task_id or 0))
        if me not in tasks:
            raise ValueError(f"Only chief and worker tasks hold replicas. Received: TF_CONFIG's task {me}")
        devices = [f"/job:{job}/replica:0/task:{index}/device:CPU:0" for job, index in tasks]
        rank = tasks.index(me)
        own = [d.name for d in tf.config.list_logical_devices("CPU")]
        if devices[rank] not in own:
            raise RuntimeError(
                "SimulatedReplicas spreads its replicas over the workers of TF_CONFIG through TF collective "
                "ops, which TensorFlow enables only at a program's start: create "
                "`tf.distribute.MultiWorkerMirroredStrategy()` first, before any other TensorFlow call, and keep "
                f"it (build the model outside its scope). Received: this process's CPUs {own}, not {devices[rank]}"
            )
        return cls(devices, rank)

    # -- one exchange -------------------------------------------------------------------

    def _keys(self) -> tuple[int, int]:
        return self._group_key, KEYS.instance_key(self._group_key, self.device)

    def _token(self) -> list:
        return [] if tf.executing_eagerly() else [collective.ordering_token(self.device)]

    def gather_small(self, x) -> tf.Tensor:
        """``[M, *x.shape]``: every worker's `x` in worker order (a TF
        collective gather; bitwise the values sent)."""
        x = tf.convert_to_tensor(x)
        group_key, instance_key = self._keys()
        with tf.device(self.device):
            out = tf.raw_ops.CollectiveGatherV2(
                input=collective.carried(x)[None],
                group_size=self.num_replicas,
                group_key=group_key,
                instance_key=instance_key,
                ordering_token=self._token(),
            )
            out = collective.restored(out, x.dtype)
        out.set_shape([self.num_replicas, *x.shape])
        return out

    def sum_small(self, x) -> tf.Tensor:
        """The float64 sum of `x` over the workers (a TF collective all-reduce;
        every worker gets the same bits)."""
        x = tf.cast(x, tf.float64)
        group_key, instance_key = self._keys()
        with tf.device(self.device):
            out = tf.raw_ops.CollectiveReduceV2(
                input=x,
                group_size=self.num_replicas,
                group_key=group_key,
                instance_key=instance_key,
                ordering_token=self._token(),
                merge_op="Add",
                final_op="Id",
            )
        out.set_shape(x.shape)
        return out

    def _closing_exchange(self) -> None:
        with tf.init_scope():
            collective.closing_exchange(lambda: self.sum_small(tf.zeros([1], tf.float64)).numpy())

    def sum_floats(self, values: Sequence[float], what: str = "a sum over the workers") -> list[float]:
        """Eagerly, the float64 sums of `values` over the workers, returned
        once every worker holds them (a closing exchange follows, so a worker
        may raise or exit on them at once); every worker calls it at the same
        point. (`what` is for the signature of `tf_adasum.processes.Processes`'
        exchanges: there is no deadline to name it in.)"""
        with tf.init_scope():
            total = [float(v) for v in self.sum_small(tf.constant(list(values), tf.float64)).numpy()]
        self._closing_exchange()
        return total

    def _allgather(self, array: np.ndarray, what: str) -> np.ndarray:
        """Eagerly, every worker's 1-D `array` stacked (`tf_adasum.engines.agreement.AllGather`)."""
        with tf.init_scope():
            return self.gather_small(tf.constant(np.asarray(array).astype(np.int64))).numpy()

    def _agreed(self, check, *args) -> None:
        """``check(allgather, *args, "worker", "workers")``: its ValueError, the
        same on every worker, raised after a closing exchange."""
        try:
            check(self._allgather, *args, "worker", "workers")
        except ValueError:
            self._closing_exchange()
            raise

    # -- what SimulatedEngine asks of its processes ------------------------------------

    @property
    def is_first_process(self) -> bool:
        return self.rank == 0

    def replica_id(self) -> int:
        return self.rank

    def check_same_variables(self, variables: Sequence, what: str = "trainable variables") -> None:
        """Raises ValueError on every worker unless all hold the same
        variable list (shapes, dtypes, order); a 32-byte gather, the lists
        themselves only when they differ."""
        self._agreed(agreement.check_same_variables, variables, what)

    def check_same_settings(self, settings: dict, what: str) -> None:
        """Raises ValueError on every worker unless all hold the same
        `settings` (a 32-byte gather; the settings themselves only when they differ)."""
        self._agreed(agreement.check_same_settings, settings, what)

    def broadcast_initial(self, model_variables: Sequence, optimizer_variables: Sequence) -> None:
        """Every worker takes worker 0's `model_variables` and those
        `optimizer_variables` that have values (eagerly; the lists checked
        equal first)."""
        with tf.init_scope():
            own = [v for v in optimizer_variables if agreement.has_value(v)]
            self.check_same_variables(own, "optimizer variables")
            for variable in list(model_variables) + own:
                value = tf.convert_to_tensor(variable)
                group_key, instance_key = self._keys()
                with tf.device(self.device):
                    if self.rank == 0:
                        tf.raw_ops.CollectiveBcastSendV2(
                            input=collective.carried(value),
                            group_size=self.num_replicas,
                            group_key=group_key,
                            instance_key=instance_key,
                        )
                    else:
                        received = tf.raw_ops.CollectiveBcastRecvV2(
                            group_size=self.num_replicas,
                            group_key=group_key,
                            instance_key=instance_key,
                            shape=value.shape,
                            T=collective.carried(value).dtype,
                        )
                        variable.assign(collective.restored(received, value.dtype))
