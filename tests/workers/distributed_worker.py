"""One worker of the multi-process tests: run by `tf-adasum launch` (TF_CONFIG,
MultiWorkerMirroredStrategy) or by `mpirun` (the MPI engine).

    python distributed_worker.py TASK OUTDIR

Tasks (every worker writes ``OUTDIR/TASK_rank{R}.npz`` or ``.json``; the test
in the parent process compares them with `tf_adasum.reference` and the numpy
simulation, so the oracle lives in the tests):

* ``collective``: several tensors of awkward lengths in every float dtype,
  combined with Adasum in one call;
* ``train``: a Dense layer trained with SGD+momentum through AdasumOptimizer
  (``model.fit``), each rank starting from its own random weights;
* ``diagnostics``: one step with AdasumDiagnostics; each rank's record;
* ``mismatch``: rank 1 freezes a layer the others train; every rank must raise;
* ``killed``: rank 1 dies mid-training; the others must fail, not hang;
* ``killed_combine``: rank 1 dies between two combines over the socket
  transport; rank 0's second must fail at once, naming the lost worker;
* ``uneven``: rank 0 has one batch more; its extra step must time out;
* ``weight_decay``: AdamW through the wrapper with the bias excluded from
  weight decay on the wrapper; every rank applies the same gradients;
* ``processes``: what `tf_adasum.processes.Processes` sees here, and two sums
  over the processes (tests/workers/processes_worker.py).
"""

import json
import os
import socket
import sys
import threading
import time
import traceback
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from simulation import BATCH, IN, OUT, SGD  # noqa: E402
from simulation import data as simulation_data  # noqa: E402

import tf_adasum  # noqa: E402
import tf_adasum.mpi  # noqa: E402
from tf_adasum.comm import collective, mpi_transport, socket_communicator, socket_setup  # noqa: E402
from tf_adasum.engines import select  # noqa: E402
from tf_adasum.engines.mpi import MPIEngine  # noqa: E402

#: Collective timeout: a bug fails the run instead of hanging it.
TIMEOUT_SECONDS = float(os.environ.get("TEST_COLLECTIVE_TIMEOUT", "60"))
SIZES = (1, 127, 129, 1000, 3, 4099)
DTYPES = ("float16", "bfloat16", "float32", "float64")
TRAIN_STEPS = 3
#: The wire format of the collective task (``TEST_COMPRESSION``; unset: none).
COMPRESSION = os.environ.get("TEST_COMPRESSION") or None
# ``TEST_REMOTE_MESSAGE_BYTES``: pairwise messages between workers split into
# pieces of at most this many bytes (the default splits only beyond 8 MiB).
collective.REMOTE_MESSAGE_BYTES = int(os.environ.get("TEST_REMOTE_MESSAGE_BYTES", collective.REMOTE_MESSAGE_BYTES))
# ``TEST_PIECE_BYTES``: the socket transport's swaps travel in pieces of about this many bytes.
socket_communicator.PIECE_BYTES = int(os.environ.get("TEST_PIECE_BYTES", socket_communicator.PIECE_BYTES))


def collective_inputs(rank: int) -> list[np.ndarray]:
    """Rank `rank`'s tensors (float64 values, rounded to their dtype by the caller)."""
    rng = np.random.default_rng(100 + rank)
    return [rng.standard_normal(size) for _ in DTYPES for size in SIZES]


def tensor_dtypes() -> list[str]:
    return [dtype for dtype in DTYPES for _ in SIZES]


class Engine:
    """The multi-worker strategy (TF_CONFIG) or MPI, behind one face."""

    def __init__(self):
        self.strategy = None
        if "TF_CONFIG" in os.environ:
            options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=TIMEOUT_SECONDS)
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
            self.rank = self.strategy.cluster_resolver.task_id
            self.size = self.strategy.num_replicas_in_sync
        else:
            assert select.launched_by_mpi(), "run under tf-adasum launch (TF_CONFIG) or mpirun"
            self.rank, self.size = tf_adasum.mpi.rank(), tf_adasum.mpi.size()

    def scope(self):
        return self.strategy.scope() if self.strategy else tf.distribute.get_strategy().scope()

    def combine(self, tensors):
        if self.strategy is None:
            engine = MPIEngine(select.mpi_world(), TIMEOUT_SECONDS, compression=COMPRESSION)
            return [t.numpy() for t in engine.combine(tensors)]
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=TIMEOUT_SECONDS)
        ops = tf_adasum.AdasumCrossDeviceOps(options=options, compression=COMPRESSION)
        with self.strategy.scope():
            values = [self.strategy.experimental_distribute_values_from_function(lambda ctx, t=t: t) for t in tensors]
            combined = ops.batch_reduce_adasum(values)
        return [self.strategy.experimental_local_results(c)[0].numpy() for c in combined]

    def fit(self, model, x, y, steps, epochs=1, callbacks=()):
        """Trains on this rank's rows of each global batch, as the simulation splits them."""
        b = BATCH // self.size
        rows = np.concatenate(
            [np.arange(s * BATCH + self.rank * b, s * BATCH + (self.rank + 1) * b) for s in range(steps)]
        )
        if self.strategy is None:
            return model.fit(
                x[rows], y[rows], batch_size=b, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks)
            )

        def dataset_fn(context):
            assert context.input_pipeline_id == self.rank
            return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(b).repeat()

        dataset = self.strategy.distribute_datasets_from_function(dataset_fn)
        return model.fit(dataset, steps_per_epoch=steps, epochs=epochs, verbose=0, callbacks=list(callbacks))


def dense_model(seed: int, units: int = OUT):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(units)])


def _tf_port(rank: int) -> int:
    return int(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][rank].rsplit(":", 1)[1])


def run_collective(engine, out):
    inputs = collective_inputs(engine.rank)
    tensors = [tf.cast(tf.constant(x), dtype) for x, dtype in zip(inputs, tensor_dtypes())]
    occupant = None  # ``TEST_OCCUPY_SOCKET_PORT=R``: rank R's socket port is taken before the combine
    if os.environ.get("TEST_OCCUPY_SOCKET_PORT") == str(engine.rank):
        offset = int(os.environ["TF_ADASUM_WORKER_PORT_OFFSET"])
        occupant = socket.create_server(("", _tf_port(engine.rank) + offset))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        combined = engine.combine(tensors)
    fallbacks = [str(w.message) for w in caught if "socket transport" in str(w.message)]
    # Sockets dropped during the combine without being closed (e.g. a listener no mesh took).
    unclosed = [str(w.message) for w in caught if w.category is ResourceWarning and "socket" in str(w.message)]
    meshes = [mesh for mesh in socket_setup._MESHES.values() if mesh is not None]
    listener = [str(a) for a in meshes[0]._listener.socket.getsockname()[:2]] if meshes else []
    tf_port = _tf_port(engine.rank) if engine.strategy is not None and "TF_CONFIG" in os.environ else 0
    # What carried it between processes: the socket transport's threads, if any.
    transport_threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("tf_adasum "))
    also = {}
    if os.environ.get("TEST_ALSO_OVER_SOCKETS"):  # the same combine again, over the socket transport
        os.environ["TF_ADASUM_WORKER_TRANSPORT"] = "sockets"
        also = {f"socket_bits{i}": c.view(np.uint8) for i, c in enumerate(engine.combine(tensors))}
    if occupant is not None:
        occupant.close()
    np.savez(
        os.path.join(out, f"collective_rank{engine.rank}.npz"),
        transport_threads=np.array(transport_threads, dtype=str),
        fallback_warnings=np.array(fallbacks, dtype=str),
        listener=np.array(listener, dtype=str),
        unclosed_sockets=np.array(unclosed, dtype=str),
        tf_port=tf_port,
        tf_config=os.environ.get("TF_CONFIG", ""),
        **also,
        **{f"bits{i}": c.view(np.uint8) for i, c in enumerate(combined)},
        **{f"value{i}": c.astype(np.float64) for i, c in enumerate(combined)},
    )


def run_train(engine, out):
    """Adasum, hierarchical Adasum and AdaCons, each from every rank's own random weights."""
    x, y = simulation_data(TRAIN_STEPS)
    results = {}
    for name, options in (
        ("plain", {}),
        ("hierarchical", {"hierarchical": True}),
        ("adacons", {"combiner": "adacons"}),
    ):
        with engine.scope():
            model = dense_model(seed=10 + engine.rank)  # different weights on every rank
            initial = [w.numpy() for w in model.weights]
            optimizer = tf_adasum.AdasumOptimizer(SGD().keras(), **options)
            model.compile(optimizer=optimizer, loss="mse")
        history = engine.fit(model, x, y, TRAIN_STEPS, callbacks=[tf_adasum.mpi.MetricAverageCallback()])
        results.update(
            {
                f"{name}_initial_kernel": initial[0],
                f"{name}_initial_bias": initial[1],
                f"{name}_kernel": model.weights[0].numpy(),
                f"{name}_bias": model.weights[1].numpy(),
                f"{name}_iterations": int(optimizer.iterations.numpy()),
                f"{name}_loss": history.history["loss"][-1],
            }
        )
    world = []  # the MPI helpers' view, under MPI (srun's workers of a strategy are not MPI ranks)
    if engine.strategy is None:
        world = [tf_adasum.mpi.rank(), tf_adasum.mpi.size(), tf_adasum.mpi.local_rank(), tf_adasum.mpi.local_size()]
    np.savez(os.path.join(out, f"train_rank{engine.rank}.npz"), mpi_world=world, **results)


def run_diagnostics(engine, out):
    """One SGD step with AdasumDiagnostics on every rank (each from its own
    random weights: the strategy or the MPI broadcast makes rank 0's the start)."""
    x, y = simulation_data(1)
    with engine.scope():
        model = dense_model(seed=20 + engine.rank)
        initial = [w.numpy().tolist() for w in model.weights]
        model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    callback = tf_adasum.AdasumDiagnostics(every_n_steps=1)
    engine.fit(model, x, y, 1, callbacks=[callback])
    step, record = callback.records[0]
    paths = [v.path for v in model.trainable_variables]
    with open(os.path.join(out, f"diagnostics_rank{engine.rank}.json"), "w") as f:
        json.dump({"step": step, "initial": initial, "paths": paths, "record": record}, f)


def run_mismatch(engine, out):
    x, y = simulation_data(TRAIN_STEPS)
    with engine.scope():
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT), keras.layers.Dense(OUT)])
        model.layers[1].trainable = engine.rank != 1  # rank 1 trains 2 variables, the others 4
        model.compile(optimizer=tf_adasum.AdasumOptimizer(SGD().keras()), loss="mse")
    _report(out, "mismatch", engine.rank, lambda: engine.fit(model, x, y, TRAIN_STEPS))


class DieAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            os._exit(17)


def run_killed(engine, out):
    steps = 200
    x, y = simulation_data(steps)
    with engine.scope():
        model = dense_model(seed=1)
        model.compile(optimizer=tf_adasum.AdasumOptimizer(SGD(lr=0.001).keras()), loss="mse")
    callbacks = [DieAt(5)] if engine.rank == 1 else []
    _report(out, "killed", engine.rank, lambda: engine.fit(model, x, y, steps, epochs=50, callbacks=callbacks))


def run_killed_combine(engine, out):
    tensors = [tf.constant(np.arange(1000, dtype=np.float32) + engine.rank)]
    engine.combine(tensors)  # sets up the socket mesh and its connections
    if engine.rank == 1:
        os._exit(17)
    _report(out, "killed_combine", engine.rank, lambda: engine.combine(tensors))


def run_uneven(engine, out):
    """Rank 0 has one batch more than the others: its extra step must time out."""
    steps = TRAIN_STEPS + (engine.rank == 0)
    x, y = simulation_data(steps)
    with engine.scope():
        model = dense_model(seed=1)
        model.compile(optimizer=tf_adasum.AdasumOptimizer(SGD().keras()), loss="mse")
    _report(out, "uneven", engine.rank, lambda: engine.fit(model, x, y, steps))
    if engine.rank != 0:
        # Stay alive until rank 0's collective has timed out (its report is
        # written): a vanished peer would be reported by the strategy's
        # heartbeat instead. At most the timeout and 5 s, as before.
        report = os.path.join(out, "uneven_rank0.json")
        deadline = time.monotonic() + TIMEOUT_SECONDS + 5
        while not os.path.exists(report) and time.monotonic() < deadline:
            time.sleep(0.2)


def weight_decay_gradients() -> list[np.ndarray]:
    """The gradients of the ``weight_decay`` task (kernel, bias of `dense_model`)."""
    return [np.linspace(-1.0, 1.0, IN * OUT, dtype=np.float32).reshape(IN, OUT), np.full(OUT, 0.5, np.float32)]


def run_weight_decay(engine, out):
    """Two steps of AdamW(0.1, weight_decay=0.5) with the bias excluded on the
    wrapper; the same gradients on every rank, so the weights must be plain
    AdamW's (tf.distribute's replicas get them scaled by 1 / replicas)."""
    with engine.scope():
        model = dense_model(seed=30)
        optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.AdamW(0.1, weight_decay=0.5))
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        optimizer.build(model.trainable_variables)
    scale = 1.0 if engine.strategy is None else 1.0 / engine.size
    grads = [tf.constant(g * scale) for g in weight_decay_gradients()]

    @tf.function
    def step():
        apply = lambda: optimizer.apply_gradients(zip(grads, model.trainable_variables))  # noqa: E731
        if engine.strategy is None:
            apply()
        else:
            engine.strategy.run(apply)

    for _ in range(2):
        step()
    np.savez(os.path.join(out, f"weight_decay_rank{engine.rank}.npz"), *[w.numpy() for w in model.weights])


def run_processes(engine, out):
    """`tf_adasum.processes.Processes` of this process: its index, the count, two sums."""
    from processes_worker import report  # beside this script

    report(engine.strategy, out)


def _report(out, task, rank, fn):
    result = {"raised": False}
    start = time.monotonic()
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - reported to the test
        text = str(error)
        result = {"raised": True, "type": type(error).__name__, "message": text[:300] + " ... " + text[-1500:]}
    result["seconds"] = time.monotonic() - start
    with open(os.path.join(out, f"{task}_rank{rank}.json"), "w") as f:
        json.dump(result, f)


TASKS = {
    "collective": run_collective,
    "train": run_train,
    "diagnostics": run_diagnostics,
    "mismatch": run_mismatch,
    "killed": run_killed,
    "killed_combine": run_killed_combine,
    "uneven": run_uneven,
    "weight_decay": run_weight_decay,
    "processes": run_processes,
}


def main():
    tasks, out = sys.argv[1].split(","), sys.argv[2]
    engine = Engine()
    for task in tasks:
        try:
            TASKS[task](engine, out)
        except Exception:
            traceback.print_exc()
            os._exit(1)
    sys.stdout.flush()
    if engine.strategy is None:
        mpi_transport.mpi().Finalize()  # mpirun treats an exit without it as a failure
    # Skip interpreter teardown: TF's collective runtime can block exit when a peer is gone.
    os._exit(0)


if __name__ == "__main__":
    main()
