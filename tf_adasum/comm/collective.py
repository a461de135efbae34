"""The TensorFlow collective-ops engine of the vector-halving driver.

Pairwise steps are ``CollectiveAllToAllV2`` (phase 1) and ``CollectiveGatherV2``
(phase 2) over a group of two, a large message between processes split into
concurrent pieces; per-level partial sums are float64 and summed by recursive
doubling over the same pairs (log2 of the subgroup's size pairwise gathers);
the non-power-of-two fold uses ``CollectiveBcastSendV2``/``CollectiveBcastRecvV2``.
The same ops serve GPUs and devices spread over worker processes (between
the CPUs of worker processes the TF engine uses `tf_adasum.comm.sockets`
instead, unless ``TF_ADASUM_WORKER_TRANSPORT=collective``); between the CPUs
of one process the driver uses none of them (`TFCollectiveCommunicator.direct`)
unless told to.

Keys are handed out in one place, `tf_adasum.comm.collective_keys.KEYS`: a
group key derived from the set of devices, and per (group, device) an
instance-key counter, so every member of a group draws the same keys as long
as it issues the same collectives in the same order. Within one
`tf.function` each device's collectives carry that device's ordering token
and a control dependency on its previous collective, so they run in program
order on every device.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_adasum.comm import cluster
from tf_adasum.comm.collective_keys import KEYS, CollectiveKeys, canonical_device, device_sort_key

__all__ = [
    "REMOTE_MESSAGE_BYTES",
    "TFCollectiveCommunicator",
    "carried",
    "closing_exchange",
    "ordering_token",
    "restored",
]

#: The default `max_message_bytes` between the CPUs of two processes (see
#: `TFCollectiveCommunicator`).
REMOTE_MESSAGE_BYTES = 8 << 20

_ORDERING_TOKENS: dict[tuple[str, int], tf.Tensor] = {}
_TOKENS_LOCK = threading.Lock()


def ordering_token(device: str, slot: int = 0) -> tf.Tensor:
    """A resource handle on `device` that orders its collectives in a tf.function
    (slot 0; a pairwise message split into pieces gives piece i slot i).

    A bare resource handle (never initialised, never read) rather than a
    variable, so no `tf.distribute` variable creator can wrap it.
    """
    key = (canonical_device(device), slot)
    with _TOKENS_LOCK:
        if key not in _ORDERING_TOKENS:
            with tf.init_scope(), tf.device(key[0]):
                _ORDERING_TOKENS[key] = tf.raw_ops.VarHandleOp(
                    dtype=tf.float32, shape=[], shared_name=f"adasum_ordering_token_{len(_ORDERING_TOKENS)}"
                )
        return _ORDERING_TOKENS[key]


def carried(x: tf.Tensor) -> tf.Tensor:
    """`x` in a dtype every collective kernel carries: gather and broadcast have
    no bfloat16 kernels, so bfloat16 travels bitcast to float16 (same width)."""
    return tf.bitcast(x, tf.float16) if x.dtype == tf.bfloat16 else x


def restored(x: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tf.bitcast(x, dtype) if x.dtype != dtype else x


def closing_exchange(exchange: Callable[[], object]) -> None:
    """Runs `exchange`, an empty collective every process calls at the same
    point after a small one whose result it may raise or exit on, so that no
    process leaves while a peer still receives: a process finishes it only
    after every process has entered it, that is, holds its result. It can
    fail only where a peer has left after finishing it (then this process's
    result is complete): that failure is ignored. (A failed collective may
    leave this process's collectives aborted; the next one then says so.)"""
    try:
        exchange()
    except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError):
        pass


def _joined(pieces: list[tf.Tensor], axis: int) -> tf.Tensor:
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis)


class TFCollectiveCommunicator:
    """One rank's view of the replicas, over TF collective ops.

    Build one per rank and per graph; it chains that rank's collectives.

    Args:
      devices: the device of every rank, in rank order (global replica order).
      rank: this communicator's rank.
      timeout_seconds: collective timeout; 0 or None waits forever. It is
        set on this communicator's first collective only: that is where a
        missing peer shows (the later ones run in lockstep behind it, and
        MultiWorkerMirroredStrategy's heartbeat aborts them if a worker dies).
        TensorFlow implements a collective timeout with one thread that
        sleeps for the whole timeout, per op executed, so timing every op
        would pile up thousands of threads per minute.
      keys: the key allocator (the process-wide one by default).
      direct: whether ranks on the CPUs of this process read each other's
        tensors where they lie (see `direct`) instead of exchanging them over
        collectives (default True; False keeps every exchange a collective).
      max_message_bytes: a pairwise message (a swapped or gathered half)
        larger than this travels as several concurrent collectives of at
        most this size; 0 never splits. None (default): `REMOTE_MESSAGE_BYTES`
        between the CPUs of two processes, where gRPC moves a few concurrent
        messages faster than one large one, and no split otherwise (within a
        process a message is a memory copy, and pieces would add a copy).
    """

    def __init__(
        self,
        devices: Sequence[str],
        rank: int,
        timeout_seconds: float | None = None,
        keys: CollectiveKeys = KEYS,
        max_message_bytes: int | None = None,
        direct: bool = True,
    ):
        self.devices = tuple(devices)
        self.rank = rank
        self.size = len(self.devices)
        self.device = self.devices[rank]
        self._timeout = float(timeout_seconds or 0)
        self._keys = keys
        self._max_message_bytes = max_message_bytes
        self._direct = direct
        self._last: tf.Tensor | None = None

    def direct(self, members: tuple[int, ...]) -> bool:
        """True when every member's device is a CPU of this rank's process
        (and `direct` was not turned off): TensorFlow hands a CPU tensor to
        another CPU device of one process by reference, so the driver reads
        a partner's half where it lies, where a collective would copy it
        (twice, for an all-to-all: its own row too) through a rendezvous."""
        if not self._direct:
            return False
        mine = cluster.process_of(self.device)
        return all(cluster.process_of(self.devices[m]) == mine and cluster.is_cpu(self.devices[m]) for m in members)

    def _next_timeout(self) -> float:
        return self._timeout if self._last is None else 0.0

    def _keys_for(self, members: Sequence[int]) -> tuple[int, int]:
        group_key = self._keys.group_key([self.devices[m] for m in members])
        return group_key, self._keys.instance_key(group_key, self.device)

    def _chained(self, make_op):
        deps = [] if self._last is None else [self._last]
        with tf.device(self.device), tf.control_dependencies(deps):
            out = make_op()
        self._last = out
        return out

    def _slots_reversed(self, partner: int) -> bool:
        """True when the runtime orders this pair opposite to rank order."""
        lower, upper = sorted((self.rank, partner))
        return device_sort_key(self.devices[lower]) > device_sort_key(self.devices[upper])

    def _pieces(self, x: tf.Tensor, partner: int, axis: int) -> list[tf.Tensor]:
        """`x`, whose message to `partner` is `axis` long, split along `axis`
        into pieces whose messages hold at most `_message_bytes` (``[x]`` when
        no split is due)."""
        limit = self._message_bytes(partner)
        length = x.shape[axis]
        count = -(-length * x.dtype.size // limit) if limit and length else 1
        if count <= 1:
            return [x]
        base, extra = divmod(length, count)
        return tf.split(x, [base + (i < extra) for i in range(count)], axis=axis)

    def _message_bytes(self, partner: int) -> int:
        """The largest pairwise message to `partner`, 0 for no limit."""
        if self._max_message_bytes is not None:
            return self._max_message_bytes
        remote = cluster.process_of(self.device) != cluster.process_of(self.devices[partner])
        cpus = cluster.is_cpu(self.device) and cluster.is_cpu(self.devices[partner])
        return REMOTE_MESSAGE_BYTES if remote and cpus else 0

    def _pairwise(self, pieces: list[tf.Tensor], partner: int, collective, assemble) -> tf.Tensor:
        """``assemble([collective(piece, group_key, instance_key, ordering_token,
        timeout) for piece in pieces])``, as one link of this rank's chain.

        Several pieces (see `_pieces`) run at once, as the ring all-reduce runs
        its subdivisions: over gRPC one large message moves slower than a few
        concurrent ones. Piece i carries the ordering token of slot i: one
        token would serialise the pieces, and pieces without tokens hung
        (timed out) on the devices of one process in our tests. So the pieces
        of one message run side by side while every slot keeps its program
        order; the chain orders the whole message after this rank's previous
        collective."""
        group_key = self._keys.group_key([self.devices[m] for m in (self.rank, partner)])

        def op():
            timeout = self._next_timeout()
            outs = [
                collective(
                    piece,
                    group_key,
                    self._keys.instance_key(group_key, self.device),
                    [ordering_token(self.device, slot)],
                    timeout,
                )
                for slot, piece in enumerate(pieces)
            ]
            return assemble(outs)

        return self._chained(op)

    def swap_halves(self, x: tf.Tensor, partner: int) -> tuple[tf.Tensor, tf.Tensor]:
        reverse = self._slots_reversed(partner)

        def swap(piece, group_key, instance_key, token, timeout):
            out = tf.raw_ops.CollectiveAllToAllV2(
                input=tf.reverse(piece, [0]) if reverse else piece,
                group_size=2,
                group_key=group_key,
                instance_key=instance_key,
                ordering_token=token,
                timeout_seconds=timeout,
            )
            out.set_shape(piece.shape)
            return tf.reverse(out, [0]) if reverse else out

        rows = self._pairwise(self._pieces(x, partner, axis=1), partner, swap, lambda outs: _joined(outs, axis=1))
        with tf.device(self.device):
            return rows[0], rows[1]

    def gather_pair(self, x: tf.Tensor, partner: int) -> tf.Tensor:
        reverse = self._slots_reversed(partner)

        def gather(piece, group_key, instance_key, token, timeout):
            out = tf.raw_ops.CollectiveGatherV2(
                input=carried(piece),
                group_size=2,
                group_key=group_key,
                instance_key=instance_key,
                ordering_token=token,
                timeout_seconds=timeout,
            )
            out = tf.reshape(restored(out, piece.dtype), [2, -1])  # one row per member
            return tf.reverse(out, [0]) if reverse else out

        def assemble(outs):  # [member 0's x; member 1's x]
            out = tf.reshape(_joined(outs, axis=1), [-1])
            out.set_shape([None if x.shape[0] is None else 2 * x.shape[0]])
            return out

        return self._pairwise(self._pieces(x, partner, axis=0), partner, gather, assemble)

    def sum_float64(self, x: tf.Tensor, members: tuple[int, ...]) -> tf.Tensor:
        """Sums `x` over `members` by recursive doubling when they are a power
        of two: at step j each rank exchanges its running sum with the member
        whose index differs in bit j (a pairwise gather) and adds the two in
        member order, so every member ends with the bitwise same sum after
        log2(len(members)) exchanges, where a ring reduce (the fallback for
        other group sizes) takes 2 (len(members) - 1) steps."""
        count = len(members)
        if count & (count - 1):
            return self._ring_sum(x, members)
        index = members.index(self.rank)
        flat = tf.reshape(x, [-1])
        bit = 1
        while bit < count:
            both = tf.reshape(self.gather_pair(flat, members[index ^ bit]), [2, -1])
            with tf.device(self.device):
                flat = both[0] + both[1]
            bit <<= 1
        summed = tf.reshape(flat, tf.shape(x))
        summed.set_shape(x.shape)
        return summed

    def _ring_sum(self, x: tf.Tensor, members: tuple[int, ...]) -> tf.Tensor:
        group_key, instance_key = self._keys_for(members)
        summed = self._chained(
            lambda: tf.raw_ops.CollectiveReduceV2(
                input=x,
                group_size=len(members),
                group_key=group_key,
                instance_key=instance_key,
                ordering_token=[ordering_token(self.device)],
                merge_op="Add",
                final_op="Id",
                timeout_seconds=self._next_timeout(),
            )
        )
        summed.set_shape(x.shape)
        return summed

    def send(self, x: tf.Tensor, peer: int) -> tf.Tensor:
        group_key, instance_key = self._keys_for((self.rank, peer))
        sent = self._chained(
            lambda: tf.raw_ops.CollectiveBcastSendV2(
                input=carried(x),
                group_size=2,
                group_key=group_key,
                instance_key=instance_key,
                timeout_seconds=self._next_timeout(),
            )
        )
        # The send's output is unused; returning x through it keeps the op alive.
        with tf.device(self.device), tf.control_dependencies([sent]):
            return tf.identity(x)

    def recv(self, peer: int, like: tf.Tensor) -> tf.Tensor:
        group_key, instance_key = self._keys_for((self.rank, peer))
        received = self._chained(
            lambda: tf.raw_ops.CollectiveBcastRecvV2(
                group_size=2,
                group_key=group_key,
                instance_key=instance_key,
                shape=tf.shape(like),
                T=carried(like).dtype,
                timeout_seconds=self._next_timeout(),
            )
        )
        received.set_shape(like.shape)
        return restored(received, like.dtype)
