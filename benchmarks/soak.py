"""Soak test: thousands of combines in a row, watching threads and memory.

Each configuration (``--engine workers mpi`` x ``--processes 2 4``) starts N
processes, as `benchmarks/collective.py` does:

* ``workers``: N workers of a localhost MultiWorkerMirroredStrategy
  (``python -m tf_adasum.launch``), each combine
  `tf_adasum.AdasumCrossDeviceOps().batch_reduce_adasum` inside one traced
  `tf.function`;
* ``mpi``: N ranks under ``mpirun``, each combine
  ``MPIEngine(select.mpi_world()).combine(tensors)`` inside one traced
  `tf.function` (the native op where it is built, else the portable path).

Every combine reduces one fixed list of tensors (shapes and dtypes drawn once
from ``--seed``, the same in every process) holding new random values (drawn
inside the function from the call's step number and the process). After
``--warmup`` combines (tracing, kernel compilation), each process prints one
JSON line at the start, the middle and the end of ``--combines`` combines:

  combines   combines done since the start
  seconds    wall time since the start
  threads    ``len(os.listdir('/proc/self/task'))``
  rss_mib    resident memory (VmRSS of /proc/self/status)

and a ``summary`` line: growth of threads and RSS per 1000 combines over the
whole run and over its second half (where one-off warm-up growth is over),
and a checksum of the last combine (equal on every process, as the combine is
bitwise identical everywhere). The parent prints every process's lines, then
one ``soak_summary`` line per configuration (the worst process), with the
run's ``date``, ``commit``, ``processor`` and ``command``.

Usage: python benchmarks/soak.py [--engine workers mpi] [--processes 2 4]
       [--combines 2000] [--tensors 6] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ENGINES = ("workers", "mpi")
ROLES = ("workers-worker", "mpi-rank")  # what the spawned processes run
DTYPES = ("float32", "float32", "float32", "float64", "bfloat16")


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", nargs="+", default=list(ENGINES), choices=list(ENGINES) + list(ROLES))
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4], help="process counts")
    parser.add_argument("--combines", type=int, default=2000, help="timed combines per configuration")
    parser.add_argument("--warmup", type=int, default=20, help="combines before the start is measured")
    parser.add_argument("--tensors", type=int, default=6, help="tensors per combine")
    parser.add_argument("--max-elements", type=int, default=1 << 16, help="largest tensor, in elements")
    parser.add_argument("--seed", type=int, default=0, help="draws the shapes and dtypes (shared by all processes)")
    args = parser.parse_args(argv)
    for name in ("combines", "warmup", "tensors", "max_elements"):
        if getattr(args, name) < (1 if name != "warmup" else 0):
            parser.error(f"--{name.replace('_', '-')} must be positive. Received: {getattr(args, name)}")
    if any(n < 2 for n in args.processes):
        parser.error(f"--processes must be at least 2. Received: {args.processes}")
    return args


def tensor_specs(seed: int, count: int, max_elements: int) -> list[tuple[tuple[int, ...], str]]:
    """`count` (shape, dtype) pairs: sizes log-uniform in [1, max_elements],
    one or two dimensions, the same for every process with the same `seed`."""
    import numpy as np

    rng = np.random.default_rng(seed)
    specs = []
    for _ in range(count):
        size = int(np.exp(rng.uniform(0.0, np.log(max_elements))))
        rows = int(rng.integers(1, 9)) if size >= 64 and rng.random() < 0.5 else 1
        shape = (rows, size // rows) if rows > 1 else (size,)
        specs.append((shape, DTYPES[int(rng.integers(len(DTYPES)))]))
    return specs


# -- measurements (in each process) -------------------------------------------------------


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0  # kB
    raise RuntimeError("no VmRSS in /proc/self/status")


def _soak(engine: str, size: int, process: int, combine, args) -> None:
    """Runs the warm-up and the timed combines; prints this process's lines."""
    import tensorflow as tf

    for step in range(args.warmup):
        combine(tf.constant(step, tf.int64)).numpy()
    base = {"benchmark": "soak", "engine": engine, "processes": size, "process": process}
    checkpoints = {0: "start", args.combines // 2: "middle", args.combines: "end"}
    samples = {}
    start = time.perf_counter()
    checksum = None
    for done in range(args.combines + 1):
        if done in checkpoints:
            sample = {"combines": done, "seconds": round(time.perf_counter() - start, 3)}
            sample.update(threads=_threads(), rss_mib=round(_rss_mib(), 2))
            samples[checkpoints[done]] = sample
            print(json.dumps({**base, "phase": checkpoints[done], **sample}), flush=True)
        if done < args.combines:
            checksum = float(combine(tf.constant(args.warmup + done, tf.int64)).numpy())

    def per_1000(first, last, key):
        span = samples[last]["combines"] - samples[first]["combines"]
        return round(1000.0 * (samples[last][key] - samples[first][key]) / span, 3) if span else 0.0

    summary = {
        **base,
        "phase": "summary",
        "combines": args.combines,
        "combines_per_second": round(args.combines / samples["end"]["seconds"], 1),
        "rss_growth_mib_per_1000": per_1000("start", "end", "rss_mib"),
        "rss_growth_mib_per_1000_second_half": per_1000("middle", "end", "rss_mib"),
        "threads_growth_per_1000": per_1000("start", "end", "threads"),
        "checksum": checksum,
    }
    print(json.dumps(summary), flush=True)


def _random_values(specs, step, process):
    """This call's values: new for every step, different on every process."""
    import tensorflow as tf

    return [
        tf.cast(tf.random.stateless_normal(shape, seed=tf.stack([step, tf.cast(process * 1000 + i, tf.int64)])), dtype)
        for i, (shape, dtype) in enumerate(specs)
    ]


def _checksum(tensors):
    import tensorflow as tf

    return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float64)) for t in tensors])


def _workers_worker(args) -> None:
    """One worker of a localhost MultiWorkerMirroredStrategy cluster."""
    import tensorflow as tf

    import tf_adasum

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    cross_device_ops = tf_adasum.AdasumCrossDeviceOps()
    specs = tensor_specs(args.seed, args.tensors, args.max_elements)
    process = strategy.cluster_resolver.task_id

    with strategy.scope():

        @tf.function
        def combine(step):
            def values():
                replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int64)
                return _random_values(specs, step, replica)

            combined = cross_device_ops.batch_reduce_adasum(list(strategy.run(values)))
            return _checksum([strategy.experimental_local_results(c)[0] for c in combined])

        _soak("workers", strategy.num_replicas_in_sync, process, combine, args)
    sys.stdout.flush()
    os._exit(0)  # skip TF's teardown, which can wait on peers that already left


def _mpi_rank(args) -> None:
    """One MPI rank: the MPI engine's combine."""
    import tensorflow as tf

    from tf_adasum.comm import mpi_transport
    from tf_adasum.engines import select
    from tf_adasum.engines.mpi import MPIEngine

    engine = MPIEngine(select.mpi_world())
    specs = tensor_specs(args.seed, args.tensors, args.max_elements)
    process = engine.world.rank

    @tf.function
    def combine(step):
        return _checksum(engine.combine(_random_values(specs, step, tf.constant(process, tf.int64))))

    _soak("mpi", engine.world.size, process, combine, args)
    sys.stdout.flush()
    mpi_transport.mpi().Finalize()


# -- the parent -------------------------------------------------------------------------------


def _forwarded_args(args) -> list[str]:
    return [
        "--combines", str(args.combines), "--warmup", str(args.warmup), "--tensors", str(args.tensors),
        "--max-elements", str(args.max_elements), "--seed", str(args.seed),
    ]  # fmt: skip


def _spawn(engine: str, n: int, args) -> list[dict]:
    """Runs this script as N processes; prints and returns their JSON lines."""
    script = os.path.abspath(__file__)
    if engine == "workers":
        command = [sys.executable, "-m", "tf_adasum.launch", "-n", str(n), script, "--engine", "workers-worker"]
    else:
        from tf_adasum.launcher.mpirun import mpirun_command

        command = mpirun_command(n) + [sys.executable, script, "--engine", "mpi-rank"]
    result = subprocess.run(command + _forwarded_args(args), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{engine} soak with {n} processes failed:\n{(result.stdout + result.stderr)[-4000:]}")
    records = []
    for line in result.stdout.splitlines():
        text = line.split("] ", 1)[1] if line.startswith("[worker ") else line
        if text.startswith("{"):
            records.append(json.loads(text))
            print(text, flush=True)
    return records


def _summarise(engine: str, n: int, records: list[dict]) -> dict:
    summaries = [r for r in records if r.get("phase") == "summary"]
    if len(summaries) != n:
        raise SystemExit(f"{engine} soak with {n} processes: {len(summaries)} of {n} processes reported")
    starts = [r for r in records if r.get("phase") == "start"]
    ends = [r for r in records if r.get("phase") == "end"]
    return {
        "benchmark": "soak_summary",
        "engine": engine,
        "processes": n,
        "combines": summaries[0]["combines"],
        "combines_per_second": min(s["combines_per_second"] for s in summaries),
        "threads_start": max(r["threads"] for r in starts),
        "threads_end": max(r["threads"] for r in ends),
        "rss_mib_start": max(r["rss_mib"] for r in starts),
        "rss_mib_end": max(r["rss_mib"] for r in ends),
        "max_rss_growth_mib_per_1000": max(s["rss_growth_mib_per_1000"] for s in summaries),
        "max_rss_growth_mib_per_1000_second_half": max(s["rss_growth_mib_per_1000_second_half"] for s in summaries),
        "max_threads_growth_per_1000": max(s["threads_growth_per_1000"] for s in summaries),
        "same_result_everywhere": len({s["checksum"] for s in summaries}) == 1,
    }


def main(argv=None) -> None:
    args = _parse_args(argv)
    if args.engine == ["workers-worker"]:
        return _workers_worker(args)
    if args.engine == ["mpi-rank"]:
        return _mpi_rank(args)
    from tf_adasum.eval import provenance

    origin = provenance.fields(provenance.command_line(__file__, argv))
    summaries = []
    for engine in ENGINES:
        if engine in args.engine:
            for n in args.processes:
                summaries.append(_summarise(engine, n, _spawn(engine, n, args)))
    for summary in summaries:
        print(json.dumps({**summary, **origin}), flush=True)


if __name__ == "__main__":
    main()
