"""The processes of a training job, seen from one of them: which one this is,
how many there are, and a sum of a few numbers over them.

`Processes.of` decides, the same way on every process, which of three jobs
this process belongs to:

* ``"worker"``: a worker of a MultiWorkerMirroredStrategy cluster (TF_CONFIG,
  ``tf-adasum launch``, Slurm's or Ray's cluster) with more than one worker;
  its index is its task's position (the chief first); the sum is one TF
  collective between the workers' first devices
  (`tf_adasum.engines.tf.sum_over_workers`), under the strategy's collective
  timeout (``CommunicationOptions(timeout_seconds=...)``; none by default);
* ``"rank"``: otherwise, a rank started by an MPI launcher (``mpirun``,
  ``srun``) with more than one rank; its index is its rank in
  ``COMM_WORLD``; the sum is an MPI allreduce on the communicator of
  `tf_adasum.mpi`'s helpers, under ``TF_ADASUM_MPI_TIMEOUT``;
* ``"process"``: otherwise, one process (no strategy, a MirroredStrategy,
  `tf_adasum.SimulatedReplicas` in one process): index 0 of 1; the sum is
  the values.

`tf_adasum.SimulatedReplicas` spread over ranks or workers (logical
replicas) runs outside any strategy: its ``processes`` property gives its
own (`BackupAndRestore` takes it).

`BackupAndRestore` checks with it that every process found the same backup;
the scaling evaluation and ``examples/mnist_multiworker.py`` sum their test
counts with it. `Processes.sum` and `Processes.barrier` are collectives:
every process calls them at the same points, with as many values. A process
that never arrives is an error on the others within the timeout above (with
no timeout, the strategy's heartbeat still reports a worker that died).

Examples:
  A test accuracy over every process's shard of the test set (here one
  process: plain ``python``, no strategy; a model that gets 3 of every 4
  examples right):

  >>> import numpy as np
  >>> import tensorflow as tf
  >>> from tf_adasum.processes import Processes
  >>> processes = Processes.of(tf.distribute.get_strategy())
  >>> processes.kind, processes.index, processes.count
  ('process', 0, 1)
  >>> labels = np.arange(100) % 4
  >>> shard = labels[processes.index :: processes.count]  # this process's test examples
  >>> correct, total = processes.sum([int(np.sum(shard != 3)), len(shard)])
  >>> if processes.index == 0:
  ...     print(f"test accuracy {correct / total:.4f}")
  test accuracy 0.7500
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from tf_adasum.comm import cluster, mpi_transport
from tf_adasum.engines import select
from tf_adasum.engines.tf import sum_over_workers

__all__ = ["KINDS", "Processes"]

#: What a process is called, by the job it belongs to (also in messages: "worker 1").
KINDS = ("worker", "rank", "process")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _check_integer(value, name: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be an integer. Received: {name}={_shown(value)}")
    return int(value)


@dataclass(frozen=True)
class Processes:
    """The processes of this job, seen from one of them (see the module).

    Made by `Processes.of`; built directly (with your own `reduce`) only to
    stand in for the processes, e.g. in a test.

    Attributes:
      kind: ``"worker"``, ``"rank"`` or ``"process"`` (see `KINDS`).
      index: this process's index, in [0, count); process 0 is the one that
        writes (the chief, rank 0).
      count: the number of processes.
      reduce: the exchange behind `sum`: ``reduce(values, what)`` returns the
        elementwise sum over the processes of `values` (a non-empty list of
        floats), `what` naming the exchange in a deadline error.

    Examples:
      Worker 1 of 4 as a test sees it, every worker holding the same values:

      >>> from tf_adasum.processes import Processes
      >>> worker = Processes("worker", index=1, count=4, reduce=lambda values, what: [4 * v for v in values])
      >>> worker
      Processes(kind='worker', index=1, count=4)
      >>> worker.sum([1.0, 2.5])
      [4.0, 10.0]
      >>> Processes("worker", index=4, count=4, reduce=worker.reduce)
      Traceback (most recent call last):
      ...
      ValueError: `index` must be in [0, 4) for count=4. Received: index=4
    """

    kind: str
    index: int
    count: int
    reduce: Callable[[list[float], str], Sequence[float]] = field(repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={_shown(self.kind)}")
        count = _check_integer(self.count, "count")
        if count < 1:
            raise ValueError(f"`count` must be at least 1. Received: count={count}")
        index = _check_integer(self.index, "index")
        if not 0 <= index < count:
            raise ValueError(f"`index` must be in [0, {count}) for count={count}. Received: index={index}")
        if not callable(self.reduce):
            raise TypeError(f"`reduce` must be callable. Received: reduce={_shown(self.reduce)}")
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "count", count)

    @classmethod
    def of(cls, strategy: tf.distribute.Strategy | None = None) -> Processes:
        """The processes of the job `strategy` runs in (default: the current
        strategy): its workers when it spans several, else the ranks of an MPI
        launcher, else this one process. Communicates nothing (MPI is
        initialised for ``"rank"``); the workers' collective timeout is read
        here, ``TF_ADASUM_MPI_TIMEOUT`` at each sum.

        Examples:
          >>> import tensorflow as tf
          >>> from tf_adasum.processes import Processes
          >>> Processes.of(tf.distribute.get_strategy())  # plain python: this one process
          Processes(kind='process', index=0, count=1)
        """
        if strategy is None:
            strategy = tf.distribute.get_strategy()
        if not isinstance(strategy, tf.distribute.Strategy):
            raise TypeError(
                f"`strategy` must be a tf.distribute.Strategy or None (the current one). Received: "
                f"strategy={_shown(strategy)} (of type {type(strategy).__name__})"
            )
        workers = cluster.num_workers(strategy)
        if workers > 1:
            timeout = select.communication_options(strategy).timeout_seconds

            def over_workers(values, what):
                return sum_over_workers(strategy, values, timeout)

            return cls("worker", cluster.task_index(strategy), workers, over_workers)
        if select.launched_by_mpi():
            world = select.mpi_world()

            def over_ranks(values, what):
                summed = mpi_transport.allreduce_sum(
                    world.helpers_comm, np.asarray(values), mpi_transport.default_timeout(), what
                )
                return [float(v) for v in summed]

            return cls("rank", world.rank, world.size, over_ranks)
        return cls.alone()

    @classmethod
    def alone(cls) -> Processes:
        """This process as the whole job: index 0 of 1; a sum returns its values.

        Examples:
          >>> from tf_adasum.processes import Processes
          >>> alone = Processes.alone()
          >>> alone.index, alone.count, alone.sum([3, 4])
          (0, 1, [3.0, 4.0])
        """
        return cls("process", 0, 1, lambda values, what: values)

    def sum(self, values: Sequence[float], what: str = "a sum over the processes") -> list[float]:
        """The elementwise float64 sum of `values` over the processes, on
        every process (an empty list: returned at once, no exchange).

        Args:
          values: a list of real numbers, as long on every process.
          what: the exchange, as a deadline error names it (under MPI).

        Returns:
          the totals, as floats; they are exact while every partial sum is an
          integer below 2**53 (counts).

        Examples:
          >>> from tf_adasum.processes import Processes
          >>> processes = Processes.alone()  # or Processes.of(strategy) on every process
          >>> correct, total = processes.sum([97, 100], "the test accuracy")
          >>> correct / total
          0.97
        """
        if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
            raise TypeError(
                f"`values` must be a list of numbers. Received: values={_shown(values)} "
                f"(of type {type(values).__name__})"
            )
        floats = []
        for i, value in enumerate(values):
            if not isinstance(value, numbers.Real):
                raise TypeError(f"`values[{i}]` must be a real number. Received: values[{i}]={_shown(value)}")
            floats.append(float(value))
        if not isinstance(what, str):
            raise TypeError(f"`what` must be a string. Received: what={_shown(what)}")
        if not floats:
            return []
        return [float(v) for v in self.reduce(floats, what)]

    def barrier(self, what: str = "a barrier over the processes") -> None:
        """Returns once every process has called it (a sum of one zero).

        Examples:
          >>> from tf_adasum.processes import Processes
          >>> processes = Processes.alone()
          >>> processes.barrier("the chief's files are written")  # e.g. before the others read them
        """
        self.sum([0.0], what)
