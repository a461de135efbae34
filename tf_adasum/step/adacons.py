"""AdaCons through the same machinery as Adasum (see `tf_adasum.combiners.AdaCons`).

Runs in cross-replica context: one SUM all-reduce of the updates (the
vector-halving collective with a plain sum), per-replica float64 dots, a gather
of 2 N scalars per weight group (`Engine.gather_small`), the weights computed
from the gathered values (so identical on every replica), and a second SUM
all-reduce of the weighted updates. The same on every engine. `tf_adasum.reference.adacons` is the specification.
"""

from __future__ import annotations

import dataclasses
import warnings

import tensorflow as tf

from tf_adasum.combiners import AdaCons
from tf_adasum.engines.base import Engine
from tf_adasum.reference import ADACONS_EPS

__all__ = ["AdaConsState", "combine"]


@dataclasses.dataclass
class AdaConsState:
    """The optimizer's AdaCons variables: momentum and last weights ``[groups, N]``
    (float64), the number of combines, and how many fell back to averaging."""

    momentum: tf.Variable
    weights: tf.Variable
    steps: tf.Variable
    fallbacks: tf.Variable

    @classmethod
    def create(cls, make_variable, groups: int, num_replicas: int) -> AdaConsState:
        """The state, its variables made by ``make_variable(name, shape, dtype)``
        (zeros, one copy per replica)."""
        shape = (groups, num_replicas)
        return cls(
            momentum=make_variable("adacons_momentum", shape, "float64"),
            weights=make_variable("adacons_weights", shape, "float64"),
            steps=make_variable("adacons_steps", (), "int64"),
            fallbacks=make_variable("adacons_fallbacks", (), "int64"),
        )

    def load(self, pairs: list, num_replicas: int) -> None:
        """Assigns each ``(variable, saved value)`` of an optimizer's variables,
        except this state's per-replica ones saved at another replica count:
        then the momentum restarts (as on a first step), with a warning."""
        restart = None
        for variable, value in pairs:
            if any(variable is v for v in (self.momentum, self.weights)) and value.shape != variable.shape:
                restart = value.shape[-1]
                continue
            variable.assign(value)
        if restart is not None:
            warnings.warn(
                f"AdaCons' state was saved with {restart} replicas and this run has {num_replicas}: "
                "its momentum restarts.",
                stacklevel=3,
            )
            self.steps.assign(0)

    def read(self, names: list[str]) -> dict:
        """``{"weights": {name: [w_0, ... w_N-1]}, "fallbacks": count}``, one name per weight group."""
        weights = self.weights.numpy()
        return {
            "weights": {name: [float(w) for w in row] for name, row in zip(names, weights)},
            "fallbacks": int(self.fallbacks.numpy()),
        }


def _to64(x: tf.Tensor) -> tf.Tensor:
    return tf.cast(x, tf.float64)


def combine(engine: Engine, per_replica, combiner: AdaCons, state: AdaConsState, rows, restore: bool):
    """AdaCons of `per_replica` (a list of per-replica tensors) over `engine`'s replicas.

    Args:
      rows: the rows of the state that the weight groups use (one per tensor
        with `per_tensor`, else ``[0]``).
      restore: rescale to the norm of the mean update.

    Returns:
      The combined tensors, identical on every replica (per-replica values).
    """
    strategy, n = engine.strategy, engine.num_replicas
    num_tensors = len(per_replica)
    groups = [[t] for t in range(num_tensors)] if combiner.per_tensor else [list(range(num_tensors))]
    total = engine.combine(per_replica, "sum")

    def group_sums(per_tensor_values):
        return tf.stack([tf.add_n([per_tensor_values[t] for t in group]) for group in groups])

    def local_statistics(*args):
        g, s = args[:num_tensors], args[num_tensors:]
        squares = [tf.reduce_sum(tf.square(_to64(x))) for x in g]
        dots = [tf.reduce_sum(_to64(x) * _to64(y)) for x, y in zip(g, s)]
        return tf.stack([tf.sqrt(group_sums(squares)), group_sums(dots)])  # [2, groups]

    statistics = strategy.extended.call_for_each_replica(local_statistics, args=(*per_replica, *total))
    gathered = engine.gather_small(statistics)  # [n, 2, groups], replica order
    norms = tf.transpose(gathered[:, 0])  # [groups, N]
    alpha = tf.transpose(gathered[:, 1]) / (n * (norms + ADACONS_EPS))
    order = tf.argsort(alpha, axis=1, stable=True)
    sorted_alpha = tf.gather(alpha, order, batch_dims=1)
    previous = tf.gather(state.momentum, rows)
    beta = tf.constant(combiner.momentum, tf.float64)
    m = tf.where(tf.equal(state.steps, 0), sorted_alpha, beta * previous + (1 - beta) * sorted_alpha)
    out = tf.gather(m, tf.argsort(order, axis=1, stable=True), batch_dims=1)  # out[order[k]] = m[k]
    out_sum = tf.reduce_sum(out, axis=1, keepdims=True)
    ok = tf.logical_and(tf.math.is_finite(out_sum), out_sum > 0)
    averaging = tf.fill(tf.shape(out), tf.constant(1.0 / n, tf.float64))
    weights = tf.where(ok, out / tf.where(ok, out_sum, 1.0), averaging)
    coefficients = weights / (norms + ADACONS_EPS)  # [groups, N]
    group_of = {t: i for i, group in enumerate(groups) for t in group}

    def weighted(*g):
        c = coefficients[:, engine.replica_id()]
        return [tf.cast(c[group_of[t]] * _to64(x), x.dtype) for t, x in enumerate(g)]

    result = engine.combine(list(strategy.extended.call_for_each_replica(weighted, args=tuple(per_replica))), "sum")
    indices = [[r] for r in rows]
    state.momentum.assign(tf.tensor_scatter_nd_update(state.momentum, indices, m))
    state.weights.assign(tf.tensor_scatter_nd_update(state.weights, indices, weights))
    state.steps.assign_add(1)
    state.fallbacks.assign_add(tf.reduce_sum(tf.cast(tf.logical_not(ok), tf.int64)))
    if not restore:
        return result

    def rescale(*args):
        r, s = args[:num_tensors], args[num_tensors:]
        target = tf.sqrt(group_sums([tf.reduce_sum(tf.square(_to64(x))) for x in s])) / n
        current = tf.sqrt(group_sums([tf.reduce_sum(tf.square(_to64(x))) for x in r]))
        factor = tf.where(current > 0, target / tf.where(current > 0, current, 1.0), tf.zeros_like(current))
        return [tf.cast(_to64(x) * factor[group_of[t]], x.dtype) for t, x in enumerate(r)]

    return list(strategy.extended.call_for_each_replica(rescale, args=(*result, *total)))
