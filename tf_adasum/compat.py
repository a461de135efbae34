"""A narrow fix that lets `model.fit` run under a multi-worker strategy.

Keras 3 (3.15 included) cannot start `fit`/`evaluate` under a
`MultiWorkerMirroredStrategy` with more than one worker: before building, it
takes one batch and calls ``strategy.reduce("MEAN", batch)`` on the whole
``(x, y)`` structure, which the multi-worker strategy rejects ("Attempt to
convert a value (PerReplica ...) to a Tensor"; keras-team/keras#20585). The
batch only provides shapes and dtypes for building the model symbolically.

`patch_keras_multiworker_fit` (applied when tf_adasum is imported) replaces
that step, for multi-worker strategies only, by taking this worker's first
replica's batch (same shapes and dtypes, no communication).

Then each training step averages its scalar metrics over replicas with
``strategy.reduce("MEAN", value, axis=0)``, which fails for scalars ("Invalid
reduction dimension 0 for input with 0 dimensions"); the patch reduces scalars
with ``axis=None`` (the mean over replicas, which is what axis=0 means for the
batch-shaped values it was written for).

Every other case runs Keras' own code unchanged.
"""

from __future__ import annotations

import tensorflow as tf

from tf_adasum.comm.cluster import num_workers

__all__ = ["patch_keras_multiworker_fit"]


def _is_multi_worker(strategy) -> bool:
    return num_workers(strategy) > 1


def patch_keras_multiworker_fit() -> None:
    """Installs the fix described above (idempotent)."""
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as trainer_lib
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    original = TensorFlowTrainer._maybe_symbolic_build
    if getattr(original, "_tf_adasum_patched", False):
        return
    original_reduce = trainer_lib.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if not _is_multi_worker(strategy) or reduction not in ("auto", "mean"):
            return original_reduce(values, strategy, reduction)

        def reduce(v):
            local = strategy.experimental_local_results(v)[0] if isinstance(v, tf.distribute.DistributedValues) else v
            if isinstance(local, tf.Tensor) and local.shape.rank == 0:
                return strategy.reduce("MEAN", v, axis=None)
            return original_reduce(v, strategy, reduction)

        return tree.map_structure(reduce, values)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = self._distribute_strategy
        if strategy is None or iterator is None or not _is_multi_worker(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, it in iterator:
            batch = next(it)
            data_batch = tree.map_structure(
                lambda x: (
                    strategy.experimental_local_results(x)[0] if isinstance(x, tf.distribute.DistributedValues) else x
                ),
                batch,
            )
            break
        with strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    _maybe_symbolic_build._tf_adasum_patched = True
    TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
    trainer_lib.reduce_per_replica = reduce_per_replica
