"""`BackupAndRestore`: resume an interrupted `model.fit` on every engine, from one folder.

Keras 3's own `keras.callbacks.BackupAndRestore` has no multi-worker logic:
every process writes ``backup_dir/latest.weights.h5`` (one shared folder fails
on HDF5's file lock; a folder per worker resumes the workers at different
epochs; a callback on MPI rank 0 only leaves the others at epoch 0). This one
works with one `backup_dir` seen by every process (a shared filesystem):

* **One writer.** The chief (task 0 of a MultiWorkerMirroredStrategy) or MPI
  rank 0 writes; in one process (no strategy, MirroredStrategy) that process.
* **Atomic backups.** At the end of each epoch the writer saves weights and
  optimizer variables (`model.save_weights`) to a temporary file in
  `backup_dir`, fsyncs it and renames it to a name of its own
  (``epoch-000003-<hex>.weights.h5``); then it writes ``backup.json`` the same
  way (temporary file, fsync, ``os.replace``), naming the weights file, the
  epoch and its size; only then are older files removed. A kill at any point
  leaves ``backup.json`` naming a complete weights file of some epoch.
* **Every process restores** at ``on_train_begin``: each reads the same
  ``backup.json`` and checks the weights file it names; one tiny reduction
  over the processes (`tf_adasum.processes`; 2 floats each: its epoch and
  whether it failed) checks that all found the same epoch, a `ValueError` on
  every process naming each process's epoch otherwise (e.g. a folder per
  worker instead of a shared one); then every process loads that file
  (`model.load_weights`, the optimizer built first) and Keras starts at that
  epoch. Nothing has trained yet when an error is raised.
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

Exact resume (the weights of an uninterrupted run): a backup every epoch, and
an input pipeline that yields the same batches for a given epoch whether or
not the run was interrupted (see `saved_epoch`); in gradient mode (and delta
mode with a slot-free optimizer) every replica's state is in the backup.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import uuid
from collections.abc import Callable

import keras
import tensorflow as tf

from tf_adasum.processes import Processes
from tf_adasum.step import keras_step

__all__ = ["METADATA_NAME", "BackupAndRestore", "saved_epoch"]

#: The file that names the current backup; written last, replaced atomically.
METADATA_NAME = "backup.json"
_FORMAT = "tf_adasum.backup/1"
_TEMP_PREFIX = ".tmp-"
_WEIGHTS_NAME = re.compile(r"epoch-\d{6,}-[0-9a-f]{8}\.weights\.h5")
_COMMUNICATING_AGGREGATIONS = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)


def _backup_dir_argument(value) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`backup_dir` must be a path (str or os.PathLike). Received: backup_dir={value!r}")
    path = os.fspath(value)
    received = f"Received: backup_dir={path!r}"
    if not path:
        raise ValueError(f"`backup_dir` must not be empty. {received}")
    if "://" in path:
        raise ValueError(
            "`backup_dir` must be a folder of a mounted filesystem (shared by all workers); URLs are not "
            f"supported, since the backup relies on atomic renames. {received}"
        )
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ValueError(f"`backup_dir` names a file; it must name a folder. {received}")
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"`backup_dir` is under {existing}, which is a file, not a folder. {received}")
    return path


def _read_metadata(backup_dir: str) -> dict | None:
    """The current backup's metadata, or None when `backup_dir` holds none."""
    path = os.path.join(backup_dir, METADATA_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        metadata = json.loads(text)
        valid = (
            metadata.get("format") == _FORMAT
            and isinstance(metadata.get("epoch"), int)
            and metadata["epoch"] >= 1
            and isinstance(metadata.get("weights"), str)
            and _WEIGHTS_NAME.fullmatch(metadata["weights"])
            and isinstance(metadata.get("bytes"), int)
        )
    except (ValueError, AttributeError):
        valid = False
    if not valid:
        raise ValueError(
            f"{path} is not a tf_adasum backup (expected JSON with format {_FORMAT!r}, epoch, weights, bytes). "
            f"`backup_dir` must hold only this callback's files. Received: {text[:200]!r}"
        )
    return metadata


def saved_epoch(backup_dir: str | os.PathLike) -> int:
    """The number of epochs the backup in `backup_dir` holds (0 without one).

    Reads ``backup.json`` only: no communication, so every process can call it
    before `model.fit`, e.g. to build an input pipeline that starts at the
    epoch training will resume from (``dataset.skip(saved_epoch(d) * steps)``,
    or one seeded shuffle per epoch from that epoch on).
    """
    metadata = _read_metadata(_backup_dir_argument(backup_dir))
    return 0 if metadata is None else metadata["epoch"]


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reading_communicates(variables) -> bool:
    """Whether reading any of `variables` outside a replica context reduces
    across replicas (a sync-on-read variable with a SUM or MEAN aggregation)."""
    for variable in variables:
        value = getattr(variable, "value", variable)  # a Keras variable holds the tf.Variable
        if (
            getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ
            and getattr(value, "aggregation", None) in _COMMUNICATING_AGGREGATIONS
        ):
            return True
    return False


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
      save_freq: ``"epoch"``: a backup at the end of every epoch.
      delete_checkpoint: delete the backup when `model.fit` completes (as
        Keras does); it is always kept when training is interrupted.

    Attributes:
      restored_epoch: after ``on_train_begin``, the epoch training resumed
        from (0: no backup, training started afresh).

    Raises (on every process, before any training step): `ValueError` when the
    processes found backups of different epochs (each process's epoch is
    named) or the backup is damaged; `RuntimeError` when another process
    failed to read the backup (that process raises its own error).
    """

    def __init__(self, backup_dir: str | os.PathLike, save_freq: str = "epoch", delete_checkpoint: bool = True):
        super().__init__()
        self.backup_dir = _backup_dir_argument(backup_dir)
        if isinstance(save_freq, int) and not isinstance(save_freq, bool):
            raise NotImplementedError(
                "BackupAndRestore saves at the end of each epoch only: resuming mid-epoch would also need the "
                f"input pipeline's position. Use save_freq='epoch'. Received: save_freq={save_freq!r}"
            )
        if save_freq != "epoch":
            raise ValueError(f"`save_freq` must be 'epoch'. Received: save_freq={save_freq!r}")
        if not isinstance(delete_checkpoint, bool):
            raise TypeError(f"`delete_checkpoint` must be a bool. Received: delete_checkpoint={delete_checkpoint!r}")
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.restored_epoch = 0
        self._processes: Processes | None = None
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
        strategy = model.distribute_strategy
        optimizer = model.optimizer
        if optimizer is not None and not optimizer.built:  # its variables must exist to be loaded
            with strategy.scope():
                optimizer.build(model.trainable_variables)
        self._processes = Processes.of(strategy)  # the same decision on every process
        optimizer_variables = list(optimizer.variables) if optimizer is not None else []
        self._reads_communicate = _reading_communicates(list(model.variables) + optimizer_variables)
        metadata, error = None, None
        try:
            metadata = self._find_backup()
        except Exception as e:  # noqa: BLE001 - raised below, once every process knows
            error = e
        self.restored_epoch = self._agree(metadata["epoch"] if metadata else 0, error)
        if self.restored_epoch:
            # Every process loads, or none: loading may communicate (see `_save_communicates`).
            model.load_weights(os.path.join(self.backup_dir, metadata["weights"]))
            keras_step.set_initial_epoch(model, self.restored_epoch)
            self._set_initial_epoch = True
        elif self._set_initial_epoch:  # left from an earlier interrupted `fit` of this callback
            keras_step.set_initial_epoch(model, None)
            self._set_initial_epoch = False

    def _find_backup(self) -> dict | None:
        """The metadata of the backup to restore (None: no backup), its weights
        file checked; no communication."""
        if self._is_writer:
            os.makedirs(self.backup_dir, exist_ok=True)
        metadata = _read_metadata(self.backup_dir)
        if metadata is None:
            return None
        weights = os.path.join(self.backup_dir, metadata["weights"])
        size = os.path.getsize(weights) if os.path.exists(weights) else None
        if size != metadata["bytes"]:
            found = "it is missing" if size is None else f"it has {size}"
            raise ValueError(
                f"The backup in {self.backup_dir} is damaged: {METADATA_NAME} names {metadata['weights']} of "
                f"{metadata['bytes']} bytes, but {found}. Remove `backup_dir` to start afresh."
            )
        return metadata

    def _agree(self, epoch: int, error: Exception | None) -> int:
        """One small sum over the processes: slot i holds process i's epoch, slot
        n + i whether it failed. Raises on every process unless all restored
        the same epoch."""
        processes = self._processes
        n, i = processes.count, processes.index
        local = [0.0] * (2 * n)
        local[i], local[n + i] = float(epoch), float(error is not None)
        total = processes.sum(local, "the check that every rank restored the same backup")
        epochs, failed = [int(e) for e in total[:n]], [j for j in range(n) if total[n + j]]
        if error is not None:
            raise error
        if failed:
            names = ", ".join(f"{processes.kind} {j}" for j in failed[:8])
            raise RuntimeError(
                f"BackupAndRestore: {names} could not restore from {self.backup_dir} (see its error); "
                "no process starts training."
            )
        if len(set(epochs)) > 1:
            listed = ", ".join(f"{processes.kind} {j}: epoch {e}" for j, e in enumerate(epochs[:16]))
            raise ValueError(
                f"BackupAndRestore: the processes found backups of different epochs in {self.backup_dir} "
                f"({listed}{', ...' if n > 16 else ''}). Every process must see the same `backup_dir`, a "
                "folder on a filesystem shared by all of them, written only by this run."
            )
        return epochs[i]

    # -- save -----------------------------------------------------------------------

    def on_epoch_end(self, epoch, logs=None):
        if self._is_writer:
            self._save(epoch + 1)
        elif self._save_communicates():  # the same collectives as the writer's save
            with tempfile.TemporaryDirectory(prefix="tf_adasum_backup_") as scratch:
                self.model.save_weights(os.path.join(scratch, "discarded.weights.h5"))

    def _save_communicates(self) -> bool:
        """Whether `model.save_weights` may issue collectives across workers: under
        a multi-worker strategy, inside its scope or with a sync-on-read SUM/MEAN
        variable (see the module docstring). The same answer on every worker."""
        return self._processes.kind == "worker" and (self._reads_communicate or tf.distribute.has_strategy())

    def _save(self, epoch: int) -> None:
        """Weights file first, then the metadata naming it, each atomically;
        then the files no backup names any more."""
        os.makedirs(self.backup_dir, exist_ok=True)
        name = f"epoch-{epoch:06d}-{uuid.uuid4().hex[:8]}.weights.h5"
        self._commit(name, self.model.save_weights)
        metadata = {
            "format": _FORMAT,
            "epoch": epoch,
            "weights": name,
            "bytes": os.path.getsize(os.path.join(self.backup_dir, name)),
            "processes": self._processes.count,
            "keras": keras.__version__,
        }

        def write_metadata(path):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(metadata, f)

        self._commit(METADATA_NAME, write_metadata)
        self._remove_files(keep=(METADATA_NAME, name))

    def _commit(self, name: str, write: Callable[[str], None]) -> None:
        """Makes ``backup_dir/name`` appear complete or not at all: `write` to a
        temporary file beside it, fsync, rename, fsync the folder."""
        temp = os.path.join(self.backup_dir, f"{_TEMP_PREFIX}{uuid.uuid4().hex[:8]}-{name}")
        try:
            write(temp)
            _fsync(temp)
            os.replace(temp, os.path.join(self.backup_dir, name))
        finally:
            if os.path.exists(temp):
                os.remove(temp)
        _fsync(self.backup_dir, directory=True)

    def _remove_files(self, keep=()) -> None:
        """Removes this callback's files (weights, metadata, temporaries) except `keep`."""
        for entry in sorted(os.listdir(self.backup_dir)):
            ours = entry == METADATA_NAME or entry.startswith(_TEMP_PREFIX) or _WEIGHTS_NAME.fullmatch(entry)
            if ours and entry not in keep:
                try:
                    os.remove(os.path.join(self.backup_dir, entry))
                except FileNotFoundError:
                    pass

    # -- completion -------------------------------------------------------------------

    def on_train_end(self, logs=None):
        if self._set_initial_epoch:  # applies to this `fit` only (Keras' own callback leaves it set)
            keras_step.set_initial_epoch(self.model, None)
            self._set_initial_epoch = False
        if self.delete_checkpoint and self._is_writer and os.path.isdir(self.backup_dir):
            metadata = os.path.join(self.backup_dir, METADATA_NAME)
            if os.path.exists(metadata):
                os.remove(metadata)  # first: a kill from here on leaves no backup, not a damaged one
            self._remove_files()
            try:
                os.rmdir(self.backup_dir)
            except OSError:
                pass  # holds other files: left as it is
