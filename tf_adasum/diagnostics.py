"""Per-tensor statistics of one combine, for `tf_adasum.AdasumDiagnostics`.

Computed from what every replica already holds after a combine: its local
delta, the combined result, and the float64 partial sums [a.b, |a|^2, |b|^2]
the Adasum tree computed at each level. Everything is float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tf_adasum import ops, rvh

__all__ = ["LEVEL_STATS", "TENSOR_STATS", "columns", "statistics"]

#: Per-tensor statistics, in column order; then, per tree level (the
#: non-power-of-two fold first), `LEVEL_STATS` with a ``levelk/`` prefix.
TENSOR_STATS = ("delta_norm_min", "delta_norm_mean", "delta_norm_max", "combined_norm", "orthogonality")
LEVEL_STATS = tuple(f"{q}_{s}" for q in ("cos", "coef_a", "coef_b") for s in ("min", "mean", "max"))


def columns(num_replicas: int, with_levels: bool) -> list[str]:
    """The statistics' names, in column order."""
    levels = rvh.num_levels(num_replicas) if with_levels else 0
    return list(TENSOR_STATS) + [f"level{k}/{q}" for k in range(levels) for q in LEVEL_STATS]


def _min_mean_max(x: tf.Tensor) -> list[tf.Tensor]:
    return [tf.reduce_min(x, 0), tf.reduce_mean(x, 0), tf.reduce_max(x, 0)]


def _safe_divide(numerator: tf.Tensor, denominator: tf.Tensor, otherwise: float) -> tf.Tensor:
    positive = denominator > 0
    return tf.where(positive, numerator / tf.where(positive, denominator, 1.0), otherwise)


def statistics(
    deltas: Sequence[Sequence[tf.Tensor]],
    combined: Sequence[tf.Tensor],
    partials: Sequence[tf.Tensor],
    with_levels: bool,
) -> tf.Tensor:
    """The ``[tensors, len(columns)]`` float64 statistics of one combine.

    Args:
      deltas: ``deltas[r][t]``: replica r's value of tensor t (before the combine).
      combined: ``combined[t]``: the combined tensor t.
      partials: per replica, its ``[levels, tensors, 3]`` partial sums (see
        `AdasumCrossDeviceOps.batch_reduce_combine(with_partials=True)`).
      with_levels: add the per-level pair statistics (Adasum only).
    """
    square = lambda x: tf.reduce_sum(tf.square(tf.cast(x, tf.float64)))  # noqa: E731
    delta_sq = tf.stack([tf.stack([square(x) for x in replica]) for replica in deltas])  # [N, T]
    combined_sq = tf.stack([square(x) for x in combined])  # [T]
    result = _min_mean_max(tf.sqrt(delta_sq)) + [
        tf.sqrt(combined_sq),
        _safe_divide(combined_sq, tf.reduce_sum(delta_sq, axis=0), 1.0),
    ]
    if with_levels:
        held = tf.stack(partials)  # [N, levels, T, 3]
        for level, ranks in enumerate(rvh.level_representatives(len(partials))):
            pairs = tf.gather(held[:, level], ranks)  # [pairs, T, 3]
            dot, a_sq, b_sq = tf.unstack(pairs, axis=-1)
            cos = _safe_divide(dot, tf.sqrt(a_sq * b_sq), 0.0)
            for quantity in (cos, *ops.coefficients(pairs)):
                result += _min_mean_max(quantity)
    return tf.stack(result, axis=1)
