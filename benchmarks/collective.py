"""Adasum all-reduce against the native SUM all-reduce, same processes, same run.

Three engines (``--engine``, default all):

* ``local``: N logical CPU devices in this process (MirroredStrategy);
  native = TensorFlow's CollectiveAllReduce (ring on CPUs), what MirroredStrategy
  uses by default, via ``strategy.extended.batch_reduce_to``;
* ``workers``: N worker processes on localhost (MultiWorkerMirroredStrategy,
  started with ``python -m tf_adasum.launch``); native = the strategy's own
  all-reduce (CollectiveAllReduce over gRPC);
* ``mpi``: N ranks under ``mpirun`` (the MPI engine); native = MPI's own
  ``Allreduce`` (SUM) of the same buffer, called from numpy; also
  ``native_tf_ms``, that ``Allreduce`` called through the same tf.function
  dispatch as the engine (its native op, or a ``tf.numpy_function`` where the
  native library is unavailable), and ``ratio_native_tf`` = adasum / native_tf.

Prints one JSON object per configuration (``engine``, ``replicas``, ``bytes``,
and the run's ``date``, ``commit``, ``processor`` and ``command``):
  adasum_ms    Adasum through tf_adasum (vector halving, float64 dots)
  native_ms    the native SUM all-reduce above
  rvh_sum_ms   the same vector-halving collective with a plain sum (transport alone)
  ratio        adasum_ms / native_ms;  ratio_rvh_sum  rvh_sum_ms / native_ms
  dots_ms      all replicas at once, on the collective's own devices or
               processes: one fused float64-accumulated pass giving
               [a.b, |a|^2, |b|^2] (``tf_adasum.ops.partial_dots``, the
               kernel of the TF path) over exactly the slices each replica
               holds at each level of the tree (S/2, S/4, ... S/N of an
               S-element buffer, plus the whole buffer for the fold when N is
               not a power of two), summed over the levels
  floor_ms     native_ms + dots_ms: what a sum plus the extra read for the
               dot products costs; ratio_to_floor = adasum_ms / floor_ms. A
               reference, not a bound: a design that computes the dot
               products while data arrives may beat it.
With ``--compression float16`` (or ``bfloat16``), engines local and workers also
report (under MPI only with ``--link``: a compressed combine leaves the native
op for the driver over mpi4py, so on loopback the ratio would mix two paths;
on a slow link the wire dominates):
  compressed_ms      Adasum with that wire format (`tf_adasum.comm.compression`)
  ratio_compressed   compressed_ms / adasum_ms (below 1: compression pays)
With ``--link RATE`` (engines workers and mpi), each process runs on a host of
its own, emulated by ``tf-adasum launch --hosts N --link RATE`` (``--mpirun``
for mpi): a network namespace per host, every host's link limited to RATE (tc
syntax, ``1gbit``) both ways. The records then also hold:
  link                 RATE;  link_floor_ms  2(N-1)/N x 8 S / B: the time a link of
                       B bits/s needs for what each host must send in an
                       all-reduce of S bytes (ring or vector halving)
  ratio_to_link_floor  adasum_ms / link_floor_ms; native_ratio_to_link_floor
                       and (with --compression) compressed_ratio_to_link_floor
                       the same for the native all-reduce and the compressed wire
Every path runs under the same TensorFlow CPU allocator (``--cpu-allocator``,
recorded as ``cpu_allocator``): ``bfc`` (default here) sets
``TF_CPU_ALLOCATOR_USE_BFC=true``, TensorFlow's pooling allocator; ``default``
leaves TensorFlow's malloc-based one, under which every buffer of 32 MiB or
more is fresh memory from the kernel, page-faulted on first touch (2.5-3 us a
page on the development machine), for native and Adasum alike. (Set before
TensorFlow is imported: ``main`` called in a process that has TensorFlow
already keeps its allocator, whatever ``cpu_allocator`` then says.)
Times are medians over repeats of one call each, the methods called in turn
within each repeat (TF paths inside a tf.function traced beforehand; MPI ranks
start each call together after a barrier, and so do worker processes: a
one-element sum over tf_adasum's socket transport; records of the worker engine
dated before 2026-12-06 were taken without it). Process engines first run
``--process-warmup`` untimed rounds (default 20): between worker processes the
first rounds are slow, for
Adasum more than for the native all-reduce (on 2026-12-03, workers, N = 4,
16 MiB, one worker's calls: Adasum 112-210 ms in the first 13 rounds, mostly
80-120 after; the native 81-151, then 61-97), and a training run, thousands of
steps long, lives in the steady state after them.

``--table FILE`` prints the Markdown table of the records in FILE (the
benchmarks guide's tables are that output; tests/test_provenance.py checks).

Usage: python benchmarks/collective.py [--engine local workers mpi] [--replicas 2 4]
       [--sizes 4096 ...] [--dtype float32] [--process-repeats 20] [--process-warmup 20]
       [--compression float16] [--cpu-allocator bfc] [--link 1gbit]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
ENGINES = ("local", "workers", "mpi")
ROLES = ("workers-worker", "mpi-rank")  # what the spawned processes run
#: The run's date, commit, processor and command (`tf_adasum.eval.provenance`), added by the
#: parent to every record it prints (the spawned processes' records come without them).
_PROVENANCE: dict = {}


def _ms(value: float) -> str:
    """Milliseconds to 3 significant digits, whole from 1,000 up."""
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


#: The columns of `table`: (heading, how a record gives its cell).
TABLE_COLUMNS = (
    ("engine", lambda r: r["engine"]),
    ("N", lambda r: str(r["replicas"])),
    ("buffer", lambda r: f"{r['bytes'] >> 20} MiB" if r["bytes"] >= 1 << 20 else f"{r['bytes'] >> 10} KiB"),
    ("adasum_ms", lambda r: _ms(r["adasum_ms"])),
    ("native_ms", lambda r: _ms(r["native_ms"])),
    ("ratio", lambda r: f"{r['ratio']:.2f}"),
    ("rvh_sum_ms", lambda r: _ms(r["rvh_sum_ms"])),
    ("dots_ms", lambda r: _ms(r["dots_ms"])),
    ("ratio_to_floor", lambda r: f"{r['ratio_to_floor']:.2f}"),
)


#: The columns `table` adds for records with ``--compression``.
COMPRESSED_COLUMNS = (
    ("compressed_ms", lambda r: _ms(r["compressed_ms"])),
    ("ratio_compressed", lambda r: f"{r['ratio_compressed']:.2f}"),
)


#: The columns of `table` for records of emulated links (``--link``): the
#: loopback table's first three (engine, N, buffer), then these.
LINK_COLUMNS = TABLE_COLUMNS[:3] + (
    ("link", lambda r: r["link"]),
    ("commit", lambda r: r["commit"]),
    ("link_floor_ms", lambda r: _ms(r["link_floor_ms"])),
    ("adasum_ms", lambda r: _ms(r["adasum_ms"])),
    ("ratio_to_link_floor", lambda r: f"{r['ratio_to_link_floor']:.2f}"),
    ("rvh_sum / floor", lambda r: f"{r['rvh_sum_ms'] / r['link_floor_ms']:.2f}"),
    ("native_ratio_to_link_floor", lambda r: f"{r['native_ratio_to_link_floor']:.2f}"),
)

#: The column `table` adds to `LINK_COLUMNS` for records with ``--compression``.
LINK_COMPRESSED_COLUMNS = (("compressed_ratio_to_link_floor", lambda r: f"{r['compressed_ratio_to_link_floor']:.2f}"),)


def table(records: list[dict]) -> str:
    """The Markdown table of records, one row per record in order, as the
    benchmarks guide shows it (``--table FILE`` prints it): `TABLE_COLUMNS`
    on loopback, with the compressed wire's columns where every record has
    them; `LINK_COLUMNS` where every record was taken on emulated links (and
    the compressed wire's ratio to the floor where every record has it)."""
    linked = bool(records) and all("link" in r for r in records)
    columns, compressed_columns = (
        (LINK_COLUMNS, LINK_COMPRESSED_COLUMNS) if linked else (TABLE_COLUMNS, COMPRESSED_COLUMNS)
    )
    if all("compressed_ms" in r for r in records):
        columns += compressed_columns
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in records]
    return "\n".join(lines) + "\n"


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", metavar="FILE", help="print the Markdown table of the records in FILE, and exit")
    parser.add_argument("--engine", nargs="+", default=list(ENGINES), choices=list(ENGINES) + list(ROLES))
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="replica (process) counts")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="buffer sizes in bytes")
    parser.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (at least)")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="keep repeating until this much time")
    parser.add_argument(
        "--process-repeats", type=int, default=20, help="timed calls per measurement with workers or MPI ranks"
    )
    parser.add_argument(
        "--process-warmup",
        type=int,
        default=20,
        help="untimed rounds before the timed ones with workers or MPI ranks (see the module docstring)",
    )
    parser.add_argument("--compression", choices=["float16", "bfloat16"], help="also time Adasum with this wire format")
    parser.add_argument(
        "--cpu-allocator",
        choices=["bfc", "default"],
        default="bfc",
        help="TensorFlow's CPU allocator for every path (TF_CPU_ALLOCATOR_USE_BFC); see the module docstring",
    )
    parser.add_argument(
        "--link",
        metavar="RATE",
        help="engines workers and mpi on emulated hosts, one process each, links at RATE (e.g. 1gbit)",
    )
    args = parser.parse_args(argv)
    if args.link and "local" in args.engine:
        parser.error(f"--link runs the engines workers and mpi only. Received: --engine {' '.join(args.engine)}")
    return args


def _wait(out):
    """Waits for `out` by reading one element of its last tensor (``numpy()`` of
    the whole tensor would add a copy of the buffer to the time); None (a numpy
    call, finished when it returns) needs no wait."""
    if out is None:
        return
    last = tf.nest.flatten(out, expand_composites=True)[-1]
    tf.reshape(last, [-1])[:1].numpy()


def main(argv=None):
    args = _parse_args(argv)
    if args.table:
        with open(args.table, encoding="utf-8") as f:
            print(table([json.loads(line) for line in f if line.strip()]), end="")
        return
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = str(args.cpu_allocator == "bfc").lower()  # read when TF starts
    global tf
    import tensorflow as tf

    if args.engine == ["workers-worker"]:
        return _workers_worker(args)
    if args.engine == ["mpi-rank"]:
        return _mpi_rank(args)
    from tf_adasum.eval import provenance

    _PROVENANCE.update(provenance.fields(provenance.command_line(__file__, argv)))
    if "local" in args.engine:
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * max(args.replicas)
        )
        for n in args.replicas:
            _bench_replicas(n, args)
    for engine in ("workers", "mpi"):
        if engine in args.engine:
            for n in args.replicas:
                _spawn(engine, n, args)


def _forwarded_args(args):
    forwarded = [
        "--sizes",
        *map(str, args.sizes),
        "--dtype",
        args.dtype,
        "--process-repeats",
        str(args.process_repeats),
        "--process-warmup",
        str(args.process_warmup),
        "--cpu-allocator",
        args.cpu_allocator,
    ]
    forwarded += ["--link", args.link] if args.link else []
    return forwarded + (["--compression", args.compression] if args.compression else [])


def _spawn(engine, n, args):
    """Runs this script as N processes; prints the JSON lines of process 0."""
    import subprocess

    script = os.path.abspath(__file__)
    hosts = ["--hosts", str(n), "--link", args.link] if args.link else []
    if engine == "workers":
        command = [sys.executable, "-m", "tf_adasum.launch", "-n", str(n), *hosts, script, "--engine", "workers-worker"]
        prefix = "[worker 0] "
    elif args.link:
        command = [sys.executable, "-m", "tf_adasum.launch", "-n", str(n), *hosts, "--mpirun", script]
        command += ["--engine", "mpi-rank"]
        prefix = "[mpirun] "
    else:
        from tf_adasum.launcher.mpirun import mpirun_command

        command = mpirun_command(n)
        command += [sys.executable, script, "--engine", "mpi-rank"]
        prefix = ""
    result = subprocess.run(command + _forwarded_args(args), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{engine} benchmark with {n} processes failed:\n{(result.stdout + result.stderr)[-4000:]}")
    for line in result.stdout.splitlines():
        if line.startswith(prefix + "{"):
            print(json.dumps({**json.loads(line[len(prefix) :]), **_PROVENANCE}), flush=True)


def level_slices(elements: int, n: int) -> list[int]:
    """The slice length each replica runs the dot products over, per level of
    the tree for `n` replicas: the fold (whole buffer) when `n` is not a power
    of two, then halves, quarters, ... (rounded up to whole blocks)."""
    from tf_adasum import ops
    from tf_adasum.reference import tree_shape

    leaves, folded = tree_shape(n)
    blocks = -(-elements // ops.BLOCK)
    slices = [blocks] if folded else []
    for level in range(1, leaves.bit_length()):
        slices.append(-(-blocks // (1 << level)))
    return [b * ops.BLOCK for b in slices]


def _dots_inputs(elements, n, dtype, seed):
    """Per level, a ``[2, slice]`` operand pair for `partial_dots`."""
    return [
        tf.cast(tf.random.stateless_normal([2, m], seed=[seed, 11 + i]), dtype)
        for i, m in enumerate(level_slices(elements, n))
    ]


def _dots(pairs):
    """The dot products of every level, as the TF path computes them."""
    from tf_adasum import ops

    return [ops.partial_dots(x[0], x[1], ops.Segments.single()) for x in pairs]


def _with_compressed(record, compression, compressed_ms):
    if compression:
        record["compression"] = compression
        record["compressed_ms"] = round(compressed_ms, 3)
        record["ratio_compressed"] = round(compressed_ms / record["adasum_ms"], 3)
    return record


def _with_floor(record, dots_ms):
    record["dots_ms"] = round(dots_ms, 3)
    record["floor_ms"] = round(record["native_ms"] + dots_ms, 3)
    record["ratio_to_floor"] = round(record["adasum_ms"] / record["floor_ms"], 3)
    return record


def link_floor_ms(n: int, nbytes: int, link: str) -> float:
    """The time each host's link needs for the bytes it must send in an
    all-reduce of `nbytes` over `n` hosts, ring or vector halving: 2(n-1)/n x
    nbytes, at `link` (tc syntax: bits per second)."""
    from tf_adasum.launcher.helper import rate_bits_per_second

    return 2 * (n - 1) / n * nbytes * 8 / rate_bits_per_second(link) * 1e3


def _with_link(record, link):
    if link:
        floor = link_floor_ms(record["replicas"], record["bytes"], link)
        record.update(link=link, link_floor_ms=round(floor, 3))
        for prefix, key in (("", "adasum_ms"), ("native_", "native_ms"), ("compressed_", "compressed_ms")):
            if key in record:
                record[f"{prefix}ratio_to_link_floor"] = round(record[key] / floor, 3)
    return record


def _record(engine, n, dtype, elements, adasum_ms, native_ms, rvh_sum_ms):
    record = {
        "benchmark": "collective",
        "engine": engine,
        "replicas": n,
        "dtype": dtype.name,
        "bytes": elements * dtype.size,
        "adasum_ms": adasum_ms,
        "native_ms": native_ms,
        "rvh_sum_ms": rvh_sum_ms,
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "cpu_allocator": "bfc" if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") == "true" else "default",
    }
    record["ratio"] = record["adasum_ms"] / record["native_ms"]
    record["ratio_rvh_sum"] = record["rvh_sum_ms"] / record["native_ms"]
    for key in ("adasum_ms", "native_ms", "rvh_sum_ms", "ratio", "ratio_rvh_sum"):
        record[key] = round(record[key], 3)
    return record


def _workers_worker(args):
    """One worker of a localhost MultiWorkerMirroredStrategy cluster."""
    import tf_adasum

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    # Fixed repeat counts: every worker must issue the same collectives.
    is_chief = strategy.cluster_resolver.task_id == 0
    cross_device_ops = tf_adasum.AdasumCrossDeviceOps()
    with strategy.scope():
        one = strategy.experimental_distribute_values_from_function(lambda ctx: tf.ones([1]))
        meet = tf.function(lambda v: cross_device_ops.batch_reduce_combine([v], "sum"))
    _bench_strategy(
        "workers",
        strategy,
        cross_device_ops,
        args,
        args.process_repeats,
        0.0,
        is_chief,
        args.process_warmup,
        barrier=lambda: _wait(meet(one)),
    )
    # A worker finishes a collective once it has its own result, while a peer
    # may still be pulling this worker's last buffer. Every worker enters the
    # tiny all-reduce only after its earlier collectives, pulls included, are
    # done; the second's wait (a guess, ample on localhost) covers the pulls
    # of the all-reduce itself.
    strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)), axis=None)
    time.sleep(1.0)
    os._exit(0)  # skip TF's teardown, which can wait on peers that already left


def _interleaved_medians_ms(calls, repeats, min_seconds=0.0, barrier=None, warmup=1):
    """Median ms of each of `calls` (functions of no argument), called in turn
    within each round, for at least `repeats` rounds and, up to 50, until
    `min_seconds` have passed (process engines pass 0: every process must
    issue the same collectives); `barrier`, if given, runs before each call.
    Each call is traced and run once, then `warmup` untimed rounds run.

    Interleaving gives every method the same machine: a slowdown mid-run
    slows them all, and every method sees the same allocator state (the first
    large buffers a process frees raise glibc's mmap threshold, and a method
    timed alone before that pays page faults on every fresh output, about 3x
    at 16 MiB here, that the others do not)."""
    for call in calls:  # trace
        _wait(call())
    for _ in range(warmup):
        for call in calls:
            if barrier is not None:
                barrier()
            _wait(call())
    times = [[] for _ in calls]
    start = time.perf_counter()
    while len(times[0]) < repeats or (time.perf_counter() - start < min_seconds and len(times[0]) < 50):
        for call, call_times in zip(calls, times):
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            _wait(call())
            call_times.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(call_times) for call_times in times]


def _mpi_rank(args):
    """One MPI rank: tf_adasum's MPI engine against MPI's own Allreduce."""
    import numpy as np

    from tf_adasum.comm import mpi_transport
    from tf_adasum.engines import mpi_native, select
    from tf_adasum.engines.mpi import MPIEngine

    MPI = mpi_transport.mpi()
    engine = MPIEngine(select.mpi_world())
    comm = engine.world.comm
    dtype = tf.as_dtype(args.dtype)
    adasum = tf.function(lambda v: engine.combine([v]))
    rvh_sum = tf.function(lambda v: engine.combine([v], "sum"))
    compressed = None
    if args.compression and args.link:  # the driver over mpi4py (see the module docstring)
        compressed_engine = MPIEngine(select.mpi_world(), compression=args.compression)
        compressed = tf.function(lambda v: compressed_engine.combine([v]))
    if engine.native is not None:
        native_tf = tf.function(lambda v: mpi_native.allreduce_sum(v, comm, 0.0))
    else:

        def allreduce(values):
            out = np.empty_like(values)
            comm.Allreduce(values, out, op=MPI.SUM)
            return out

        native_tf = tf.function(lambda v: tf.numpy_function(allreduce, [v], v.dtype, stateful=True))

    for size in args.sizes:
        elements = size // dtype.size
        value = tf.cast(tf.random.stateless_normal([elements], seed=[comm.rank, 7]), dtype)
        buffer = np.ascontiguousarray(value.numpy())
        out = np.empty_like(buffer)
        mpi_type = MPI.FLOAT if dtype == tf.float32 else MPI.DOUBLE if dtype == tf.float64 else None
        if mpi_type is None:
            raise SystemExit("--engine mpi compares with MPI's Allreduce, which has no 16-bit float type")

        def native(_, buffer=buffer, out=out, mpi_type=mpi_type):
            comm.Allreduce([buffer, mpi_type], [out, mpi_type], op=MPI.SUM)

        pairs = _dots_inputs(elements, comm.size, dtype, comm.rank)
        dots = tf.function(lambda _, pairs=pairs: _dots(pairs))
        fns = (adasum, native, rvh_sum, native_tf, dots, *([compressed] if compressed else []))
        calls = [lambda fn=fn, value=value: fn(value) for fn in fns]
        times = _interleaved_medians_ms(calls, args.process_repeats, barrier=comm.Barrier, warmup=args.process_warmup)
        if comm.rank == 0:
            record = _with_floor(_record("mpi", comm.size, dtype, elements, *times[:3]), times[4])
            record["native_tf_ms"] = round(times[3], 3)
            record["ratio_native_tf"] = round(times[0] / times[3], 3)
            record["native_library"] = engine.native is not None
            if compressed:
                record = _with_compressed(record, args.compression, times[5])
            print(json.dumps(_with_link(record, args.link)), flush=True)


def _bench_replicas(n, args):
    """N logical CPU devices of this process. The strategy's SUM goes through
    AdasumCrossDeviceOps' fallback, TF's default CollectiveAllReduce with its own
    keys: two plain MirroredStrategies of different sizes in one process would
    collide on TF's group key 1."""
    import tf_adasum

    cross_device_ops = tf_adasum.AdasumCrossDeviceOps()
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)], cross_device_ops=cross_device_ops)
    _bench_strategy("local", strategy, cross_device_ops, args, args.repeats, args.min_seconds, True)


def _bench_strategy(engine, strategy, cross_device_ops, args, repeats, min_seconds, report, warmup=1, barrier=None):
    """Times Adasum, the strategy's native SUM all-reduce and the plain-sum
    collective for each size (`barrier`, if given, before each call); prints
    the record when `report`."""
    import tf_adasum

    dtype = tf.as_dtype(args.dtype)
    options = cross_device_ops.options
    compressed_ops = tf_adasum.AdasumCrossDeviceOps(options=options, compression=args.compression)
    with strategy.scope():
        adasum = tf.function(lambda v: cross_device_ops.batch_reduce_adasum([v]))
        compressed = tf.function(lambda v: compressed_ops.batch_reduce_adasum([v]))
        rvh_sum = tf.function(lambda v: cross_device_ops.batch_reduce_combine([v], "sum"))
        native = tf.function(lambda v: strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(v, v)]))
        for size in args.sizes:
            elements = size // dtype.size
            value = strategy.experimental_distribute_values_from_function(
                lambda ctx, elements=elements: tf.cast(
                    tf.random.stateless_normal([elements], seed=[ctx.replica_id_in_sync_group, 7]), dtype
                )
            )
            n = strategy.num_replicas_in_sync
            pairs = strategy.experimental_distribute_values_from_function(
                lambda ctx, elements=elements, n=n: _dots_inputs(elements, n, dtype, ctx.replica_id_in_sync_group)
            )
            dots = tf.function(lambda pairs: strategy.run(_dots, args=(pairs,)))
            calls = [lambda fn=fn, value=value: fn(value) for fn in (adasum, native, rvh_sum)]
            calls.append(lambda dots=dots, pairs=pairs: dots(pairs))
            if args.compression:
                calls.append(lambda value=value: compressed(value))
            times = _interleaved_medians_ms(calls, repeats, min_seconds, barrier=barrier, warmup=warmup)
            if report:  # in the parent (engine local): with its provenance
                record = _with_floor(_record(engine, n, dtype, elements, *times[:3]), times[3])
                _with_compressed(record, args.compression, times[-1])
                print(json.dumps({**_with_link(record, args.link), **_PROVENANCE}), flush=True)


if __name__ == "__main__":
    main()
