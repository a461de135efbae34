"""Which engine combines, and where simulated replicas run: the one place
that reads MPI launchers' variables (and, for `replica_processes`, whether
``TF_CONFIG`` names several workers).

`make_engine` is called once, when `tf_adasum.AdasumOptimizer` is built:

* ``backend="tf"``: the strategy's replicas over TF collective ops
  (`tf_adasum.engines.tf.TFEngine`);
* ``backend="mpi"``: MPI ranks, one replica per process
  (`tf_adasum.engines.mpi.MPIEngine`);
* ``backend="auto"``: "tf" with a multi-replica strategy, else "mpi" when an
  MPI launcher started this process with several ranks, else one replica.

Combinations that would silently train each process alone raise.

`replica_processes` chooses the processes `tf_adasum.SimulatedReplicas`
spreads its replicas over: MPI ranks, the workers of ``TF_CONFIG``, or none.
"""

from __future__ import annotations

import os

import tensorflow as tf
from tensorflow.python.distribute import collective_util

from tf_adasum.comm import cluster, mpi_transport
from tf_adasum.engines.base import Engine
from tf_adasum.engines.mpi import MPIEngine
from tf_adasum.engines.simulated import ReplicaProcesses, replicas_per_process
from tf_adasum.engines.tf import TFEngine
from tf_adasum.engines.workers import WorkerProcesses
from tf_adasum.launcher.elastic import REPLICAS_VARIABLE

__all__ = [
    "BACKENDS",
    "LAUNCHER_SIZE_VARIABLES",
    "SIMULATION_BACKENDS",
    "choose_backend",
    "communication_options",
    "launched_by_mpi",
    "launcher_world_size",
    "make_engine",
    "mpi_world",
    "replica_processes",
    "resolve_compression",
    "strategy_compression",
    "tf_config_workers",
]

#: Environment variables MPI launchers set to the world size (Open MPI,
#: MPICH/Hydra, PMIx, Intel MPI, srun). Slurm's allocation-wide SLURM_NTASKS is
#: left out: it is also set for a plain ``python train.py`` inside ``sbatch``.
LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_TASKS")

BACKENDS = ("auto", "tf", "mpi")
#: Where `tf_adasum.SimulatedReplicas` runs its replicas: all in this process, or spread over MPI ranks
#: or over the workers of TF_CONFIG.
SIMULATION_BACKENDS = ("auto", "local", "mpi", "workers")


def launcher_world_size() -> int:
    """The world size an MPI launcher announced in this process's environment
    (1 when none did; mpi4py is not imported)."""
    sizes = [1]
    for name in LAUNCHER_SIZE_VARIABLES:
        try:
            sizes.append(int(os.environ.get(name, "1")))
        except ValueError:
            continue
    return max(sizes)


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process with world size > 1."""
    return launcher_world_size() > 1


def mpi_world() -> mpi_transport.World:
    """The process's MPI world (initialises MPI), checked against the launcher."""
    return mpi_transport.world(launcher_world_size())


def tf_config_workers() -> int:
    """The chief and worker tasks ``TF_CONFIG`` names when this process is one
    of them (0 when it is unset, or this process is another task: an
    evaluator, a parameter server)."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    tasks = cluster.resolver_tasks(resolver)
    return len(tasks) if (resolver.task_type, int(resolver.task_id or 0)) in tasks else 0


def replica_processes(backend: str, num_replicas: int) -> tuple[str, ReplicaProcesses | None]:
    """Where `tf_adasum.SimulatedReplicas` spreads its `num_replicas`
    replicas: ``("mpi", MPIEngine)`` over the ranks, ``("workers",
    WorkerProcesses)`` over the workers of ``TF_CONFIG``, or ``("local",
    None)``: all in this process. ``"auto"``: the ranks when an MPI launcher
    started several, else the workers when ``TF_CONFIG`` names several
    chief and worker tasks and this process is one, else this process.
    Raises before any exchange when `backend` is unknown, when ``tf-adasum
    launch --logical-replicas`` announced another count
    (`REPLICAS_VARIABLE`), or when the processes announced cannot hold the
    replicas (`tf_adasum.engines.simulated.replicas_per_process`)."""
    if backend not in SIMULATION_BACKENDS:
        raise ValueError(f"`backend` must be one of {SIMULATION_BACKENDS}. Received: backend={backend!r}")
    announced = os.environ.get(REPLICAS_VARIABLE, "")
    if announced and announced != str(num_replicas):
        raise ValueError(
            f"The launcher runs this job with {REPLICAS_VARIABLE}={announced} (tf-adasum launch "
            f"--logical-replicas), and this model has num_replicas={num_replicas}: give both the same count."
        )
    if backend == "auto" and launched_by_mpi():
        backend = "mpi"
    if backend == "mpi":
        replicas_per_process(num_replicas, launcher_world_size())  # before MPI starts
        return backend, MPIEngine(mpi_world())
    workers = 0 if backend == "local" else tf_config_workers()
    if backend == "auto":
        backend = "workers" if workers > 1 else "local"
    if backend == "local":
        return backend, None
    if workers < 2:
        raise ValueError(
            "SimulatedReplicas(backend='workers') spreads its replicas over the chief and worker tasks that "
            f"TF_CONFIG names (e.g. under `tf-adasum launch -n M`), and it names {workers} with this process "
            f"among them. Received: TF_CONFIG={os.environ.get('TF_CONFIG', '')!r}"
        )
    replicas_per_process(num_replicas, workers)  # before any exchange
    return backend, WorkerProcesses.from_tf_config()


def choose_backend(backend: str, strategy) -> str:
    """``"tf"`` or ``"mpi"`` for `backend` under `strategy`; raises for
    combinations that would train each process alone."""
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}. Received: backend={backend!r}")
    replicas = strategy.num_replicas_in_sync
    launched = launched_by_mpi()
    one_process_strategy = replicas > 1 and cluster.num_workers(strategy) == 1
    if (backend == "mpi" and replicas > 1) or (backend == "auto" and launched and one_process_strategy):
        raise ValueError(
            f"AdasumOptimizer(backend={backend!r}) in a process started by an MPI launcher cannot also "
            f"combine the {replicas} replicas of a tf.distribute strategy: run one MPI rank per device "
            "without a strategy, or use MultiWorkerMirroredStrategy (TF_CONFIG, or Slurm's cluster resolver "
            "under srun) without an MPI combine."
        )
    if backend == "tf" and replicas == 1 and launched:
        raise ValueError(
            "AdasumOptimizer(backend='tf') has one replica in a process started by an MPI launcher, so it "
            "would train each rank alone. Use backend='auto' or 'mpi' under mpirun, or a multi-replica "
            "tf.distribute strategy."
        )
    if backend == "auto":
        return "mpi" if launched and replicas == 1 else "tf"
    return backend


def _cross_device_ops(strategy):
    """A MirroredStrategy's cross-device ops (None for other strategies).
    tf.distribute has no public accessor: the private attribute is read here
    only, and its absence is an error."""
    if not isinstance(strategy, tf.distribute.MirroredStrategy):
        return None
    if not hasattr(strategy.extended, "_cross_device_ops"):
        raise RuntimeError("tf_adasum: MirroredStrategy.extended._cross_device_ops is gone in this TensorFlow.")
    return strategy.extended._cross_device_ops


def communication_options(strategy) -> tf.distribute.experimental.CommunicationOptions:
    """The options the strategy's collectives use: those of its cross-device
    ops when they carry options (`tf_adasum.AdasumCrossDeviceOps`), else a
    `MultiWorkerMirroredStrategy`'s own (e.g. its collective timeout), else
    the defaults. MultiWorkerMirroredStrategy has no public accessor either;
    its private attribute is read here only, and its absence is an error."""
    options = getattr(_cross_device_ops(strategy), "options", None)
    if isinstance(options, collective_util.Options):
        return options
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        if not hasattr(strategy.extended, "_communication_options"):
            raise RuntimeError(
                "tf_adasum: MultiWorkerMirroredStrategy.extended._communication_options is gone in this TensorFlow."
            )
        return strategy.extended._communication_options
    return tf.distribute.experimental.CommunicationOptions()


def strategy_compression(strategy) -> str | None:
    """The wire format of the strategy's cross-device ops when they carry one
    (`tf_adasum.AdasumCrossDeviceOps(compression=...)`), else None."""
    return getattr(_cross_device_ops(strategy), "compression", None)


def resolve_compression(compression: str | None, strategy) -> str | None:
    """The optimizer's `compression`, else the strategy's; a ValueError naming
    both when they differ (neither silently wins)."""
    from_strategy = strategy_compression(strategy)
    if compression is not None and from_strategy is not None and compression != from_strategy:
        raise ValueError(
            "AdasumOptimizer(compression=...) and the strategy's AdasumCrossDeviceOps(compression=...) "
            f"differ; set one of them. Received: compression={compression!r}, the cross-device ops' "
            f"compression={from_strategy!r}"
        )
    return compression if compression is not None else from_strategy


def make_engine(backend: str, strategy, compression: str | None = None) -> Engine:
    """The engine for `backend` (see `choose_backend`) under `strategy`.

    `compression`: the wire format (`tf_adasum.comm.compression`); None takes
    the strategy's `tf_adasum.AdasumCrossDeviceOps` one, if any (see
    `resolve_compression`).

    Examples:
      The engine `tf_adasum.AdasumOptimizer` builds in a plain ``python``
      process (no strategy, no MPI launcher): one replica.

      >>> import tensorflow as tf
      >>> from tf_adasum.engines.select import make_engine
      >>> engine = make_engine("auto", tf.distribute.get_strategy())
      >>> type(engine).__name__, engine.num_replicas, engine.local_replicas
      ('TFEngine', 1, 1)
      >>> make_engine("nccl", tf.distribute.get_strategy())
      Traceback (most recent call last):
      ...
      ValueError: `backend` must be one of ('auto', 'tf', 'mpi'). Received: backend='nccl'
    """
    if choose_backend(backend, strategy) == "mpi":
        return MPIEngine(mpi_world(), compression=compression)
    compression = resolve_compression(compression, strategy)
    return TFEngine.for_strategy(strategy, communication_options(strategy), compression)
