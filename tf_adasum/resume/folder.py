"""The files of a `tf_adasum.BackupAndRestore` folder: their names, the metadata naming them, atomic writes.

A backup is

* ``backup.json`` (`METADATA_NAME`), written last and replaced atomically:
  the format, the position (epoch, batch), the steps per epoch, the weights
  file and its size, every process's replica file with its first replica,
  replica count and size, the replica count and the optimizer's variable
  count;
* ``epoch-000003-<hex>.weights.h5``: the writer's `model.save_weights`;
* ``epoch-000003-batch-000012.replicas-00001.npz``: process 1's replicas'
  copies of the optimizer's variables (`tf_adasum.resume.replica_states`).

Every file is written to a temporary file beside it (``.tmp-<hex>-NAME``),
fsynced, renamed, and the folder fsynced (`commit`), so a kill at any point
leaves ``backup.json`` naming complete files. Standard library and numpy;
no TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

__all__ = [
    "FORMAT",
    "FORMAT_WITHOUT_SHARDS",
    "METADATA_NAME",
    "Position",
    "backup_dir_argument",
    "check_files",
    "commit",
    "read_metadata",
    "remove_files",
    "shard_name",
    "weights_name",
    "write_arrays",
]

#: The file that names the current backup; written last, replaced atomically.
METADATA_NAME = "backup.json"
FORMAT = "tf_adasum.backup/2"
#: Format 1 had no replica files: it restores every replica from replica 0's copies.
FORMAT_WITHOUT_SHARDS = "tf_adasum.backup/1"
_TEMP_PREFIX = ".tmp-"
_WEIGHTS_NAME = re.compile(r"epoch-\d{6,}-[0-9a-f]{8}\.weights\.h5")
_SHARD_NAME = re.compile(r"epoch-\d{6,}-batch-\d{6,}\.replicas-\d{5,}\.npz")


class Position(NamedTuple):
    """Where a backup stands: `epoch` epochs complete and `batch` batches of
    the next one (the run's batch count is ``epoch * steps_per_epoch + batch``)."""

    epoch: int
    batch: int

    def __str__(self) -> str:
        return f"epoch {self.epoch}" + (f" batch {self.batch}" if self.batch else "")


def weights_name(position: Position) -> str:
    """A new weights file's name (its own: a killed save never overwrites a named one)."""
    return f"epoch-{position.epoch:06d}-{uuid.uuid4().hex[:8]}.weights.h5"


def shard_name(position: Position, process: int) -> str:
    """The name of process `process`'s replica file of the backup at `position`."""
    return f"epoch-{position.epoch:06d}-batch-{position.batch:06d}.replicas-{process:05d}.npz"


def backup_dir_argument(value) -> str:
    """`value` as a folder path, or the error naming ``backup_dir`` and the value received."""
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


def _is_count(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _valid_shards(metadata: dict) -> bool:
    """Whether the replica files named cover replicas 0..replicas-1 in order,
    each entry a file name, its first replica, its replica count and size."""
    shards, first = metadata.get("shards"), 0
    counts = (("replicas", 1), ("variables", 0), ("batch", 0), ("steps", 0))
    if not all(_is_count(metadata.get(name), least) for name, least in counts):
        return False
    if not isinstance(shards, list) or not shards:
        return False
    for shard in shards:
        if not (
            isinstance(shard, dict)
            and isinstance(shard.get("file"), str)
            and _SHARD_NAME.fullmatch(shard["file"])
            and shard.get("first") == first
            and _is_count(shard.get("count"), 1)
            and _is_count(shard.get("bytes"), 0)
        ):
            return False
        first += shard["count"]
    return first == metadata["replicas"]


def read_metadata(backup_dir: str) -> dict | None:
    """The current backup's metadata, or None when `backup_dir` holds none;
    a `ValueError` for a ``backup.json`` that is not ours."""
    path = os.path.join(backup_dir, METADATA_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        metadata = json.loads(text)
        valid = (
            metadata.get("format") in (FORMAT, FORMAT_WITHOUT_SHARDS)
            and _is_count(metadata.get("epoch"), 0)
            and _is_count(metadata.get("batch", 0), 0)
            and metadata["epoch"] + metadata.get("batch", 0) >= 1
            and isinstance(metadata.get("weights"), str)
            and _WEIGHTS_NAME.fullmatch(metadata["weights"])
            and _is_count(metadata.get("bytes"), 0)
            and (metadata["format"] == FORMAT_WITHOUT_SHARDS or _valid_shards(metadata))
        )
    except (ValueError, AttributeError, TypeError):
        valid = False
    if not valid:
        raise ValueError(
            f"{path} is not a tf_adasum backup (expected JSON with format {FORMAT!r}, epoch, batch, steps, "
            f"weights, bytes, replicas, variables, shards). `backup_dir` must hold only this callback's files. "
            f"Received: {text[:200]!r}"
        )
    return metadata


def check_files(backup_dir: str, metadata: dict) -> None:
    """A `ValueError` unless every file `metadata` names is there, of its size."""
    named = [(metadata["weights"], metadata["bytes"])]
    named += [(shard["file"], shard["bytes"]) for shard in metadata.get("shards", ())]
    for name, expected in named:
        path = os.path.join(backup_dir, name)
        size = os.path.getsize(path) if os.path.exists(path) else None
        if size != expected:
            found = "it is missing" if size is None else f"it has {size}"
            raise ValueError(
                f"The backup in {backup_dir} is damaged: {METADATA_NAME} names {name} of "
                f"{expected} bytes, but {found}. Remove `backup_dir` to start afresh."
            )


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(backup_dir: str, name: str, write: Callable[[str], None]) -> None:
    """Makes ``backup_dir/name`` appear complete or not at all: `write` to a
    temporary file beside it, fsync, rename, fsync the folder."""
    temp = os.path.join(backup_dir, f"{_TEMP_PREFIX}{uuid.uuid4().hex[:8]}-{name}")
    try:
        write(temp)
        _fsync(temp)
        os.replace(temp, os.path.join(backup_dir, name))
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    _fsync(backup_dir, directory=True)


def write_arrays(path: str, values: dict[str, np.ndarray]) -> None:
    """`values` to `path` as one ``.npz`` file."""
    with open(path, "wb") as f:
        np.savez(f, **values)


def write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)


def remove_files(backup_dir: str, keep=()) -> None:
    """Removes this callback's files (metadata, weights, replica files,
    temporaries) from `backup_dir`, except `keep`. Called when no process
    writes (every process has left the backup, or training has ended)."""
    for entry in sorted(os.listdir(backup_dir)):
        ours = (
            entry == METADATA_NAME
            or entry.startswith(_TEMP_PREFIX)
            or _WEIGHTS_NAME.fullmatch(entry)
            or _SHARD_NAME.fullmatch(entry)
        )
        if ours and entry not in keep:
            try:
                os.remove(os.path.join(backup_dir, entry))
            except FileNotFoundError:
                pass
