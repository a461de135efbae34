"""`BackupAndRestore`: resume an interrupted `model.fit` on every engine, from one folder.

Keras 3's own `keras.callbacks.BackupAndRestore` has no multi-worker logic:
every process writes ``backup_dir/latest.weights.h5`` (one shared folder fails
on HDF5's file lock; a folder per worker resumes the workers at different
epochs; a callback on MPI rank 0 only leaves the others at epoch 0), and it
keeps replica 0's optimizer state only. This one works with one `backup_dir`
seen by every process (a shared filesystem); its files are
`tf_adasum.resume.folder`'s:

* **A file per process, one writer.** At each backup (every epoch, every K
  batches, or on a preemption notice) every process writes its replicas' own
  copies of the optimizer's variables (in delta mode each replica's momentum
  or Adam moments are its own) to a file of its own
  (`tf_adasum.resume.replica_states`), and the model's random-number
  generators' states (dropout masks; `model.save_weights` leaves them out);
  no process gathers the others'. One
  tiny sum over the processes (`tf_adasum.processes`) says every file is
  complete, a second that every process sees them all (a folder per process
  instead of a shared one is a `ValueError` on every process). Then the
  writer (the chief, task 0 of a MultiWorkerMirroredStrategy, or MPI rank 0;
  in one process that process) writes the weights and optimizer variables
  (`model.save_weights`), then ``backup.json`` naming every file, each
  atomically, and removes older files, while the others wait in a third sum
  (which also carries the writer's failure, if any): every process leaves
  the backup together, so no process writes while old files are removed, and
  a process that exits right after a backup cannot cut the writer short.
* **Every process restores** at ``on_train_begin``: each reads the same
  ``backup.json`` and checks every file it names; one tiny sum over the
  processes (4 numbers each: its position's epoch and batch, whether it
  failed, its replica count) checks that all found the same backup (a
  `ValueError` on every process naming each one's otherwise); then every
  process loads the weights file (`model.load_weights`, the optimizer built
  first), gives each of its replicas its saved replica's optimizer state
  (replica j takes saved replica j mod N, N the replicas saved: all of the
  optimizer's variables at the same count, the exact resume; at another
  count the innermost optimizer's, while the wrapper's own state, such as
  AdaCons' per-replica weights, restarts as `model.load_weights` left it),
  and Keras starts at that epoch. A backup inside an epoch makes the first
  train calls of the epoch read their batches and train on none, as many as
  the backup holds (`tf_adasum.step.keras_step.skip_train_calls`). Nothing
  has trained yet when an error is raised.
* **Deleted when training completes** (`model.fit` returns), kept when it is
  interrupted, as Keras does; only this callback's files are removed.

Saving and loading issue no collective when only mirrored variables are read
outside the strategy's scope: a mirrored variable is read from this worker's
first replica (the chief's: global replica 0, as `tf.distribute` checkpoints
do). Two things communicate under a MultiWorkerMirroredStrategy: reading a
sync-on-read SUM/MEAN variable, and creating a variable inside the strategy's
scope (Keras 3.15 creates a throwaway optimizer in every `save_weights` and
`load_weights` call, for its attribute skip list; inside the scope its
variables are mirrored and their initial values broadcast from the chief). So
every process loads (or none does, after the check), and when `fit` runs
inside ``strategy.scope()`` or the model holds such a variable, every worker
runs the save, the others into a private scratch folder deleted at once, so
that all issue the same collectives; otherwise the chief saves alone.

Exact resume (the weights and every replica's optimizer state of an
uninterrupted run): the same replica count, and an input pipeline that yields
the same batches for a given epoch whether or not the run was interrupted
(it starts at `saved_epoch`). A backup of format 1 (before the replica
files) restores every replica from replica 0's copies.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf

from tf_adasum.processes import Processes
from tf_adasum.resume import folder, replica_states
from tf_adasum.resume import save as save_lib
from tf_adasum.resume.folder import METADATA_NAME, Position
from tf_adasum.resume.notice import PREEMPTED_EXIT_CODE, PREEMPTION_SIGNALS, PreemptionNotice
from tf_adasum.step import keras_step

__all__ = [
    "METADATA_NAME",
    "PREEMPTED_EXIT_CODE",
    "PREEMPTION_SIGNALS",
    "BackupAndRestore",
    "Position",
    "saved_epoch",
    "saved_position",
]


def saved_epoch(backup_dir: str | os.PathLike) -> int:
    """The epoch the backup in `backup_dir` resumes in (0 without one):
    build the input pipeline from its start.

    Reads ``backup.json`` only: no communication, so every process can call it
    before `model.fit`, e.g. to build an input pipeline that starts at that
    epoch (``dataset.skip(saved_epoch(d) * steps)``, or one seeded shuffle per
    epoch from that epoch on). A backup inside an epoch holds some of its
    batches already: the callback reads those and trains on none of them.

    Examples:
      A folder without a backup (after an interrupted run: see
      `BackupAndRestore`'s example):

      >>> import tempfile
      >>> from tf_adasum.backup import saved_epoch
      >>> with tempfile.TemporaryDirectory() as backup_dir:
      ...     print(saved_epoch(backup_dir))
      0
    """
    return saved_position(backup_dir).epoch


def saved_position(backup_dir: str | os.PathLike) -> Position:
    """Where the backup in `backup_dir` stands: ``Position(epoch, batch)``,
    the epochs complete and the batches of the next one it holds
    (``Position(0, 0)`` without a backup; batch 0 for backups at epoch ends).
    Reads ``backup.json`` only. The input pipeline still starts at the epoch
    (`saved_epoch`): the callback skips the batches the backup holds.

    Examples:
      >>> import tempfile
      >>> from tf_adasum.backup import saved_position
      >>> with tempfile.TemporaryDirectory() as no_backup_yet:
      ...     print(tuple(saved_position(no_backup_yet)))
      (0, 0)
    """
    metadata = folder.read_metadata(folder.backup_dir_argument(backup_dir))
    return Position(0, 0) if metadata is None else Position(metadata["epoch"], metadata.get("batch", 0))


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the training state every epoch and resumes from it, on every engine.

    A drop-in for `keras.callbacks.BackupAndRestore` under
    MultiWorkerMirroredStrategy, under mpirun (the MPI engine, no strategy),
    under MirroredStrategy and in one process; see the module docstring for
    the protocol. Pass the same `backup_dir` on every process: a folder on a
    filesystem all processes share (one per training run; nothing else may
    write there).

    Args:
      backup_dir: the folder of the backup (created by the writer if missing).
      save_freq: ``"epoch"``: a backup at the end of every epoch; an integer
        K >= 1: a backup whenever the run's batch count (over all epochs)
        reaches a multiple of K, with its position in the epoch, and none at
        the end of an epoch otherwise (as in Keras). Needs ``steps_per_epoch``
        (a multiple of ``steps_per_execution``); the input pipeline starts at
        the epoch (`saved_epoch`), and the callback skips the batches of it
        the backup holds.
      delete_checkpoint: delete the backup when `model.fit` completes (as
        Keras does); it is always kept when training is interrupted.
      save_before_preemption: on SIGTERM or SIGUSR1 (a preemption notice;
        `PREEMPTION_SIGNALS`) to any process, every process backs up after
        the batch it is in, then raises ``SystemExit(PREEMPTED_EXIT_CODE)``:
        no batch is lost. Costs one tiny sum over the processes per batch
        when there are several. `fit` must run in the main thread.

    Attributes:
      restored_epoch: after ``on_train_begin``, the epoch training resumed
        in (0 also when training started afresh).
      restored_batch: the batches of that epoch the backup holds already
        (their train calls are skipped: nothing is read or trained).

    Raises (on every process, before any training step): `ValueError` when the
    processes found backups of different positions (each process's is
    named), the backup is damaged, or it is inside an epoch of another length
    than this `fit`'s; `RuntimeError` when another process failed to read the
    backup (that process raises its own error).

    Examples:
      A run of 3 epochs that stops after 2 (here: a first run of 2 epochs
      that keeps its backup), then starts again, as a new process would:

      >>> import os
      >>> import tempfile
      >>> import keras
      >>> import numpy as np
      >>> import tf_adasum
      >>> from tf_adasum.backup import saved_epoch
      >>> def train(epochs, backup):
      ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      ...     model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
      ...     return model.fit(np.ones((8, 3)), np.ones((8, 1)), epochs=epochs, callbacks=[backup], verbose=0)
      >>> scratch = tempfile.TemporaryDirectory()
      >>> backup_dir = os.path.join(scratch.name, "backup")  # created by the first backup
      >>> history = train(2, tf_adasum.BackupAndRestore(backup_dir, delete_checkpoint=False))
      >>> saved_epoch(backup_dir)
      2
      >>> backup = tf_adasum.BackupAndRestore(backup_dir)
      >>> history = train(3, backup)
      >>> backup.restored_epoch, len(history.history["loss"])  # resumed in epoch 2: one epoch left
      (2, 1)
      >>> os.path.exists(backup_dir)  # training completed: the backup is deleted
      False
      >>> scratch.cleanup()
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        save_before_preemption: bool = False,
    ):
        super().__init__()
        self.backup_dir = folder.backup_dir_argument(backup_dir)
        if isinstance(save_freq, int) and not isinstance(save_freq, bool):
            if save_freq < 1:
                raise ValueError(f"`save_freq` must be 'epoch' or an integer >= 1. Received: save_freq={save_freq}")
        elif save_freq != "epoch":
            raise ValueError(f"`save_freq` must be 'epoch' or an integer >= 1. Received: save_freq={save_freq!r}")
        flags = {"delete_checkpoint": delete_checkpoint, "save_before_preemption": save_before_preemption}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"`{name}` must be a bool. Received: {name}={value!r}")
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.save_before_preemption = save_before_preemption
        self.restored_epoch = 0
        """After ``on_train_begin``, the epoch training resumed in (0 also when it started afresh)."""
        self.restored_batch = 0
        self._epoch = 0
        self._saved_batches = 0  # the run's batches the latest backup holds
        self._notice = PreemptionNotice()
        self._processes: Processes | None = None
        self._local_replicas = 1
        self._first_replica = 0
        self._replicas = 1
        self._copies = replica_states.local_copies
        self._reads_communicate = False
        self._set_initial_epoch = False

    @property
    def _is_writer(self) -> bool:
        return self._processes is not None and self._processes.index == 0

    # -- restore ------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        model = self.model
        if not keras_step.has_initial_epoch(model):
            keras_step.set_initial_epoch(model, None)  # raises, naming what is missing
        if not model.built:
            raise ValueError(
                "BackupAndRestore needs a built model before `fit` (give it a `keras.Input`, or call "
                f"`model.build(input_shape)`). Received: an unbuilt {type(model).__name__}"
            )
        keras_step.restore_train_function(model)  # an earlier `fit` may have ended while skipping
        keras_step.seed_states(model)  # raises now, not at the first backup, if Keras lacks what it reads
        self._notice.release(resend=False)  # one left by an earlier `fit` that raised
        strategy = model.distribute_strategy
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:  # its variables must exist to be loaded
            with strategy.scope():
                optimizer.build(model.trainable_variables)
        # The same decision on every process; SimulatedReplicas names its own (its replicas' processes).
        own = getattr(model, "processes", None)
        self._processes = own if isinstance(own, Processes) else Processes.of(strategy)
        self._reads_communicate = replica_states.reading_communicates(
            list(model.variables) + self._optimizer_variables()
        )
        replicas = strategy.num_replicas_in_sync  # of this process, or of every worker together
        self._local_replicas = replicas // self._processes.count if self._processes.kind == "worker" else replicas
        logical = getattr(model, "replica_copies", None)  # SimulatedReplicas: its logical replicas
        self._copies = logical or replica_states.local_copies
        if logical is not None and optimizer is not None:
            self._local_replicas = len(logical(optimizer.iterations))
        metadata, error = None, None
        try:
            steps = self._steps_per_epoch()
            metadata = self._find_backup(steps)
        except Exception as e:  # noqa: BLE001 - raised below, once every process knows
            error = e
        position = Position(metadata["epoch"], metadata.get("batch", 0)) if metadata else Position(0, 0)
        self.restored_epoch, self.restored_batch = self._agree(position, error)
        self._saved_batches = self.restored_epoch * steps + self.restored_batch if steps else 0
        if metadata is not None:
            # Every process loads, or none: loading may communicate (see `_save_communicates`).
            model.load_weights(os.path.join(self.backup_dir, metadata["weights"]))
            self._restore_replicas(metadata)
            keras_step.set_initial_epoch(model, self.restored_epoch)
            keras_step.skip_train_calls(model, self.restored_batch // model.steps_per_execution)
            self._set_initial_epoch = True
        elif self._set_initial_epoch:  # left from an earlier interrupted `fit` of this callback
            keras_step.set_initial_epoch(model, None)
            self._set_initial_epoch = False
        if self.save_before_preemption:
            self._notice.catch()

    def _steps_per_epoch(self) -> int | None:
        """The epoch's batches (`fit`'s ``steps_per_epoch``, or the data's
        known length); a `ValueError` if a position inside an epoch needs it
        and it is unknown, or it is not a multiple of ``steps_per_execution``."""
        steps = (self.params or {}).get("steps")
        inside = self.save_freq != "epoch" or self.save_before_preemption
        received = f"Received: save_freq={self.save_freq!r}, save_before_preemption={self.save_before_preemption}"
        if steps is None and inside:
            raise ValueError(
                "BackupAndRestore with an integer `save_freq` or `save_before_preemption=True` backs up inside "
                f"an epoch, so it needs the epoch's length: pass `steps_per_epoch` to `fit`. {received}, and "
                "no steps_per_epoch"
            )
        per_call = self.model.steps_per_execution
        if inside and steps % per_call:
            raise ValueError(
                "BackupAndRestore backs up inside an epoch after a train call, so `steps_per_epoch` must be a "
                f"multiple of the model's `steps_per_execution`. {received}, steps_per_epoch={steps}, "
                f"steps_per_execution={per_call}"
            )
        return steps

    def _optimizer_variables(self) -> list:
        optimizer = self.model.optimizer
        return list(optimizer.variables) if optimizer is not None else []

    def _find_backup(self, steps: int | None) -> dict | None:
        """The metadata of the backup to restore (None: no backup), every file
        it names checked for its size; no communication."""
        if self._is_writer:
            os.makedirs(self.backup_dir, exist_ok=True)
        metadata = folder.read_metadata(self.backup_dir)
        if metadata is None:
            return None
        folder.check_files(self.backup_dir, metadata)
        variables = len(self._optimizer_variables())
        if metadata.get("variables", variables) != variables:
            raise ValueError(
                f"The backup in {self.backup_dir} holds {metadata['variables']} optimizer variables per replica, "
                f"and this model's optimizer has {variables}: resume with the model and optimizer that made it, "
                "or remove `backup_dir` to start afresh."
            )
        batch, per_call = metadata.get("batch", 0), self.model.steps_per_execution
        if batch and (metadata["steps"] != steps or batch % per_call):
            raise ValueError(
                f"The backup in {self.backup_dir} stands at batch {batch} of epoch {metadata['epoch']} of "
                f"{metadata['steps']} batches; this `fit` has steps_per_epoch={steps} and steps_per_execution="
                f"{per_call}: resume with the same steps_per_epoch and a steps_per_execution that divides {batch}."
            )
        return metadata

    def _agree(self, position: Position, error: Exception | None) -> Position:
        """One small sum over the processes: slot i holds process i's epoch,
        slot n + i whether it failed, slot 2n + i its replica count (which
        numbers the replicas), slot 3n + i its batch in the epoch. Raises on
        every process unless all restored the same position."""
        processes = self._processes
        n, i = processes.count, processes.index
        local = [0.0] * (4 * n)
        local[i], local[n + i] = float(position.epoch), float(error is not None)
        local[2 * n + i], local[3 * n + i] = float(self._local_replicas), float(position.batch)
        total = processes.sum(local, "the check that every rank restored the same backup")
        positions = [Position(int(total[j]), int(total[3 * n + j])) for j in range(n)]
        failed = [j for j in range(n) if total[n + j]]
        self._first_replica = int(sum(total[2 * n : 2 * n + i]))
        self._replicas = int(sum(total[2 * n : 3 * n]))
        if error is not None:
            raise error
        if failed:
            names = ", ".join(f"{processes.kind} {j}" for j in failed[:8])
            raise RuntimeError(
                f"BackupAndRestore: {names} could not restore from {self.backup_dir} (see its error); "
                "no process starts training."
            )
        if len(set(positions)) > 1:
            listed = ", ".join(f"{processes.kind} {j}: {p}" for j, p in enumerate(positions[:16]))
            raise ValueError(
                f"BackupAndRestore: the processes found backups of different epochs in {self.backup_dir} "
                f"({listed}{', ...' if n > 16 else ''}). Every process must see the same `backup_dir`, a "
                "folder on a filesystem shared by all of them, written only by this run."
            )
        return positions[i]

    def _restore_replicas(self, metadata: dict) -> None:
        """Each local replica's optimizer state from its saved replica's
        (`tf_adasum.resume.replica_states`): every variable at the same
        replica count, the innermost optimizer's at another (the wrapper's own
        state restarts as `model.load_weights` left it). A format-1 backup has
        none: `model.load_weights` gave every replica replica 0's. Then the
        model's random-number generators, which `model.save_weights` leaves
        out, from process 0's file."""
        if "shards" not in metadata:
            return
        loaded: dict[str, dict] = {}

        def load(replica: int) -> dict:
            (shard,) = [s for s in metadata["shards"] if s["first"] <= replica < s["first"] + s["count"]]
            if shard["file"] not in loaded:
                with np.load(os.path.join(self.backup_dir, shard["file"])) as values:
                    loaded[shard["file"]] = dict(values)
            return loaded[shard["file"]]

        pairs = list(enumerate(self._optimizer_variables()))
        if metadata["replicas"] != self._replicas:
            own = {id(v) for v in replica_states.innermost_optimizer(self.model.optimizer).variables}
            pairs = [(position, v) for position, v in pairs if id(v) in own]
        replica_states.restore(pairs, self._first_replica, metadata["replicas"], load, self._copies)
        replica_states.restore_seeds(self.model, load(0))  # process 0's file holds replica 0

    # -- save -----------------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        """A backup when the run's batch count reaches a multiple of an integer
        `save_freq`, or when any process caught a preemption notice (then
        `SystemExit`)."""
        preempted = False
        if self.save_before_preemption:
            preempted = self._processes.sum([float(self._notice.pending)], "the check for a preemption notice")[0] > 0
        if self.save_freq == "epoch" and not preempted:
            return
        steps = self.params["steps"]
        done = self._epoch * steps + batch + 1  # the run's batches, this one included
        due = self.save_freq != "epoch" and done // self.save_freq > self._saved_batches // self.save_freq
        if done > self._saved_batches and (preempted or due):  # not a batch the backup held (skipped)
            self._save(Position(*divmod(done, steps)))
        if preempted:
            self._notice.pending = 0  # acted on
            self._notice.release()
            raise SystemExit(PREEMPTED_EXIT_CODE)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(Position(epoch + 1, 0))

    def _save_communicates(self) -> bool:
        """Whether `model.save_weights` may issue collectives across workers: under
        a multi-worker strategy, inside its scope or with a sync-on-read SUM/MEAN
        variable (see the module docstring). The same answer on every worker."""
        return self._processes.kind == "worker" and (self._reads_communicate or tf.distribute.has_strategy())

    def _save(self, position: Position) -> None:
        """Every process's part of the backup at `position` (`tf_adasum.resume.save`)."""
        steps = (self.params or {}).get("steps") or 0
        self._saved_batches = position.epoch * steps + position.batch  # on every process
        job = save_lib.Job(
            self._processes, self.backup_dir, self._first_replica, self._local_replicas, steps, self._copies
        )
        save_lib.save(job, position, self.model, self._optimizer_variables(), self._save_communicates())

    # -- completion -------------------------------------------------------------------

    def on_train_end(self, logs=None):
        self._notice.release()
        if self._set_initial_epoch:  # applies to this `fit` only (Keras' own callback leaves it set)
            keras_step.set_initial_epoch(self.model, None)
            self._set_initial_epoch = False
        if self.delete_checkpoint and self._is_writer and os.path.isdir(self.backup_dir):
            metadata = os.path.join(self.backup_dir, METADATA_NAME)
            if os.path.exists(metadata):
                os.remove(metadata)  # first: a kill from here on leaves no backup, not a damaged one
            folder.remove_files(self.backup_dir)
            try:
                os.rmdir(self.backup_dir)
            except OSError:
                pass  # holds other files: left as it is
