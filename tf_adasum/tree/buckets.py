"""Bucket fusion: the tensors of one combine packed into flat buffers.

The tree (`tf_adasum.tree.rvh`) combines one flat buffer at a time. A
`Bucket` is that buffer's layout: tensors of one dtype, in order, each
starting on a block boundary (`tf_adasum.ops.BLOCK`) and owning whole blocks,
the buffer a whole number of blocks per tree leaf, so that every slice the
vector halving makes holds whole blocks of single tensors. `make_buckets`
fuses a list of tensors into buckets (a large tensor that needs no padding
travels alone, with no copy); `pack` and `unpack` move tensors into and out
of a bucket's buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from tf_adasum.ops import BLOCK, Segments
from tf_adasum.reference import tree_shape

__all__ = ["ALONE_BYTES", "Bucket", "make_buckets", "pack", "unpack"]


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
