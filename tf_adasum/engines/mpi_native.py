"""Native MPI ops: the whole Adasum tree of one bucket in one TensorFlow op.

A C++ op library (``tf_adasum/native/adasum_mpi_ops.cc``, with the tree's
algorithm in ``adasum_mpi_tree.h`` beside it) compiled on first use against
the installed TensorFlow and the MPI library that mpi4py loaded
(`tf_adasum.native.build`), cached under
``~/.cache/tf_adasum/tf_adasum_mpi_ops/<hash>/`` (``TF_ADASUM_CACHE_DIR``
overrides ``~/.cache/tf_adasum``) and loaded with `tf.load_op_library`. Its
ops call MPI directly, read their inputs in place and write their outputs directly (into the
inputs' buffers when nothing else holds them, e.g. intermediates of a graph):

* `tree`: ``TfAdasumMpiTree``, the vector-halving tree of `tf_adasum.tree.rvh`
  (``allreduce``) with the Adasum or plain-sum pair rule, for a list of
  tensors in one call;
* `allreduce_sum`: ``TfAdasumMpiAllreduce``, an elementwise sum
  (``MPI_Iallreduce``);
* `allgather`: ``TfAdasumMpiAllgather``, every rank's tensor in rank order.

Each wrapper builds exactly one op. The ops are stateful (never pruned,
merged or constant-folded), but they are not ordered among themselves: every
rank must run the same ops in the same order, one at a time, so callers
chain them with control dependencies. They need MPI initialised with at
least ``MPI_THREAD_SERIALIZED`` (mpi4py's default is ``MPI_THREAD_MULTIPLE``).
The communicator's handle is an attribute of the op, valid in this process
only: graphs holding these ops cannot be exported (SavedModel).
Every MPI wait polls against ``timeout_seconds`` (0: forever) and fails with
`tf.errors.DeadlineExceededError` naming the call and the peer. Before any
data moves, the ranks of a `tree` agree on its layout (dtype, rule, every
tensor's size, the message size): a disagreement raises
`tf.errors.InvalidArgumentError` on every rank, naming two ranks that differ,
and sends no data; `allreduce_sum` and `allgather` agree on their tensor's
size and dtype the same way (one small all-reduce first). An op that fails with messages possibly in flight (a
deadline, an MPI error, a message of the wrong size) marks its communicator
failed: every later op on it raises `tf.errors.FailedPreconditionError` at
once, since a late message of the failed op would fill a later one's receive.

``python -m tf_adasum.engines.mpi_native --build`` builds the library ahead
of time and prints its path. ``TF_ADASUM_MPI_NATIVE=0`` turns it off; `load`
then returns None, as it does (with one warning per process) when no C++
compiler (``CXX``, default ``g++``), no ``mpi.h`` or no build is possible.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import tensorflow as tf

from tf_adasum.native import build as native_build
from tf_adasum.native.build import BuildError
from tf_adasum.reference import tree_shape

__all__ = [
    "RULES",
    "BuildError",
    "allgather",
    "allreduce_sum",
    "availability",
    "build",
    "cache_root",
    "deadlines_missed",
    "load",
    "tree",
]

SOURCE = "adasum_mpi_ops.cc"  # in tf_adasum/native/
LIBRARY = "tf_adasum_mpi_ops.so"
#: The pair rules of `tree`.
RULES = ("adasum", "sum")

_TREE_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_SUM_DTYPES = (tf.float32, tf.float64)
_GATHER_DTYPES = (tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64)


def cache_root() -> Path:
    """Where the built library is kept, one folder per build configuration."""
    return native_build.cache_root() / Path(LIBRARY).stem


def _loaded_libmpi() -> str | None:
    """The path of the libmpi that mpi4py loaded into this process (Linux)."""
    try:
        from mpi4py import MPI  # noqa: F401 (loads libmpi)
    except ImportError as error:
        raise BuildError(f"mpi4py cannot be imported ({error})") from error
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi" in line}
    except OSError:
        return None
    return next((p for p in sorted(paths) if Path(p).name.split(".so")[0] in ("libmpi", "libmpich")), None)


def _mpicc_flags(which: str) -> list[str]:
    beside_python = Path(sys.executable).parent / "mpicc"
    mpicc = str(beside_python) if beside_python.exists() else shutil.which("mpicc")
    if mpicc is None:
        raise BuildError("mpi.h was not found beside the MPI library mpi4py loaded, and there is no mpicc")
    result = subprocess.run([mpicc, f"--showme:{which}"], capture_output=True, text=True)
    if result.returncode:
        raise BuildError(f"`{mpicc} --showme:{which}` failed: {result.stderr.strip()}")
    return result.stdout.split()


def _mpi_flags() -> tuple[list[str], list[str], str]:
    """Compile flags, link flags, and what identifies the MPI library."""
    library = _loaded_libmpi()
    if library is None:
        return _mpicc_flags("compile"), _mpicc_flags("link"), "mpicc"
    include = Path(library).parent.parent / "include"
    compile_flags = [f"-I{include}"] if (include / "mpi.h").exists() else _mpicc_flags("compile")
    folder = Path(library).parent
    link_flags = [f"-L{folder}", f"-l:{Path(library).name}", f"-Wl,-rpath,{folder}"]
    stat = os.stat(library)
    return compile_flags, link_flags, f"{library} {stat.st_size} {stat.st_mtime_ns}"


def build() -> Path:
    """Compiles the op library unless the cache has it; returns its path.

    Ranks starting together compile it once: the others wait on a lock file.

    Raises:
      BuildError: no compiler, no ``mpi.h``, no mpi4py, or a failed compile.
    """
    native_build.compiler()  # the first thing missing to name, before MPI's
    mpi_compile, mpi_link, mpi_id = _mpi_flags()
    return native_build.build(SOURCE, LIBRARY, mpi_compile, mpi_link, mpi_id)


_lock = threading.Lock()
_loaded: list = []  # [(module or None, reason or None)] once the library was built and loaded (or not)
_warned: list = []  # [True] once `load` warned
_library: list = []  # [the loaded library, through ctypes] for `deadlines_missed`


def availability() -> tuple[object | None, str | None]:
    """``(module, None)``, or ``(None, reason)`` where this process cannot use
    the native ops: ``TF_ADASUM_MPI_NATIVE=0`` (read on each call), or a
    library that cannot be built or loaded (tried once per process). Warns
    about nothing and never raises for these (see `load`)."""
    if os.environ.get("TF_ADASUM_MPI_NATIVE", "1").strip() == "0":
        return None, "TF_ADASUM_MPI_NATIVE=0"
    with _lock:
        if not _loaded:
            module, path, reason = native_build.load(build)
            if module is not None:
                _library.append(ctypes.CDLL(str(path)))  # already loaded: finds it
            _loaded.append((module, reason))
        return _loaded[0]


def load():
    """The op module, built and loaded once per process, or None.

    None (with one `RuntimeWarning` per process naming the cause) when
    ``TF_ADASUM_MPI_NATIVE=0``, or when the library cannot be built or
    loaded; callers then use the Python path. Never raises for these. (The
    MPI engine asks `availability` and agrees with the other ranks instead.)
    """
    module, reason = availability()
    with _lock:
        if module is None and not _warned:
            _warned.append(True)
            warnings.warn(
                f"tf_adasum: the native MPI ops are unavailable: {reason}. The MPI engine uses its "
                "Python path (slower).",
                RuntimeWarning,
                stacklevel=2,
            )
    return module


def deadlines_missed() -> bool:
    """Whether a native op of this process missed its deadline (each such op
    also reported it on stderr)."""
    return bool(_library) and _library[0].tf_adasum_mpi_deadlines_missed() > 0


def _ops():
    module = load()
    if module is None:
        raise RuntimeError("tf_adasum: the native MPI ops are unavailable (see the warning); use the Python path.")
    return module


def _handle(comm) -> int:
    from mpi4py import MPI

    if not hasattr(MPI, "_handleof"):
        raise RuntimeError(
            "This mpi4py has no `MPI._handleof`, which the native MPI ops need to reach the communicator; "
            "install the `mpi` extra's mpi4py (>= 4.0)."
        )
    return int(MPI._handleof(comm))


def _checked(x, dtypes, name: str) -> tf.Tensor:
    x = tf.convert_to_tensor(x)
    if x.dtype not in dtypes:
        raise TypeError(
            f"`{name}` must have one of the dtypes {[d.name for d in dtypes]}. Received: {name}.dtype={x.dtype.name}"
        )
    return x


def _timeout(timeout_seconds: float) -> float:
    if not timeout_seconds >= 0:
        raise ValueError(f"`timeout_seconds` must be >= 0 (0: forever). Received: timeout_seconds={timeout_seconds}")
    return float(timeout_seconds)


@tf.autograph.experimental.do_not_convert
def tree(
    values: Sequence[tf.Tensor], comm, rule: str = "adasum", timeout_seconds: float = 0.0
) -> tuple[list[tf.Tensor], tf.Tensor]:
    """Combines each tensor of `values` over the ranks of `comm` in one op.

    The semantics of `tf_adasum.tree.rvh.allreduce` with `tf_adasum.combiners`'
    ``Adasum`` or ``Sum`` rule, each tensor on its own: the binary tree over
    the ranks in rank order (non-power-of-two sizes fold pairs (0, 1), ...
    first), vector halving, then a gather. Adasum accumulates the partial
    sums [a.b, |a|^2, |b|^2] in float64 (elements cast to float64 before they
    are multiplied) and sums them over each level's group of ranks; the
    coefficients are float64 (exactly 1 below `tf_adasum.reference.NORM_GUARD`)
    and ``c_a * a + c_b * b`` is computed in float64 and cast to the dtype once
    per level (via float32 for float16 and bfloat16, as `tf.cast`). "sum" adds
    in the dtype, as TensorFlow does. Every rank ends bitwise identical.

    Args:
      values: tensors of one float dtype (float16, bfloat16, float32,
        float64), any shapes (empty ones too); the same list on every rank.
      comm: an mpi4py communicator.
      rule: "adasum" or "sum".
      timeout_seconds: how long each MPI wait may take (0: forever).

    Returns:
      ``(combined, partials)``: the combined tensors (shapes of `values`),
      and float64 ``[levels, len(values), 3]``: per level (the fold first
      when the size is not a power of two), the group-summed partials this
      rank used, zeros where it computed none (all zeros for "sum"); as
      `tf_adasum.tree.topology.level_representatives` and ``num_levels`` count levels.
    """
    if rule not in RULES:
        raise ValueError(f"`rule` must be one of {list(RULES)}. Received: rule={rule!r}")
    timeout_seconds = _timeout(timeout_seconds)
    values = [_checked(v, _TREE_DTYPES, f"values[{i}]") for i, v in enumerate(values)]
    if not values:
        raise ValueError("`values` must hold at least one tensor. Received: values=[]")
    for i, x in enumerate(values):
        if x.dtype != values[0].dtype:
            raise TypeError(
                f"`values` must share one dtype. Received: values[0].dtype={values[0].dtype.name}, "
                f"values[{i}].dtype={x.dtype.name}"
            )
    combined, partials = _ops().tf_adasum_mpi_tree(
        values=values, comm=_handle(comm), rule=rule, timeout_seconds=timeout_seconds
    )
    leaves, folded = tree_shape(comm.Get_size())
    partials.set_shape([leaves.bit_length() - 1 + (1 if folded else 0), len(values), 3])
    return list(combined), partials


@tf.autograph.experimental.do_not_convert
def allreduce_sum(x: tf.Tensor, comm, timeout_seconds: float = 0.0) -> tf.Tensor:
    """Elementwise sum of `x` (float32 or float64) over the ranks of `comm`
    (``MPI_Iallreduce``, MPI's summation order); same shape and dtype."""
    timeout_seconds, x = _timeout(timeout_seconds), _checked(x, _SUM_DTYPES, "x")
    return _ops().tf_adasum_mpi_allreduce(x=x, comm=_handle(comm), timeout_seconds=timeout_seconds)


@tf.autograph.experimental.do_not_convert
def allgather(x: tf.Tensor, comm, timeout_seconds: float = 0.0) -> tf.Tensor:
    """``[size, *x.shape]``: every rank's `x` in rank order (bytes, unchanged).
    For small tensors (under 2 GiB in all); the same shape on every rank."""
    timeout_seconds, x = _timeout(timeout_seconds), _checked(x, _GATHER_DTYPES, "x")
    out = _ops().tf_adasum_mpi_allgather(x=x, comm=_handle(comm), timeout_seconds=timeout_seconds)
    out.set_shape([comm.Get_size(), *x.shape])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``--build``: builds the library (or finds it in the cache), prints its path."""
    import argparse

    parser = argparse.ArgumentParser(description="Builds tf_adasum's native MPI op library.")
    parser.add_argument("--build", action="store_true", required=True, help="build it and print its path")
    parser.parse_args(argv)
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # only the path of libmpi is needed: no MPI_Init here
    except ImportError:
        pass  # `build` names what is missing
    return native_build.print_built(build)


if __name__ == "__main__":
    sys.exit(main())
