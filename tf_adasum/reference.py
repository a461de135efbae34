"""The executable specification of Adasum, in numpy and float64.

Every TensorFlow and MPI path in tf_adasum is tested against this module. It
imports nothing but numpy.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation",
MLSys 2021) combines two updates ``a`` and ``b`` of the same tensor as::

    Adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b

Orthogonal updates add up, identical updates are averaged (``Adasum(a, a) = a``).

Precision: all dot products, coefficients and the scaled sums are computed in
float64; the result is cast to the input dtype once, at the very end.

References:
  Maleki, Musuvathi, Mytkowicz, Saarikivi, Xu, Eksarevskiy, Ekanayake, Barsoum.
  "Scaling Distributed Training with Adaptive Summation." MLSys 2021,
  arXiv:2006.02924.

Examples:
  >>> import numpy as np
  >>> from tf_adasum import reference
  >>> reference.adasum_pair(np.array([1.0, 0.0]), np.array([0.0, 2.0]))  # orthogonal: the sum
  array([1., 2.])
  >>> reference.adasum_pair(np.array([3.0, 4.0]), np.array([3.0, 4.0]))  # identical: the average
  array([3., 4.])
  >>> per_rank = [[np.array([1.0, 0.0, 0.0])], [np.array([0.0, 2.0, 0.0])], [np.array([0.0, 0.0, 3.0])]]
  >>> reference.adasum_tree(per_rank)  # 3 ranks, one tensor each: A(A(0, 1), 2)
  [array([1., 2., 3.])]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

#: A coefficient is exactly 1 when the squared norm it divides by is below this
#: value, sqrt(DBL_MIN) ~ 1.49e-154, so ``Adasum(0, b) == b``. No epsilon is used.
NORM_GUARD = float(np.sqrt(np.finfo(np.float64).tiny))

#: The floating dtypes Adasum accepts, by name (numpy has no native bfloat16;
#: arrays of ``ml_dtypes.bfloat16`` are accepted).
FLOAT_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")

PairFn = Callable[[np.ndarray, np.ndarray], np.ndarray]

__all__ = [
    "NORM_GUARD",
    "adacons",
    "adasum_coefficients",
    "adasum_pair",
    "adasum_tree",
    "mean",
    "sum_",
    "block_sizes",
    "tree_reduce",
    "tree_shape",
    "tree_with_blocks",
]


def _check_float_array(x: np.ndarray, name: str) -> None:
    if np.dtype(x.dtype).name not in FLOAT_DTYPE_NAMES:
        raise TypeError(
            f"`{name}` must have a floating dtype ({', '.join(FLOAT_DTYPE_NAMES)}). "
            f"Received: {name}.dtype={np.dtype(x.dtype).name}"
        )


def adasum_coefficients(dot: float, a_norm_sq: float, b_norm_sq: float) -> tuple[float, float]:
    """Returns the two Adasum coefficients for given float64 partial sums.

    Args:
      dot: ``a.b``.
      a_norm_sq: ``|a|^2``.
      b_norm_sq: ``|b|^2``.

    Returns:
      ``(1 - dot / (2 |a|^2), 1 - dot / (2 |b|^2))``, where a coefficient is
      exactly 1 when its squared norm is below `NORM_GUARD`.

    Examples:
      >>> from tf_adasum.reference import adasum_coefficients
      >>> adasum_coefficients(dot=1.0, a_norm_sq=1.0, b_norm_sq=2.0)  # a = [1, 0], b = [1, 1]
      (0.5, 0.75)
      >>> adasum_coefficients(dot=0.0, a_norm_sq=0.0, b_norm_sq=4.0)  # a = 0: Adasum(0, b) = b
      (1.0, 1.0)
    """
    a_coeff = 1.0 if a_norm_sq < NORM_GUARD else 1.0 - dot / (2.0 * a_norm_sq)
    b_coeff = 1.0 if b_norm_sq < NORM_GUARD else 1.0 - dot / (2.0 * b_norm_sq)
    return a_coeff, b_coeff


def _adasum_pair64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a_flat, b_flat = a.ravel(), b.ravel()
    a_coeff, b_coeff = adasum_coefficients(
        float(np.dot(a_flat, b_flat)), float(np.dot(a_flat, a_flat)), float(np.dot(b_flat, b_flat))
    )
    return a_coeff * a + b_coeff * b


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two arrays of the same shape and floating dtype.

    Args:
      a: the left operand.
      b: the right operand; same shape and dtype as `a`.

    Returns:
      ``Adasum(a, b)``, computed in float64 and cast to the dtype of `a`.

    Examples:
      >>> import numpy as np
      >>> from tf_adasum.reference import adasum_pair
      >>> adasum_pair(np.array([1.0, 0.0]), np.array([0.0, 2.0]))  # orthogonal: the sum
      array([1., 2.])
      >>> adasum_pair(np.array([3.0, 4.0]), np.array([3.0, 4.0]))  # identical: the average
      array([3., 4.])
      >>> adasum_pair(np.array([1.0, 0.0]), np.array([1.0, 1.0]))  # 0.5 a + 0.75 b
      array([1.25, 0.75])
      >>> adasum_pair(np.array([1.0, 0.0], np.float32), np.array([0.0, 2.0], np.float32)).dtype
      dtype('float32')
    """
    a, b = np.asarray(a), np.asarray(b)
    _check_float_array(a, "a")
    _check_float_array(b, "b")
    if a.dtype != b.dtype:
        raise TypeError(f"`a` and `b` must have the same dtype. Received: a.dtype={a.dtype}, b.dtype={b.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"`a` and `b` must have the same shape. Received: a.shape={a.shape}, b.shape={b.shape}")
    return _adasum_pair64(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype)


def tree_shape(num_ranks: int) -> tuple[int, int]:
    """Returns ``(leaves, folded_pairs)`` of the Adasum tree over `num_ranks`.

    ``leaves`` is the largest power of two not above `num_ranks`; the first
    ``2 * folded_pairs`` ranks are first combined in pairs (0, 1), (2, 3), ...
    so that exactly ``leaves`` values enter the binary tree.

    Examples:
      >>> from tf_adasum.reference import tree_shape
      >>> tree_shape(8)
      (8, 0)
      >>> tree_shape(6)  # (0, 1) and (2, 3) folded first, then a tree of 4
      (4, 2)
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)):
        raise TypeError(f"`num_ranks` must be an int. Received: num_ranks={num_ranks!r}")
    if num_ranks < 1:
        raise ValueError(f"`num_ranks` must be >= 1. Received: num_ranks={num_ranks}")
    num_ranks = int(num_ranks)
    leaves = 1 << (num_ranks.bit_length() - 1)
    return leaves, num_ranks - leaves


def tree_reduce(values: Sequence[np.ndarray], pair: PairFn) -> np.ndarray:
    """Reduces `values` (one per rank, in rank order) with `pair` as Adasum's tree.

    For N = 2^p, level k pairs rank i with i XOR 2^k. Otherwise the first
    2r ranks (r = N - 2^p) are first folded in pairs (0, 1), ..., (2r-2, 2r-1),
    and the r results followed by ranks 2r..N-1 form the 2^p leaves.

    Examples:
      A `pair` that writes its operands shows the tree:

      >>> from tf_adasum.reference import tree_reduce
      >>> pair = lambda a, b: f"A({a}, {b})"
      >>> tree_reduce(["0", "1", "2"], pair)
      'A(A(0, 1), 2)'
      >>> tree_reduce(["0", "1", "2", "3", "4", "5"], pair)
      'A(A(A(0, 1), A(2, 3)), A(4, 5))'
    """
    values = list(values)
    _, folded = tree_shape(len(values))
    level = [pair(values[2 * i], values[2 * i + 1]) for i in range(folded)] + values[2 * folded :]
    while len(level) > 1:
        level = [pair(level[2 * i], level[2 * i + 1]) for i in range(len(level) // 2)]
    return level[0]


def _leaves(node) -> list[int]:
    return [node] if isinstance(node, int) else _leaves(node[0]) + _leaves(node[1])


def _subtree(node, start: int, stop: int):
    """The node of the tree `node` whose leaves are exactly ``start .. stop - 1`` (None: no such node)."""
    if _leaves(node) == list(range(start, stop)):
        return node
    if isinstance(node, int):
        return None
    for child in node:
        found = _subtree(child, start, stop)
        if found is not None:
            return found
    return None


def _nested(num_ranks: int):
    """Adasum's tree over `num_ranks` as nested pairs of ranks, e.g. ((0, 1), 2) for 3."""
    return tree_reduce(list(range(num_ranks)), lambda a, b: (a, b))


def block_sizes(num_ranks: int) -> list[int]:
    """Every block size b dividing `num_ranks` for which each run of b
    consecutive ranks ``[p*b, (p+1)*b)`` is a whole subtree of Adasum's tree
    over `num_ranks` (so the tree is the tree of those blocks' values: the
    lower levels inside each block, the upper ones across blocks; see
    `tree_with_blocks`). Every divisor when `num_ranks` is a power of two.

    Examples:
      >>> from tf_adasum.reference import block_sizes
      >>> block_sizes(8)
      [1, 2, 4, 8]
      >>> block_sizes(6)  # the tree A(A(A(0, 1), A(2, 3)), A(4, 5)) has no blocks of 3
      [1, 2, 6]
    """
    nested = _nested(num_ranks)
    return [b for b in range(1, num_ranks + 1) if _is_block_size(nested, num_ranks, b)]


def _is_block_size(nested, num_ranks: int, size: int) -> bool:
    if size == num_ranks:
        return True
    return num_ranks % size == 0 and all(_subtree(nested, p, p + size) is not None for p in range(0, num_ranks, size))


def tree_with_blocks(
    values: Sequence[np.ndarray], pair: PairFn, num_ranks: int, first: int, blocks: Callable | None = None
) -> np.ndarray:
    """`tree_reduce` over `num_ranks` ranks of which `values` are ranks
    ``first .. first + b - 1`` (b = len(values), one of `block_sizes`):

    * `blocks` None: returns their block's subtree value (every pair inside it, as `tree_reduce` pairs them);
    * else ``blocks(value)`` must return every block's subtree value, in
      rank order, given this one's (an all-gather across the processes holding
      the blocks); returns the whole tree's value, the upper levels paired over
      those block values as `tree_reduce` pairs them.

    The same pairs with the same operands as `tree_reduce` over all
    `num_ranks` values, so the same result, bit for bit, with a deterministic
    `pair`, whatever b is.

    Examples:
      The process holding ranks 4 and 5 of 6 (blocks of 2), with a `pair`
      that writes its operands:

      >>> from tf_adasum.reference import tree_with_blocks
      >>> pair = lambda a, b: f"A({a}, {b})"
      >>> tree_with_blocks(["4", "5"], pair, num_ranks=6, first=4)
      'A(4, 5)'
      >>> gather = lambda own: ["A(0, 1)", "A(2, 3)", own]  # every block's value, as an all-gather returns them
      >>> tree_with_blocks(["4", "5"], pair, num_ranks=6, first=4, blocks=gather)
      'A(A(A(0, 1), A(2, 3)), A(4, 5))'
    """
    size = len(values)
    nested = _nested(num_ranks)
    if not _is_block_size(nested, num_ranks, size) or first % size:
        raise ValueError(
            f"Ranks {first}..{first + size - 1} of {num_ranks} are not one block of the tree (block sizes: "
            f"{block_sizes(num_ranks)}, starting at a multiple of the size)"
        )
    known: dict[tuple[int, int], np.ndarray] = {}

    def evaluate(node, leaf):
        leaves = _leaves(node)
        span = (leaves[0], leaves[-1] + 1)
        if span in known:
            return known[span]
        if isinstance(node, int):
            return leaf(node)
        return pair(evaluate(node[0], leaf), evaluate(node[1], leaf))

    own = evaluate(_subtree(nested, first, first + size), lambda rank: values[rank - first])
    if blocks is None or size == num_ranks:
        return own
    for p, value in enumerate(blocks(own)):
        known[(p * size, (p + 1) * size)] = value
    return evaluate(nested, None)


def _per_tensor(per_rank: Sequence[Sequence[np.ndarray]]) -> list[list[np.ndarray]]:
    """Validates `per_rank` and returns, per tensor, its values in rank order."""
    if len(per_rank) == 0:
        raise ValueError("`per_rank` must hold at least one rank. Received: per_rank=[]")
    per_rank = [[np.asarray(t) for t in rank] for rank in per_rank]
    num_tensors = len(per_rank[0])
    for r, rank in enumerate(per_rank):
        if len(rank) != num_tensors:
            raise ValueError(
                f"Every rank must hold the same number of tensors. Received: rank 0 has "
                f"{num_tensors}, rank {r} has {len(rank)}"
            )
        for t, (x, x0) in enumerate(zip(rank, per_rank[0])):
            _check_float_array(x, f"per_rank[{r}][{t}]")
            if x.dtype != x0.dtype or x.shape != x0.shape:
                raise ValueError(
                    f"Tensor {t} differs across ranks. Received: rank 0 has {x0.dtype}{list(x0.shape)}, "
                    f"rank {r} has {x.dtype}{list(x.shape)}"
                )
    return [[rank[t] for rank in per_rank] for t in range(num_tensors)]


def adasum_tree(per_rank: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """Adasum over N ranks, tensor by tensor, in float64.

    Args:
      per_rank: ``per_rank[r]`` is the list of tensors of rank r; every rank has
        the same number of tensors with the same shapes and dtypes.

    Returns:
      One array per tensor: the Adasum tree (see `tree_reduce`) of that tensor's
      values over the ranks, computed in float64 and cast to its dtype once.

    Examples:
      Two ranks, two tensors each (a kernel and a bias): each tensor is
      combined on its own.

      >>> import numpy as np
      >>> from tf_adasum.reference import adasum_tree
      >>> rank_0 = [np.array([1.0, 0.0]), np.array([2.0])]
      >>> rank_1 = [np.array([0.0, 1.0]), np.array([2.0])]
      >>> adasum_tree([rank_0, rank_1])
      [array([1., 1.]), array([2.])]
    """
    return [
        tree_reduce([x.astype(np.float64) for x in values], _adasum_pair64).astype(values[0].dtype)
        for values in _per_tensor(per_rank)
    ]


def sum_(per_rank: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """The plain sum over ranks, per tensor, in float64, cast once at the end.

    Examples:
      >>> import numpy as np
      >>> from tf_adasum.reference import sum_
      >>> sum_([[np.array([1.0, 0.0]), np.array([2.0])], [[0.0, 1.0], [2.0]]])
      [array([1., 1.]), array([4.])]
    """
    return [
        np.sum([x.astype(np.float64) for x in values], axis=0).astype(values[0].dtype)
        for values in _per_tensor(per_rank)
    ]


def mean(per_rank: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """The plain mean over ranks (sum / N), per tensor, in float64, cast once.

    Examples:
      >>> import numpy as np
      >>> from tf_adasum.reference import mean
      >>> mean([[np.array([1.0, 0.0]), np.array([2.0])], [[0.0, 1.0], [2.0]]])
      [array([0.5, 0.5]), array([2.])]
    """
    return [
        (np.sum([x.astype(np.float64) for x in values], axis=0) / len(values)).astype(values[0].dtype)
        for values in _per_tensor(per_rank)
    ]


# -- AdaCons ---------------------------------------------------------------------------

ADACONS_EPS = 1e-8


def adacons(
    per_rank: Sequence[Sequence[np.ndarray]],
    state: dict | None = None,
    momentum: float = 0.0,
    restore_magnitude: bool = False,
    per_tensor: bool = False,
) -> tuple[list[np.ndarray], dict]:
    """AdaCons (Choukroun, Azoulay, Kisilev 2024, arXiv:2411.03742), in float64.

    For updates g_i (all tensors of a rank together, or each tensor on its own
    with `per_tensor`): s = sum_i g_i; alpha_i = <g_i, s> / (N (|g_i| + eps));
    the alphas sorted ascending (stable) give v; m = v on the first step, else
    momentum * m + (1 - momentum) * v; the replica with the k-th smallest alpha
    gets m[k]; w = that / its sum (plain averaging when the sum is not a
    positive finite number); the result is sum_i w_i / (|g_i| + eps) g_i,
    rescaled to |s / N| with `restore_magnitude`. Identical g_i give g / |g|.

    Args:
      per_rank: ``per_rank[r]`` is the list of tensors of rank r.
      state: the previous call's returned state, or None for the first step.
      momentum: the subspace momentum beta in [0, 1).
      restore_magnitude: rescale the result to the norm of the mean update.
      per_tensor: one set of weights per tensor instead of one for the model.

    Returns:
      ``(result, state)``: one array per tensor (cast to its dtype), and the
      new state ``{"m": momentum values, "steps": int, "fallbacks": int,
      "weights": the weights used}``.

    Examples:
      Two replicas with orthogonal updates of one tensor: the larger update,
      which agrees more with their sum, gets the larger weight.

      >>> import numpy as np
      >>> from tf_adasum.reference import adacons
      >>> per_rank = [[np.array([1.0, 0.0])], [np.array([0.0, 2.0])]]
      >>> result, state = adacons(per_rank)
      >>> state["weights"].round(4)
      array([[0.3333, 0.6667]])
      >>> result[0].round(4)  # sum_i w_i g_i / |g_i|
      array([0.3333, 0.6667])
      >>> result, state = adacons(per_rank, state, momentum=0.9, restore_magnitude=True)
      >>> state["steps"], round(float(np.linalg.norm(result[0])), 4)  # |mean update| = |[0.5, 1]|
      (2, 1.118)
    """
    values = _per_tensor(per_rank)  # values[t][r]
    n = len(per_rank)
    groups = [[t] for t in range(len(values))] if per_tensor else [list(range(len(values)))]
    state = dict(state) if state else {"m": None, "steps": 0, "fallbacks": 0}
    new_m, weights_used, result = [], [], [None] * len(values)
    for group_index, group in enumerate(groups):
        g = [[values[t][r].astype(np.float64).ravel() for t in group] for r in range(n)]
        s = [sum(g[r][j] for r in range(n)) for j in range(len(group))]
        norms = np.array([np.sqrt(sum(np.dot(x, x) for x in g[r])) for r in range(n)])
        alpha = np.array([sum(np.dot(x, y) for x, y in zip(g[r], s)) for r in range(n)]) / (n * (norms + ADACONS_EPS))
        order = np.argsort(alpha, kind="stable")
        v = alpha[order]
        m = v if state["m"] is None else momentum * np.asarray(state["m"])[group_index] + (1 - momentum) * v
        out = np.empty(n)
        out[order] = m
        total = out.sum()
        if np.isfinite(total) and total > 0:
            w = out / total
        else:
            w = np.full(n, 1.0 / n)
            state["fallbacks"] += 1
        coefficients = w / (norms + ADACONS_EPS)
        combined = [sum(coefficients[r] * g[r][j] for r in range(n)) for j in range(len(group))]
        if restore_magnitude:
            target = np.sqrt(sum(np.dot(x, x) for x in s)) / n
            current = np.sqrt(sum(np.dot(x, x) for x in combined))
            combined = [x * (target / current if current > 0 else 0.0) for x in combined]
        for j, t in enumerate(group):
            result[t] = combined[j].reshape(values[t][0].shape).astype(values[t][0].dtype)
        new_m.append(m)
        weights_used.append(w)
    state.update(m=np.array(new_m), steps=state["steps"] + 1, weights=np.array(weights_used))
    return result, state
