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
before any other TensorFlow call, as every multi-worker program does (it
connects the workers; nothing else of it is used). `WorkerProcesses.from_tf_config`
finds the workers in ``TF_CONFIG`` and says so when this process cannot
reach them. (A second strategy made here instead hung the first exchange,
now and then, on 2026-12-06: its set-up races the peers' first collective.)

Deadlines: the eager exchanges at `compile` wait at most `timeout_seconds`
(none by default); the exchanges of a training step wait without one
(TensorFlow spends a sleeping thread per op on a timeout), and a worker
that dies is reported by the strategy's heartbeat, or ended by the elastic
launcher.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_adasum.comm import cluster, collective
from tf_adasum.comm.collective_keys import KEYS
from tf_adasum.engines.base import check_same_settings, check_same_variables

__all__ = ["WorkerProcesses"]


class WorkerProcesses:
    """This worker among the workers of a cluster, one replica each (see the module).

    Args:
      devices: every worker's first CPU, in worker order (the chief first,
        then workers by index).
      rank: this worker's position in `devices`.
      timeout_seconds: the deadline of the eager exchanges (None or 0: none).

    Attributes:
      num_replicas: the worker count M.
      local_replicas: 1.
    """

    local_replicas = 1

    def __init__(self, devices: Sequence[str], rank: int, timeout_seconds: float | None = None):
        self.devices = tuple(devices)
        if len(self.devices) < 2 or not 0 <= rank < len(self.devices):
            raise ValueError(
                f"WorkerProcesses needs two or more workers and this one's rank among them. Received: "
                f"devices={self.devices}, rank={rank}"
            )
        self.num_replicas = len(self.devices)
        self.rank = rank
        self.device = self.devices[rank]
        self.timeout_seconds = float(timeout_seconds or 0)
        self._group_key = KEYS.group_key(self.devices)

    @classmethod
    def from_tf_config(cls, timeout_seconds: float | None = None) -> WorkerProcesses:
        """The workers ``TF_CONFIG`` names; a RuntimeError saying what to do
        when this process cannot reach them (no MultiWorkerMirroredStrategy
        created at the program's start, see the module)."""
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        tasks = cluster.resolver_tasks(resolver)
        me = (resolver.task_type, int(resolver.task_id or 0))
        if me not in tasks:
            raise ValueError(f"TF_CONFIG's task holds no replica (only chief and worker tasks do). Received: task {me}")
        devices = [f"/job:{job}/replica:0/task:{index}/device:CPU:0" for job, index in tasks]
        rank = tasks.index(me)
        if devices[rank] not in {d.name for d in tf.config.list_logical_devices("CPU")}:
            raise RuntimeError(
                "SimulatedReplicas spreads its replicas over the workers of TF_CONFIG through TF collective "
                "ops, which TensorFlow enables only at a program's start: create "
                "`tf.distribute.MultiWorkerMirroredStrategy()` first, before any other TensorFlow call (and "
                f"build the model outside its scope). Received: this process's devices "
                f"{[d.name for d in tf.config.list_logical_devices('CPU')]}, not {devices[rank]}"
            )
        return cls(devices, rank, timeout_seconds)

    # -- one exchange -------------------------------------------------------------------

    def _keys(self) -> tuple[int, int]:
        return self._group_key, KEYS.instance_key(self._group_key, self.device)

    def _timeout(self) -> float:
        return self.timeout_seconds if tf.executing_eagerly() else 0.0

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
                timeout_seconds=self._timeout(),
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
                timeout_seconds=self._timeout(),
            )
        out.set_shape(x.shape)
        return out

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Eagerly, the float64 sums of `values` over the workers (every worker calls it)."""
        with tf.init_scope():
            return [float(v) for v in self.sum_small(tf.constant(list(values), tf.float64)).numpy()]

    def _allgather(self, array: np.ndarray, what: str) -> np.ndarray:
        """Eagerly, every worker's 1-D `array` stacked (`tf_adasum.engines.base.AllGather`)."""
        with tf.init_scope():
            return self.gather_small(tf.constant(np.asarray(array).astype(np.int64))).numpy()

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
        check_same_variables(self._allgather, variables, what, "worker", "workers")

    def check_same_settings(self, settings: dict, what: str) -> None:
        """Raises ValueError on every worker unless all hold the same
        `settings` (a 32-byte gather; the settings themselves only when they differ)."""
        check_same_settings(self._allgather, settings, what, "worker", "workers")

    def broadcast_initial(self, model_variables: Sequence, optimizer_variables: Sequence) -> None:
        """Every worker takes worker 0's `model_variables` and those
        `optimizer_variables` that have values (eagerly; the lists checked
        equal first)."""
        with tf.init_scope():
            own = [v for v in optimizer_variables if np.shape(v.numpy()) == tuple(v.shape)]
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
                            timeout_seconds=self.timeout_seconds,
                        )
                    else:
                        received = tf.raw_ops.CollectiveBcastRecvV2(
                            group_size=self.num_replicas,
                            group_key=group_key,
                            instance_key=instance_key,
                            shape=value.shape,
                            T=collective.carried(value).dtype,
                            timeout_seconds=self.timeout_seconds,
                        )
                        variable.assign(collective.restored(received, value.dtype))
