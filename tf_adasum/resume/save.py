"""One backup, written by every process of the job together (`tf_adasum.BackupAndRestore`'s save).

1. Every process writes its replicas' copies of the optimizer's variables
   (`tf_adasum.resume.replica_states`) to a file of its own in the folder
   (`tf_adasum.resume.folder.commit`: a temporary file, fsync, rename).
2. One tiny sum over the processes: every file complete (each process's
   failure flag), and each process's replica count.
3. A second: every process sees every process's file (a folder per process
   instead of a shared one is a `ValueError` on every process).
4. The writer (process 0) writes the weights file (`model.save_weights`),
   then ``backup.json`` naming every file with its size, then removes the
   older files; a process whose `save_weights` communicates (see
   `tf_adasum.backup`) runs one into a scratch folder meanwhile.
5. A third sum, which carries the writer's failure: every process leaves
   together, so none writes while old files go, and none exits before the
   writer is done.

An error on one process is an error on every process after the sum that
follows it (the failing one raises its own; the others a `RuntimeError`
naming it): no process is left waiting in a sum.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import keras

from tf_adasum.resume import folder, replica_states
from tf_adasum.resume.folder import METADATA_NAME, Position

__all__ = ["Job", "save"]


@dataclass(frozen=True)
class Job:
    """What one process's part of a backup needs to know of the job."""

    processes: object  # a `tf_adasum.processes.Processes`
    backup_dir: str
    first_replica: int  # the job-wide number of this process's first replica
    local_replicas: int
    steps: int  # the epoch's batches (0: unknown)
    copies: Callable = replica_states.local_copies  # a variable's copies of this process's replicas


def save(job: Job, position: Position, model: keras.Model, variables: list, save_communicates: bool) -> None:
    """This process's part of the backup at `position` (see the module docstring)."""
    processes = job.processes
    n, i = processes.count, processes.index
    error = None
    try:
        os.makedirs(job.backup_dir, exist_ok=True)
        values = {**replica_states.read(variables, job.first_replica, job.copies), **replica_states.read_seeds(model)}
        folder.commit(job.backup_dir, folder.shard_name(position, i), lambda path: folder.write_arrays(path, values))
    except Exception as e:  # noqa: BLE001 - raised below, once every process knows
        error = e
    local = [0.0] * (2 * n)
    local[i], local[n + i] = float(job.local_replicas), float(error is not None)
    total = processes.sum(local, "the check that every rank wrote its part of the backup")
    _raise_if_failed(job, error, [j for j in range(n) if total[n + j]], "write its part of the backup")
    _check_seen(job, position)
    error = None
    try:
        if i == 0:
            _write(job, position, model, [int(c) for c in total[:n]], len(variables))
        elif save_communicates:  # the same collectives as the writer's save
            with tempfile.TemporaryDirectory(prefix="tf_adasum_backup_") as scratch:
                model.save_weights(os.path.join(scratch, "discarded.weights.h5"))
    except Exception as e:  # noqa: BLE001 - raised below, once every process knows
        error = e
    _raise_if_failed(job, error, _failed(job, error, "the end of the backup"), "finish the backup")


def _failed(job: Job, error: Exception | None, what: str) -> list[int]:
    """One small sum: the processes whose part failed (`error` is this one's)."""
    processes = job.processes
    local = [0.0] * processes.count
    local[processes.index] = float(error is not None)
    return [j for j, flag in enumerate(processes.sum(local, what)) if flag]


def _raise_if_failed(job: Job, error: Exception | None, failed: list[int], what: str) -> None:
    if error is not None:
        raise error
    if failed:
        names = ", ".join(f"{job.processes.kind} {j}" for j in failed[:8])
        raise RuntimeError(f"BackupAndRestore: {names} could not {what} (see its error).")


def _check_seen(job: Job, position: Position) -> None:
    """One small sum: whether every process sees every process's replica file;
    a `ValueError` on every process otherwise, before any metadata."""
    processes = job.processes
    names = [folder.shard_name(position, j) for j in range(processes.count)]
    missing = [name for name in names if not os.path.exists(os.path.join(job.backup_dir, name))]
    blind = _failed(job, ValueError() if missing else None, "the check that every rank sees the backup")
    if blind:
        seen = f" (this one misses {missing[0]})" if missing else ""
        listed = ", ".join(f"{processes.kind} {j}" for j in blind[:8])
        raise ValueError(
            f"BackupAndRestore: {listed} cannot see every process's part of the backup in {job.backup_dir}"
            f"{seen}. Every process must see the same `backup_dir`, a folder on a filesystem shared by all "
            "of them, written only by this run."
        )


def _write(job: Job, position: Position, model: keras.Model, counts: list[int], variables: int) -> None:
    """The writer's part: the weights file, then the metadata naming every
    file, then the older files removed (every other process waits in a sum)."""
    name = folder.weights_name(position)
    folder.commit(job.backup_dir, name, model.save_weights)
    shards, first = [], 0
    for j, count in enumerate(counts):
        file = folder.shard_name(position, j)
        shards.append({"file": file, "first": first, "count": count, "bytes": _size(job, file)})
        first += count
    metadata = {
        "format": folder.FORMAT,
        "epoch": position.epoch,
        "batch": position.batch,
        "steps": job.steps,
        "weights": name,
        "bytes": _size(job, name),
        "processes": len(counts),
        "replicas": first,
        "variables": variables,
        "shards": shards,
        "keras": keras.__version__,
    }
    folder.commit(job.backup_dir, METADATA_NAME, lambda path: folder.write_json(path, metadata))
    folder.remove_files(job.backup_dir, keep=(METADATA_NAME, name, *(s["file"] for s in shards)))


def _size(job: Job, name: str) -> int:
    return os.path.getsize(os.path.join(job.backup_dir, name))
