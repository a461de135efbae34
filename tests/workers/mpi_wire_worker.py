"""One rank of `tests/test_mpi_wire.py`: what the MPI wire must survive.

    mpirun -np 2 python mpi_wire_worker.py OUTDIR
    mpirun -np 3 python mpi_wire_worker.py OUTDIR last_differs

Every rank runs the same tasks in order and writes ``OUTDIR/wire_rank{R}.json``
(plus ``OUTDIR/path_rank{R}.npz``); the test holds the oracle:

* ``native_mismatch``: the native tree with 100000 float32 on rank 0 and
  60000 on rank 1; then float32 on rank 0 and float64 on rank 1 (the same
  count); then an agreeing call on the same communicator; then the native
  sum and gather with 3 and 5 (2 and 3) elements, and an agreeing sum.
* ``python_mismatch``: the same sizes through the mpi4py path's swap, then an
  agreeing swap; then, past the agreement, a message shorter than its
  receive, and a retry on that communicator.
* ``helpers``: `tf_adasum.mpi.check_same_variables` and `broadcast_variables`
  from rank 1, then a list that differs on rank 1, then bad arguments.
* ``path``: rank 1 sets ``TF_ADASUM_MPI_NATIVE=0``, both build an MPI engine
  (its warnings recorded) and combine tensors with it and, for comparison,
  with the mpi4py path directly.

With ``last_differs`` (three ranks) it runs only that task and writes
``OUTDIR/last_rank{R}.json``: the mpi4py path's whole tree (`combine_with_communicators`)
where only the last rank's tensor has another size, then an agreeing tree on the same
communicator.
"""

import json
import os
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

TIMEOUT_SECONDS = 120.0  # two ranks on two busy cores
#: The MPI engine's deadline in the ``path`` task: ranks on different paths would wait it out.
PATH_TIMEOUT_SECONDS = 30.0
#: The sizes of the issue's reproduction (rank 0, rank 1).
SIZES = (100000, 60000)
#: The deadline of the ``last_differs`` task: a rank left waiting would wait this long.
LAST_TIMEOUT_SECONDS = 60.0
#: The tensor sizes of the ``last_differs`` task: every rank's, and the last rank's.
LAST_SIZES = (1024, 512)  # no padding on 3 ranks: the tree buffers are these sizes
SHAPES = [(1000,), (3, 7), (70000,), (5,)]


def path_inputs(rank: int) -> list[np.ndarray]:
    """Rank `rank`'s float32 tensors for the ``path`` task."""
    rng, shared = np.random.default_rng(300 + rank), np.random.default_rng(9)
    return [(0.8 * shared.standard_normal(s) + 0.6 * rng.standard_normal(s)).astype(np.float32) for s in SHAPES]


def _outcome(call) -> dict:
    start = time.monotonic()
    try:
        value = call()
        report = {"raised": False, "value": value}
    except Exception as error:  # noqa: BLE001 (the test checks the type)
        report = {"raised": True, "type": type(error).__name__, "message": str(error)}
    report["seconds"] = time.monotonic() - start
    return report


def native_mismatch(comm, rank: int) -> dict:
    from tf_adasum.engines import mpi_native

    def tree(x):
        return mpi_native.tree([x], comm, "adasum", TIMEOUT_SECONDS)[0][0].numpy()

    sizes = _outcome(lambda: tree(tf.ones([SIZES[rank]], tf.float32)).size)
    dtypes = _outcome(lambda: tree(tf.ones([1000], tf.float32 if rank == 0 else tf.float64)).size)
    x = tf.range(1000, dtype=tf.float32)  # the same on both ranks: Adasum(x, x) == x
    after = _outcome(lambda: bool(np.array_equal(tree(x), x.numpy())))
    # The sum and the gather ops: 3 elements on rank 0, 5 on rank 1; then the same sizes.
    summed = _outcome(lambda: mpi_native.allreduce_sum(tf.ones([3 + 2 * rank]), comm, TIMEOUT_SECONDS).numpy().size)
    gathered = _outcome(lambda: mpi_native.allgather(tf.ones([2 + rank]), comm, TIMEOUT_SECONDS).numpy().size)
    sum_after = _outcome(lambda: mpi_native.allreduce_sum(tf.ones([3]), comm, TIMEOUT_SECONDS).numpy().tolist())
    return {
        "sizes": sizes,
        "dtypes": dtypes,
        "after": after,
        "sum": summed,
        "gather": gathered,
        "sum_after": sum_after,
    }


def python_mismatch(comm, rank: int, world) -> dict:
    from tf_adasum.comm import mpi_communicator, mpi_transport
    from tf_adasum.tree import topology

    def swap(length):
        communicator = mpi_communicator.MPICommunicator(  # a fresh tree call: its first step agrees
            comm, world.sum_communicators(comm, topology.groups(2)), mpi_transport.Chain(), TIMEOUT_SECONDS
        )
        rows = tf.reshape(tf.range(2 * length, dtype=tf.float32) + 10 * rank, [2, length])
        return [t.numpy().tolist()[:3] for t in communicator.swap_halves(rows, 1 - rank)]

    sizes = _outcome(lambda: swap(SIZES[rank] // 2))
    after = _outcome(lambda: swap(4))
    # Past the agreement (as a bug would be): rank 0 sends 1000 bytes where rank 1 receives 2000. The
    # size check fails rank 1 and marks its communicator failed, so its next step fails at once.
    other = comm.Dup()
    latching = mpi_communicator.MPICommunicator(other, {}, mpi_transport.Chain(), TIMEOUT_SECONDS)
    if rank == 0:
        short = _outcome(lambda: latching._transfer(1, np.zeros(1000, np.uint8), None, 5, "a test's send"))
        retry = {}
    else:
        short = _outcome(lambda: latching._transfer(0, None, np.zeros(2000, np.uint8), 5, "a test's receive"))
        retry = _outcome(lambda: latching._agree(np.zeros(4, np.uint8)))
    return {"sizes": sizes, "after": after, "short": short, "retry": retry}


def helpers(rank: int) -> dict:
    import keras

    import tf_adasum.mpi

    variables = [
        tf.Variable(np.full([3, 2], 10.0 * rank + 1, np.float32)),
        keras.Variable(np.arange(5, dtype=np.float64) + rank),
    ]
    report = {"initial": [np.asarray(v.numpy()).tolist() for v in variables]}
    report["check_same"] = _outcome(lambda: tf_adasum.mpi.check_same_variables(variables))
    report["broadcast"] = _outcome(lambda: tf_adasum.mpi.broadcast_variables(variables, root_rank=1))
    report["after"] = [np.asarray(v.numpy()).tolist() for v in variables]
    differing = variables + ([tf.Variable(tf.zeros([4]))] if rank == 1 else [])
    report["check_differing"] = _outcome(lambda: tf_adasum.mpi.check_same_variables(differing, "test variables"))
    report["bad_sum"] = _outcome(lambda: tf_adasum.mpi.allreduce_sum(tf.ones([3])))
    report["bad_root"] = _outcome(lambda: tf_adasum.mpi.broadcast_variables(variables, root_rank="0"))
    return report


def path(rank: int, world, out: str) -> dict:
    from tf_adasum import combiners
    from tf_adasum.comm import mpi_communicator, mpi_transport
    from tf_adasum.engines import mpi as mpi_engine
    from tf_adasum.engines.base import combine_with_communicators
    from tf_adasum.tree import topology

    if rank == 1:
        os.environ["TF_ADASUM_MPI_NATIVE"] = "0"  # this rank alone cannot use the native ops
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = mpi_engine.MPIEngine(world, timeout_seconds=PATH_TIMEOUT_SECONDS)
    values = [tf.constant(x) for x in path_inputs(rank)]
    combined = engine.combine(values, "adasum")
    comm = world.comm
    communicator = mpi_communicator.MPICommunicator(
        comm, world.sum_communicators(comm, topology.groups(2)), mpi_transport.Chain(), TIMEOUT_SECONDS
    )
    python, _ = combine_with_communicators([(v,) for v in values], [communicator], combiners.get("adasum"))
    arrays = {f"engine_{i}": np.asarray(x) for i, x in enumerate(combined)}
    arrays.update({f"python_{i}": np.asarray(x[0]) for i, x in enumerate(python)})
    np.savez(os.path.join(out, f"path_rank{rank}.npz"), **arrays)
    return {
        "native": engine.native is not None,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
    }


def last_differs(rank: int, world) -> dict:
    from tf_adasum import combiners
    from tf_adasum.comm import mpi_communicator, mpi_transport
    from tf_adasum.engines.base import combine_with_communicators
    from tf_adasum.tree import topology

    comm = world.comm.Dup()

    def tree(x):
        communicator = mpi_communicator.MPICommunicator(
            comm,
            world.sum_communicators(comm, topology.groups(comm.Get_size())),
            mpi_transport.Chain(),
            LAST_TIMEOUT_SECONDS,
        )
        combined, _ = combine_with_communicators([(x,)], [communicator], combiners.get("adasum"))
        return np.asarray(combined[0][0])

    last = rank == world.size - 1
    sizes = _outcome(lambda: tree(tf.ones([LAST_SIZES[last]], tf.float32)).size)
    x = tf.range(LAST_SIZES[0], dtype=tf.float32)  # the same on every rank: Adasum(x, x, x) == x
    after = _outcome(lambda: bool(np.array_equal(tree(x), x.numpy())))
    return {"sizes": sizes, "after": after}


def main(argv) -> int:
    out = argv[0]
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)  # ranks share few cores
    from mpi4py import MPI

    from tf_adasum.engines import mpi_native, select

    if argv[1:] == ["last_differs"]:
        world = select.mpi_world()
        report = last_differs(world.rank, world)
        with open(os.path.join(out, f"last_rank{world.rank}.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, default=str)
        return 0

    if mpi_native.load() is None:
        raise SystemExit("the native MPI ops are unavailable (see the warning)")
    world = select.mpi_world()
    rank = world.rank
    comm = MPI.COMM_WORLD.Dup()
    report = {
        "native_mismatch": native_mismatch(comm, rank),
        "python_mismatch": python_mismatch(comm, rank, world),
        "helpers": helpers(rank),
        "path": path(rank, world, out),
    }
    with open(os.path.join(out, f"wire_rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
