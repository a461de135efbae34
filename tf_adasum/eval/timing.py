"""Time per step and communication share of large models, on synthetic data.

For ``--models resnet50`` / ``bert``: convergence on this machine would take
days, but what a cluster operator needs first is how long a step takes and
how much of it the combine costs. For each combiner this times a training step
(``train_on_batch``) and, separately, the combine of tensors shaped like the
model's trainable variables through the same collective; the communication
share is the combine's time over the step's. ``keras`` is the plain inner
optimizer, whose combine is TF's native SUM all-reduce.
"""

from __future__ import annotations

import statistics
import time

from tf_adasum.eval.config import KERAS_BASELINES

__all__ = ["time_model"]


def _synthetic_batch(name: str, batch: int, rng):

    if name == "bert":
        return rng.integers(0, 8000, (batch, 64)).astype("int32"), rng.integers(0, 2, batch).astype("int32")
    return rng.standard_normal((batch, 64, 64, 3)).astype("float32"), rng.integers(0, 10, batch).astype("int32")


def _median_seconds(fn, steps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_model(name: str, combiner: str, replicas: int, batch_per_replica: int, devices, steps: int = 3) -> dict:
    """One timing record: `seconds_per_step`, `combine_seconds`, `communication_share`."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_adasum
    from tf_adasum.eval.models import build

    cross_device_ops = tf_adasum.AdasumCrossDeviceOps()
    strategy = tf.distribute.MirroredStrategy(devices[:replicas], cross_device_ops=cross_device_ops)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = build(name)
        inner = keras.optimizers.Adam(1e-4)
        optimizer = inner if combiner in KERAS_BASELINES else tf_adasum.AdasumOptimizer(inner, combiner=combiner)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _synthetic_batch(name, replicas * batch_per_replica, np.random.default_rng(0))
    step = _median_seconds(lambda: model.train_on_batch(x, y), steps)

    with strategy.scope():
        values = [
            strategy.experimental_distribute_values_from_function(
                lambda ctx, v=v: tf.random.stateless_normal(v.shape, seed=[ctx.replica_id_in_sync_group, 1])
            )
            for v in model.trainable_variables
        ]
        if combiner in KERAS_BASELINES:  # the same all-reduce (a learning rate does not change a step's time)
            pairs = [(v, v) for v in values]
            combine = tf.function(lambda: strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs))
        else:
            combine = tf.function(lambda: cross_device_ops.batch_reduce_combine(values, combiner))
        combine_seconds = _median_seconds(lambda: tf.nest.flatten(combine(), expand_composites=True)[-1].numpy(), steps)
    return {
        "model": name,
        "combiner": combiner,
        "engine": "local-devices",
        "replicas": replicas,
        "batch_per_replica": batch_per_replica,
        "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
        "seconds_per_step": step,
        "combine_seconds": combine_seconds,
        "communication_share": min(combine_seconds / step, 1.0),
    }
