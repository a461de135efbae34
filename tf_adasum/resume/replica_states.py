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
replica without a strategy; a `tf_adasum.SimulatedReplicas` its logical
replicas, whose copies its ``replica_copies`` gives in place of
`local_copies`).

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

__all__ = [
    "innermost_optimizer",
    "key",
    "local_copies",
    "read",
    "read_seeds",
    "reading_communicates",
    "restore",
    "restore_seeds",
    "saved_replica",
]

_COMMUNICATING_AGGREGATIONS = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)


def innermost_optimizer(optimizer):
    """The optimizer whose slots each replica owns: the innermost of wrappers
    (AdasumOptimizer, LossScaleOptimizer) that hold an ``inner_optimizer``."""
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def reading_communicates(variables) -> bool:
    """Whether reading any of `variables` outside a replica context reduces
    across replicas (a sync-on-read variable with a SUM or MEAN aggregation)."""
    for variable in variables:
        value = keras_step.tf_variable(variable)
        if (
            getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_READ
            and getattr(value, "aggregation", None) in _COMMUNICATING_AGGREGATIONS
        ):
            return True
    return False


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


def read(variables: Sequence, first: int, copies: Callable = local_copies) -> dict[str, np.ndarray]:
    """Every local replica's value of each of `variables`, named by `key`
    (the replicas numbered from `first`; ``copies(variable)``: its local
    replicas' copies). Reads each copy on its own device: no communication."""
    values = {}
    for position, variable in enumerate(variables):
        for offset, copy in enumerate(copies(variable)):
            values[key(first + offset, position)] = copy.numpy()
    return values


def read_seeds(model) -> dict[str, np.ndarray]:
    """The states of the model's random-number generators (dropout, random
    augmentation; `tf_adasum.step.keras_step.seed_states`), named ``seed/i``:
    `model.save_weights` leaves them out, and without them a resumed run
    would draw other dropout masks than an uninterrupted one."""
    return {f"seed/{i}": state.numpy() for i, state in enumerate(keras_step.seed_states(model))}


def restore_seeds(model, saved: Mapping[str, np.ndarray]) -> None:
    """Assigns each generator state its value in `saved` (`read_seeds`'s
    names; a backup without them leaves the generators as they are)."""
    for i, state in enumerate(keras_step.seed_states(model)):
        if f"seed/{i}" in saved and tuple(saved[f"seed/{i}"].shape) == tuple(state.shape):
            state.assign(saved[f"seed/{i}"])


def saved_replica(replica: int, saved_replicas: int) -> int:
    """The saved replica whose values replica `replica` takes (the rule above)."""
    return replica % saved_replicas


def restore(
    pairs: Sequence[tuple[int, object]],
    first: int,
    saved_replicas: int,
    load: Callable[[int], Mapping[str, np.ndarray]],
    copies: Callable = local_copies,
) -> list[str]:
    """Assigns each local replica's copy of each variable of `pairs`
    ((position in `read`'s list, variable)) its saved replica's value (the
    rule above). `load(r)` returns the saved values holding replica r
    (`read`'s names). Returns the paths of the variables left as they were
    (their shape changed with the replica count). ``copies`` as for `read`.
    No communication."""
    kept = set()
    for position, variable in pairs:
        for offset, copy in enumerate(copies(variable)):
            source = saved_replica(first + offset, saved_replicas)
            value = load(source)[key(source, position)]
            if tuple(value.shape) != tuple(copy.shape):
                kept.add(getattr(variable, "path", copy.name))
                continue
            copy.assign(value.astype(copy.dtype.as_numpy_dtype, copy=False))
    return sorted(kept)
