"""The vector-halving tree's steps over mpi4py (`tf_adasum.comm.mpi_transport`).

`MPICommunicator` is one rank's `tf_adasum.tree.communicator.Communicator`: each step (a
swap, a gather, a level's float64 partial sums, a fold's send or receive) is
one ``tf.numpy_function`` on the rank's `tf_adasum.comm.mpi_transport.Chain` (the
portable path of `tf_adasum.engines.mpi`; the native op is the fast one).

Sizes are agreed before data moves, once per tree call, as the native op
does: the first step of each call (on every rank: the fold's send or
receive, or the first swap) first gathers every rank's layout record of the
tree's buffer (element count, dtype, message size) in one small allgather
over the whole communicator; when they differ, every rank raises the same
`tf.errors.InvalidArgumentError`, naming the lowest rank and the lowest rank
that differs from it (nothing was sent, so the communicator stays usable).
The later steps' sizes follow from that layout, so they agree on nothing
again; every receive's size is still checked (``MPI_Get_count``). A failure
with messages in flight marks the communicator failed (see
`tf_adasum.comm.mpi_transport`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_adasum.comm import mpi_transport
from tf_adasum.reference import tree_shape

__all__ = ["MESSAGE_BYTES", "MPICommunicator"]

#: The most bytes one message of the tree carries, as in the native op
#: (``kMaxMessageBytes`` in ``tf_adasum/native/adasum_mpi_ops.cc``): over TCP,
#: Open MPI moves large messages swapped both ways at once far below a link's
#: rate, and pieces of this size nearest it when each receive is posted just
#: before its send (``benchmarks/bare_exchange.py``).
MESSAGE_BYTES = 256 << 10

_TAG_EXCHANGE, _TAG_FOLD = 0, 1
#: Dtypes named in a layout record (others by their item size).
_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8")


def _pieces(array: np.ndarray) -> list[np.ndarray]:
    """`array`'s bytes in messages of at most `MESSAGE_BYTES` (views)."""
    raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return [raw[start : start + MESSAGE_BYTES] for start in range(0, raw.size, MESSAGE_BYTES)] or [raw]


def _layout(array: np.ndarray) -> np.ndarray:
    """A rank's record of a tree call's buffer: element count, dtype, message size."""
    name = array.dtype.name
    code = _DTYPES.index(name) if name in _DTYPES else 1000 + array.dtype.itemsize
    return np.array([array.size, code, MESSAGE_BYTES], np.int64)


def _describe(rank: int, record: np.ndarray) -> str:
    elements, code, piece = (int(x) for x in record)
    dtype = _DTYPES[code] if 0 <= code < len(_DTYPES) else f"{code - 1000}-byte"
    buffer = f"in its tree buffer (its tensors, padded; {piece}-byte messages)"
    return f"rank {rank} has {elements} {dtype} elements {buffer}"


def _steps_per_tree(rank: int, size: int) -> int:
    """The data steps (swaps, gathers, sends, receives) `rank` takes in one
    tree call over `size` ranks (`tf_adasum.tree.rvh.allreduce`): the fold's upper
    rank sends and receives back; the others swap and gather once per level,
    the fold's lower rank receiving first and sending back last."""
    leaves, folded = tree_shape(size)
    levels = leaves.bit_length() - 1
    if rank < 2 * folded:
        return 2 if rank % 2 else 2 * levels + 2
    return 2 * levels


class MPICommunicator:
    """One rank's `tf_adasum.tree.communicator.Communicator` over an mpi4py communicator.

    Args:
      comm: the mpi4py communicator whose ranks take part (e.g. ``COMM_WORLD``).
      sum_comms: `tf_adasum.comm.mpi_transport.World.sum_communicators` of `comm` for
        the tree's groups.
      chain: orders this process's MPI calls.
      timeout_seconds: how long a call waits for its peers (0: forever).
    """

    device = ""  # the arithmetic stays where TensorFlow places it

    def __init__(self, comm, sum_comms, chain: mpi_transport.Chain, timeout_seconds: float):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._sum_comms = sum_comms
        self._chain = chain
        self._timeout = timeout_seconds
        self._steps = _steps_per_tree(self.rank, self.size) if self.size > 1 else 1
        self._built = 0  # data steps built so far; they run in this order on the chain

    def _starts_tree(self) -> bool:
        """Whether the data step being built is the first of its tree call."""
        first = self._built % self._steps == 0
        self._built += 1
        return first

    def _agree(self, buffer: np.ndarray) -> None:
        """Gathers every rank's layout record of the tree call's `buffer` over
        the whole communicator; every rank raises the same error when they differ."""
        records = mpi_transport.allgather(
            self.comm, _layout(buffer), self._timeout, "the layout agreement of this tree call"
        )
        differing = [r for r in range(self.size) if not np.array_equal(records[r], records[0])]
        if differing:
            raise tf.errors.InvalidArgumentError(
                None,
                None,
                "tf_adasum MPI engine: the ranks disagree on the tensors of this tree call, so no data was sent: "
                f"{_describe(0, records[0])}; {_describe(differing[0], records[differing[0]])}. Every rank must "
                "pass tensors of the same shapes and dtype, in the same order.",
            )

    def _transfer(self, peer: int, send: np.ndarray | None, receive: np.ndarray | None, tag: int, what: str) -> None:
        """Sends `send` to `peer` while receiving its message into `receive`
        (either may be None), in `MESSAGE_BYTES` pieces: receive k, then send
        k; each receive's size checked."""
        mpi_transport.check_usable(self.comm)  # a failed step may have left messages in flight
        MPI = mpi_transport.mpi()
        incoming = _pieces(receive) if receive is not None else []
        outgoing = _pieces(send) if send is not None else []
        requests, expected = [], []
        for k in range(max(len(incoming), len(outgoing))):
            if k < len(incoming):
                requests.append(self.comm.Irecv(incoming[k], source=peer, tag=tag))
                expected.append(incoming[k].nbytes)
            if k < len(outgoing):
                requests.append(self.comm.Isend(outgoing[k], dest=peer, tag=tag))
                expected.append(None)
        statuses = [MPI.Status() for _ in requests]
        mpi_transport.wait(requests, self._timeout, what, self.comm, statuses, cancel=True)
        for status, nbytes in zip(statuses, expected):
            if nbytes is not None and status.Get_count(MPI.BYTE) != nbytes:
                message = (
                    f"tf_adasum MPI engine: {what} received a message of {status.Get_count(MPI.BYTE)} bytes where "
                    f"{nbytes} were expected (the ranks run different programs)."
                )
                mpi_transport.mark_failed(self.comm, message)
                raise tf.errors.InvalidArgumentError(None, None, message)

    def _exchange(self, send: np.ndarray, receive: np.ndarray, peer: int, what: str) -> None:
        """Sends `send` to `peer` while receiving its message into `receive` (same size)."""
        self._transfer(peer, send, receive, _TAG_EXCHANGE, f"{what} with rank {peer}")

    def swap_halves(self, x: tf.Tensor, partner: int) -> tuple[tf.Tensor, tf.Tensor]:
        me, agree = 0 if self.rank < partner else 1, self._starts_tree()

        def swap(rows):
            if agree:  # the rows are the tree's whole buffer
                self._agree(rows)
            out = np.empty_like(rows[me])
            self._exchange(rows[1 - me], out, partner, "swap_halves")
            return out

        received = self._chain.call(swap, [x], x.dtype, x.shape[1:])
        return (x[0], received) if me == 0 else (received, x[1])

    def gather_pair(self, x: tf.Tensor, partner: int) -> tf.Tensor:
        me, agree = 0 if self.rank < partner else 1, self._starts_tree()

        def gather(mine):
            if agree:  # only when used alone: in a tree a swap comes first
                self._agree(mine)
            out = np.empty((2,) + mine.shape, mine.dtype)
            self._exchange(mine, out[1 - me], partner, "gather_pair")
            out[me] = mine
            return out.reshape(-1)

        length = x.shape[0]
        return self._chain.call(gather, [x], x.dtype, [None if length is None else 2 * length])

    def sum_float64(self, x: tf.Tensor, members: tuple[int, ...]) -> tf.Tensor:
        sub = self._sum_comms[tuple(members)]
        what = f"the partial sums over ranks {members}"
        return self._chain.call(
            lambda v: mpi_transport.allreduce_sum(sub, v, self._timeout, what), [x], tf.float64, x.shape
        )

    def send(self, x: tf.Tensor, peer: int) -> tf.Tensor:
        agree = self._starts_tree()

        def send(values):
            if agree:  # the fold: the tree's whole buffer
                self._agree(values)
            self._transfer(peer, values, None, _TAG_FOLD, f"a send to rank {peer}")
            return values

        return self._chain.call(send, [x], x.dtype, x.shape)

    def recv(self, peer: int, like: tf.Tensor) -> tf.Tensor:
        agree = self._starts_tree()

        def recv(template):
            out = np.empty_like(template)
            if agree:  # the fold: the tree's whole buffer
                self._agree(out)
            self._transfer(peer, None, out, _TAG_FOLD, f"a receive from rank {peer}")
            return out

        return self._chain.call(recv, [like], like.dtype, like.shape)

    def direct(self, members: tuple[int, ...]) -> bool:
        """False: every rank is a process of its own."""
        return False
