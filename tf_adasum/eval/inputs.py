"""Checks of `tf-adasum eval`'s inputs, all made before anything is written.

Each check raises `InputError` with one line naming the option and what it
received; the command prints it and exits with status 2. Standard library and
numpy only: no check loads TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence

from tf_adasum.eval import data
from tf_adasum.eval.config import OPTIONAL_FIELDS, RunConfig

__all__ = ["RECORD_FIELDS", "InputError", "check_data", "check_output_folder", "read_results"]

#: What `--resume` needs of each record in ``results.jsonl``, besides the configuration.
RECORD_FIELDS = (
    "effective_batch", "accuracy_per_epoch", "epochs_until_convergence", "minutes_per_epoch", "score", "final_acc",
    "best_acc",
)  # fmt: skip


class InputError(ValueError):
    """A wrong command-line input; its message is one line."""


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def check_output_folder(out: str, files: Iterable[str]) -> None:
    """`out` is a folder (or can be made one) where `files` can be written."""
    if os.path.isdir(out):
        if not os.access(out, os.W_OK | os.X_OK):
            raise InputError(f"--out is a folder this user cannot write to. Received: --out {out}")
        for name in files:
            path = os.path.join(out, name)
            if os.path.isdir(path):
                raise InputError(
                    f"--out holds a folder {name}, where the evaluation writes a file. Received: --out {out}"
                )
            if os.path.exists(path) and not os.access(path, os.W_OK):
                raise InputError(f"--out holds {name}, which this user cannot overwrite. Received: --out {out}")
    elif os.path.lexists(out):
        raise InputError(f"--out must be a folder, but names a file. Received: --out {out}")
    else:
        existing = _nearest_existing(out)
        if not os.path.isdir(existing):
            raise InputError(f"--out is under {existing}, which is a file, not a folder. Received: --out {out}")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise InputError(f"--out cannot be made: this user cannot write to {existing}. Received: --out {out}")


def check_data(configs: Sequence[RunConfig], data_dir: str | None) -> None:
    """Every dataset of the grid is there (`--data-dir`, or the built-in sources)."""
    for dataset in dict.fromkeys(config.dataset for config in configs):
        try:
            data.check_dataset(dataset, data_dir)
        except (FileNotFoundError, ValueError, ImportError) as error:
            where = f"--data-dir {data_dir}" if data_dir else f"dataset {dataset!r}"
            raise InputError(f"{where}: {error}") from None


def read_results(path: str) -> list[dict]:
    """The records of ``results.jsonl`` at `path` for `--resume` (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    # Fields added later (`OPTIONAL_FIELDS`) take their defaults in records from before them.
    needed = [f.name for f in dataclasses.fields(RunConfig) if f.name not in OPTIONAL_FIELDS] + list(RECORD_FIELDS)
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--resume cannot read {path}: {error}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise InputError(f"--resume: line {number} of {path} is not JSON.") from None
        missing = [name for name in needed if name not in record] if isinstance(record, dict) else needed
        if missing:
            lacks = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise InputError(
                f"--resume: line {number} of {path} is not a result record of this version (it lacks {lacks}); "
                "move the file away, or run without --resume to replace it."
            )
        records.append(record)
    return records
