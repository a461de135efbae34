"""One worker of the elastic tests, started by ``tf-adasum launch`` with elastic options
(TF_CONFIG: a MultiWorkerMirroredStrategy worker; with ``--mpirun``: an MPI rank, no strategy).

    python elastic_worker.py OUTDIR PLAN.json

Trains the backup tests' job (a Dense layer, AdasumOptimizer in delta mode
over Adam, EPOCHS epochs of STEPS global batches of BATCH rows, each epoch
its own seeded order; every worker takes its block of each global batch, so
the global batches are the same whatever the worker count) with
`tf_adasum.BackupAndRestore(OUTDIR/backup, save_freq=2,
save_before_preemption=True)`, a short sleep after each batch (so that the
launcher's discovery, asked every second, sees a change in time).

The plan (JSON) says what happens in which round (``TF_ADASUM_ELASTIC_ROUND``):
``{"reference": true}`` first trains the same job uninterrupted in
``OUTDIR/reference_backup`` (round 0 only; ``reference_rank{I}.npz``);
``{"kill": [ROUND, RANK, BATCH]}`` SIGKILLs that worker as the run's batch
BATCH begins; ``{"cut": [ROUND, RANK, BATCH]}`` takes that worker's host's
link down then (on an emulated host of ``--hosts``: its peers' exchanges
then time out); ``{"slots": [[ROUND, TRAINED, COUNT], ...]}`` makes worker 0
replace ``OUTDIR/slots`` (which the test's discovery command prints) by
COUNT once it has trained TRAINED batches in that round.

Writes, per round R and worker I: ``restored{R}_rank{I}.json`` (the
workers, the position restored) and ``.npz`` (the state just after the
restore), ``preempted{R}_rank{I}.npz`` (the state when a SIGTERM's backup
ended the round); at the end ``final_rank{I}.npz`` and ``final_rank{I}.json``
(the step counter). A state is the weights, then this worker's copy of each
optimizer variable.
"""

import json
import os
import signal
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from simulation import BATCH, IN, OUT  # noqa: E402
from simulation import data as simulation_data  # noqa: E402

import tf_adasum  # noqa: E402
from tf_adasum import backup  # noqa: E402
from tf_adasum.comm import mpi_transport  # noqa: E402
from tf_adasum.processes import Processes  # noqa: E402
from tf_adasum.resume import replica_states  # noqa: E402

EPOCHS, STEPS = 4, 6
SLEEP_SECONDS = 0.25


def state(model):
    copies = [replica_states.local_copies(v)[0].numpy() for v in model.optimizer.variables]
    return [w.numpy() for w in model.weights] + copies


def write_slots(out, count):
    """``OUTDIR/slots`` (what the test's discovery command prints) replaced by
    `count`, atomically: the discovery never reads it half-written."""
    temporary = os.path.join(out, "slots.tmp")
    with open(temporary, "w") as f:
        f.write(f"{count}\n")
    os.replace(temporary, os.path.join(out, "slots"))


class Plan(keras.callbacks.Callback):
    def __init__(self, plan, round_number, rank, out, restoring):
        super().__init__()
        self.plan, self.round, self.rank, self.out, self.epoch = plan, round_number, rank, out, 0
        self.restoring, self.trained = restoring, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.plan.get("kill") == [self.round, self.rank, self.epoch * STEPS + batch]:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.plan.get("cut") == [self.round, self.rank, self.epoch * STEPS + batch]:
            subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)

    def on_train_batch_end(self, batch, logs=None):
        restored = self.restoring.restored_epoch * STEPS + self.restoring.restored_batch
        if self.epoch * STEPS + batch < restored:
            return  # a batch the backup held: skipped, not trained
        self.trained += 1
        if self.plan.get("slots"):
            time.sleep(SLEEP_SECONDS)  # the launcher asks the discovery every second
        for round_number, trained, count in self.plan.get("slots", ()):
            if self.rank == 0 and [round_number, trained] == [self.round, self.trained]:
                write_slots(self.out, count)


class Restored(keras.callbacks.Callback):
    """After the backup's restore (it comes first in the list)."""

    def __init__(self, restoring, path, report):
        super().__init__()
        self.restoring, self.path, self.report = restoring, path, report

    def on_train_begin(self, logs=None):
        np.savez(self.path + ".npz", *state(self.model))
        with open(self.path + ".json", "w") as f:
            json.dump({**self.report, "restored": [self.restoring.restored_epoch, self.restoring.restored_batch]}, f)


def main():
    out, plan = sys.argv[1], json.loads(open(sys.argv[2]).read())
    round_number = int(os.environ.get("TF_ADASUM_ELASTIC_ROUND", "0"))
    strategy = tf.distribute.get_strategy()  # under mpirun: no strategy, the MPI engine
    if "TF_CONFIG" in os.environ:
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=60)
        )
    processes = Processes.of(strategy)
    rank, size = processes.index, processes.count

    def make_model():
        with strategy.scope():
            keras.utils.set_random_seed(10 + rank)
            model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
            optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.Adam(0.01))
            model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        return model

    def make_dataset(folder):
        """This worker's block of each global batch, from the backup's epoch on."""
        x, y = simulation_data(STEPS)
        b = BATCH // size
        mine, xs, ys = np.arange(rank * b, (rank + 1) * b), [], []
        for epoch in range(backup.saved_epoch(folder), EPOCHS):
            order = np.random.default_rng(epoch).permutation(STEPS)
            rows = np.concatenate([s * BATCH + mine for s in order])
            xs.append(x[rows])
            ys.append(y[rows])
        dataset = tf.data.Dataset.from_tensor_slices((np.concatenate(xs), np.concatenate(ys))).batch(b)
        if "TF_CONFIG" in os.environ:
            dataset = strategy.distribute_datasets_from_function(lambda context: dataset)
        return dataset

    options = {"save_freq": 2, "save_before_preemption": True}
    if plan.get("reference") and round_number == 0:
        reference, folder = make_model(), os.path.join(out, "reference_backup")
        fit = {"epochs": EPOCHS, "steps_per_epoch": STEPS, "shuffle": False, "verbose": 0}
        reference.fit(make_dataset(folder), callbacks=[backup.BackupAndRestore(folder, **options)], **fit)
        np.savez(os.path.join(out, f"reference_rank{rank}.npz"), *state(reference))
    model, folder = make_model(), os.path.join(out, "backup")
    dataset = make_dataset(folder)
    restoring = backup.BackupAndRestore(folder, **options)
    callbacks = [
        restoring,
        Restored(restoring, os.path.join(out, f"restored{round_number}_rank{rank}"), {"workers": size}),
        Plan(plan, round_number, rank, out, restoring),
    ]
    try:
        model.fit(dataset, epochs=EPOCHS, steps_per_epoch=STEPS, shuffle=False, verbose=0, callbacks=callbacks)
    except SystemExit:
        np.savez(os.path.join(out, f"preempted{round_number}_rank{rank}.npz"), *state(model))
        raise
    np.savez(os.path.join(out, f"final_rank{rank}.npz"), *state(model))
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"iterations": int(model.optimizer.iterations.numpy()), "round": round_number}, f)
    sys.stdout.flush()
    if processes.kind == "rank":
        mpi_transport.mpi().Finalize()  # mpirun treats an exit without it as a failure
    os._exit(0)  # skip TF's teardown, which can wait on peers that already left


if __name__ == "__main__":
    main()
