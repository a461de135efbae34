"""One process of tests/test_processes.py: run by `tf-adasum launch`
(TF_CONFIG: a MultiWorkerMirroredStrategy worker) or by `mpirun` (an MPI
rank, no strategy).

    python processes_worker.py OUTDIR

Writes what `tf_adasum.processes.Processes.of` saw and two sums over the
processes (one before and one after a barrier) to
``OUTDIR/processes_{index}.json``.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from tf_adasum.comm import mpi_transport  # noqa: E402
from tf_adasum.processes import Processes  # noqa: E402

#: Collective timeout: a bug fails the run instead of hanging it.
TIMEOUT_SECONDS = 60.0


def main():
    out = sys.argv[1]
    strategy = None
    if "TF_CONFIG" in os.environ:
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=TIMEOUT_SECONDS)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    processes = Processes.of(strategy)
    first = processes.sum([1, processes.index, 10.0**processes.index])
    processes.barrier()
    second = processes.sum([processes.count], "the second sum")
    report = {"kind": processes.kind, "index": processes.index, "count": processes.count, "sums": [first, second]}
    with open(os.path.join(out, f"processes_{processes.index}.json"), "w") as f:
        json.dump(report, f)
    processes.barrier()  # every report written before any process leaves
    sys.stdout.flush()
    if processes.kind == "rank":
        mpi_transport.mpi().Finalize()  # mpirun treats an exit without it as a failure
    os._exit(0)  # skip TF's teardown, which can wait on peers that already left


if __name__ == "__main__":
    main()
