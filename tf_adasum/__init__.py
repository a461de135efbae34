"""tf_adasum: Adasum (adaptive summation) for TensorFlow 2 and Keras 3.

Public API:
  reference              the numpy/float64 oracle (`adasum_pair`, `adasum_tree`, ...)
  adasum_pair            Adasum of two tensors, as a TF op
  AdasumCrossDeviceOps   a `tf.distribute.CrossDeviceOps` carrying the collective
  AdasumOptimizer        a Keras 3 optimizer wrapper: local steps, Adasum-combined
  AdasumDiagnostics      a Keras callback with per-tensor diagnostics of the combine
  BackupAndRestore       a Keras callback: back up every epoch or K batches, resume after a kill, on every engine
  SimulatedReplicas      N replicas' training in one process ("what would Adasum do on 256 workers")
  combiners              combiner objects ("adasum", "sum", "mean", AdaCons)
  mpi                    rank(), size(), local_rank(), MetricAverageCallback for mpirun jobs

Engines: MirroredStrategy and MultiWorkerMirroredStrategy (TF collective ops),
and MPI ranks (`tf_adasum.engines`, mpi4py imported only when used). The
launcher: `tf-adasum launch -n N script.py` / `python -m tf_adasum.launch`.
"""

__version__ = "0.1.0"


def _requested_keras_backend() -> str:
    """The backend Keras will load, found as Keras finds it (KERAS_BACKEND, then
    keras.json), without importing Keras, whose import fails for a backend
    whose packages are missing."""
    import json
    import os

    if "KERAS_BACKEND" in os.environ:
        return os.environ["KERAS_BACKEND"]
    keras_home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(keras_home, "keras.json"), encoding="utf-8") as f:
            return json.load(f).get("backend", "tensorflow")
    except (OSError, ValueError):
        return "tensorflow"


def _check_keras_backend() -> None:
    def refuse(backend: str) -> None:
        raise ImportError(
            "tf_adasum needs Keras' TensorFlow backend. Received: keras.backend.backend()="
            f"{backend!r}. Set the environment variable KERAS_BACKEND=tensorflow before importing "
            'keras, or set "backend": "tensorflow" in ~/.keras/keras.json.'
        )

    if _requested_keras_backend() != "tensorflow":
        refuse(_requested_keras_backend())
    import keras

    if keras.backend.backend() != "tensorflow":
        refuse(keras.backend.backend())


__all__ = [
    "AdasumCrossDeviceOps",
    "AdasumDiagnostics",
    "AdasumOptimizer",
    "BackupAndRestore",
    "SimulatedReplicas",
    "__version__",
    "adasum_pair",
    "combiners",
    "mpi",
    "reference",
]


def _load() -> None:
    """Imports the public API, and so TensorFlow, into this module."""
    global _loading, AdasumCrossDeviceOps, AdasumDiagnostics, AdasumOptimizer, BackupAndRestore, SimulatedReplicas
    global adasum_pair
    global combiners, mpi, reference
    _loading = True
    _check_keras_backend()
    import tf_adasum.combiners as combiners
    import tf_adasum.compat as compat
    import tf_adasum.mpi as mpi
    import tf_adasum.reference as reference
    from tf_adasum.backup import BackupAndRestore
    from tf_adasum.callbacks import AdasumDiagnostics
    from tf_adasum.cross_device_ops import AdasumCrossDeviceOps
    from tf_adasum.ops import adasum_pair
    from tf_adasum.optimizer import AdasumOptimizer
    from tf_adasum.simulation import SimulatedReplicas

    compat.patch_keras_multiworker_fit()  # keras-team/keras#20585, multi-worker strategies only


def _started_as_the_command_line() -> bool:
    """Whether this process is the `tf-adasum` console script. It checks its
    arguments before it needs TensorFlow (so `--help` and argument errors answer
    at once), then loads TensorFlow quietly (`tf_adasum.eval.quiet`); in it the
    public API loads on first use instead of at import."""
    import os
    import sys

    argv = getattr(sys, "argv", None) or [""]
    return os.path.basename(argv[0]) in ("tf-adasum", "tf-adasum.exe")


_loading = False
if _started_as_the_command_line():

    def __getattr__(name: str):
        if name in __all__ and not _loading:
            _load()
            return globals()[name]
        raise AttributeError(f"module 'tf_adasum' has no attribute {name!r}")

else:
    _load()
