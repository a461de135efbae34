"""The parts of one run of the scaling evaluation (train a model to a target
accuracy), which `tf_adasum.eval.processes` runs in processes of its own.

Every combiner in a grid trains with the same base learning rate, schedule and
optimizer settings (Adam, or LAMB where a configuration says so), as in the
paper: no per-combiner tuning. ``keras``
is the plain inner optimizer under the same strategy (Keras' gradient
averaging, what users run today), ``keras-scaled`` the same with the learning
rate scaled to the effective batch and warmed up (`learning_rate`); the others
go through `tf_adasum.AdasumOptimizer` in the configuration's mode (delta by
default) with `local_steps` local steps per combine.

On the ``simulated`` engine the others train `tf_adasum.SimulatedReplicas`
with the same inner optimizer and settings, and the averaging baselines train
the plain model on the whole global batch: N replicas averaging their
gradients compute the mean gradient of that batch, the same method at every N
(`tests/test_simulation.py` checks it against a strategy's replicas).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import keras
import numpy as np

from tf_adasum.eval import metrics, provenance
from tf_adasum.eval.config import BASE_BATCH, COMBINERS, ENGINES, KERAS_BASELINES, WARMUP_EPOCHS, RunConfig

__all__ = [
    "COMBINERS",
    "ENGINES",
    "EpochEnd",
    "RunConfig",
    "compiled_model",
    "correct_counter",
    "learning_rate",
    "logical_cpus",
    "optimizer_for",
    "record",
    "subset",
]  # COMBINERS, ENGINES and RunConfig live in tf_adasum.eval.config (no TensorFlow there)


def learning_rate(config: RunConfig, steps_per_epoch: int) -> float | keras.optimizers.schedules.LearningRateSchedule:
    """The configuration's learning rate: a float, or a Keras schedule over the
    optimizer's iterations, defined per epoch so that it means the same at
    every batch size. The optimizer's ``iterations`` count local steps in
    delta mode (one per training step, whatever K) and combined steps in
    gradient mode (one per K training steps), so the schedule is laid out
    over ``ceil(steps_per_epoch / K)`` iterations an epoch in gradient mode.

    ``cosine``: from ``lr`` down to 0 over the epoch budget. ``keras-scaled``
    (Goyal et al. 2017's recipe with the square-root rule usual for Adam,
    Hoffer et al. 2017), and any combiner at ``lr_rule="scaled"``: the peak is
    ``lr * sqrt(effective batch / BASE_BATCH)``, reached by a linear warm-up
    from ``lr`` over the first `WARMUP_EPOCHS` epochs, then the same cosine to
    0 (a constant schedule keeps the peak after the warm-up). Where the scaled
    rate is not above the base rate (effective batch <= BASE_BATCH) there is
    no warm-up: it is `keras`. ``lr_rule="warmup"``: the same warm-up with the
    peak left at ``lr``: from ``lr * sqrt(BASE_BATCH / effective batch)`` (the
    fraction of the peak ``keras-scaled`` starts from) up to ``lr``.
    """
    if config.mode == "gradient":
        steps_per_epoch = -(-steps_per_epoch // config.local_steps)
    start, peak, warmup_steps = config.lr, config.lr, 0
    scale = math.sqrt(config.effective_batch / BASE_BATCH)
    if scale > 1.0 and (config.combiner == "keras-scaled" or config.lr_rule == "scaled"):
        peak = config.lr * scale
    elif scale > 1.0 and config.lr_rule == "warmup":
        start = config.lr / scale
    if peak != start:
        warmup_steps = min(WARMUP_EPOCHS, config.epochs) * steps_per_epoch
    if config.schedule == "constant" and not warmup_steps:
        return config.lr
    return keras.optimizers.schedules.CosineDecay(
        start,
        decay_steps=max(1, config.epochs * steps_per_epoch - warmup_steps),
        alpha=1.0 if config.schedule == "constant" else 0.0,  # 1.0: no decay
        warmup_target=peak if warmup_steps else None,
        warmup_steps=warmup_steps,
    )


def optimizer_for(config: RunConfig, steps_per_epoch: int) -> keras.optimizers.Optimizer:
    """The configuration's optimizer: its inner optimizer (Adam or LAMB, Keras'
    defaults) at `learning_rate`, wrapped in its `mode` unless it is one of the
    Keras baselines or the engine is ``simulated`` (where `compiled_model`
    wraps the model instead)."""
    import tf_adasum

    inner_class = {"adam": keras.optimizers.Adam, "lamb": keras.optimizers.Lamb}[config.inner]
    inner = inner_class(learning_rate(config, steps_per_epoch))
    if config.combiner in KERAS_BASELINES or config.engine == "simulated":
        return inner
    return tf_adasum.AdasumOptimizer(
        inner, combiner=config.combiner, mode=config.mode, backward_passes_per_step=config.local_steps
    )


def subset(config: RunConfig, data):
    """`data` cut to the configuration's `train_examples`/`test_examples`."""
    (x_train, y_train), (x_test, y_test) = data
    if config.train_examples:
        x_train, y_train = x_train[: config.train_examples], y_train[: config.train_examples]
    if config.test_examples:
        x_test, y_test = x_test[: config.test_examples], y_test[: config.test_examples]
    return (x_train, y_train), (x_test, y_test)


def logical_cpus(count: int) -> list[str]:
    """`count` logical CPU devices (configured here unless TF already started with enough)."""
    import tensorflow as tf

    try:
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * count)
    except RuntimeError:  # already initialised, e.g. inside a test process
        pass
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(devices) < count:
        raise RuntimeError(
            f"{count} logical CPU devices are needed, but TensorFlow already started with {len(devices)}."
        )
    return devices[:count]


def compiled_model(config: RunConfig, steps_per_epoch: int, **compile_options):
    """The configuration's model, compiled with its optimizer (call in the
    strategy's scope); on the ``simulated`` engine, `tf_adasum.SimulatedReplicas`
    around it (except for the averaging baselines)."""
    from tf_adasum.eval.models import build

    model = build(config.model)
    if config.engine == "simulated" and config.combiner not in KERAS_BASELINES:
        from tf_adasum.simulation import SimulatedReplicas

        model = SimulatedReplicas(
            model,
            config.replicas,
            combiner=config.combiner,
            mode=config.mode,
            backward_passes_per_step=config.local_steps,
            backend="local",  # the simulated engine: every replica in this process
        )
    model.compile(
        optimizer=optimizer_for(config, steps_per_epoch),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_options,
    )
    return model


def correct_counter(model: keras.Model, images: np.ndarray, labels: np.ndarray, batch: int = 1000) -> Callable[[], int]:
    """A function returning how many of `images` (float32) `model` classifies as `labels`.

    A traced prediction function over fixed batches: `model.evaluate` inside a
    running `fit` makes a second distributed iterator each time, and two of
    three concurrent single-replica runs died in a TensorFlow thread at that
    point (segfault) on 2026-11-30."""
    import tensorflow as tf

    predict = tf.function(lambda x: tf.argmax(model(x, training=False), axis=-1, output_type=tf.int32))
    batches = [(images[i : i + batch], labels[i : i + batch]) for i in range(0, len(images), batch)]
    return lambda: sum(int(np.sum(predict(x).numpy() == y)) for x, y in batches)


class EpochEnd(keras.callbacks.Callback):
    """Times each epoch's training, then measures test accuracy (untimed);
    reports it to `progress` and stops training once it reaches `target`.

    Args:
      measure_accuracy: ``() -> test accuracy``.
      target: stop at this accuracy (None: train the whole budget).
      progress: called with (epoch, test accuracy, seconds), or None.

    Attributes:
      accuracy, seconds: per epoch.
    """

    def __init__(self, measure_accuracy, target: float | None, progress=None):
        super().__init__()
        self.measure_accuracy, self.target, self.progress = measure_accuracy, target, progress
        self.accuracy: list[float] = []
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self.start)
        self.accuracy.append(self.measure_accuracy())
        if self.progress is not None:
            self.progress(epoch + 1, self.accuracy[-1], self.seconds[-1])
        if self.target is not None and self.accuracy[-1] >= self.target:
            self.model.stop_training = True


def record(config: RunConfig, accuracy: list[float], seconds: list[float], stop_at_target: bool) -> dict:
    """The result record of a finished run."""
    epochs = metrics.epochs_until_convergence(accuracy, config.target)
    minutes_per_epoch = statistics.median(seconds) / 60.0
    return {
        **dataclasses.asdict(config),
        "effective_batch": config.effective_batch,
        "accuracy_per_epoch": accuracy,
        "epochs_until_convergence": epochs,
        "minutes_per_epoch": minutes_per_epoch,
        "seconds_per_epoch": seconds,
        "final_acc": accuracy[-1],
        "best_acc": max(accuracy),
        "score": metrics.score(epochs, minutes_per_epoch),
        "stopped_at_target": stop_at_target,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {_cpu_count()} cores, Python {sys.version.split()[0]}",
        "processor": provenance.processor(),
        "kernels": _kernels(),
    }


def _kernels() -> str:
    """Which CPU kernels TensorFlow was started with: the ``TF_ENABLE_ONEDNN_OPTS``
    it read, or ``default`` (TensorFlow's choice for the processor) when unset."""
    return f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'default')}"


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
