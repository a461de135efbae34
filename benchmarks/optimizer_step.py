"""Training-step time of AdasumOptimizer against the plain inner optimizer, same strategy, same run.

Prints one JSON object per model:
  inner_ms     a step of the plain inner optimizer (Adam) under MirroredStrategy
               (Keras' gradient all-reduce: TF's native SUM all-reduce)
  adasum_ms    a step of AdasumOptimizer(Adam) under the same strategy
  ratio        adasum_ms / inner_ms
  bytes        the trainable weights' size
  extra_state_bytes     optimizer state the wrapper adds beyond the inner optimizer's slots
  transient_copy_bytes  the weights snapshot a delta-mode step holds (one copy of the weights)
  date, commit, processor, command   the run's provenance (`tf_adasum.eval.provenance`)
Times are medians over timed `train_on_batch` calls after warm-up, the two
optimizers taking turns (5 turns of steps / 5 steps each).

Usage: python benchmarks/optimizer_step.py [--replicas 4] [--models lenet5 mlp10m]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=["lenet5", "mlp10m"], choices=["lenet5", "mlp10m"])
    parser.add_argument("--batch-per-replica", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per optimizer")
    return parser.parse_args(argv)


def _model(name):
    import keras

    if name == "lenet5":
        from tf_adasum.eval.models import lenet5

        return lenet5(), (28, 28, 1)
    # About 10M parameters: 784 -> 2048 -> 2048 -> 2048 -> 10.
    layers = [keras.Input((784,))] + [keras.layers.Dense(2048, activation="relu") for _ in range(3)]
    return keras.Sequential(layers + [keras.layers.Dense(10)]), (784,)


def _interleaved_median_step_ms(runs, steps, rounds=5):
    """Median ms of one `train_on_batch` of each (model, x, y) in `runs`, after
    warm-up; the runs take turns (`rounds` turns of `steps` / `rounds` steps
    each), so a machine that slows down mid-run slows them all alike."""
    for model, x, y in runs:
        for _ in range(3):
            model.train_on_batch(x, y)
    times = [[] for _ in runs]
    for _ in range(rounds):
        for (model, x, y), samples in zip(runs, times):
            for _ in range(max(1, steps // rounds)):
                start = time.perf_counter()
                model.train_on_batch(x, y)
                samples.append(time.perf_counter() - start)
    return [1e3 * statistics.median(samples) for samples in times]


def main(argv=None):
    args = _parse_args(argv)
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    import keras
    import numpy as np

    import tf_adasum
    from tf_adasum.eval import provenance

    devices = [f"/cpu:{i}" for i in range(args.replicas)]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=tf_adasum.AdasumCrossDeviceOps())
    batch = args.batch_per_replica * args.replicas
    for name in args.models:
        record = {"benchmark": "optimizer_step", "model": name, "replicas": args.replicas, "global_batch": batch}
        runs = {}
        for label in ("inner", "adasum"):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model, input_shape = _model(name)
                inner = keras.optimizers.Adam(1e-3)
                optimizer = tf_adasum.AdasumOptimizer(inner) if label == "adasum" else inner
                model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            rng = np.random.default_rng(0)
            x = rng.standard_normal((batch, *input_shape)).astype("float32")
            y = rng.integers(0, 10, batch).astype("int32")
            runs[label] = (model, x, y)
        for label, ms in zip(runs, _interleaved_median_step_ms(list(runs.values()), args.steps)):
            record[f"{label}_ms"] = round(ms, 3)
        model = runs["adasum"][0]
        optimizer = model.optimizer
        weights_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        own = [v for v in optimizer.variables if all(v is not w for w in optimizer.inner_optimizer.variables)]
        record["params"] = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        record["bytes"] = weights_bytes
        record["extra_state_bytes"] = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in own)
        record["transient_copy_bytes"] = weights_bytes
        record["ratio"] = round(record["adasum_ms"] / record["inner_ms"], 3)
        print(json.dumps({**record, **provenance.fields(provenance.command_line(__file__, argv))}), flush=True)


if __name__ == "__main__":
    main()
