"""One rank of `tests/test_mpi_native.py`: the native MPI ops under `mpirun`.

    mpirun -np N python mpi_native_worker.py OUTDIR SIZES [--deadline]

For each communicator size k in SIZES (comma-separated; the first k ranks of
COMM_WORLD, split off, or ``1`` for COMM_SELF on every rank), every member
writes ``OUTDIR/tree_k{k}_rank{R}.npz``: the native tree op's results and
partials for every dtype and rule, those of the Python path
(`tf_adasum.tree.rvh` over `tf_adasum.comm.mpi_communicator.MPICommunicator`) on the same
inputs, the tree's results on large float32 tensors (`BIG_SHAPES`: twice, and
once in place), and the native sum and gather ops' results. With ``--deadline``,
rank 1 of a two-rank communicator skips a call that rank 0 makes (twice), and
rank 0 writes ``OUTDIR/deadline.json``. The test compares everything with
`tf_adasum.reference` and numpy, so the oracle lives in the test.
"""

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

#: Tensors of every tree call: awkward lengths around the 128-element blocks of
#: the Python path, an empty one and a 2-D one; 70000 elements, more than one
#: message (256 KiB) of the native op in float64 at the first level, and then
#: 30000-element ones, each under a message, so that runs of them fill several.
SHAPES = [(1,), (3,), (127,), (128,), (129,), (1000,), (70000,), (0,), (7, 13), (5,)] + [(30000,)] * 4
#: Float32 tensors of the pipelined calls: 4 MiB, 8 or more messages a level, so that
#: messages arrive while the tree still scales the level before.
BIG_SHAPES = [(1 << 20,), (1000,)]
ZERO_ON_EVEN_RANKS = 3  # Adasum(0, b) == b: the norm guard
SAME_ON_ALL_RANKS = 9  # Adasum(a, a) == a
DTYPES = ("float16", "bfloat16", "float32", "float64")
RULES = ("adasum", "sum")
SUM_CASES = [("float32", (17,)), ("float64", (3, 4)), ("float64", ()), ("float32", (0,))]
GATHER_DTYPES = ("int32", "int64", "float16", "bfloat16", "float32", "float64")
TIMEOUT_SECONDS = 300.0  # six ranks on two busy cores can be slow
DEADLINE_SECONDS = 3.0


def tree_inputs(rank: int) -> list[np.ndarray]:
    """Rank `rank`'s tensors in float64 (rounded to each dtype by the caller):
    a shared component plus the rank's own, so the coefficients are far from 1."""
    shared, own = np.random.default_rng(7), np.random.default_rng(100 + rank)
    values = []
    for i, shape in enumerate(SHAPES):
        common, mine = shared.standard_normal(shape), own.standard_normal(shape)
        if i == ZERO_ON_EVEN_RANKS and rank % 2 == 0:
            values.append(np.zeros(shape))
        else:
            values.append(common if i == SAME_ON_ALL_RANKS else 0.8 * common + 0.6 * mine)
    return values


def big_inputs(rank: int) -> list[np.ndarray]:
    """Rank `rank`'s BIG_SHAPES tensors (float32), a shared component plus its own."""
    shared, own = np.random.default_rng(17), np.random.default_rng(300 + rank)
    return [(0.8 * shared.standard_normal(s) + 0.6 * own.standard_normal(s)).astype(np.float32) for s in BIG_SHAPES]


def sum_input(rank: int, dtype: str, shape) -> np.ndarray:
    return np.random.default_rng(200 + rank).standard_normal(shape).astype(dtype)


def gather_input(rank: int) -> np.ndarray:
    return np.arange(6, dtype=np.float64).reshape(2, 3) + 10 * rank


def _numpy(x) -> np.ndarray:
    return np.asarray(tf.cast(x, tf.float64))


def _intermediate(x: tf.Tensor) -> tf.Tensor:
    """`x` (float32) recomputed exactly, as a tensor nothing else holds."""
    return tf.cast(tf.cast(x, tf.float64), x.dtype)


def run(comm, k: int, out: str, world) -> None:
    """Every op on communicator `comm` (k ranks); writes this rank's results."""
    from tf_adasum import combiners, ops
    from tf_adasum.comm import mpi_communicator, mpi_transport
    from tf_adasum.engines import mpi_native
    from tf_adasum.engines.base import combine_with_communicators
    from tf_adasum.tree import topology

    rank = comm.Get_rank()
    # The Python path's XLA kernels compile per shape and dtype (seconds each);
    # its plain-op kernels compute the same.
    ops.XLA_MIN_ELEMENTS = 1 << 62
    communicator = mpi_communicator.MPICommunicator(
        comm, world.sum_communicators(comm, topology.groups(k)), mpi_transport.Chain(), TIMEOUT_SECONDS
    )
    results = {}
    # In a traced function, on intermediates: the op may reuse their buffers (in place).
    graph_tree = tf.function(
        lambda values: mpi_native.tree([_intermediate(v) for v in values], comm, "adasum", TIMEOUT_SECONDS),
        autograph=False,
    )
    graph_sum = tf.function(
        lambda x: mpi_native.allreduce_sum(_intermediate(x), comm, TIMEOUT_SECONDS), autograph=False
    )
    for dtype in DTYPES:
        values = [tf.cast(x, dtype) for x in tree_inputs(rank)]
        for rule in RULES:
            combined, partials = mpi_native.tree(values, comm, rule, TIMEOUT_SECONDS)
            python, python_partials = combine_with_communicators(
                [(v,) for v in values], [communicator], combiners.get(rule)
            )
            for i, (x, y) in enumerate(zip(combined, python)):
                assert x.shape == values[i].shape and x.dtype == values[i].dtype, (x, values[i])
                results[f"{dtype}_{rule}_{i}"] = _numpy(x)
                results[f"{dtype}_{rule}_{i}_python"] = _numpy(y[0])
            results[f"{dtype}_{rule}_partials"] = partials.numpy()
            results[f"{dtype}_{rule}_partials_python"] = python_partials[0].numpy()
        if dtype == "float32":
            combined, partials = graph_tree(values)
            assert partials.shape == [topology.num_levels(k), len(SHAPES), 3], partials.shape
            for i, x in enumerate(combined):
                results[f"graph_{i}"] = _numpy(x)
    # Large tensors, twice out of place and once in place: bitwise the same each time.
    big = [tf.constant(x) for x in big_inputs(rank)]
    for name, call in (("first", mpi_native.tree), ("again", mpi_native.tree), ("graph", graph_tree)):
        combined = call(big, comm, "adasum", TIMEOUT_SECONDS)[0] if name != "graph" else call(big)[0]
        for i, x in enumerate(combined):
            results[f"big_{name}_{i}"] = x.numpy()
    for j, (dtype, shape) in enumerate(SUM_CASES):
        results[f"sum_{j}"] = mpi_native.allreduce_sum(sum_input(rank, dtype, shape), comm, TIMEOUT_SECONDS).numpy()
    for dtype in GATHER_DTYPES:
        gathered = mpi_native.allgather(tf.cast(gather_input(rank), dtype), comm, TIMEOUT_SECONDS)
        results[f"gather_{dtype}"] = _numpy(gathered)
    dtype, shape = SUM_CASES[0]
    results["sum_graph"] = graph_sum(sum_input(rank, dtype, shape)).numpy()
    results["gather_empty"] = mpi_native.allgather(tf.zeros([0, 2]), comm, TIMEOUT_SECONDS).numpy()
    np.savez(os.path.join(out, f"tree_k{k}_rank{rank}.npz"), **results)


def barrier(comm) -> None:
    """A barrier that sleeps while it waits: idle ranks leave the cores to the
    busy ones (MPI's own barrier spins)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.005)


def deadline(world_comm, out: str) -> None:
    """Rank 0 calls the tree on ranks {0, 1}; rank 1 never does. Then rank 0
    calls it again: the communicator stays failed (a late message of the
    first call must not fill the second's receive)."""
    from mpi4py import MPI

    from tf_adasum.engines import mpi_native

    rank = world_comm.Get_rank()
    pair = world_comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    if rank == 0:
        call = tf.function(lambda x: mpi_native.tree([x], pair, "adasum", DEADLINE_SECONDS)[0][0], autograph=False)
        call.get_concrete_function(tf.TensorSpec([4], tf.float32))  # traced before the clock starts
        report = {}
        for attempt in ("first", "retry"):
            start = time.monotonic()
            try:
                call(tf.ones([4]))
                report[attempt] = {"raised": False}
            except Exception as error:  # noqa: BLE001 (the test checks the type)
                report[attempt] = {"raised": True, "type": type(error).__name__, "message": str(error)}
            report[attempt]["seconds"] = time.monotonic() - start
        with open(os.path.join(out, "deadline.json"), "w", encoding="utf-8") as f:
            json.dump(report, f)
    barrier(world_comm)  # rank 1 stays away until rank 0 has given up


def main(argv) -> int:
    out, sizes = argv[0], [int(k) for k in argv[1].split(",")]
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)  # ranks share few cores
    from mpi4py import MPI

    from tf_adasum.comm import mpi_transport
    from tf_adasum.engines import mpi_native

    if mpi_native.load() is None:
        raise SystemExit("the native MPI ops are unavailable (see the warning)")
    comm = MPI.COMM_WORLD
    world = mpi_transport.world()
    # Every communicator stays alive: `World.sum_communicators` caches by id(),
    # which a collected communicator's successor could reuse on some ranks only.
    subs = [MPI.COMM_SELF if k == 1 else comm.Split(0 if comm.rank < k else MPI.UNDEFINED, comm.rank) for k in sizes]
    for k, sub in zip(sizes, subs):
        if sub != MPI.COMM_NULL and (k > 1 or comm.rank == 0):
            run(sub, k, out, world)
        barrier(comm)
    if "--deadline" in argv:
        deadline(comm, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
