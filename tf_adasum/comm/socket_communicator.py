"""The vector-halving tree's steps over a socket mesh (`tf_adasum.comm.sockets`).

`SocketCommunicator` is one rank's `tf_adasum.tree.communicator.Communicator`: each step (a
gather, a level's float64 partial sums, a fold's send or receive) is one
``tf.numpy_function``, and a swap one per piece (`swap_in_pieces`), that
sends from the tensor's memory and receives into the result's (bytes,
whatever the dtype: tensors travel bitcast to uint8). `sum_steps` says whom
a partial sum talks to. Each step tells the mesh the size of the message it
receives (`Mesh.allow`: when it is built, if the shape is known, and when it
runs), so a message arriving before its receive is buffered only up to the
largest size of the agreed layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_adasum.comm import collective_keys
from tf_adasum.comm.socket_link import aligned_empty
from tf_adasum.comm.sockets import Mesh

__all__ = ["PIECE_BYTES", "SocketCommunicator", "sum_steps"]

#: A swap's half travels in messages of about this many bytes (`SocketCommunicator.swap_in_pieces`).
PIECE_BYTES = 1 << 20


def _as_bytes(x: tf.Tensor) -> tf.Tensor:
    """`x` flattened to bytes, sharing its buffer."""
    return tf.reshape(tf.bitcast(tf.reshape(x, [-1]), tf.uint8), [-1])


def _from_bytes(raw: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return raw if dtype == tf.uint8 else tf.bitcast(tf.reshape(raw, [-1, dtype.size]), dtype)


def sum_steps(members: tuple[int, ...], rank: int) -> list[list[int]]:
    """The members `rank` exchanges its running sum with, step by step, when
    `SocketCommunicator.sum_float64` sums over `members`: one partner a step by
    recursive doubling for a power of two, else every other member at once."""
    index, count = members.index(rank), len(members)
    if count & (count - 1):
        return [[m for m in members if m != rank]]
    return [[members[index ^ (1 << b)]] for b in range(count.bit_length() - 1)]


class SocketCommunicator:
    """One rank's `tf_adasum.tree.communicator.Communicator` over a `tf_adasum.comm.sockets.Mesh`.

    For trees whose ranks sit on CPUs, no two of one tree in the same process
    (a process may hold one rank of each of several trees). Each step's
    ``tf.numpy_function`` calls are on the mesh's chain, so every process
    issues them in the same order; each message's tag is a pair of
    collective keys drawn from `tf_adasum.comm.collective_keys.KEYS` (the
    pair's group key and this device's next instance key in it), identical
    on both members of a pair.

    A swap travels in pieces of about `PIECE_BYTES` (`swap_in_pieces`), each
    a tensor as soon as it has come.

    Args:
      devices: the device of every rank, in rank order.
      rank: this communicator's rank.
      processes: the mesh index of every rank's process.
      mesh: this process's `Mesh`.
    """

    def __init__(self, devices: Sequence[str], rank: int, processes: Sequence[int], mesh: Mesh):
        self.devices, self.rank, self.size = tuple(devices), rank, len(devices)
        self.piece_bytes = PIECE_BYTES
        self.device = self.devices[rank]
        self._processes = tuple(processes)
        self._mesh = mesh
        self._in_flight: dict[int, tuple] = {}  # swap_in_pieces: handle -> (Pieces, received buffer)
        self._handles = itertools.count()

    def direct(self, members: tuple[int, ...]) -> bool:
        """False: no two ranks of the tree share a process."""
        return False

    def _tag(self, peer: int) -> int:
        group_key = collective_keys.KEYS.group_key([self.device, self.devices[peer]])
        instance_key = collective_keys.KEYS.instance_key(group_key, self.device)
        return group_key << 32 | instance_key

    def _call(self, fn, inputs: Sequence[tf.Tensor], nbytes, receives=None) -> tf.Tensor:
        """`fn` on the mesh's chain, returning `nbytes` bytes; `receives`: the
        size of the message it receives, when known now (see `Mesh.allow`)."""
        if receives is not None:
            self._mesh.allow(receives)
        with tf.device(self.device):
            return self._mesh.chain.call(fn, inputs, tf.uint8, [nbytes])

    def _what(self, step: str, peer: int) -> str:
        return f"{step} of rank {self.rank} with rank {peer}"

    def swap_halves(self, x: tf.Tensor, partner: int) -> tuple[tf.Tensor, tf.Tensor]:
        me, peer, tag = (0 if self.rank < partner else 1), self._processes[partner], self._tag(partner)
        what = self._what("swap_halves", partner)
        with tf.device(self.device):
            rows = tf.reshape(tf.bitcast(x, tf.uint8), [2, -1])
            nbytes = None if x.shape[1] is None else x.shape[1] * x.dtype.size

        def swap(rows):
            self._mesh.allow(rows.shape[1])
            return self._mesh.exchange(peer, tag, rows[1 - me], rows.shape[1], what)

        received = _from_bytes(self._call(swap, [rows], nbytes, nbytes), x.dtype)
        with tf.device(self.device):
            kept = x[me]
        return (kept, received) if me == 0 else (received, kept)

    def swap_in_pieces(
        self, send: tf.Tensor, keep: tf.Tensor, partner: int, cuts: Sequence[int]
    ) -> tuple[tf.Tensor, list[tf.Tensor], tf.Tensor]:
        """Sends `send` (``[m]``, this rank's half for `partner`) while
        receiving the partner's half for this rank, both cut at the element
        offsets `cuts` (``0 < c_1 < ... < m``, possibly none) into messages of
        their own.

        Returns ``(kept, pieces, whole)``: `keep` (``[m]``, the half this rank
        keeps, unchanged here); the received half's pieces, each a tensor as
        soon as it has come (work on one overlaps the transfer of the rest);
        and the whole received half (``[m]``, the buffer the pieces were
        received into), complete once every piece of `send` is sent too. One
        call on the mesh's chain per piece (the last piece is a slice of the
        whole)."""
        peer, tag, what = self._processes[partner], self._tag(partner), self._what("swap_in_pieces", partner)
        m, size = send.shape[0], send.dtype.size
        bounds = [(start * size, end * size) for start, end in zip([0, *cuts], [*cuts, m])]
        largest = max(end - start for start, end in bounds)
        self._mesh.allow(largest)
        with tf.device(self.device):
            raw = _as_bytes(send)

        def start(raw):
            # A swap still in flight here is one whose step stopped between its
            # calls: its receives, still posted, would take this swap's messages.
            stale = [pieces for pieces, _ in self._in_flight.values()]
            self._in_flight.clear()
            for pieces in stale:
                pieces.abandon()
            self._mesh.allow(largest)
            received = aligned_empty(raw.nbytes)
            pieces = self._mesh.exchange_in_pieces(
                peer, tag, [raw[a:b] for a, b in bounds], [received[a:b] for a, b in bounds], what
            )
            if len(bounds) == 1:
                return finish(pieces, received), np.int64(-1)
            first = pieces.wait(0)
            handle = next(self._handles)
            self._in_flight[handle] = (pieces, received)
            return first, np.int64(handle)

        def finish(pieces, received):
            pieces.wait(len(bounds) - 1)
            pieces.finish()
            return received

        def piece(k):
            def wait(handle):
                try:
                    return self._in_flight[int(handle)][0].wait(k)
                except BaseException:
                    self._in_flight.pop(int(handle), None)
                    raise

            return wait

        with tf.device(self.device):
            first, handle = self._mesh.chain.chain(
                lambda: tf.numpy_function(start, [raw], [tf.uint8, tf.int64], stateful=True)
            )
        first.set_shape([bounds[0][1]])
        received = [first] + [self._call(piece(k), [handle], b - a) for k, (a, b) in enumerate(bounds[1:-1], 1)]
        if len(bounds) > 1:
            whole = self._call(lambda handle: finish(*self._in_flight.pop(int(handle))), [handle], m * size)
            # The pieces and the whole are tensors over the same memory: every
            # read of a piece (its partials) precedes the combine, the first op
            # that could take the whole's buffer over.
            with tf.device(self.device):
                received.append(whole[bounds[-1][0] :])
        else:
            whole = first
        with tf.device(self.device):
            return keep, [_from_bytes(piece, send.dtype) for piece in received], _from_bytes(whole, send.dtype)

    def gather_pair(self, x: tf.Tensor, partner: int) -> tf.Tensor:
        me, peer, tag = (0 if self.rank < partner else 1), self._processes[partner], self._tag(partner)
        what = self._what("gather_pair", partner)
        with tf.device(self.device):
            mine = _as_bytes(x)
        nbytes = None if x.shape[0] is None else 2 * x.shape[0] * x.dtype.size

        def gather(mine):
            self._mesh.allow(mine.nbytes)
            out = aligned_empty(2 * mine.nbytes).reshape(2, -1)

            def copy_mine():  # after the send: the copy overlaps the transfer's tail
                out[me] = mine

            self._mesh.exchange(peer, tag, mine, out[1 - me], what, while_receiving=copy_mine)
            return out.reshape(-1)

        return _from_bytes(self._call(gather, [mine], nbytes, None if nbytes is None else nbytes // 2), x.dtype)

    def sum_float64(self, x: tf.Tensor, members: tuple[int, ...]) -> tf.Tensor:
        """Sums `x` over `members` in one call: by recursive doubling (the pair
        with the lower member first) for a power of two, every member's value
        in member order otherwise; every member gets the bitwise same sum."""
        steps = sum_steps(members, self.rank)
        tags = [[self._tag(m) for m in step] for step in steps]
        what = f"the partial sums of rank {self.rank} over ranks {members}"
        with tf.device(self.device):
            flat = _as_bytes(tf.cast(x, tf.float64))

        def add(mine):
            self._mesh.allow(mine.nbytes)
            total = mine.view(np.float64).copy()
            for step, step_tags in zip(steps, tags):
                values = {self.rank: total}
                for m, tag in zip(step, step_tags):
                    got = self._mesh.exchange(self._processes[m], tag, total, total.nbytes, what)
                    values[m] = got.view(np.float64)
                total = values[min(values)]
                for m in sorted(values)[1:]:
                    total = total + values[m]
            return total.view(np.uint8)

        elements = x.shape.num_elements()
        nbytes = None if elements is None else 8 * elements
        summed = _from_bytes(self._call(add, [flat], nbytes, nbytes), tf.float64)
        with tf.device(self.device):
            out = tf.reshape(summed, tf.shape(x))
        out.set_shape(x.shape)
        return out

    def send(self, x: tf.Tensor, peer: int) -> tf.Tensor:
        process, tag, what = self._processes[peer], self._tag(peer), self._what("a send", peer)
        with tf.device(self.device):
            raw = _as_bytes(x)

        def send(raw):
            self._mesh.exchange(process, tag, raw, None, what)
            return np.zeros(0, np.uint8)

        sent = self._call(send, [raw], 0)
        with tf.device(self.device), tf.control_dependencies([sent]):
            return tf.identity(x)

    def recv(self, peer: int, like: tf.Tensor) -> tf.Tensor:
        process, tag, what = self._processes[peer], self._tag(peer), self._what("a receive", peer)
        nbytes = None if like.shape.num_elements() is None else like.shape.num_elements() * like.dtype.size
        with tf.device(self.device):
            size = tf.size(like, out_type=tf.int64) * like.dtype.size

        def recv(size):
            self._mesh.allow(int(size))
            return self._mesh.exchange(process, tag, None, int(size), what)

        received = _from_bytes(self._call(recv, [size], nbytes, nbytes), like.dtype)
        with tf.device(self.device):
            out = tf.reshape(received, tf.shape(like))
        out.set_shape(like.shape)
        return out
