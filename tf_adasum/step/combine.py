"""The combine of one step: every replica's values made one, the same on every replica.

The one place that dispatches on the combiner, for `tf_adasum.AdasumOptimizer`
and `tf_adasum.SimulatedReplicas` alike: a pair rule (adasum, sum, mean) runs
the engine's tree (`tf_adasum.engines.base.Engine.combine`); AdaCons runs
`tf_adasum.step.adacons` over the same engine, with its state.
"""

from __future__ import annotations

import tensorflow as tf

from tf_adasum.engines.base import Engine
from tf_adasum.step import adacons as adacons_lib
from tf_adasum.step.settings import StepSettings

__all__ = ["combine", "combine_state"]


def combine_state(
    settings: StepSettings, make_variable, num_variables: int, num_replicas: int
) -> adacons_lib.AdaConsState | None:
    """The state `combine` carries from step to step: AdaCons' (one weight
    group per variable with ``per_tensor``, else one for the model), its
    variables made by ``make_variable(name, shape, dtype)``; None for a pair
    rule, which keeps none."""
    combiner = settings.combiner
    if combiner.pairwise:
        return None
    groups = num_variables if combiner.per_tensor else 1
    return adacons_lib.AdaConsState.create(make_variable, groups, num_replicas)


def combine(
    engine: Engine,
    per_replica: list,
    settings: StepSettings,
    adacons_state: adacons_lib.AdaConsState | None,
    rows: list[int],
    with_partials: bool = False,
):
    """Combines `per_replica` (a list of per-replica tensors) over `engine`'s
    replicas with ``settings.combiner`` (cross-replica context).

    Args:
      adacons_state: AdaCons' variables (None for a pair rule).
      rows: each tensor's row in `adacons_state` (its variable's index); with
        AdaCons' ``per_tensor=False`` the whole model is row 0.
      with_partials: also return the tree's float64 partial sums (see
        `Engine.combine`); AdaCons has no tree, so none (zero levels).

    Returns:
      The combined tensors, identical on every replica (per-replica values);
      with `with_partials`, a pair.
    """
    combiner = settings.combiner
    if combiner.pairwise:
        return engine.combine(per_replica, combiner, settings.hierarchical, with_partials=with_partials)
    restore = combiner.restore_magnitude
    restore = settings.mode == "delta" if restore is None else restore
    rows = rows if combiner.per_tensor else [0]
    combined = adacons_lib.combine(engine, per_replica, combiner, adacons_state, rows, restore)
    if with_partials:
        return combined, tf.zeros([0, len(per_replica), 3], tf.float64)
    return combined
