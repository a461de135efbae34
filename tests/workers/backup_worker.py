"""One process of the backup tests: run by `tf-adasum launch` (TF_CONFIG,
MultiWorkerMirroredStrategy) or by `mpirun` (the MPI engine).

    python backup_worker.py STEP OUTDIR WRITER_FAULT
    python backup_worker.py STEP OUTDIR preempt    (see `run_preemption`)

Every step trains the same job (a Dense layer, AdasumOptimizer in delta
mode over Adam, so each process's moments are its own, EPOCHS epochs of STEPS batches, each epoch its own seeded
order of the rows) with `tf_adasum.backup.BackupAndRestore` on one shared
folder, ``OUTDIR/backup``, and is interrupted at a different point; the test
relaunches the next step on the same folder:

1. an uninterrupted run in its own folder (``reference_rank{R}.npz``); then
   the chain starts, and the writer dies in its save at the end of epoch 1:
   WRITER_FAULT ``inside`` (only a partial temporary file written) or
   ``between`` (the weights file written, not the metadata naming it);
2. process 1 (not the writer) dies in the middle of epoch 2, or, with
   ``TEST_LINK_FAULT`` (``down`` or ``trickle``; on an emulated host of
   ``tf-adasum launch --hosts``), takes its host's link down (``ip link set
   eth0 down``) or cuts it to 100 bit/s (far below what a step sends) and trains on: every process must
   then fail with an error (``step2_error_rank{R}.json``, beside the time of
   the cut in ``link_cut.json``);
3. the run completes (``final_rank{R}.npz``; `fit` inside the strategy's
   scope, where loading and saving communicate); then a misconfiguration:
   a folder per process must be a ValueError on every process at the first
   backup (``mismatch_rank{R}.json``).

Each chain step reports ``step{S}_rank{R}.json`` (the epoch restored, the
epochs begun), rewritten at every epoch so that it survives the kill. The
input pipeline starts at `tf_adasum.backup.saved_epoch`, as the README says.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback

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
from tf_adasum.resume import folder  # noqa: E402

EPOCHS, STEPS = 4, 3
#: Collective timeout: a bug fails the run instead of hanging it.
TIMEOUT_SECONDS = float(os.environ.get("TEST_COLLECTIVE_TIMEOUT", "60"))
#: What goes wrong in chain step 1 (the writer's fault) and 2, and in which epoch.
WRITER_FAULT_EPOCH, MID_EPOCH_FAULT_EPOCH = 1, 2
LAST_STEP = 3
#: The run's batch during which process 1 gets SIGTERM (of EPOCHS * STEPS, counted from 0).
PREEMPTED_BATCH = 7
KILLED = 23


class Job:
    """The multi-worker strategy (TF_CONFIG) or MPI ranks, behind one face
    (`tf_adasum.processes`, the backup's own view of them)."""

    def __init__(self):
        self.strategy = None
        if "TF_CONFIG" in os.environ:
            options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=TIMEOUT_SECONDS)
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        processes = Processes.of(self.strategy)
        expected = "worker" if self.strategy else "rank"
        assert processes.kind == expected, f"run under tf-adasum launch (TF_CONFIG) or mpirun: {processes}"
        self.rank, self.size = processes.index, processes.count

    def scope(self):
        return self.strategy.scope() if self.strategy else contextlib.nullcontext()

    def model(self):
        """The Dense layer from this process's own random weights, compiled."""
        with self.scope():
            keras.utils.set_random_seed(10 + self.rank)
            model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
            optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.Adam(0.01), mode="delta")
            model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        return model

    def fit(self, model, start, callbacks):
        """Epochs start..EPOCHS-1; in epoch e this process's rows of each
        global batch, the batches in epoch e's own order."""
        x, y = simulation_data(STEPS)
        b = BATCH // self.size
        mine, xs, ys = np.arange(self.rank * b, (self.rank + 1) * b), [], []
        for epoch in range(start, EPOCHS):
            order = np.random.default_rng(epoch).permutation(STEPS)
            rows = np.concatenate([s * BATCH + mine for s in order])
            xs.append(x[rows])
            ys.append(y[rows])
        dataset = tf.data.Dataset.from_tensor_slices((np.concatenate(xs), np.concatenate(ys))).batch(b)
        if self.strategy is not None:
            dataset = self.strategy.distribute_datasets_from_function(lambda context: dataset)
        model.fit(dataset, epochs=EPOCHS, steps_per_epoch=STEPS, shuffle=False, verbose=0, callbacks=callbacks)


class FaultyBackup(backup.BackupAndRestore):
    """Dies inside the writer's save at the end of epoch `epoch`: after a
    partial temporary weights file ("inside"), or after the weights file,
    before the metadata ("between"). It wraps `tf_adasum.resume.folder.commit`,
    through which every file of a backup is written."""

    def __init__(self, backup_dir, fault, epoch):
        super().__init__(backup_dir)
        self.fault, self.epoch, self.now = fault, epoch, False
        original = folder.commit

        def commit(backup_dir, name, write):
            if self.now and self.fault == "inside" and name.endswith(".weights.h5"):
                temp = os.path.join(backup_dir, f".tmp-killed-{name}")
                write(temp)
                os.truncate(temp, os.path.getsize(temp) // 2)  # as if killed while writing
                os._exit(KILLED)
            if self.now and self.fault == "between" and name == backup.METADATA_NAME:
                os._exit(KILLED)
            original(backup_dir, name, write)

        folder.commit = commit

    def on_epoch_end(self, epoch, logs=None):
        self.now = epoch == self.epoch
        super().on_epoch_end(epoch, logs)


class Report(keras.callbacks.Callback):
    """Writes what this process restored and which epochs it began."""

    def __init__(self, path, restoring):
        super().__init__()
        self.path, self.restoring, self.begun = path, restoring, []

    def _write(self):
        report = {"restored": self.restoring.restored_epoch, "begun": self.begun}
        with open(self.path, "w") as f:
            json.dump(report, f)

    def on_train_begin(self, logs=None):
        self._write()

    def on_epoch_begin(self, epoch, logs=None):
        self.begun.append(epoch)
        self._write()


class DieMidEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch, self.current = epoch, None

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == 1:
            os._exit(KILLED)


class CutLinkMidEpoch(DieMidEpoch):
    """Takes this host's link down, or cuts it to a trickle, and trains on."""

    def __init__(self, epoch, fault, out):
        super().__init__(epoch)
        self.fault, self.out = fault, out

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == 1:
            with open(os.path.join(self.out, "link_cut.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            if self.fault == "down":
                command = ["ip", "link", "set", "eth0", "down"]
            else:
                command = ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf"]
                command += ["rate", "100bit", "burst", "1600", "limit", "1600"]
            subprocess.run(command, check=True)


def save_state(model, path):
    np.savez(path, *[v.numpy() for v in model.weights], *[v.numpy() for v in model.optimizer.variables])


def run_reference(job, out):
    folder = os.path.join(out, "reference_backup")
    model = job.model()
    job.fit(model, backup.saved_epoch(folder), [backup.BackupAndRestore(folder)])
    save_state(model, os.path.join(out, f"reference_rank{job.rank}.npz"))


def run_chain(job, out, step, writer_fault):
    folder = os.path.join(out, "backup")
    if step == 1:
        restoring = FaultyBackup(folder, writer_fault, WRITER_FAULT_EPOCH)
    else:
        restoring = backup.BackupAndRestore(folder)
    callbacks = [restoring, Report(os.path.join(out, f"step{step}_rank{job.rank}.json"), restoring)]
    if step == 2 and job.rank == 1:
        fault = os.environ.get("TEST_LINK_FAULT")
        callbacks.append(
            CutLinkMidEpoch(MID_EPOCH_FAULT_EPOCH, fault, out) if fault else DieMidEpoch(MID_EPOCH_FAULT_EPOCH)
        )
    model = job.model()
    # The last step calls `fit` inside the strategy's scope, where Keras' load and
    # save create mirrored variables (collectives): every worker loads and saves.
    with job.scope() if step == LAST_STEP else contextlib.nullcontext():
        job.fit(model, backup.saved_epoch(folder), callbacks)
    save_state(model, os.path.join(out, f"final_rank{job.rank}.npz"))
    return model


def run_mismatch(job, out, model):
    """A folder per process: at the end of the first epoch no process sees the
    others' parts of the backup (`model` is trained on; its train function is
    traced already)."""
    folder = os.path.join(out, f"own{job.rank}")
    x, y = simulation_data(STEPS)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH // job.size).repeat()
    if job.strategy is not None:
        dataset = job.strategy.distribute_datasets_from_function(lambda context: dataset)
    fit = lambda epochs: model.fit(  # noqa: E731
        dataset, epochs=epochs, steps_per_epoch=1, shuffle=False, verbose=0,
        callbacks=[backup.BackupAndRestore(folder, delete_checkpoint=False)],
    )  # fmt: skip
    report = {"raised": False}
    try:
        fit(1)
    except Exception as error:  # noqa: BLE001 - reported to the test
        report = {"raised": True, "type": type(error).__name__, "message": str(error)}
    with open(os.path.join(out, f"mismatch_rank{job.rank}.json"), "w") as f:
        json.dump(report, f)


class SigtermAtBatch(keras.callbacks.Callback):
    """Sends this process SIGTERM as the run's batch `number` begins."""

    def __init__(self, number):
        super().__init__()
        self.number, self.epoch = number, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch * STEPS + batch == self.number:
            os.kill(os.getpid(), signal.SIGTERM)


def run_preemption(job, out, step):
    """Backups every 2 batches and on SIGTERM. Step 1: the reference run, then
    process 1 alone gets SIGTERM during batch PREEMPTED_BATCH: every process
    backs up after it and exits with PREEMPTED_EXIT_CODE (Python's own exit,
    as a user's script would). Step 2: the resumed run completes."""
    options = {"save_freq": 2, "save_before_preemption": True}
    if step == 1:
        folder = os.path.join(out, "reference_backup")
        model = job.model()
        job.fit(model, 0, [backup.BackupAndRestore(folder, **options)])
        save_state(model, os.path.join(out, f"reference_rank{job.rank}.npz"))
    folder = os.path.join(out, "backup")
    restoring = backup.BackupAndRestore(folder, **options)
    callbacks = [SigtermAtBatch(PREEMPTED_BATCH)] if step == 1 and job.rank == 1 else []
    model = job.model()
    job.fit(model, backup.saved_epoch(folder), [*callbacks, restoring])
    report = {"restored": [restoring.restored_epoch, restoring.restored_batch]}
    report["iterations"] = int(model.optimizer.iterations.numpy())
    with open(os.path.join(out, f"preempt_rank{job.rank}.json"), "w") as f:
        json.dump(report, f)
    save_state(model, os.path.join(out, f"final_rank{job.rank}.npz"))


def main():
    step, out, writer_fault = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    assert writer_fault in ("inside", "between", "preempt"), writer_fault
    job = Job()
    if writer_fault == "preempt":
        run_preemption(job, out, step)
        if job.strategy is None:
            mpi_transport.mpi().Finalize()
        os._exit(0)
    try:
        if step == 1:
            run_reference(job, out)
        model = run_chain(job, out, step, writer_fault)
        if step == LAST_STEP:
            run_mismatch(job, out, model)
    except Exception as error:
        traceback.print_exc()
        report = {"type": type(error).__name__, "message": str(error)[-2000:], "time": time.time()}
        with open(os.path.join(out, f"step{step}_error_rank{job.rank}.json"), "w") as f:
            json.dump(report, f)
        os._exit(1)
    sys.stdout.flush()
    if job.strategy is None:
        mpi_transport.mpi().Finalize()  # mpirun treats an exit without it as a failure
    os._exit(0)  # skip TF's teardown, which can wait on peers that already left


if __name__ == "__main__":
    main()
