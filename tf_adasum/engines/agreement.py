"""What every process must agree on before data moves: the checks that the
processes of a job hold the same variables and settings, over any small
all-gather (MPI's, or TF collectives between workers).

Each check gathers one 32-byte digest per process and, only when the
digests differ, the items themselves, so that every process raises the same
`ValueError` naming process 0's and the first differing process's items.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tf_adasum.engines.base import variable_signature

__all__ = [
    "AllGather",
    "check_same_settings",
    "check_same_variables",
    "differing_items",
    "first_difference",
    "gather_strings",
    "has_value",
]


def has_value(variable) -> bool:
    """False for a variable created in a `tf.function` being traced (it is
    initialised when the function first runs; reading it gives an empty array)."""
    return np.shape(variable.numpy()) == tuple(variable.shape)


#: ``allgather(array, what)``: every process's 1-D numpy `array` (as long on
#: every process), stacked in process order; `what` names the exchange in a
#: deadline error. What the checks below exchange through.
AllGather = Callable[[np.ndarray, str], np.ndarray]


def first_difference(a: Sequence, b: Sequence) -> str:
    """Where two lists first differ, in words."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first difference at position {i}: {x} vs {y}"
    return f"the shorter list ends at position {min(len(a), len(b))}"


def gather_strings(allgather: AllGather, text: str, what: str) -> list[str]:
    """Every process's `text`, in process order (two small gathers; no pickling)."""
    encoded = np.frombuffer(text.encode(), np.uint8)
    lengths = allgather(np.array([encoded.size], np.int64), what)[:, 0]
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: encoded.size] = encoded
    rows = allgather(padded, what)
    return [bytes(np.asarray(row[:n], np.uint8)).decode() for row, n in zip(rows, lengths)]


def differing_items(allgather: AllGather, items: Any, what: str) -> list | None:
    """None when every process holds equal JSON-serialisable `items`; else
    every process's items. One 32-byte digest per process is gathered first,
    the items themselves only when they differ."""
    text = json.dumps(items)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    digests = allgather(digest, f"the check that the {what} agree")
    if (digests == digests[0]).all():
        return None
    return [json.loads(t) for t in gather_strings(allgather, text, f"the comparison of the {what}")]


def check_same_variables(allgather: AllGather, variables: Sequence, what: str, kind: str, plural: str) -> None:
    """Raises ValueError on every process unless all hold the same variable
    list (shapes, dtypes, order); `kind` and `plural` as for `check_same_settings`."""
    everyone = differing_items(allgather, variable_signature(variables), what)
    if everyone is None:
        return
    signatures = [[(tuple(shape), dtype) for shape, dtype in items] for items in everyone]
    differing = [r for r, s in enumerate(signatures) if s != signatures[0]]
    first = differing[0]
    raise ValueError(
        f"The {what} differ across {plural} (shapes, dtypes or order): {kind} 0 has {len(signatures[0])}, "
        f"{kind} {first} has {len(signatures[first])}; {first_difference(signatures[0], signatures[first])}. "
        f"{kind.capitalize()}s differing from {kind} 0: {differing}. Every {kind} must build the same model."
    )


def check_same_settings(allgather: AllGather, settings: dict, what: str, kind: str, plural: str) -> None:
    """Raises ValueError on every process unless all hold the same `settings`
    (a JSON-serialisable dict), naming process 0's and the first differing
    process's. `kind` names one process in the message ("rank", "worker"),
    `plural` all of them ("MPI ranks", "workers")."""
    everyone = differing_items(allgather, settings, what)
    if everyone is None:
        return
    first = next(r for r, items in enumerate(everyone) if items != everyone[0])
    differing = {
        k: (everyone[0].get(k), everyone[first].get(k))
        for k in everyone[0]
        if everyone[0].get(k) != everyone[first].get(k)
    }
    raise ValueError(
        f"The {what} differ across {plural}: {kind} 0 has {everyone[0]}, {kind} {first} has "
        f"{everyone[first]} (differing: {differing}). Every {kind} must run the same program."
    )
