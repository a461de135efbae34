"""Compressed transport: 32- and 64-bit values travel as 16-bit floats.

`Compressed` wraps any transport of the vector-halving driver (the
`tf_adasum.tree.communicator.Communicator` protocol) and changes only what crosses the wire,
as Horovod's ``Compression.fp16`` does for sums: every message of float32 or
float64 values is sent as ``float16`` or ``bfloat16`` and widened back on
arrival. The dot products, coefficients and scaled sums stay float64 on the
widened values; float16 and bfloat16 buffers travel unchanged.

Range: messages are whole blocks of `tf_adasum.ops.BLOCK` (128) elements, and
a block never holds two tensors. Each block is scaled by a power of two 2^-e
so that its largest magnitude, rounded to the wire format, lies in [2^13,
2^14), far inside float16's 65504; e travels after the block (one int32 as two
16-bit slots: 2/128 = 1.6% more elements). Scaling by a power of two is exact,
so the loss is the rounding to 11 (float16) or 8 (bfloat16) significant bits:
relative to each element for elements down to 2^-27 of their block's peak,
fewer bits below that (float16's subnormals), zero below about 2^-38 of the
peak (bfloat16 keeps its 8 bits all the way). Values such as 1e6 or 1e-9,
out of float16's range or precision, so travel with float16's relative
precision, whatever the magnitudes of the other tensors in the bucket.
(float64 values beyond 2^1000 or below 2^-1000 are outside this scheme's
exponent range.) A block holding an infinity or NaN is sent unscaled: it
stays non-finite, as the whole result would.

The encoding is idempotent: a decoded message encodes to the same bits (the
exponent comes from the bits of the peak, after rounding), so a value that
makes a second trip, as the non-power-of-two fold's result does, is unchanged.

Replicas stay bitwise identical: a rank that keeps or sends its own values
uses the same widened copy its peers receive (a message's own row comes back
from the swap and the gather; `send` returns the widened copy).
"""

from __future__ import annotations

import tensorflow as tf

from tf_adasum import ops
from tf_adasum.ops import BLOCK

__all__ = ["COMPRESSIONS", "Compressed", "check_compression", "compressed", "round_trip"]

#: The wire formats a compressed transport offers (None: uncompressed).
COMPRESSIONS = (None, "float16", "bfloat16")

# A block's peak is scaled into [2^13, 2^14); exponents are clamped so that
# 2^e and 2^-e are normal float64 numbers.
_PEAK_EXPONENT = 13
_MAX_EXPONENT = 1022
_COMPRESSED_DTYPES = (tf.float32, tf.float64)


def check_compression(compression) -> tf.DType | None:
    """The wire dtype `compression` names (None for none); raises TypeError or
    ValueError naming the argument and the value otherwise."""
    if compression is not None and not isinstance(compression, str):
        raise TypeError(
            "`compression` must be a string or None. "
            f"Received: compression={compression!r} of type {type(compression).__name__}"
        )
    if compression not in COMPRESSIONS:
        raise ValueError(f"`compression` must be one of {COMPRESSIONS}. Received: compression={compression!r}")
    return None if compression is None else tf.as_dtype(compression)


def _power_of_two(exponent: tf.Tensor) -> tf.Tensor:
    """2^exponent in float64, exactly (built from its bits); exponent int64 in [-1022, 1022]."""
    return tf.bitcast(tf.bitwise.left_shift(exponent + 1023, tf.constant(52, tf.int64)), tf.float64)


def _floor_log2(x: tf.Tensor) -> tf.Tensor:
    """floor(log2(x)) of positive normal float64 `x`, exactly: its exponent bits."""
    return tf.bitwise.right_shift(tf.bitcast(x, tf.int64), tf.constant(52, tf.int64)) - 1023


def _clamped(exponent: tf.Tensor) -> tf.Tensor:
    return tf.clip_by_value(exponent, tf.constant(-_MAX_EXPONENT, tf.int64), tf.constant(_MAX_EXPONENT, tf.int64))


def _encode(rows: tf.Tensor, wire: tf.DType) -> tf.Tensor:
    """``[r, m]`` float32/float64 (m a multiple of `BLOCK`) -> ``[r, m / BLOCK * (BLOCK + 2)]``
    in `wire`: per block, its scaled values, then its exponent. On CPUs in one
    native pass (`tf_adasum.ops.native_for`), bitwise the same as the ops below."""
    native = ops.native_for(rows)
    if native is not None:
        return native.tf_adasum_encode_blocks(rows, W=wire)
    return _tf_encode(rows, wire)


def _tf_encode(rows: tf.Tensor, wire: tf.DType) -> tf.Tensor:
    x = tf.reshape(tf.cast(rows, tf.float64), [tf.shape(rows)[0], -1, BLOCK])
    peak = tf.reduce_max(tf.abs(x), axis=2)
    usable = tf.math.is_finite(peak) & (peak > 0.0)
    exponent = _clamped(_floor_log2(peak) - _PEAK_EXPONENT)
    # The scaled peak lies in [2^13, 2^14); rounding may carry it up to 2^14:
    # then one more halving (it rounds to 2^13 exactly) keeps it in the range.
    rounded_peak = tf.cast(tf.cast(peak * _power_of_two(-exponent), wire), tf.float64)
    exponent = _clamped(exponent + tf.cast(rounded_peak >= 2.0 ** (_PEAK_EXPONENT + 1), tf.int64))
    exponent = tf.where(usable, exponent, tf.zeros_like(exponent))
    values = tf.cast(x * _power_of_two(-exponent)[..., None], wire)
    exponent_slots = tf.bitcast(tf.cast(exponent, tf.int32), wire)  # [r, blocks, 2]
    return tf.reshape(tf.concat([values, exponent_slots], axis=2), [tf.shape(rows)[0], -1])


def _decode(packed: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """Inverse of `_encode`: ``[r, blocks * (BLOCK + 2)]`` in the wire dtype -> ``[r, blocks * BLOCK]``."""
    native = ops.native_for(packed)
    if native is not None:
        return native.tf_adasum_decode_blocks(packed, T=dtype)
    return _tf_decode(packed, dtype)


def _tf_decode(packed: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    blocks = tf.reshape(packed, [tf.shape(packed)[0], -1, BLOCK + 2])
    exponent = tf.cast(tf.bitcast(blocks[..., BLOCK:], tf.int32), tf.int64)
    values = tf.cast(blocks[..., :BLOCK], tf.float64) * _power_of_two(exponent)[..., None]
    return tf.reshape(tf.cast(values, dtype), [tf.shape(packed)[0], -1])


def _wire_length(length):
    return length // BLOCK * (BLOCK + 2)


def round_trip(rows: tf.Tensor, wire: tf.DType) -> tf.Tensor:
    """What ``[r, m]`` `rows` (m a multiple of `BLOCK`) become after one trip over a `wire` transport."""
    return _decode(_encode(rows, wire), rows.dtype)


class Compressed:
    """A `tf_adasum.tree.communicator.Communicator` whose float32/float64 messages travel as `wire`.

    Args:
      comm: the transport to wrap (any `tf_adasum.tree.communicator.Communicator`).
      wire: ``tf.float16`` or ``tf.bfloat16``.
    """

    def __init__(self, comm, wire: tf.DType):
        self.comm = comm
        self.wire = wire
        self.rank, self.size, self.device = comm.rank, comm.size, comm.device

    def _compresses(self, x: tf.Tensor) -> bool:
        return x.dtype in _COMPRESSED_DTYPES

    def swap_halves(self, x: tf.Tensor, partner: int) -> tuple[tf.Tensor, tf.Tensor]:
        if not self._compresses(x):
            return self.comm.swap_halves(x, partner)
        rows = self.comm.swap_halves(_encode(x, self.wire), partner)
        return tuple(_decode(row[None], x.dtype)[0] for row in rows)

    @property
    def piece_bytes(self) -> int:
        """The wrapped transport's (0 where it swaps whole halves only)."""
        return getattr(self.comm, "piece_bytes", 0)

    def swap_in_pieces(self, send: tf.Tensor, keep: tf.Tensor, partner: int, cuts):
        """The wrapped transport's `swap_in_pieces` on the wire format: cut
        at the same blocks, each received piece widened as soon as it has
        come; `keep` comes back widened from the wire format too, as
        `swap_halves` returns its own row."""
        if not self._compresses(send):
            return self.comm.swap_in_pieces(send, keep, partner, cuts)
        _, received, _ = self.comm.swap_in_pieces(
            _encode(send[None], self.wire)[0], keep, partner, [_wire_length(c) for c in cuts]
        )
        pieces = [_decode(piece[None], send.dtype)[0] for piece in received]
        return round_trip(keep[None], self.wire)[0], pieces, tf.concat(pieces, axis=0)

    def gather_pair(self, x: tf.Tensor, partner: int) -> tf.Tensor:
        if not self._compresses(x):
            return self.comm.gather_pair(x, partner)
        gathered = self.comm.gather_pair(_encode(x[None], self.wire)[0], partner)
        return tf.reshape(_decode(tf.reshape(gathered, [2, -1]), x.dtype), [-1])

    def sum_float64(self, x: tf.Tensor, members: tuple[int, ...]) -> tf.Tensor:
        return self.comm.sum_float64(x, members)

    def direct(self, members: tuple[int, ...]) -> bool:
        """False: compression asks for what travels to be rounded, so every
        exchange goes through the wrapped transport."""
        return False

    def send(self, x: tf.Tensor, peer: int) -> tf.Tensor:
        if not self._compresses(x):
            return self.comm.send(x, peer)
        sent = self.comm.send(tf.reshape(_encode(x[None], self.wire), [-1]), peer)
        return _decode(sent[None], x.dtype)[0]

    def recv(self, peer: int, like: tf.Tensor) -> tf.Tensor:
        if not self._compresses(like):
            return self.comm.recv(peer, like)
        length = like.shape[0] if like.shape[0] is not None else tf.shape(like)[0]
        wire_like = tf.zeros([_wire_length(length)], self.wire)
        return _decode(self.comm.recv(peer, like=wire_like)[None], like.dtype)[0]


def compressed(comms, compression):
    """`comms` (a list of communicators) over the wire format `compression` names
    (unchanged for None)."""
    wire = check_compression(compression)
    return list(comms) if wire is None else [Compressed(c, wire) for c in comms]
