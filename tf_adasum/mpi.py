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

Arguments are checked on every call, with or without a launcher, before any
MPI call: a `TypeError` or `ValueError` names the argument and the value
received (an MPI call that one rank skipped would leave the others waiting
for their deadline).

Examples:
  In a plain ``python`` process (under ``mpirun -np 4`` each rank prints its
  own rank, 4, and the mean over the 4 ranks):

  >>> from tf_adasum import mpi
  >>> mpi.rank(), mpi.size()
  (0, 1)
  >>> mpi.allreduce_mean({"accuracy": 0.75})
  {'accuracy': 0.75}
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import keras
import numpy as np

from tf_adasum.comm import mpi_transport
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
    """This process's rank in ``COMM_WORLD`` (0 without an MPI launcher).

    Examples:
      >>> import tensorflow as tf
      >>> from tf_adasum import mpi
      >>> mpi.rank()
      0
      >>> dataset = tf.data.Dataset.range(8).shard(mpi.size(), mpi.rank())  # this rank's examples
      >>> [int(i) for i in dataset]
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    world = _world()
    return world.rank if world else 0


def size() -> int:
    """The number of ranks (1 without an MPI launcher).

    Examples:
      >>> from tf_adasum import mpi
      >>> mpi.size()
      1
    """
    world = _world()
    return world.size if world else 1


def local_rank() -> int:
    """This process's rank among the ranks of its node (e.g. to pick a GPU).

    Examples:
      One GPU per rank: rank r of its node takes the node's r-th GPU (set
      before TensorFlow's first operation, e.g.
      ``tf.config.set_visible_devices(gpus[local_rank()], "GPU")``):

      >>> from tf_adasum import mpi
      >>> mpi.local_rank()
      0
      >>> f"this rank's GPU: {mpi.local_rank()} of {mpi.local_size()} ranks on this node"
      "this rank's GPU: 0 of 1 ranks on this node"
    """
    world = _world()
    return world.local_rank if world else 0


def local_size() -> int:
    """The number of ranks on this process's node.

    Examples:
      >>> from tf_adasum import mpi
      >>> mpi.local_size()
      1
    """
    world = _world()
    return world.local_size if world else 1


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _check_variables(variables, name: str = "variables") -> list:
    """`variables` as a list, or a TypeError naming what is wrong."""
    if not isinstance(variables, Sequence) or isinstance(variables, (str, bytes)):
        raise TypeError(
            f"`{name}` must be a list of variables. Received: {name}={_shown(variables)} "
            f"(of type {type(variables).__name__})"
        )
    for i, variable in enumerate(variables):
        if not all(hasattr(variable, a) for a in ("shape", "dtype", "numpy", "assign")):
            raise TypeError(
                f"`{name}[{i}]` must be a variable (tf.Variable or keras.Variable). Received: "
                f"{name}[{i}]={_shown(variable)} (of type {type(variable).__name__})"
            )
    return list(variables)


def _check_text(value, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"`{name}` must be a string. Received: {name}={_shown(value)}")


def check_same_variables(variables: Sequence, what: str = "variables") -> None:
    """Raises ValueError on every rank unless all ranks hold the same variable
    list (shapes, dtypes, order). Exchanges one short digest per rank first,
    the lists themselves only when they differ. Call on every rank.

    Examples:
      >>> import keras
      >>> from tf_adasum import mpi
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
      >>> mpi.check_same_variables(model.trainable_variables)  # returns None when they agree
      >>> mpi.check_same_variables(model)
      Traceback (most recent call last):
      ...
      TypeError: `variables` must be a list of variables. Received: variables=<Sequential ...
    """
    variables = _check_variables(variables)
    _check_text(what, "what")
    world = _world()
    if world is not None:
        mpi_engine.check_same_variables(world.helpers_comm, variables, what, mpi_transport.default_timeout())


def broadcast_variables(variables: Sequence, root_rank: int = 0) -> None:
    """Sets every rank's `variables` to `root_rank`'s values (eagerly; call on
    every rank with the same list, e.g. after `check_same_variables`).

    Examples:
      >>> import tensorflow as tf
      >>> from tf_adasum import mpi
      >>> variable = tf.Variable([1.0, 2.0])
      >>> mpi.broadcast_variables([variable], root_rank=0)  # rank 0's values on every rank
      >>> variable.numpy()
      array([1., 2.], dtype=float32)
    """
    variables = _check_variables(variables)
    if not isinstance(root_rank, numbers.Integral) or isinstance(root_rank, bool):
        raise TypeError(f"`root_rank` must be an integer. Received: root_rank={_shown(root_rank)}")
    world = _world()
    count = world.size if world is not None else 1
    if not 0 <= root_rank < count:
        raise ValueError(f"`root_rank` must be in [0, {count}). Received: root_rank={root_rank}")
    if world is not None:
        mpi_engine.broadcast_variables(world.helpers_comm, variables, int(root_rank), mpi_transport.default_timeout())


def _check_scalars(values) -> dict[str, float]:
    """`values` (names to real scalars) as floats, or an error naming the entry."""
    if not isinstance(values, Mapping):
        raise TypeError(
            f"`values` must be a dict of names to numbers, e.g. {{'loss': 0.5}}. Received: values={_shown(values)} "
            f"(of type {type(values).__name__})"
        )
    out = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise TypeError(f"The keys of `values` must be strings. Received: key {_shown(key)}")
        if np.ndim(value) != 0:
            raise ValueError(
                f"`values[{key!r}]` must be a scalar. Received: values[{key!r}] of shape {np.shape(value)}"
            )
        try:
            number = np.asarray(value)
            if not (np.issubdtype(number.dtype, np.number) or number.dtype == bool):
                raise TypeError
            out[key] = float(number)
        except (TypeError, ValueError):
            raise TypeError(f"`values[{key!r}]` must be a number. Received: values[{key!r}]={_shown(value)}") from None
    return out


def allreduce_sum(values: dict[str, float]) -> dict[str, float]:
    """The sum over ranks of each scalar in `values` (same keys on every rank;
    `check_same_keys` first when they may differ).

    Examples:
      A test accuracy over every rank's shard of the test set:

      >>> from tf_adasum import mpi
      >>> totals = mpi.allreduce_sum({"correct": 97, "examples": 100})
      >>> totals
      {'correct': 97.0, 'examples': 100.0}
      >>> totals["correct"] / totals["examples"]
      0.97
    """
    values = _check_scalars(values)
    world = _world()
    if world is None or not values:
        return values
    keys = sorted(values)
    local = np.array([values[k] for k in keys], np.float64)
    what = "a sum of metrics over all ranks"
    total = mpi_transport.allreduce_sum(world.helpers_comm, local, mpi_transport.default_timeout(), what)
    return {k: float(v) for k, v in zip(keys, total)}


def allreduce_mean(values: dict[str, float]) -> dict[str, float]:
    """The mean over ranks of each scalar in `values` (same keys on every rank).

    Examples:
      >>> from tf_adasum import mpi
      >>> mpi.allreduce_mean({"accuracy": 0.5, "loss": 0.25})
      {'accuracy': 0.5, 'loss': 0.25}
    """
    return {k: v / size() for k, v in allreduce_sum(values).items()}


def check_same_keys(names: Sequence[str], what: str = "metric names") -> None:
    """Raises ValueError on every rank unless all ranks pass the same `names`.

    Examples:
      >>> from tf_adasum import mpi
      >>> logs = {"accuracy": 0.5, "loss": 0.25}
      >>> mpi.check_same_keys(list(logs))  # returns None when every rank passes these
      >>> mpi.allreduce_mean(logs)
      {'accuracy': 0.5, 'loss': 0.25}
    """
    if not isinstance(names, (Sequence, Mapping)) or isinstance(names, (str, bytes)):
        raise TypeError(f"`names` must be a list of strings. Received: names={_shown(names)}")
    for index, name in enumerate(names):
        _check_text(name, f"names[{index}]")
    _check_text(what, "what")
    world = _world()
    if world is not None:
        mpi_engine.check_same_names(world.helpers_comm, sorted(names), what, mpi_transport.default_timeout())


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages the epoch's metrics (loss, accuracy, validation ...) over MPI
    ranks at the end of every epoch, so the callbacks after it see global
    values. Put it first in ``callbacks``. A no-op without an MPI launcher and
    under tf.distribute strategies (whose metrics are already global).

    Every rank must run the same number of epochs with the same metric names:
    the names are compared first (an error on every rank names the
    difference), and a rank whose peers never arrive gets a
    `tf.errors.DeadlineExceededError` (``TF_ADASUM_MPI_TIMEOUT``).

    Examples:
      >>> import keras
      >>> import numpy as np
      >>> from tf_adasum import mpi
      >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      >>> model.compile(optimizer="sgd", loss="mse")
      >>> callbacks = [mpi.MetricAverageCallback(), keras.callbacks.EarlyStopping("loss", patience=2)]
      >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), epochs=2, callbacks=callbacks, verbose=0)
      >>> sorted(history.history)  # each epoch's loss, averaged over the ranks
      ['loss']
    """

    def __init__(self):
        super().__init__()
        self._supports_tf_logs = False

    def on_epoch_end(self, epoch, logs=None):
        # A multi-replica strategy's metrics are global already; its workers
        # need not be MPI ranks (e.g. srun tasks, whose variables look like a launcher's).
        model = self.model  # None when the callback is called outside `fit`
        if logs is None or (model is not None and model.distribute_strategy.num_replicas_in_sync > 1) or size() == 1:
            return
        numeric = {k: v for k, v in logs.items() if np.ndim(v) == 0 and np.issubdtype(np.asarray(v).dtype, np.number)}
        check_same_keys(list(numeric))
        logs.update(allreduce_mean(numeric))
