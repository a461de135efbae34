"""One process of the logical-replica tests: L = 8 replicas of one job on
however many processes run it (plain ``python``: all eight here; ``mpirun
-np M``: 8 / M on each rank, e.g. started by ``tf-adasum launch --mpirun
--logical-replicas 8`` with elastic options; ``tf-adasum launch -n M``: 8 / M
on each worker of TF_CONFIG, which creates its MultiWorkerMirroredStrategy
first, as TensorFlow requires).

    python logical_worker.py OUTDIR COMBINER MODE [PLAN.json]

Trains `tf_adasum.SimulatedReplicas` (an MLP with dropout, Adam, COMBINER in MODE) for
the elastic worker's EPOCHS epochs of STEPS global batches of 8 x BATCH
rows, each epoch in its own seeded order (every process reads every global
batch and keeps its replicas' rows); every process builds its model from a
seed of its own (the broadcast must make process 0's the start).

Without a plan: writes ``rank{R}.npz`` (the weights as ``weight{i}``, and
this process's replicas' optimizer state as ``replica{j}/variable{v}``, j the
replica's number) and ``rank{R}.json`` (the replicas it held).

With a plan (`elastic_worker.Plan`'s: the discovery's count rewritten
after some batches of a round): `tf_adasum.BackupAndRestore` backs up after every batch and
on a preemption notice in ``OUTDIR/backup``; writes ``restored{ROUND}_rank{R}.json``
(the processes of the round, the position restored) and at the end
``final_rank{R}.npz`` and ``.json`` (the step counter, the round).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if len(json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {}).get("worker", [])) > 1:
    # At the start, and kept: SimulatedReplicas spreads over its workers (its heartbeat watches them).
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic_worker import EPOCHS, STEPS, Plan, Restored  # noqa: E402

import tf_adasum  # noqa: E402
from tf_adasum import backup  # noqa: E402

L, BATCH, IN, OUT = 8, 4, 6, 3


def dataset(start_epoch):
    """The global batches from `start_epoch` on, each epoch in an order of its own."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(STEPS * L * BATCH, IN)).astype("float32")
    y = rng.integers(0, OUT, size=len(x))
    orders = [np.random.default_rng(100 + e).permutation(len(x)) for e in range(start_epoch, EPOCHS)]
    rows = np.concatenate(orders) if orders else np.zeros([0], int)
    return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(L * BATCH, drop_remainder=True)


def replica_states(trainer):
    """The weights and every replica of this process's optimizer state, by replica number."""
    engine = trainer.engine
    values = {f"weight{i}": v.numpy() for i, v in enumerate(trainer.model.trainable_variables)}
    for v, stack in enumerate(trainer.replica_variables):
        for offset, row in enumerate(stack.numpy()):
            values[f"replica{engine.first_replica + offset}/variable{v}"] = row
    return values


def main(out, combiner, mode, plan_path=None):
    task = json.loads(os.environ.get("TF_CONFIG") or "{}").get("task", {})
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", task.get("index", 0)))
    keras.utils.set_random_seed(1 + rank)  # ranks start apart: the broadcast must make rank 0's the start
    layers = [keras.layers.Dense(16, activation="tanh"), keras.layers.Dropout(0.25), keras.layers.Dense(OUT)]
    model = keras.Sequential([keras.Input((IN,)), *layers])  # dropout: each replica's draws its own
    trainer = tf_adasum.SimulatedReplicas(model, L, combiner=combiner, mode=mode)
    trainer.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    engine = trainer.engine
    fit = {"epochs": EPOCHS, "steps_per_epoch": STEPS, "verbose": 0}
    if plan_path is None:
        trainer.fit(dataset(0), **fit)
        np.savez(os.path.join(out, f"rank{rank}.npz"), **replica_states(trainer))
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"first": engine.first_replica, "count": engine.local_replicas}, f)
        return
    plan = json.loads(open(plan_path).read())
    round_number = int(os.environ.get("TF_ADASUM_ELASTIC_ROUND", "0"))
    folder = os.path.join(out, "backup")
    restoring = backup.BackupAndRestore(folder, save_freq=1, save_before_preemption=True)
    processes = engine.num_replicas // engine.local_replicas
    callbacks = [
        restoring,
        Restored(restoring, os.path.join(out, f"restored{round_number}_rank{rank}"), {"workers": processes}),
        Plan(plan, round_number, rank, out, restoring),
    ]
    trainer.fit(dataset(backup.saved_epoch(folder)), callbacks=callbacks, **fit)
    np.savez(os.path.join(out, f"final_rank{rank}.npz"), **replica_states(trainer))
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"iterations": int(trainer.optimizer.iterations.numpy()), "round": round_number}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
