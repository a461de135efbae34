"""How `AdasumOptimizer` reaches the other replicas, and how they agree.

* `uses_mpi`: whether the optimizer combines over MPI ranks (one replica per
  process) or over the strategy's replicas (TF collective ops), refusing the
  combinations that would silently train each process alone.
* `check_same_variables`: across processes, before any optimizer variable is
  created, an error on every process when the trainable variable lists
  (shapes, dtypes, order) differ; one tiny metadata exchange.
* `broadcast_from_rank_0`: under MPI, rank 0's model and optimizer variables
  everywhere before the first step.
* `agree`: each step's finite check, one all-reduce of a few float64 numbers
  that also carries a digest of the variable list.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tf_adasum import mpi as mpi_lib
from tf_adasum.comm import mpi as mpi_engine
from tf_adasum.cross_device_ops import num_workers, sum_over_workers

__all__ = ["agree", "broadcast_from_rank_0", "check_same_variables", "num_workers", "uses_mpi"]

#: Three 10-bit digests of the variable list; sums of d and d^2 stay exact in
#: float64 for up to 4096 replicas, and n * sum(d^2) == sum(d)^2 exactly when
#: every replica has the same d.
_DIGESTS, _DIGEST_BITS = 3, 10


def uses_mpi(backend: str, strategy) -> bool:
    """Whether `backend` ("auto", "tf" or "mpi") combines over MPI ranks under
    `strategy`; raises for combinations it cannot serve."""
    multi_replica = strategy.num_replicas_in_sync > 1
    launched = mpi_engine.launched_by_mpi()
    if multi_replica and (backend == "mpi" or (backend == "auto" and launched)):
        raise ValueError(
            f"AdasumOptimizer(backend={backend!r}) in a process started by an MPI launcher cannot also "
            f"combine the {strategy.num_replicas_in_sync} replicas of a tf.distribute strategy: run one MPI "
            "rank per device without a strategy, or use MultiWorkerMirroredStrategy (TF_CONFIG) without mpirun."
        )
    if multi_replica:
        return False
    if backend == "tf" and launched:
        raise ValueError(
            "AdasumOptimizer(backend='tf') has one replica in a process started by an MPI launcher, so it "
            "would train each rank alone. Use backend='auto' or 'mpi' under mpirun, or a multi-replica "
            "tf.distribute strategy."
        )
    return backend == "mpi" or (backend == "auto" and launched)


def _digests(variables) -> list[float]:
    digest = int(mpi_lib.signature_digest(mpi_lib.variable_signature(variables)), 16)
    mask = (1 << _DIGEST_BITS) - 1
    return [float((digest >> (_DIGEST_BITS * i)) & mask) for i in range(_DIGESTS)]


def _differ(n, sums, sums_of_squares) -> bool:
    return any(n * q != s * s for s, q in zip(sums, sums_of_squares))


def _describe(variables) -> str:
    signature = mpi_lib.variable_signature(variables)
    return f"{len(signature)}: {signature[:8]}{' ...' if len(signature) > 8 else ''}"


def check_same_variables(strategy, var_list, over_mpi: bool) -> None:
    """Raises ValueError on every process when the processes' `var_list`s
    differ (shapes, dtypes, order). Eager; call on every process at the same
    point. Nothing to do within one process."""
    if over_mpi:
        with tf.init_scope():
            mpi_lib.check_same_variables(var_list, "trainable variables")
        return
    if num_workers(strategy) == 1:
        return
    digests = _digests(var_list)
    options = getattr(strategy.extended, "_communication_options", None)
    timeout = options.timeout_seconds if options is not None else None
    totals = sum_over_workers(strategy, [1.0] + [x for d in digests for x in (d, d * d)], timeout)
    if _differ(totals[0], totals[1::2], totals[2::2]):
        raise ValueError(
            "The trainable variables differ across the workers of the MultiWorkerMirroredStrategy "
            "(shapes, dtypes or order); every worker must build the same model. This worker "
            f"(task {strategy.extended._id_in_cluster}) has {_describe(var_list)}"
        )


def _has_value(variable) -> bool:
    """False for a variable created in a `tf.function` being traced (it is
    initialised when the function first runs; reading it gives an empty array)."""
    return np.shape(variable.numpy()) == tuple(variable.shape)


def broadcast_from_rank_0(var_list, optimizer_variables) -> None:
    """MPI: every rank takes rank 0's `var_list` (the model's trainable
    variables, which must have values) and those `optimizer_variables` that
    have values; optimizer variables created by a build inside a `tf.function`
    have none yet and start from their initializers, the same on every rank.
    Eager (also when called while tracing)."""
    with tf.init_scope():
        unset = [v.path for v in var_list if not _has_value(v)]
        if unset:
            raise ValueError(
                "Under MPI, AdasumOptimizer broadcasts rank 0's weights before the first step, but these "
                f"variables have no value yet: {unset[:5]}. Build the model before training (give it a "
                "`keras.Input`, or call `model.build(input_shape)`)."
            )
        own = [v for v in optimizer_variables if _has_value(v)]
        mpi_lib.check_same_variables(own, "optimizer variables")
        mpi_lib.broadcast_variables(list(var_list) + own, root_rank=0)


def agree(strategy, grads, variables, num_combined: int, mpi_sum: Callable | None = None) -> tf.Tensor:
    """Cross-replica context, before any combine: True when every replica's
    `grads` are finite (the same answer on every replica), after one
    all-reduce (`mpi_sum` under MPI, else the strategy's); an error on every
    replica when the replicas' `variables` differ."""
    digests = _digests(variables)

    def local_vector(*local_grads):
        ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in local_grads])
        values = [tf.cast(tf.logical_not(ok), tf.float64)]
        for d in digests:
            values += [tf.constant(d, tf.float64), tf.constant(d * d, tf.float64)]
        return tf.stack(values)

    per_replica = strategy.extended.call_for_each_replica(local_vector, args=tuple(grads))
    if mpi_sum is not None:
        total = mpi_sum(per_replica)
    else:
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    n = tf.constant(float(num_combined), tf.float64)
    same = tf.reduce_all(tf.equal(n * total[2::2], tf.square(total[1::2])))
    check = tf.debugging.Assert(
        same,
        [
            "AdasumOptimizer: the replicas' variable lists differ (shapes, dtypes or order); every "
            f"replica must build the same model. This replica has {_describe(variables)}"
        ],
    )
    with tf.control_dependencies([check]):
        return tf.equal(total[0], 0.0)
