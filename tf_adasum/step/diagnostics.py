"""Per-tensor statistics of one combine, for `tf_adasum.AdasumDiagnostics`.

Computed from what the replicas already hold after a combine: their local
deltas, the combined result, and the float64 partial sums [a.b, |a|^2, |b|^2]
the Adasum tree computed at each level. Across processes one tiny gather
(`Engine.gather_small`: N x (T + 3 T levels) float64 numbers) brings every
replica's squared delta norms and partials to every replica; nothing else is
exchanged. Everything is float64.

`Recorder` holds the optimizer's diagnostics variable (never checkpointed)
and writes the statistics of each combine into it.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tf_adasum import ops
from tf_adasum.engines.base import Engine
from tf_adasum.tree import topology

__all__ = ["LEVEL_STATS", "TENSOR_STATS", "Recorder", "columns", "statistics"]

#: Per-tensor statistics, in column order; then, per tree level (the
#: non-power-of-two fold first), `LEVEL_STATS` with a ``levelk/`` prefix.
#: ``delta_sq_sum`` is sum_i |delta_i|^2, so that model-level figures can be
#: weighted by squared norms.
TENSOR_STATS = (
    "delta_norm_min",
    "delta_norm_mean",
    "delta_norm_max",
    "combined_norm",
    "orthogonality",
    "delta_sq_sum",
)
LEVEL_STATS = tuple(f"{q}_{s}" for q in ("cos", "coef_a", "coef_b") for s in ("min", "mean", "max"))


def columns(num_replicas: int, with_levels: bool) -> list[str]:
    """The statistics' names, in column order."""
    levels = topology.num_levels(num_replicas) if with_levels else 0
    return list(TENSOR_STATS) + [f"level{k}/{q}" for k in range(levels) for q in LEVEL_STATS]


def _min_mean_max(x: tf.Tensor) -> list[tf.Tensor]:
    return [tf.reduce_min(x, 0), tf.reduce_mean(x, 0), tf.reduce_max(x, 0)]


def _safe_divide(numerator: tf.Tensor, denominator: tf.Tensor, otherwise: float) -> tf.Tensor:
    positive = denominator > 0
    return tf.where(positive, numerator / tf.where(positive, denominator, 1.0), otherwise)


def statistics(delta_sq: tf.Tensor, combined_sq: tf.Tensor, partials: tf.Tensor, with_levels: bool) -> tf.Tensor:
    """The ``[tensors, len(columns)]`` float64 statistics of one combine.

    Args:
      delta_sq: ``[N, T]``: replica r's squared norm of tensor t (before the combine).
      combined_sq: ``[T]``: the squared norm of the combined tensor t.
      partials: ``[N, levels, T, 3]``: every replica's partial sums (see
        `tf_adasum.engines.base.Engine.combine` with ``with_partials``).
      with_levels: add the per-level pair statistics (Adasum only).
    """
    delta_total = tf.reduce_sum(delta_sq, axis=0)
    result = _min_mean_max(tf.sqrt(delta_sq)) + [
        tf.sqrt(combined_sq),
        _safe_divide(combined_sq, delta_total, 1.0),
        delta_total,
    ]
    if with_levels:
        for level, ranks in enumerate(topology.level_representatives(int(delta_sq.shape[0]))):
            pairs = tf.gather(partials[:, level], ranks)  # [pairs, T, 3]
            dot, a_sq, b_sq = tf.unstack(pairs, axis=-1)
            cos = _safe_divide(dot, tf.sqrt(a_sq * b_sq), 0.0)
            for quantity in (cos, *ops.coefficients(pairs)):
                result += _min_mean_max(quantity)
    return tf.stack(result, axis=1)


def _squares(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    return tf.stack([tf.reduce_sum(tf.square(tf.cast(x, tf.float64))) for x in tensors])


class Recorder:
    """The diagnostics of an optimizer: off until `enable`; then each combine's
    statistics land in `variable` (``[tensors, columns]`` float64).

    Every replica (every process) must record, since `record` gathers.
    """

    def __init__(self):
        self.enabled = False
        self.variable: tf.Variable | None = None
        self.num_replicas = 1
        self.with_levels = False

    def create(self, strategy, num_tensors: int, num_replicas: int, with_levels: bool) -> None:
        """Makes the variable (NaN until the first combine)."""
        self.num_replicas, self.with_levels = num_replicas, with_levels
        width = len(self.columns())
        with strategy.scope(), tf.init_scope():
            self.variable = tf.Variable(
                tf.fill([num_tensors, width], tf.constant(float("nan"), tf.float64)),
                dtype=tf.float64,
                trainable=False,
                name="adasum_diagnostics",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )

    def columns(self) -> list[str]:
        return columns(self.num_replicas, self.with_levels)

    def read(self, names: list[str]) -> dict[str, dict[str, float]]:
        """The latest statistics, ``{name: {column: value}}`` (one name per tensor)."""
        if self.variable is None:
            raise ValueError("Diagnostics are not enabled: attach a tf_adasum.AdasumDiagnostics callback.")
        return {name: dict(zip(self.columns(), map(float, row))) for name, row in zip(names, self.variable.numpy())}

    def record(self, engine: Engine, per_replica: Sequence, combined: Sequence, partials, rows: Sequence[int]) -> None:
        """Cross-replica context: statistics of one combine of `per_replica`
        values into `combined`, with the tree's per-replica `partials`, written
        to the variable's `rows` (one per value: the tensors a step updates may
        be a subset; the other rows keep their last statistics)."""
        num_tensors = len(per_replica)
        levels = topology.num_levels(self.num_replicas) if self.with_levels else 0
        strategy = engine.strategy

        def local_row(*args):
            deltas, held = args[:num_tensors], args[num_tensors]
            held = held[:levels] if levels else tf.zeros([0, num_tensors, 3], tf.float64)
            return tf.concat([_squares(deltas), tf.reshape(held, [-1])], axis=0)

        gathered = engine.gather_small(
            strategy.extended.call_for_each_replica(local_row, args=(*per_replica, partials))
        )
        delta_sq = gathered[:, :num_tensors]
        held = tf.reshape(gathered[:, num_tensors:], [self.num_replicas, levels, num_tensors, 3])
        combined_sq = _squares([strategy.experimental_local_results(value)[0] for value in combined])
        values = statistics(delta_sq, combined_sq, held, self.with_levels)
        indices = tf.constant([[row] for row in rows], tf.int32)
        self.variable.assign(tf.tensor_scatter_nd_update(tf.convert_to_tensor(self.variable), indices, values))
