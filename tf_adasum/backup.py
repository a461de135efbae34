"""`BackupAndRestore`: resume an interrupted `model.fit` on every engine, from one folder.

Keras 3's own `keras.callbacks.BackupAndRestore` has no multi-worker logic:
every process writes ``backup_dir/latest.weights.h5`` (one shared folder fails
on HDF5's file lock; a folder per worker resumes the workers at different
epochs; a callback on MPI rank 0 only leaves the others at epoch 0). This one
works with one `backup_dir` seen by every process (a shared filesystem):

* **One writer, and a shard per process.** At the end of each epoch every
  process writes its replicas' own copies of the optimizer's variables (each
  replica's momentum or Adam moments in delta mode differ; a mirrored
  variable's checkpoint holds replica 0's only) to a file of its own,
  ``epoch-000003.replicas-00001.npz`` (`tf_adasum.step.replica_states`); no
  process gathers the others'. The chief (task 0 of a
  MultiWorkerMirroredStrategy) or MPI rank 0, in one process that process,
  also writes the weights and optimizer variables (`model.save_weights`).
* **Atomic backups.** Every file goes to a temporary file in `backup_dir`,
  fsynced, then renamed (the weights to a name of its own,
  ``epoch-000003-<hex>.weights.h5``). After one tiny reduction over the
  processes (each process's replica count and whether its shard failed), the
  writer writes ``backup.json`` the same way (temporary file, fsync,
  ``os.replace``), naming the weights file, every shard and their sizes, the
  epoch and the replica count; only then are older files removed. A kill at
  any point leaves ``backup.json`` naming complete files of some epoch.
* **Every process restores** at ``on_train_begin``: each reads the same
  ``backup.json`` and checks the weights file it names; one tiny reduction
  over the processes (`tf_adasum.processes`; 2 floats each: its epoch and
  whether it failed) checks that all found the same epoch, a `ValueError` on
  every process naming each process's epoch otherwise (e.g. a folder per
  worker instead of a shared one); then every process loads that file
  (`model.load_weights`, the optimizer built first), then gives each of its
  replicas its saved replica's copies of the optimizer's variables (replica j
  takes saved replica j mod N, N the replicas saved: exact at the same
  replica count, and a fixed rule at another; `tf_adasum.step.replica_states`),
  and Keras starts at that epoch. Nothing has trained yet when an error is
  raised.
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
uninterrupted run): a backup every epoch, the same replica count, and an input
pipeline that yields the same batches for a given epoch whether or not the run
was interrupted (see `saved_epoch`). A backup of format 1 (before the shards)
restores every replica from replica 0's copies.
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import uuid
from collections.abc import Callable
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from tf_adasum.processes import Processes
from tf_adasum.step import keras_step, replica_states

__all__ = ["METADATA_NAME", "PREEMPTED_EXIT_CODE", "BackupAndRestore", "Position", "saved_epoch", "saved_position"]

#: The file that names the current backup; written last, replaced atomically.
METADATA_NAME = "backup.json"
_FORMAT = "tf_adasum.backup/2"
#: Format 1 had no shards: it restores every replica from replica 0's copies.
_FORMAT_WITHOUT_SHARDS = "tf_adasum.backup/1"
_TEMP_PREFIX = ".tmp-"
_WEIGHTS_NAME = re.compile(r"epoch-\d{6,}-[0-9a-f]{8}\.weights\.h5")
_SHARD_NAME = re.compile(r"epoch-\d{6,}-batch-\d{6,}\.replicas-\d{5,}\.npz")
#: The exit code of every process after the backup that a SIGTERM asked for (128 + SIGTERM, as a shell shows it).
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
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
            metadata.get("format") in (_FORMAT, _FORMAT_WITHOUT_SHARDS)
            and _is_count(metadata.get("epoch"), 0)
            and _is_count(metadata.get("batch", 0), 0)
            and metadata["epoch"] + metadata.get("batch", 0) >= 1
            and isinstance(metadata.get("weights"), str)
            and _WEIGHTS_NAME.fullmatch(metadata["weights"])
            and _is_count(metadata.get("bytes"), 0)
            and (metadata["format"] == _FORMAT_WITHOUT_SHARDS or _valid_shards(metadata))
        )
    except (ValueError, AttributeError, TypeError):
        valid = False
    if not valid:
        raise ValueError(
            f"{path} is not a tf_adasum backup (expected JSON with format {_FORMAT!r}, epoch, weights, bytes, "
            f"replicas, variables, shards). `backup_dir` must hold only this callback's files. "
            f"Received: {text[:200]!r}"
        )
    return metadata


def _is_count(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _valid_shards(metadata: dict) -> bool:
    """Whether the shards named cover replicas 0..replicas-1 in order, each
    entry a shard file name, its first replica, its replica count and size."""
    shards, first = metadata.get("shards"), 0
    counts = (("replicas", 1), ("variables", 0), ("batch", 0))
    if not all(_is_count(metadata.get(name), least) for name, least in counts):
        return False
    if not isinstance(shards, list) or not shards:
        return False
    for shard in shards:
        if not (
            isinstance(shard.get("file"), str)
            and _SHARD_NAME.fullmatch(shard["file"])
            and shard.get("first") == first
            and _is_count(shard.get("count"), 1)
            and _is_count(shard.get("bytes"), 0)
        ):
            return False
        first += shard["count"]
    return first == metadata["replicas"]


def _shard_name(position: Position, process: int) -> str:
    return f"epoch-{position.epoch:06d}-batch-{position.batch:06d}.replicas-{process:05d}.npz"


class Position(NamedTuple):
    """Where a backup stands: `epoch` epochs complete and `batch` batches of
    the next one (the run's batch count is ``epoch * steps_per_epoch + batch``)."""

    epoch: int
    batch: int

    def __str__(self) -> str:
        return f"epoch {self.epoch}" + (f" batch {self.batch}" if self.batch else "")


def saved_epoch(backup_dir: str | os.PathLike) -> int:
    """The number of epochs the backup in `backup_dir` holds (0 without one).

    Reads ``backup.json`` only: no communication, so every process can call it
    before `model.fit`, e.g. to build an input pipeline that starts at the
    epoch training will resume from (``dataset.skip(saved_epoch(d) * steps)``,
    or one seeded shuffle per epoch from that epoch on).
    """
    return saved_position(backup_dir).epoch


def saved_position(backup_dir: str | os.PathLike) -> Position:
    """Where the backup in `backup_dir` stands: ``Position(epoch, batch)``,
    epochs complete and batches of the next one (``Position(0, 0)`` without
    a backup; batch 0 for every backup of ``save_freq="epoch"``).

    Reads ``backup.json`` only, like `saved_epoch`: build the input pipeline
    from it, so that the resumed run reads the batches after the backup's and
    no other (``epoch_batches(epoch).skip(batch)`` for the first epoch, then
    the later epochs whole; or ``stream.skip(epoch * steps + batch)``).
    """
    metadata = _read_metadata(_backup_dir_argument(backup_dir))
    return Position(0, 0) if metadata is None else Position(metadata["epoch"], metadata.get("batch", 0))


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_arrays(path: str, values: dict) -> None:
    with open(path, "wb") as f:
        np.savez(f, **values)


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
      save_freq: ``"epoch"``: a backup at the end of every epoch; an integer
        K >= 1: a backup whenever the run's batch count (over all epochs)
        reaches a multiple of K, with its position in the epoch, and none at
        the end of an epoch otherwise (as in Keras). Resuming inside an epoch
        needs ``steps_per_epoch`` and an input pipeline that starts at
        `saved_position` (see the module docstring).
      delete_checkpoint: delete the backup when `model.fit` completes (as
        Keras does); it is always kept when training is interrupted.
      save_before_preemption: on SIGTERM (a preemption notice) to any
        process, every process backs up after the batch it is in, then
        raises ``SystemExit(PREEMPTED_EXIT_CODE)``: no batch is lost. Costs
        one tiny sum over the processes per batch when there are several.
        `fit` must run in the main thread.

    Attributes:
      restored_epoch: after ``on_train_begin``, the epoch training resumed
        in (0 also when training started afresh).
      restored_batch: the batches of that epoch the backup holds already
        (their train calls are skipped: nothing is read or trained).

    Raises (on every process, before any training step): `ValueError` when the
    processes found backups of different epochs (each process's epoch is
    named) or the backup is damaged; `RuntimeError` when another process
    failed to read the backup (that process raises its own error).
    """

    def __init__(
        self,
        backup_dir: str | os.PathLike,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        save_before_preemption: bool = False,
    ):
        super().__init__()
        self.backup_dir = _backup_dir_argument(backup_dir)
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
        self.restored_batch = 0
        self._epoch = 0
        self._saved_batches = 0  # the run's batches the latest backup holds
        self._preempted = False
        self._previous_handler = None
        self._processes: Processes | None = None
        self._local_replicas = 1
        self._first_replica = 0
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
        self._reads_communicate = _reading_communicates(list(model.variables) + self._optimizer_variables())
        replicas = strategy.num_replicas_in_sync  # of this process, or of every worker together
        self._local_replicas = replicas // self._processes.count if self._processes.kind == "worker" else replicas
        metadata, error = None, None
        try:
            metadata = self._find_backup()
        except Exception as e:  # noqa: BLE001 - raised below, once every process knows
            error = e
        steps = self._steps_per_epoch()
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
            self._catch_sigterm()

    def _steps_per_epoch(self) -> int | None:
        """The epoch's batches (`fit`'s ``steps_per_epoch``, or the data's
        known length); a `ValueError` if a position inside an epoch needs it
        and it is unknown."""
        steps = (self.params or {}).get("steps")
        if steps is None and (self.save_freq != "epoch" or self.save_before_preemption):
            raise ValueError(
                "BackupAndRestore with an integer `save_freq` or `save_before_preemption=True` backs up inside "
                "an epoch, so it needs the epoch's length: pass `steps_per_epoch` to `fit`. Received: "
                f"save_freq={self.save_freq!r}, save_before_preemption={self.save_before_preemption}, and "
                "no steps_per_epoch"
            )
        return steps

    def _catch_sigterm(self) -> None:
        def preempted(signum, frame):
            self._preempted = True

        try:
            self._previous_handler = signal.signal(signal.SIGTERM, preempted)
        except ValueError as e:  # not the main thread
            raise RuntimeError(
                "BackupAndRestore(save_before_preemption=True) catches SIGTERM, which Python allows in the "
                f"main thread only: call `fit` there. ({e})"
            ) from e

    def _release_sigterm(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def _optimizer_variables(self) -> list:
        optimizer = self.model.optimizer
        return list(optimizer.variables) if optimizer is not None else []

    def _find_backup(self) -> dict | None:
        """The metadata of the backup to restore (None: no backup), every file
        it names checked for its size; no communication."""
        if self._is_writer:
            os.makedirs(self.backup_dir, exist_ok=True)
        metadata = _read_metadata(self.backup_dir)
        if metadata is None:
            return None
        named = [(metadata["weights"], metadata["bytes"])]
        named += [(shard["file"], shard["bytes"]) for shard in metadata.get("shards", ())]
        for name, expected in named:
            path = os.path.join(self.backup_dir, name)
            size = os.path.getsize(path) if os.path.exists(path) else None
            if size != expected:
                found = "it is missing" if size is None else f"it has {size}"
                raise ValueError(
                    f"The backup in {self.backup_dir} is damaged: {METADATA_NAME} names {name} of "
                    f"{expected} bytes, but {found}. Remove `backup_dir` to start afresh."
                )
        variables = len(self._optimizer_variables())
        if metadata.get("variables", variables) != variables:
            raise ValueError(
                f"The backup in {self.backup_dir} holds {metadata['variables']} optimizer variables per replica, "
                f"and this model's optimizer has {variables}: resume with the model and optimizer that made it, "
                "or remove `backup_dir` to start afresh."
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
        """Each local replica's copies of the optimizer's variables from its
        saved replica's (`tf_adasum.step.replica_states`); a format-1 backup
        has none, and `model.load_weights` gave every replica replica 0's."""
        if "shards" not in metadata:
            return
        loaded: dict[str, dict] = {}

        def load(replica: int) -> dict:
            (shard,) = [s for s in metadata["shards"] if s["first"] <= replica < s["first"] + s["count"]]
            if shard["file"] not in loaded:
                with np.load(os.path.join(self.backup_dir, shard["file"])) as values:
                    loaded[shard["file"]] = dict(values)
            return loaded[shard["file"]]

        replica_states.restore(self._optimizer_variables(), self._first_replica, metadata["replicas"], load)

    # -- save -----------------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        """A backup when the run's batch count reaches a multiple of an integer
        `save_freq`, or when any process got SIGTERM (then `SystemExit`)."""
        preempted = False
        if self.save_before_preemption:
            preempted = self._processes.sum([float(self._preempted)], "the check for a preemption notice")[0] > 0
        if self.save_freq == "epoch" and not preempted:
            return
        steps = self.params["steps"]
        done = self._epoch * steps + batch + 1  # the run's batches, this one included
        if done <= self._saved_batches:
            return  # a batch the backup held already (skipped on resume)
        if preempted or (self.save_freq != "epoch" and done // self.save_freq > self._saved_batches // self.save_freq):
            self._save(Position(*divmod(done, steps)))
        if preempted:
            self._release_sigterm()
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
        """Every process's shard; one small sum (every shard complete, and
        the replica counts); then the writer's weights file and the metadata
        naming them all, each atomically; then the files no backup names."""
        processes = self._processes
        n, i = processes.count, processes.index
        epoch = position.epoch
        self._saved_batches = epoch * ((self.params or {}).get("steps") or 0) + position.batch  # on every process
        shard = _shard_name(position, i)
        variables = self._optimizer_variables()
        error = None
        try:
            os.makedirs(self.backup_dir, exist_ok=True)
            values = replica_states.read(variables, self._first_replica)
            self._commit(shard, lambda path: _write_arrays(path, values))
        except Exception as e:  # noqa: BLE001 - raised below, once every process knows
            error = e
        local = [0.0] * (2 * n)
        local[i], local[n + i] = float(self._local_replicas), float(error is not None)
        total = processes.sum(local, "the check that every rank wrote its part of the backup")
        if error is not None:
            raise error
        failed = [j for j in range(n) if total[n + j]]
        if failed:
            names = ", ".join(f"{processes.kind} {j}" for j in failed[:8])
            raise RuntimeError(f"BackupAndRestore: {names} could not write its part of the backup (see its error).")
        self._check_shards_seen(position)
        if not self._is_writer:
            if self._save_communicates():  # the same collectives as the writer's save
                with tempfile.TemporaryDirectory(prefix="tf_adasum_backup_") as scratch:
                    self.model.save_weights(os.path.join(scratch, "discarded.weights.h5"))
            return
        name = f"epoch-{epoch:06d}-{uuid.uuid4().hex[:8]}.weights.h5"
        self._commit(name, self.model.save_weights)
        shards, first = [], 0
        for j, count in enumerate(int(c) for c in total[:n]):
            file = _shard_name(position, j)
            size = os.path.getsize(os.path.join(self.backup_dir, file))
            shards.append({"file": file, "first": first, "count": count, "bytes": size})
            first += count
        metadata = {
            "format": _FORMAT,
            "epoch": epoch,
            "batch": position.batch,
            "weights": name,
            "bytes": os.path.getsize(os.path.join(self.backup_dir, name)),
            "processes": n,
            "replicas": first,
            "variables": len(variables),
            "shards": shards,
            "keras": keras.__version__,
        }

        def write_metadata(path):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(metadata, f)

        self._commit(METADATA_NAME, write_metadata)
        self._remove_files(keep=(METADATA_NAME, name, *(s["file"] for s in shards)))

    def _check_shards_seen(self, position: Position) -> None:
        """One small sum: whether every process sees every process's shard in
        `backup_dir`; a `ValueError` on every process otherwise (a folder per
        process instead of a shared one), before the metadata names them."""
        processes = self._processes
        n, i = processes.count, processes.index
        missing = [j for j in range(n) if not os.path.exists(os.path.join(self.backup_dir, _shard_name(position, j)))]
        local = [0.0] * n
        local[i] = float(bool(missing))
        blind = [j for j, flag in enumerate(processes.sum(local, "the check that every rank sees the backup")) if flag]
        if blind:
            seen = f" (this one misses {_shard_name(position, missing[0])})" if missing else ""
            names = ", ".join(f"{processes.kind} {j}" for j in blind[:8])
            raise ValueError(
                f"BackupAndRestore: {names} cannot see every process's part of the backup in {self.backup_dir}"
                f"{seen}. Every process must see the same `backup_dir`, a folder on a filesystem shared by all "
                "of them, written only by this run."
            )

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
            ours = (
                entry == METADATA_NAME
                or entry.startswith(_TEMP_PREFIX)
                or _WEIGHTS_NAME.fullmatch(entry)
                or _SHARD_NAME.fullmatch(entry)
            )
            if ours and entry not in keep:
                try:
                    os.remove(os.path.join(self.backup_dir, entry))
                except FileNotFoundError:
                    pass

    # -- completion -------------------------------------------------------------------

    def on_train_end(self, logs=None):
        self._release_sigterm()
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
