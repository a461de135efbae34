"""The MPI engine: one replica per MPI rank (``mpirun``/``srun``, no strategy).

Each bucket's whole tree runs in one native op when the compiled library is
available (`tf_adasum.engines.mpi_native`: the fold, the halving levels with
their float64 partial sums and the gathers in C++, reading and writing the
tensors in place); otherwise each tree step is a ``tf.numpy_function`` over
`tf_adasum.comm.mpi_communicator.MPICommunicator` (the portable path,
slower). Both are the tree of `tf_adasum.tree.rvh` and are tested against
`tf_adasum.reference`. The ranks choose the path together when the engine is
built: the native one only when every rank can load the library (the two
paths exchange different messages), else every rank takes the Python path,
with one warning naming the ranks that could not and why.

Every MPI call has a deadline (`tf_adasum.comm.mpi_transport.default_timeout`) and the
calls of one graph are chained in program order. Sub-communicators are made
when the engine is built, in the same order on every rank.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_adasum import combiners as combiners_lib
from tf_adasum.comm import compression as compression_lib
from tf_adasum.comm import mpi_communicator, mpi_transport
from tf_adasum.engines import agreement, mpi_native
from tf_adasum.engines.agreement import differing_items, gather_strings, has_value
from tf_adasum.engines.base import Components, Engine, combine_with_communicators
from tf_adasum.tree import topology
from tf_adasum.tree.buckets import make_buckets

__all__ = ["MPIEngine", "agree_on_native", "broadcast_variables", "check_same_names", "check_same_variables"]


def _allgather(comm, timeout: float):
    """``allgather(array, what)`` over the ranks of `comm` (see `tf_adasum.engines.agreement.differing_items`)."""
    return lambda array, what: mpi_transport.allgather(comm, array, timeout, what)


def check_same_variables(comm, variables: Sequence, what: str, timeout: float) -> None:
    """Raises ValueError on every rank of `comm` unless all hold the same
    variable list (shapes, dtypes, order)."""
    agreement.check_same_variables(_allgather(comm, timeout), variables, what, "rank", "MPI ranks")


def check_same_names(comm, names: Sequence[str], what: str, timeout: float) -> None:
    """Raises ValueError on every rank of `comm` unless all hold the same `names`."""
    everyone = differing_items(_allgather(comm, timeout), list(names), what)
    if everyone is None:
        return
    first = next(r for r, items in enumerate(everyone) if items != everyone[0])
    raise ValueError(
        f"The {what} differ across MPI ranks: rank 0 has {everyone[0]}, rank {first} has {everyone[first]}. "
        "Every rank must log the same metrics (e.g. validation data on every rank, or on none)."
    )


def check_same_settings(comm, settings: dict, what: str, timeout: float) -> None:
    """Raises ValueError on every rank of `comm` unless all hold the same
    `settings` (a JSON-serialisable dict), naming rank 0's and the first
    differing rank's (`tf_adasum.engines.agreement.check_same_settings`)."""
    agreement.check_same_settings(_allgather(comm, timeout), settings, what, "rank", "MPI ranks")


def broadcast_variables(comm, variables: Sequence, root: int, timeout: float) -> None:
    """Sets every rank's `variables` to `root`'s values (eagerly; same list everywhere)."""
    for variable in variables:
        value = mpi_transport.bcast(comm, variable.numpy(), root, timeout, f"the broadcast of {variable.name}")
        if comm.Get_rank() != root:
            variable.assign(value)


def agree_on_native(comm, timeout: float):
    """The native op module when every rank of `comm` can use it, else None
    on every rank, with one `RuntimeWarning` naming the ranks that cannot and
    why (one small gather; the reasons only when some rank lacks it)."""
    module, reason = mpi_native.availability()
    what = "the check that every rank can use the native MPI ops"
    able = mpi_transport.allgather(comm, np.array([module is not None], np.uint8), timeout, what)[:, 0]
    if able.all():
        return module
    reasons = gather_strings(_allgather(comm, timeout), reason or "", what)
    unable = ", ".join(f"rank {r} ({reasons[r]})" for r in np.flatnonzero(able == 0))
    warnings.warn(
        f"tf_adasum: the native MPI ops are unavailable on {unable}. Every rank's MPI engine uses its Python "
        "path (slower), so that all ranks exchange the same messages.",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _native_rule(combiner: combiners_lib.Combiner) -> str | None:
    if type(combiner) is combiners_lib.Adasum:
        return "adasum"
    if type(combiner) in (combiners_lib.Sum, combiners_lib.Mean):
        return "sum"  # the mean is prepared (scaled by 1/N) first
    return None


class MPIEngine(Engine):
    """This process's one replica among the MPI ranks of `world`.

    Args:
      world: `tf_adasum.comm.mpi_transport.World` (see `tf_adasum.engines.select.mpi_world`).
      timeout_seconds: how long an MPI call waits for its peers (0: forever).
      bytes_per_bucket: fusion cap (0: one bucket per dtype; see `tf_adasum.tree.buckets.make_buckets`).
      compression: None, or ``"float16"``/``"bfloat16"``: float32 and float64
        buffers travel in that format (`tf_adasum.comm.compression`), through
        the vector-halving driver over mpi4py (the native tree sends full width).
    """

    kind = "rank"  # what a process is called in messages and in `tf_adasum.processes.Processes`
    local_replicas = 1

    def __init__(
        self, world, timeout_seconds: float | None = None, bytes_per_bucket: int = 0, compression: str | None = None
    ):
        compression_lib.check_compression(compression)
        self.compression = compression
        self.world = world
        self.num_replicas = world.size
        self.timeout_seconds = mpi_transport.default_timeout() if timeout_seconds is None else float(timeout_seconds)
        self.bytes_per_bucket = bytes_per_bucket
        self.strategy = tf.distribute.get_strategy()
        self._chain = mpi_transport.Chain()
        self._comms = {"all": world.comm, "local": world.node, "cross": world.cross}
        with tf.init_scope():
            self._sum_comms = {
                scope: world.sum_communicators(comm, topology.groups(comm.Get_size()))
                for scope, comm in self._comms.items()
            }
        # The same path on every rank: None everywhere (one warning) where one rank cannot load the library.
        self.native = agree_on_native(world.comm, self.timeout_seconds)
        if self.native is not None:
            mpi_transport.add_deadline_probe(mpi_native.deadlines_missed)

    def scope_size(self, scope: str) -> int:
        return self._comms[scope].Get_size()

    def _combine_implementation(self, values: list[Components], combiner: combiners_lib.Combiner, scope: str):
        comm = self._comms[scope]
        rule = _native_rule(combiner)
        if self.native is None or rule is None or self.compression is not None:
            communicator = mpi_communicator.MPICommunicator(
                comm, self._sum_comms[scope], self._chain, self.timeout_seconds
            )
            communicators = compression_lib.compressed([communicator], self.compression)
            return combine_with_communicators(values, communicators, combiner, self.bytes_per_bucket)
        size = comm.Get_size()
        tensors = [combiner.prepare(v[0], size) for v in values]
        shapes = [t.shape for t in tensors]
        buckets = make_buckets(
            [t.dtype for t in tensors], [s.num_elements() for s in shapes], size, self.bytes_per_bucket
        )
        levels = topology.num_levels(size)
        columns = [tf.zeros([levels, 3], tf.float64)] * len(tensors)
        for bucket in buckets:
            members = [tensors[i] for i in bucket.indices]
            combined, partials = self._chain.chain(
                lambda members=members: mpi_native.tree(members, comm, rule, self.timeout_seconds)
            )
            for row, (i, tensor) in enumerate(zip(bucket.indices, combined)):
                tensors[i] = tensor
                columns[i] = partials[:, row]
        return [(t,) for t in tensors], (tf.stack(columns, axis=1),)

    def sum_small(self, x) -> tf.Tensor:
        x = tf.cast(x, tf.float64)
        comm, timeout = self.world.comm, self.timeout_seconds
        if self.native is not None:
            return self._chain.chain(lambda: mpi_native.allreduce_sum(x, comm, timeout))
        what = "a sum over all ranks"
        return self._chain.call(lambda v: mpi_transport.allreduce_sum(comm, v, timeout, what), [x], tf.float64, x.shape)

    def gather_small(self, x) -> tf.Tensor:
        comm, timeout, size = self.world.comm, self.timeout_seconds, self.world.size
        if self.native is not None:
            return self._chain.chain(lambda: mpi_native.allgather(x, comm, timeout))
        what = "a gather over all ranks"
        return self._chain.call(
            lambda v: mpi_transport.allgather(comm, v, timeout, what), [x], x.dtype, [size, *x.shape]
        )

    def sum_floats(self, values: Sequence[float], what: str = "a sum over all ranks") -> list[float]:
        """Eagerly, the float64 sums of `values` over the ranks (on the helpers'
        communicator, under this engine's deadline); every rank calls it at the same point."""
        summed = mpi_transport.allreduce_sum(self.world.helpers_comm, np.asarray(values), self.timeout_seconds, what)
        return [float(v) for v in summed]

    @property
    def is_first_process(self) -> bool:
        return self.world.rank == 0

    def replica_id(self) -> int:
        return self.world.rank

    def check_same_variables(self, variables) -> None:
        with tf.init_scope():
            check_same_variables(self.world.comm, variables, "trainable variables", self.timeout_seconds)

    def check_same_settings(self, settings: dict, what: str) -> None:
        """Raises ValueError on every rank unless all hold the same `settings`
        (one 32-byte gather; the settings themselves only when they differ)."""
        with tf.init_scope():
            check_same_settings(self.world.comm, settings, what, self.timeout_seconds)

    def broadcast_initial(self, model_variables, optimizer_variables) -> None:
        """Every rank takes rank 0's `model_variables` (which must have values)
        and those `optimizer_variables` that have values; optimizer variables
        created by a build inside a `tf.function` have none yet and start from
        their initializers, the same on every rank. Eager (also while tracing)."""
        with tf.init_scope():
            unset = [v.path for v in model_variables if not has_value(v)]
            if unset:
                raise ValueError(
                    "Under MPI, AdasumOptimizer broadcasts rank 0's weights before the first step, but these "
                    f"variables have no value yet: {unset[:5]}. Build the model before training (give it a "
                    "`keras.Input`, or call `model.build(input_shape)`)."
                )
            own = [v for v in optimizer_variables if has_value(v)]
            check_same_variables(self.world.comm, own, "optimizer variables", self.timeout_seconds)
            broadcast_variables(self.world.comm, list(model_variables) + own, 0, self.timeout_seconds)
