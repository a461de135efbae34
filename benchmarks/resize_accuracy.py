"""A resize without logical replicas: does Adasum at an unchanged learning rate go through 8 -> 4 -> 8 replicas?

The evaluation's recipe (``lenet_caffe`` on real MNIST, Adam 1e-3 decayed by
a cosine over a 10-epoch budget, per epoch here, 64 examples a replica;
stops at 99.3% test accuracy, as the replica sweep does), with the replicas
simulated (`tf_adasum.SimulatedReplicas`; the averaging baseline is one
model at the effective batch, as in the sweep). Each row, three seeds:

* ``adasum fixed``: 8 replicas throughout;
* ``adasum 8-4-8``: 8 replicas for epochs 1-2, 4 for epochs 3-4, 8 from
  epoch 5; each resize through `tf_adasum.BackupAndRestore` (a backup at
  the epoch's end, restored at the new count by its rule: replica j takes
  saved replica j mod N's Adam state), the learning rate unchanged;
* ``keras fixed`` / ``keras 8-4-8``: Keras' gradient averaging at the
  effective batch (512, 256 during the 4-replica epochs), the rate unchanged;
* ``keras-linear 8-4-8``: the same with the rate scaled linearly with the
  replicas (halved during the 4-replica epochs).

Writes one JSON line per run to ``--out`` (a run already there is skipped:
resumable) and prints a summary per row: epochs to 99.3% per seed (None:
not within the budget), the accuracy at the end (at the target, or after
the budget), the commit and the processor.

Usage: python benchmarks/resize_accuracy.py [--seeds 0 1 2] [--epochs 10] [--out resize_accuracy.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as `tf-adasum eval` does
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCH_PER_REPLICA, LR, TARGET = 64, 1e-3, 0.993
ROWS = [("adasum", "fixed"), ("adasum", "8-4-8"), ("keras", "fixed"), ("keras", "8-4-8"), ("keras-linear", "8-4-8")]


def replicas_at(schedule: str, epoch: int) -> int:
    """The replica count of `epoch` (from 0)."""
    return 4 if schedule == "8-4-8" and epoch in (2, 3) else 8


def _phases(schedule: str, epochs: int) -> list[tuple[int, int, int]]:
    """(first epoch, end epoch, replicas) of each stretch at one count."""
    phases = []
    for epoch in range(epochs):
        n = replicas_at(schedule, epoch)
        if phases and phases[-1][2] == n:
            phases[-1] = (phases[-1][0], epoch + 1, n)
        else:
            phases.append((epoch, epoch + 1, n))
    return phases


def run(combiner: str, schedule: str, seed: int, epochs: int) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_adasum
    from tf_adasum.eval.data import load_mnist
    from tf_adasum.eval.models import lenet_caffe
    from tf_adasum.eval.runner import EpochEnd, correct_counter

    (x, y), (x_test, y_test) = load_mnist()
    x, x_test = (x[..., None] / 255.0).astype("float32"), (x_test[..., None] / 255.0).astype("float32")
    keras.utils.set_random_seed(seed)
    model = lenet_caffe()
    count = correct_counter(model, x_test, y_test)
    measure = EpochEnd(lambda: count() / len(y_test), TARGET)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def rate(epoch, _=None):
        scale = replicas_at(schedule, epoch) / 8 if combiner == "keras-linear" else 1.0
        return LR * scale * 0.5 * (1 + math.cos(math.pi * epoch / epochs))

    def data(first, end, n):
        whole = len(x) // (n * BATCH_PER_REPLICA) * n * BATCH_PER_REPLICA  # each epoch whole batches
        orders = [np.random.default_rng([seed, e]).permutation(len(x))[:whole] for e in range(first, end)]
        rows = np.concatenate(orders)
        return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(n * BATCH_PER_REPLICA, True).prefetch(2)

    callbacks = [keras.callbacks.LearningRateScheduler(rate), measure]
    trained = model
    with tempfile.TemporaryDirectory(prefix="resize_accuracy_") as folder:
        for first, end, n in _phases(schedule, epochs):
            if combiner == "adasum":  # a fresh wrapper at each count, resumed from the backup by its rule
                trained = tf_adasum.SimulatedReplicas(model, n)
                trained.compile(optimizer=keras.optimizers.Adam(LR), loss=loss)
                resize = tf_adasum.BackupAndRestore(folder, delete_checkpoint=False)
                phase_callbacks = [resize, *callbacks]
            else:  # Keras' averaging: one model at the effective batch
                if getattr(trained, "optimizer", None) is None:
                    trained.compile(optimizer=keras.optimizers.Adam(LR), loss=loss)
                phase_callbacks = callbacks
            steps = len(x) // (n * BATCH_PER_REPLICA)
            trained.fit(
                data(first, end, n),
                epochs=end,
                initial_epoch=first,
                steps_per_epoch=steps,
                callbacks=phase_callbacks,
                verbose=0,
            )
            if measure.accuracy and measure.accuracy[-1] >= TARGET:
                break
    reached = next((e + 1 for e, a in enumerate(measure.accuracy) if a >= TARGET), None)
    return {
        "combiner": combiner,
        "schedule": schedule,
        "seed": seed,
        "epochs_to_target": reached,
        "accuracy": measure.accuracy,
        "seconds_per_epoch": [round(s, 1) for s in measure.seconds],
    }


def main() -> None:
    from tf_adasum.eval import provenance

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="resize_accuracy.jsonl", help="one JSON line per run (resumable)")
    parser.add_argument("--run", nargs=3, metavar=("COMBINER", "SCHEDULE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:  # one run, in a process of its own
        print(json.dumps(run(args.run[0], args.run[1], int(args.run[2]), args.epochs)))
        return
    done = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = [json.loads(line) for line in f if line.strip()]
    for combiner, schedule in ROWS:
        for seed in args.seeds:
            if any((r["combiner"], r["schedule"], r["seed"]) == (combiner, schedule, seed) for r in done):
                continue
            command = [sys.executable, __file__, "--epochs", str(args.epochs), "--run", combiner, schedule, str(seed)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{combiner} {schedule} seed {seed} failed: {result.stderr[-3000:]}")
            record = json.loads(result.stdout.strip().splitlines()[-1])
            record.update(provenance.fields())
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
            done.append(record)
    for combiner, schedule in ROWS:
        runs = [r for r in done if (r["combiner"], r["schedule"]) == (combiner, schedule) and r["seed"] in args.seeds]
        reached = [r["epochs_to_target"] for r in runs]
        print(
            json.dumps(
                {
                    "row": f"{combiner} {schedule}",
                    "epochs_to_target": reached,
                    "median": statistics.median(reached) if None not in reached and reached else None,
                    "accuracy_at_end": [r["accuracy"][-1] for r in runs],
                }
            )
        )


if __name__ == "__main__":
    main()
