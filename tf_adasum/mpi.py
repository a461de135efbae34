"""What MPI users need beside the optimizer (as Horovod's ``hvd.rank()`` etc.).

Under ``mpirun -np N python train.py`` (or ``srun``):

* `rank`, `size`, `local_rank`, `local_size`: this process's place, for
  sharding data (``dataset.shard(size(), rank())``) and for rank-0-only work;
* `MetricAverageCallback`: averages epoch metrics over the ranks, so
  ``EarlyStopping``, ``ReduceLROnPlateau`` and checkpoint callbacks decide the
  same on every rank;
* `allreduce_sum`, `allreduce_mean`: of Python scalars over the ranks;
* `broadcast_variables`, `check_same_variables`: what `tf_adasum.AdasumOptimizer`
  does itself before the first step (rank 0's values everywhere; a clear error
  on every rank when the variable lists differ).

Checkpoints and logs: write them on rank 0 only
(``if tf_adasum.mpi.rank() == 0:``, or ``callbacks=[...] if rank() == 0``);
every rank loads the same file before training, the optimizer's broadcast then
makes them equal anyway.

Outside an MPI launcher (plain ``python train.py``) these report one process
(rank 0 of 1) without importing mpi4py.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np

from tf_adasum.comm import mpi as transport
from tf_adasum.engines import mpi as mpi_engine
from tf_adasum.engines import select

__all__ = [
    "MetricAverageCallback",
    "allreduce_mean",
    "allreduce_sum",
    "broadcast_variables",
    "check_same_keys",
    "check_same_variables",
    "local_rank",
    "local_size",
    "rank",
    "size",
]


def _world():
    return select.mpi_world() if select.launched_by_mpi() else None


def rank() -> int:
    """This process's rank in ``COMM_WORLD`` (0 without an MPI launcher)."""
    world = _world()
    return world.rank if world else 0


def size() -> int:
    """The number of ranks (1 without an MPI launcher)."""
    world = _world()
    return world.size if world else 1


def local_rank() -> int:
    """This process's rank among the ranks of its node (e.g. to pick a GPU)."""
    world = _world()
    return world.local_rank if world else 0


def local_size() -> int:
    """The number of ranks on this process's node."""
    world = _world()
    return world.local_size if world else 1


def check_same_variables(variables: Sequence, what: str = "variables") -> None:
    """Raises ValueError on every rank unless all ranks hold the same variable
    list (shapes, dtypes, order). Exchanges one short digest per rank first,
    the lists themselves only when they differ. Call on every rank."""
    world = _world()
    if world is not None:
        mpi_engine.check_same_variables(world.helpers_comm, variables, what, transport.default_timeout())


def broadcast_variables(variables: Sequence, root_rank: int = 0) -> None:
    """Sets every rank's `variables` to `root_rank`'s values (eagerly; call on
    every rank with the same list, e.g. after `check_same_variables`)."""
    world = _world()
    if world is None:
        return
    if not 0 <= root_rank < world.size:
        raise ValueError(f"`root_rank` must be in [0, {world.size}). Received: root_rank={root_rank}")
    mpi_engine.broadcast_variables(world.helpers_comm, variables, root_rank, transport.default_timeout())


def allreduce_sum(values: dict[str, float]) -> dict[str, float]:
    """The sum over ranks of each scalar in `values` (same keys on every rank;
    `check_same_keys` first when they may differ)."""
    world = _world()
    if world is None or not values:
        return {k: float(v) for k, v in values.items()}
    keys = sorted(values)
    local = np.array([float(values[k]) for k in keys], np.float64)
    what = "a sum of metrics over all ranks"
    total = transport.allreduce_sum(world.helpers_comm, local, transport.default_timeout(), what)
    return {k: float(v) for k, v in zip(keys, total)}


def allreduce_mean(values: dict[str, float]) -> dict[str, float]:
    """The mean over ranks of each scalar in `values` (same keys on every rank)."""
    return {k: v / size() for k, v in allreduce_sum(values).items()}


def check_same_keys(names: Sequence[str], what: str = "metric names") -> None:
    """Raises ValueError on every rank unless all ranks pass the same `names`."""
    world = _world()
    if world is not None:
        mpi_engine.check_same_names(world.helpers_comm, sorted(names), what, transport.default_timeout())


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's metrics (loss, accuracy, validation ...) over MPI
    ranks at the end of every epoch, so the callbacks after it see global
    values. Put it first in ``callbacks``. A no-op without an MPI launcher and
    under tf.distribute strategies (whose metrics are already global).

    Every rank must run the same number of epochs with the same metric names:
    the names are compared first (an error on every rank names the
    difference), and a rank whose peers never arrive gets a
    `tf.errors.DeadlineExceededError` (``TF_ADASUM_MPI_TIMEOUT``).
    """

    def __init__(self):
        super().__init__()
        self._supports_tf_logs = False

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or size() == 1:
            return
        numeric = {k: v for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number)}
        check_same_keys(list(numeric))
        logs.update(allreduce_mean(numeric))
