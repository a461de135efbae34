"""ADASUMRVH: the recursive vector-halving all-reduce, written once.

The driver runs against a small communicator per rank
(`tf_adasum.tree.communicator.Communicator`); each process calls it
once per bucket (a flat buffer laid out by `tf_adasum.tree.buckets`) with all
the ranks it holds, whose parts of the graph it builds together (see
`allreduce`). Beside it: the same tree over N buffers on one device
(`reduce_on_one_device`). Which ranks meet at which level is
`tf_adasum.tree.topology`; how this process's ranks reach their partners,
`tf_adasum.tree.exchanges`.

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

`allreduce` builds all of this process's ranks of a tree together, phase by
phase. Where a communicator allows it (`Communicator.direct`: the CPUs of one
process), an exchange between two of those ranks is no collective at all: a
rank reads its partner's tensor where it lies (TensorFlow hands a CPU tensor
to another CPU device of the same process without copying it), and a partial
sum over such ranks is a local sum of their partials, in member order.

Where a communicator moves the bytes itself (`Communicator.piece_bytes`: the
socket transport between worker processes), a level's half travels in
messages of about that size, and each piece's partials are computed as soon
as it has come, while the rest is on the wire; a rank adds its pieces'
partials in piece order (pairwise, as `tf_adasum.tree.exchanges.pairwise_sum` does), before they are
summed over the ranks, so the sum's order is fixed and the result is the same
whatever the arrival order. The level's combine then computes first the half
that the rank sends at the next level, whose exchange starts while it
combines the half it keeps. (Its float64 sums are added in another order than
a tree without pieces adds them: the results of the two may differ in the
last bit of an element, never between the ranks of one tree.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import tensorflow as tf

from tf_adasum.ops import BLOCK, Segments
from tf_adasum.reference import tree_shape, tree_with_blocks
from tf_adasum.tree.buckets import Bucket
from tf_adasum.tree.communicator import Communicator
from tf_adasum.tree.exchanges import Ranks, pairwise_sum
from tf_adasum.tree.topology import real_rank, sum_group

__all__ = ["PairRule", "RecordFn", "allreduce", "reduce_on_one_device"]


class PairRule(Protocol):
    """How two subtrees' values are combined (Adasum, or a plain sum)."""

    def prepare(self, flat: tf.Tensor, num_ranks: int) -> tf.Tensor:
        """Applied to each rank's buffer before the tree (e.g. 1/N for a mean)."""

    def partials(self, a: tf.Tensor, b: tf.Tensor, segments: Segments) -> tf.Tensor | None:
        """Float64 per-tensor partial sums of the slices `a` and `b` (``[m]``
        each) that the driver sums over every rank holding a slice of these
        two subtrees (so that a rule may use whole-tensor dot products), or
        None when the rule needs none. Sums, so the driver may also compute
        them over pieces of a slice and add those."""

    def combine(self, a: tf.Tensor, b: tf.Tensor, segments: Segments, partials: tf.Tensor | None) -> tf.Tensor:
        """Combines `a`, a slice of the left subtree's value, and `b`, the same
        slice of the right subtree's (``[m]`` each); returns ``[m]``. Elementwise
        given `partials`: the driver may combine a slice in pieces.
        `partials`: the sums of what `partials` returned, over the ranks
        holding these two subtrees (None where it returned None)."""


#: Called as ``record(level, partials)`` with a level's float64 ``[tensors, 3]``
#: whole-tensor partial sums [a.b, |a|^2, |b|^2], on the ranks that have them.
RecordFn = Callable[[int, tf.Tensor], None]


def _partials(ranks: Ranks, pieces: dict, blocks: dict, rule: PairRule, records, level: int) -> dict:
    """Per rank, the rule's partials of its pair, given as pieces
    ``[(a, b, segments), ...]`` (one per message it came in: each piece's
    partials are computed as soon as it has come, and added in piece order),
    summed over the rank's `blocks` of ranks (None: its own alone); None
    where the rule needs none."""
    comms = ranks.comms
    partials = {}
    for i, pair_pieces in pieces.items():
        with tf.device(comms[i].device):
            each = [rule.partials(a, b, segments) for a, b, segments in pair_pieces]
            partials[i] = None if each[0] is None else pairwise_sum(each)
    if any(p is not None for p in partials.values()):
        shared = {i: (p, blocks[i]) for i, p in partials.items() if blocks[i] is not None}
        partials = {**partials, **ranks.sum_float64(shared)}
        for i, p in partials.items():
            if records[i] is not None:
                with tf.device(comms[i].device):
                    records[i](level, p)
    return partials


def _in_pieces(comm: Communicator) -> bool:
    """Whether `comm` sends a level's halves in pieces (`Communicator.piece_bytes`)."""
    return getattr(comm, "piece_bytes", 0) > 0


def _cuts(length: int, itemsize: int, piece_bytes: int) -> list[int]:
    """Where a half of `length` elements (whole blocks) is cut into messages
    of about `piece_bytes` (at least one block each; none below two pieces)."""
    blocks = length // BLOCK
    count = max(1, min(blocks, length * itemsize // piece_bytes))
    return [blocks * k // count * BLOCK for k in range(1, count)]


@tf.autograph.experimental.do_not_convert  # builds a graph; plain Python, nothing for AutoGraph to convert
def allreduce(
    comms: Sequence[Communicator],
    flats: Sequence[tf.Tensor],
    bucket: Bucket,
    rule: PairRule,
    records: Sequence[RecordFn | None] | None = None,
) -> list[tf.Tensor]:
    """Combines one bucket over all ranks; called once in every process, with
    the communicators of the ranks it holds and their buffers.

    Args:
      comms: this process's ranks' communicators: several ranks of one tree,
        or one rank each of several trees of the same size (then all with the
        same rank, as in the hierarchical cross-worker scope).
      flats: each rank's buffer, as made by `tf_adasum.tree.buckets.pack`.
      bucket: the buffers' layout (identical on every rank).
      rule: the pair rule, e.g. Adasum.
      records: optional, per rank; receives the partial sums a rule computes
        at each level (for diagnostics; no extra communication).

    Returns:
      Each given rank's combined buffer, bitwise identical on every rank.
    """
    ranks = Ranks(comms)
    records = list(records) if records is not None else [None] * len(comms)
    size = comms[0].size
    flats = list(flats)
    for i, comm in enumerate(comms):
        with tf.device(comm.device):
            flats[i] = rule.prepare(flats[i], size)
    if size == 1:
        return flats
    leaves, folded = tree_shape(size)
    rank_of = [comm.rank for comm in comms]

    # The fold: rank 2i + 1 (i < r) hands its buffer to rank 2i.
    folds = [i for i, rank in enumerate(rank_of) if rank < 2 * folded]
    sends = {i: (flats[i], rank_of[i] - 1) for i in folds if rank_of[i] % 2}
    recvs = {i: (rank_of[i] + 1, flats[i]) for i in folds if not rank_of[i] % 2}
    sent, received = ranks.transfer(sends, recvs)
    if received:
        whole = bucket.segments(0, bucket.padded_length)
        partials = _partials(
            ranks, {i: [(flats[i], b, whole)] for i, b in received.items()}, dict.fromkeys(received), rule, records, 0
        )
        for i, b in received.items():
            with tf.device(comms[i].device):
                flats[i] = rule.combine(flats[i], b, whole, partials[i])

    tree = [i for i in range(len(comms)) if i not in sends]
    virtual = {i: rank_of[i] // 2 if rank_of[i] < 2 * folded else rank_of[i] - folded for i in tree}
    level = 1 if folded else 0
    lo, length = dict.fromkeys(tree, 0), bucket.padded_length
    # Ranks whose communicator sends a level's half in pieces (`_in_pieces`),
    # and their slices kept as two halves (`halves`) where the last level
    # combined them so, the half sent next first.
    piecewise = {i for i in tree if _in_pieces(comms[i])}
    halves = {}
    bit = 1
    while bit < leaves:
        half = length // 2
        partner = {i: real_rank(virtual[i] ^ bit, folded) for i in tree}
        upper = {i: int(bool(virtual[i] & bit)) for i in tree}  # also this rank's index in its pair
        outgoing = {}
        for i in (i for i in tree if i not in piecewise):  # in tree order: the order of the chained calls
            with tf.device(comms[i].device):
                outgoing[i] = (tf.reshape(flats[i], [2, half]), partner[i])
        swapped = ranks.swap_halves(outgoing)
        pieces = {i: [(*swapped[i], None)] for i in swapped}
        for i in (i for i in tree if i in piecewise):
            with tf.device(comms[i].device):
                lower_upper = halves.pop(i, None) or (flats[i][:half], flats[i][half:])
                cuts = _cuts(half, flats[i].dtype.size, comms[i].piece_bytes)
                kept, received, whole = comms[i].swap_in_pieces(
                    lower_upper[1 - upper[i]], lower_upper[upper[i]], partner[i], cuts
                )
                kept_pieces = [kept[start:end] for start, end in zip([0, *cuts], [*cuts, half])]
            ordered = zip(kept_pieces, received) if upper[i] == 0 else zip(received, kept_pieces)
            swapped[i] = (kept, whole) if upper[i] == 0 else (whole, kept)
            pieces[i] = [(a, b, (start, end)) for (a, b), start, end in zip(ordered, [0, *cuts], [*cuts, half])]
        length = half
        segments, blocks = {}, {}
        for i in tree:
            lo[i] += half * upper[i]
            segments[i] = bucket.segments(lo[i], lo[i] + length)
            pieces[i] = [
                (a, b, segments[i] if at is None else bucket.segments(lo[i] + at[0], lo[i] + at[1]))
                for a, b, at in pieces[i]
            ]
            blocks[i] = sum_group(virtual[i], bit, folded)
        partials = _partials(ranks, pieces, blocks, rule, records, level)
        bit <<= 1
        level += 1
        for i in tree:
            a, b = swapped[i]
            with tf.device(comms[i].device):
                if i not in piecewise or bit >= leaves:
                    flats[i] = rule.combine(a, b, segments[i], partials[i])
                    continue
                # The half this rank sends at the next level first, then the one it keeps.
                h, send = length // 2, 1 - int(bool(virtual[i] & bit))
                bounds = [(0, h), (h, length)]
                out = [None, None]
                for j in (send, 1 - send):
                    start, end = bounds[j]
                    with tf.control_dependencies([] if out[send] is None else [out[send]]):
                        out[j] = rule.combine(
                            a[start:end], b[start:end], bucket.segments(lo[i] + start, lo[i] + end), partials[i]
                        )
                halves[i] = tuple(out)
    while bit > 1:
        bit >>= 1
        gathered = ranks.gather_pair({i: (flats[i], real_rank(virtual[i] ^ bit, folded)) for i in tree})
        for i, flat in gathered.items():
            flats[i] = flat

    # The unfold: rank 2i hands the result back to rank 2i + 1.
    back_sends = {i: (flats[i], rank_of[i] + 1) for i in recvs}
    back_recvs = {i: (rank_of[i] - 1, sent[i]) for i in sends}
    back_sent, back_received = ranks.transfer(back_sends, back_recvs)
    for i, flat in {**back_sent, **back_received}.items():
        flats[i] = flat
    return flats


def reduce_on_one_device(
    flats: Sequence[tf.Tensor],
    bucket: Bucket,
    rule: PairRule,
    num_ranks: int | None = None,
    first: int = 0,
    gather: Callable[[tf.Tensor], tf.Tensor] | None = None,
) -> tf.Tensor:
    """The tree of `allreduce` over N buffers that all live on one device, one
    pair at a time over whole buffers: nothing travels, so nothing is halved,
    and the graph holds the tree's N - 1 pair combines instead of every rank's
    program (`tf_adasum.engines.simulated`). The same pairs in the same order
    (`tf_adasum.reference.tree_reduce`, the fold included) and the same kernels
    as `allreduce`. Precision: a pair's float64 partial sums are accumulated
    over the whole buffer at once rather than slice by slice and then summed,
    so its coefficients may differ from `allreduce`'s in the last bits of a
    float64, and a result, rarely, in the last bit of its dtype.

    Spread over processes: `flats` may be one block of the tree's `num_ranks`
    buffers, ranks ``first .. first + b - 1`` (b one of
    `tf_adasum.reference.block_sizes`); then this device computes the block's
    subtree and ``gather(value)`` (``[num_ranks / b, padded_length]``: every
    block's value in rank order, the same on every process) brings the others'
    for the levels above, which every process computes alike. The pairs and
    their operands do not depend on b, so neither does the result, bit for bit
    (`tf_adasum.reference.tree_with_blocks`)."""
    size = num_ranks or len(flats)
    whole = bucket.segments(0, bucket.padded_length)

    def pair(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        # EnsureShape keeps each pair's result a node of its own: Grappler's
        # arithmetic optimizer would otherwise merge a tree of plain sums on
        # one device into one AddN and add in another order (measured: 47% of
        # the elements of an 8-leaf float32 tree differed in the last bit).
        return tf.ensure_shape(rule.combine(a, b, whole, rule.partials(a, b, whole)), a.shape)

    blocks = None if gather is None else (lambda value: tf.unstack(gather(value)))  # noqa: E731
    prepared = [rule.prepare(flat, size) for flat in flats]
    return tree_with_blocks(prepared, pair, size, first, blocks)
