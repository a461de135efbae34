"""Which ranks meet at which level of the vector-halving tree of N ranks.

With ``leaves`` the largest power of two <= N and r = N - leaves
(`tf_adasum.reference.tree_shape`), ranks 2i and 2i+1 (i < r) are folded
first, and leaf v of the tree is real rank 2v (v < r) or v + r (`real_rank`).
Level k pairs leaf v with leaf ``v XOR 2^k``; a pair's float64 sums run over
the 2^(k+1) leaves of its two subtrees. `tf_adasum.tree.rvh` builds the tree
from these facts; the engines make their sub-communicators and diagnostics
from them.
"""

from __future__ import annotations

from tf_adasum.reference import tree_shape

__all__ = ["groups", "level_representatives", "num_levels", "pair", "real_rank", "sum_group"]


def real_rank(virtual: int, folded: int) -> int:
    """The rank standing for tree leaf `virtual`: 2v for folded pairs, else v + r."""
    return 2 * virtual if virtual < folded else virtual + folded


def pair(rank: int, peer: int) -> tuple[int, int]:
    """The pair of two ranks, the lower first (the pair's "member 0")."""
    return (rank, peer) if rank < peer else (peer, rank)


def sum_group(leaf: int, bit: int, folded: int) -> tuple[int, ...]:
    """The ranks over which the pair that tree leaf `leaf` belongs to at the
    level of `bit` (2^k) sums its float64 partials: the real ranks of the
    2 x `bit` leaves of its two subtrees, in leaf order."""
    start = leaf & ~(2 * bit - 1)
    return tuple(real_rank(u, folded) for u in range(start, start + 2 * bit))


def groups(num_ranks: int) -> list[tuple[int, ...]]:
    """Every rank group the collective uses for `num_ranks`, in a canonical order.

    The swap pairs of each level and the groups whose dot products are summed
    (the MPI engine makes one sub-communicator for each; the TF engine's
    partners are those a rank belongs to).
    """
    leaves, folded = tree_shape(num_ranks)
    result = [(2 * i, 2 * i + 1) for i in range(folded)]
    bit = 1
    while bit < leaves:
        for v in range(leaves):
            if not v & bit:
                result.append((real_rank(v, folded), real_rank(v | bit, folded)))
        for start in range(0, leaves, 2 * bit):
            result.append(sum_group(start, bit, folded))
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
        levels.append([real_rank(start, folded) for start in range(0, leaves, 2 * bit)])
        bit <<= 1
    return levels
