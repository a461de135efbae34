"""The native MPI ops alone: the Adasum tree op against MPI's own all-reduce.

Spawns ``mpirun -np N`` of itself (``--role rank``) for each N of
``--replicas``; float32, one tensor per call for each of ``--sizes`` (bytes),
then four small tensors (1,000 + 3 + 70,000 + 1 elements) in one call.
Prints one JSON object per configuration, with the run's ``date``, ``commit``,
``processor`` and ``command`` (`tf_adasum.eval.provenance`):

  adasum_ms     TfAdasumMpiTree, rule "adasum", in a traced tf.function
  tree_sum_ms   the same op with rule "sum" (the tree's transport alone)
  native_tf_ms  TfAdasumMpiAllreduce (MPI_Iallreduce) of the same buffer in a
                traced tf.function: the same op dispatch, MPI's algorithm
  native_ms     mpi4py ``comm.Allreduce`` from numpy (MPI's own, no TensorFlow)
  ratio         adasum_ms / native_ms;  ratio_tf  adasum_ms / native_tf_ms

Each time is the median over ``--repeats`` calls; every call starts after a
barrier and counts the slowest rank. The methods take turns call by call, so
a busy machine slows them alike.

Usage: python benchmarks/mpi_native.py [--replicas 2 4] [--sizes 65536 ...] [--repeats 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEFAULT_SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
SMALL_TENSORS = [1000, 3, 70000, 1]


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="MPI rank counts")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="buffer sizes in bytes")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per method and size")
    parser.add_argument("--timeout", type=float, default=300.0, help="MPI wait limit of the ops, seconds")
    parser.add_argument("--role", choices=["parent", "rank"], default="parent", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    if args.role == "rank":
        return _rank(args)
    from tf_adasum.launcher.mpirun import mpirun_command

    # Build once here, so that the ranks only load the library.
    subprocess.run([sys.executable, "-m", "tf_adasum.engines.mpi_native", "--build"], check=True, capture_output=True)
    from tf_adasum.eval import provenance

    origin = provenance.fields(provenance.command_line(__file__, argv))
    forwarded = ["--sizes", *map(str, args.sizes), "--repeats", str(args.repeats), "--timeout", str(args.timeout)]
    for n in args.replicas:
        command = mpirun_command(n) + [sys.executable, os.path.abspath(__file__), "--role", "rank", *forwarded]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"the benchmark with {n} ranks failed:\n{(result.stdout + result.stderr)[-4000:]}")
        for line in result.stdout.splitlines():
            if line.startswith("{"):
                print(json.dumps({**json.loads(line), **origin}), flush=True)
    return 0


def _rank(args) -> int:
    import numpy as np
    import tensorflow as tf
    from mpi4py import MPI

    from tf_adasum.engines import mpi_native

    comm = MPI.COMM_WORLD
    if mpi_native.load() is None:
        raise SystemExit("the native MPI ops are unavailable (see the warning above)")

    def tree(rule):
        return tf.function(lambda values: mpi_native.tree(values, comm, rule, args.timeout)[0], autograph=False)

    adasum, tree_sum = tree("adasum"), tree("sum")
    native_tf = tf.function(lambda x: mpi_native.allreduce_sum(x, comm, args.timeout), autograph=False)

    def measure(element_counts):
        values = [
            tf.random.stateless_normal([count], seed=[comm.rank, i], dtype=tf.float32)
            for i, count in enumerate(element_counts)
        ]
        fused = tf.concat(values, axis=0) if len(values) > 1 else values[0]
        buffer = np.ascontiguousarray(fused.numpy())
        out = np.empty_like(buffer)
        # Eager calls return once the op has run; `.numpy()` would add a copy.
        methods = {
            "adasum_ms": lambda: adasum(values),
            "tree_sum_ms": lambda: tree_sum(values),
            "native_tf_ms": lambda: native_tf(fused),
            "native_ms": lambda: comm.Allreduce([buffer, MPI.FLOAT], [out, MPI.FLOAT], op=MPI.SUM),
        }
        times = {name: [] for name in methods}
        for repeat in range(args.repeats + 2):  # two warm-up rounds (tracing)
            for name, method in methods.items():
                comm.Barrier()
                start = time.perf_counter()
                method()
                elapsed = time.perf_counter() - start
                if repeat >= 2:
                    times[name].append(elapsed)
        record = {
            "benchmark": "mpi_native",
            "replicas": comm.size,
            "dtype": "float32",
            "bytes": 4 * sum(element_counts),
            "tensors": len(element_counts),
        }
        for name, own in times.items():
            slowest = np.empty(len(own))
            comm.Allreduce(np.asarray(own), slowest, op=MPI.MAX)
            record[name] = round(1e3 * statistics.median(slowest), 3)
        record["ratio"] = round(record["adasum_ms"] / record["native_ms"], 3)
        record["ratio_tf"] = round(record["adasum_ms"] / record["native_tf_ms"], 3)
        record.update(cpu_count=os.cpu_count(), machine=platform.machine())
        if comm.rank == 0:
            print(json.dumps(record), flush=True)

    for size in args.sizes:
        measure([size // 4])
    measure(SMALL_TENSORS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
