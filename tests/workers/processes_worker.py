"""The ``processes`` task of tests/workers/distributed_worker.py, for
tests/test_processes.py: in one of the processes that `tf-adasum launch`
(TF_CONFIG: a MultiWorkerMirroredStrategy worker) or `mpirun` (an MPI rank,
no strategy) started.

`report` writes what `tf_adasum.processes.Processes.of` saw and two sums over
the processes (one before and one after a barrier) to
``OUTDIR/processes_{index}.json``.
"""

import json
import os

from tf_adasum.processes import Processes


def report(strategy, out):
    """`strategy`: the worker's MultiWorkerMirroredStrategy, or None for an MPI rank."""
    processes = Processes.of(strategy)
    first = processes.sum([1, processes.index, 10.0**processes.index])
    processes.barrier()
    second = processes.sum([processes.count], "the second sum")
    result = {"kind": processes.kind, "index": processes.index, "count": processes.count, "sums": [first, second]}
    with open(os.path.join(out, f"processes_{processes.index}.json"), "w") as f:
        json.dump(result, f)
    processes.barrier()  # every report written before any process goes on
