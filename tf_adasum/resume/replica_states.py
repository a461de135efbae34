"""Every replica's own copy of the optimizer's variables: read, and restored by one rule.

In delta mode each replica's inner optimizer takes its own local steps, so its
slots (momentum, Adam's moments) differ from replica to replica, while a
checkpoint of a mirrored variable (`model.save_weights`, tf.distribute's
checkpoints) holds replica 0's copy only. `tf_adasum.BackupAndRestore` saves
what this module reads, one file per process (`tf_adasum.resume.folder`),
and restores it here.

Replicas are numbered over the whole job: the process of index p
(`tf_adasum.processes`) holds the replicas ``first .. first + k - 1``, where
``first`` is the number of replicas of the processes before it and k its own
(a worker's devices in the strategy's order; one rank under mpirun, one
replica without a strategy).

**The rule at restore.** With N replicas saved and M now, replica j takes
saved replica ``j mod N``'s value of each variable it is given (whose saved
shape is its shape): `tf_adasum.BackupAndRestore` gives every optimizer
variable at the same N (the resume is exact) and the innermost optimizer's
at another (its slots and step count; the wrapper's own state, such as
AdaCons' per-replica weights, restarts). So M < N keeps replicas 0..M-1 and
M > N repeats the saved replicas in order. Values are copied bit for bit;
nothing is averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tf_adasum.step import keras_step

__all__ = ["key", "local_copies", "read", "restore", "saved_replica"]


def local_copies(variable) -> list:
    """This process's copies of `variable` (a Keras or TF variable), one per
    local replica in the strategy's order; a plain variable is its own copy."""
    value = keras_step.tf_variable(variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def key(replica: int, position: int) -> str:
    """The name of replica `replica`'s value of the variable at `position`."""
    return f"replica{replica}/variable{position}"


def read(variables: Sequence, first: int) -> dict[str, np.ndarray]:
    """Every local replica's value of each of `variables`, named by `key`
    (the replicas numbered from `first`). Reads each copy on its own device:
    no communication."""
    values = {}
    for position, variable in enumerate(variables):
        for offset, copy in enumerate(local_copies(variable)):
            values[key(first + offset, position)] = copy.numpy()
    return values


def saved_replica(replica: int, saved_replicas: int) -> int:
    """The saved replica whose values replica `replica` takes (the rule above)."""
    return replica % saved_replicas


def restore(
    pairs: Sequence[tuple[int, object]],
    first: int,
    saved_replicas: int,
    load: Callable[[int], Mapping[str, np.ndarray]],
) -> list[str]:
    """Assigns each local replica's copy of each variable of `pairs`
    ((position in `read`'s list, variable)) its saved replica's value (the
    rule above). `load(r)` returns the saved values holding replica r
    (`read`'s names). Returns the paths of the variables left as they were
    (their shape changed with the replica count). No communication."""
    kept = set()
    for position, variable in pairs:
        for offset, copy in enumerate(local_copies(variable)):
            source = saved_replica(first + offset, saved_replicas)
            value = load(source)[key(source, position)]
            if tuple(value.shape) != tuple(copy.shape):
                kept.add(getattr(variable, "path", copy.name))
                continue
            copy.assign(value.astype(copy.dtype.as_numpy_dtype, copy=False))
    return sorted(kept)
