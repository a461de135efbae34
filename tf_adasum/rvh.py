"""ADASUMRVH: the recursive vector-halving all-reduce, written once.

The driver runs on one rank at a time against a small `Communicator`: in one
process holding several devices it is called once per device (each call
builds that device's part of the graph), across processes once per process.

Phase 1 (reduce-scatter by vector halving): at level k a rank swaps half of its
current slice with partner ``rank XOR 2^k`` and keeps the other half. On that
half, ``a`` is the left subtree's value and ``b`` the right subtree's (the
lower rank's row comes first, whichever rank this is). The pair rule combines
them, summing its per-tensor float64 partials over the 2^(k+1) ranks that hold
the rest of those two subtrees. Phase 2 gathers the slices back (distance
halving). For N = 2^p every rank sends ``2 (N-1) / N`` of the buffer, as a
ring all-reduce does, plus one tiny float64 sum per level.

N not a power of two: with r = N - 2^p, rank 2i+1 (i < r) sends its buffer to
rank 2i, which combines the two and takes part in the tree; at the end it sends
the result back. That is one full-buffer send each way for those 2r ranks.

Every element of the result is computed by exactly one rank and copied to the
others, so every rank ends with a bitwise identical buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import tensorflow as tf

from tf_adasum.ops import BLOCK, Segments
from tf_adasum.reference import tree_shape

__all__ = ["Bucket", "Communicator", "PairRule", "allreduce", "groups", "make_buckets", "pack", "unpack"]


class Communicator(Protocol):
    """What the vector-halving driver needs from a transport.

    Members of a pair are ordered by rank: "member 0" is the lower rank.
    Every rank must call these in the same order as its peers.
    """

    rank: int
    size: int
    device: str  # where this rank's computation is placed

    def swap_halves(self, x: tf.Tensor, partner: int) -> tf.Tensor:
        """All-to-all with `partner`: row j of ``x`` ([2, m]) goes to member j;
        row j of the result is what member j sent to this rank."""

    def gather_pair(self, x: tf.Tensor, partner: int) -> tf.Tensor:
        """Concatenation of member 0's and member 1's ``x`` (1-D, same length)."""

    def sum_float64(self, x: tf.Tensor, members: tuple[int, ...]) -> tf.Tensor:
        """Elementwise sum of a small float64 tensor over `members` (sorted ranks)."""

    def send(self, x: tf.Tensor, peer: int) -> tf.Tensor:
        """Sends ``x`` to `peer`, which calls `recv` for it; returns ``x`` once sent
        (use the returned tensor so that the send is part of the computation)."""

    def recv(self, peer: int, like: tf.Tensor) -> tf.Tensor:
        """Receives from `peer` a tensor of the shape and dtype of `like`."""


class PairRule(Protocol):
    """How two subtrees' values are combined (Adasum, or a plain sum)."""

    def prepare(self, flat: tf.Tensor, num_ranks: int) -> tf.Tensor:
        """Applied to each rank's buffer before the tree (e.g. 1/N for a mean)."""

    def combine(
        self,
        x: tf.Tensor,
        segments: Segments,
        sum_partials: Callable[[tf.Tensor], tf.Tensor],
    ) -> tf.Tensor:
        """Combines ``x = [a; b]`` (``[2, m]``): a slice of the left subtree's
        value ``a`` and the same slice of the right subtree's ``b``; returns ``[m]``.

        `sum_partials` sums float64 per-tensor partials over all ranks holding
        a slice of these two subtrees, so a rule may compute whole-tensor dot
        products from its slice.
        """


def _num_blocks(size: int) -> int:
    return -(-size // BLOCK)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype fused into one flat buffer, in blocks of `BLOCK`.

    Each tensor starts on a block boundary and owns whole blocks (zero-padded),
    so every slice the halving makes holds whole blocks of single tensors.

    Attributes:
      dtype: the common dtype.
      indices: positions of the fused tensors in the caller's list.
      sizes: their element counts (all > 0), in order.
      total_blocks: the buffer's block count, a multiple of the tree's leaf
        count so that every halving is exact; the extra blocks belong to the
        last tensor. Padding zeros add nothing to dot products and are dropped.
    """

    dtype: tf.DType
    indices: tuple[int, ...]
    sizes: tuple[int, ...]
    total_blocks: int

    @property
    def blocks(self) -> tuple[int, ...]:
        """The number of blocks of each tensor."""
        return tuple(_num_blocks(size) for size in self.sizes)

    @property
    def padded_length(self) -> int:
        return self.total_blocks * BLOCK

    def starts(self) -> list[int]:
        """The first element of each tensor in the buffer."""
        starts, block = [], 0
        for count in self.blocks:
            starts.append(block * BLOCK)
            block += count
        return starts

    def segments(self, lo: int, hi: int) -> Segments:
        """The tensors that the slice ``[lo, hi)`` (whole blocks) of the buffer holds."""
        lo_block, hi_block = lo // BLOCK, hi // BLOCK
        counts, first, start = [], None, 0
        for t, count in enumerate(self.blocks):
            end = self.total_blocks if t == len(self.blocks) - 1 else start + count
            overlap = min(hi_block, end) - max(lo_block, start)
            if overlap > 0:
                first = t if first is None else first
                counts.append(overlap)
            start = end
        return Segments(first=first, counts=tuple(counts), num_tensors=len(self.sizes))


#: Tensors this large travel unfused when they need no padding (see `make_buckets`).
ALONE_BYTES = 4 << 20


def make_buckets(
    dtypes: Sequence[tf.DType], sizes: Sequence[int], num_ranks: int, bytes_per_bucket: int = 0
) -> list[Bucket]:
    """Fuses tensors into buckets: one dtype each, in order, at most
    `bytes_per_bucket` bytes unless a single tensor is larger (0: no limit).
    Empty tensors are left out (they need no communication). A tensor of at
    least `ALONE_BYTES` that fills whole blocks of the tree's leaves (needs no
    padding) gets a bucket of its own: its buffer is the tensor itself, with
    no copy into a fused buffer, which for such a tensor costs more than the
    latency of a bucket's own exchanges."""
    leaves, _ = tree_shape(num_ranks)
    open_buckets: dict[tf.DType, tuple[list[int], list[int]]] = {}  # dtype -> (members, [bytes])
    closed: list[list[int]] = []
    for i, (dtype, size) in enumerate(zip(dtypes, sizes)):
        if size == 0:
            continue
        nbytes = size * dtype.size
        if nbytes >= ALONE_BYTES and size % (BLOCK * leaves) == 0:
            closed.append([i])
            continue
        members, used = open_buckets.setdefault(dtype, ([], [0]))
        if members and bytes_per_bucket and used[0] + nbytes > bytes_per_bucket:
            closed.append(members)
            members, used = open_buckets[dtype] = ([], [0])
        members.append(i)
        used[0] += nbytes
    closed.extend(members for members, _ in open_buckets.values())
    closed.sort(key=lambda members: members[0])
    buckets = []
    for members in closed:
        total_blocks = -(-sum(_num_blocks(sizes[i]) for i in members) // leaves) * leaves
        buckets.append(Bucket(dtypes[members[0]], tuple(members), tuple(sizes[i] for i in members), total_blocks))
    return buckets


def pack(tensors: Sequence[tf.Tensor], bucket: Bucket) -> tf.Tensor:
    """The flat, block-padded buffer of `bucket`'s tensors taken from `tensors`."""
    parts = []
    for i, size, blocks in zip(bucket.indices, bucket.sizes, bucket.blocks):
        flat = tf.reshape(tensors[i], [-1])
        parts.append(tf.pad(flat, [[0, blocks * BLOCK - size]]) if blocks * BLOCK != size else flat)
    tail = bucket.total_blocks - sum(bucket.blocks)
    if tail:
        parts.append(tf.zeros([tail * BLOCK], bucket.dtype))
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def unpack(flat: tf.Tensor, bucket: Bucket, shapes: Sequence[tf.TensorShape]) -> list[tf.Tensor]:
    """Splits a bucket's buffer back into its tensors (in `bucket.indices` order)."""
    return [
        tf.reshape(flat[start : start + size], shapes[i])
        for i, size, start in zip(bucket.indices, bucket.sizes, bucket.starts())
    ]


def _real_rank(virtual: int, folded: int) -> int:
    """The rank standing for tree leaf `virtual`: 2v for folded pairs, else v + r."""
    return 2 * virtual if virtual < folded else virtual + folded


def groups(num_ranks: int) -> list[tuple[int, ...]]:
    """Every rank group the collective uses for `num_ranks`, in a canonical order.

    Registering these before any rank issues a collective makes group keys
    agree across processes.
    """
    leaves, folded = tree_shape(num_ranks)
    result = [(2 * i, 2 * i + 1) for i in range(folded)]
    bit = 1
    while bit < leaves:
        for v in range(leaves):
            if not v & bit:
                result.append((_real_rank(v, folded), _real_rank(v | bit, folded)))
        for start in range(0, leaves, 2 * bit):
            result.append(tuple(_real_rank(u, folded) for u in range(start, start + 2 * bit)))
        bit <<= 1
    return list(dict.fromkeys(result))


def num_levels(num_ranks: int) -> int:
    """Levels of the tree as `level_representatives` counts them (the fold is one)."""
    leaves, folded = tree_shape(num_ranks)
    return (leaves.bit_length() - 1) + (1 if folded else 0)


def level_representatives(num_ranks: int) -> list[list[int]]:
    """Per level (the fold first, if any), one rank per pair combined at that
    level: the rank that holds that pair's whole-tensor partial sums."""
    leaves, folded = tree_shape(num_ranks)
    levels = [[2 * i for i in range(folded)]] if folded else []
    bit = 1
    while bit < leaves:
        levels.append([_real_rank(start, folded) for start in range(0, leaves, 2 * bit)])
        bit <<= 1
    return levels


#: Called as ``record(level, partials)`` with a level's float64 ``[tensors, 3]``
#: whole-tensor partial sums [a.b, |a|^2, |b|^2], on the ranks that have them.
RecordFn = Callable[[int, tf.Tensor], None]


def _recording(sum_partials, level: int, record: RecordFn | None):
    if record is None:
        return sum_partials

    def summed(partials):
        partials = sum_partials(partials)
        record(level, partials)
        return partials

    return summed


def allreduce(
    comm: Communicator, flat: tf.Tensor, bucket: Bucket, rule: PairRule, record: RecordFn | None = None
) -> tf.Tensor:
    """Combines one bucket over all ranks; call on every rank with its buffer.

    Args:
      comm: this rank's communicator.
      flat: this rank's buffer, as made by `pack`.
      bucket: the buffer's layout (identical on every rank).
      rule: the pair rule, e.g. Adasum.
      record: optional; receives the partial sums a rule computes at each
        level (for diagnostics; no extra communication).

    Returns:
      The combined buffer, bitwise identical on every rank.
    """
    rank, size = comm.rank, comm.size
    flat = rule.prepare(flat, size)
    if size == 1:
        return flat
    leaves, folded = tree_shape(size)
    if rank < 2 * folded:
        if rank % 2:
            sent = comm.send(flat, rank - 1)
            return comm.recv(rank - 1, like=sent)
        pair = tf.stack([flat, comm.recv(rank + 1, like=flat)])
        flat = rule.combine(pair, bucket.segments(0, bucket.padded_length), _recording(tf.identity, 0, record))
        virtual = rank // 2
    else:
        virtual = rank - folded
    level = 1 if folded else 0

    lo, length = 0, bucket.padded_length
    bit = 1
    while bit < leaves:
        partner = _real_rank(virtual ^ bit, folded)
        half = length // 2
        swapped = comm.swap_halves(tf.reshape(flat, [2, half]), partner)
        if virtual & bit:
            lo += half
        length = half
        block_start = virtual & ~(2 * bit - 1)
        block = tuple(_real_rank(u, folded) for u in range(block_start, block_start + 2 * bit))
        sum_partials = lambda partials, block=block: comm.sum_float64(partials, block)  # noqa: E731
        flat = rule.combine(swapped, bucket.segments(lo, lo + length), _recording(sum_partials, level, record))
        bit <<= 1
        level += 1
    while bit > 1:
        bit >>= 1
        flat = comm.gather_pair(flat, _real_rank(virtual ^ bit, folded))

    if rank < 2 * folded:
        flat = comm.send(flat, rank + 1)
    return flat
