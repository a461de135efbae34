"""Adasum all-reduce against TensorFlow's native SUM all-reduce, same devices, same run.

Prints one JSON object per configuration:
  adasum_ms    AdasumCrossDeviceOps.batch_reduce_adasum (vector halving, float64 dots)
  native_ms    the native SUM all-reduce: what MirroredStrategy uses by default
               (CollectiveAllReduce, ring on CPUs), via strategy.extended.batch_reduce_to
  rvh_sum_ms   the same vector-halving collective with a plain sum (transport cost alone)
  ratio        adasum_ms / native_ms
  ratio_rvh_sum  rvh_sum_ms / native_ms
Times are medians over repeats of one call each, inside a tf.function traced beforehand.

Usage: python benchmarks/collective.py [--replicas 2 4] [--sizes 4096 ...] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def _parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="local replica counts")
    parser.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="buffer sizes in bytes")
    parser.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (at least)")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="keep repeating until this much time")
    return parser.parse_args(argv)


def _median_ms(fn, arg, repeats, min_seconds):
    fn(arg)  # trace and warm up
    fn(arg)
    times = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_seconds and len(times) < 50):
        t0 = time.perf_counter()
        out = fn(arg)
        tf.nest.flatten(out, expand_composites=True)[-1].numpy()  # wait for the result
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None):
    args = _parse_args(argv)
    global tf
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * max(args.replicas))
    for n in args.replicas:
        _bench_replicas(n, args)


def _bench_replicas(n, args):
    import tf_adasum

    dtype = tf.as_dtype(args.dtype)
    cross_device_ops = tf_adasum.AdasumCrossDeviceOps()
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)], cross_device_ops=cross_device_ops)
    with strategy.scope():
        adasum = tf.function(lambda v: cross_device_ops.batch_reduce_adasum([v]))
        rvh_sum = tf.function(lambda v: cross_device_ops.batch_reduce_combine([v], "sum"))
        native = tf.function(lambda v: strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(v, v)]))
        for size in args.sizes:
            elements = size // dtype.size
            value = strategy.experimental_distribute_values_from_function(
                lambda ctx, elements=elements: tf.cast(
                    tf.random.stateless_normal([elements], seed=[ctx.replica_id_in_sync_group, 7]), dtype
                )
            )
            record = {
                "benchmark": "collective",
                "engine": "local-devices",
                "replicas": n,
                "dtype": args.dtype,
                "bytes": elements * dtype.size,
                "adasum_ms": _median_ms(adasum, value, args.repeats, args.min_seconds),
                "native_ms": _median_ms(native, value, args.repeats, args.min_seconds),
                "rvh_sum_ms": _median_ms(rvh_sum, value, args.repeats, args.min_seconds),
                "cpu_count": os.cpu_count(),
                "machine": platform.machine(),
            }
            record["ratio"] = record["adasum_ms"] / record["native_ms"]
            record["ratio_rvh_sum"] = record["rvh_sum_ms"] / record["native_ms"]
            for key in ("adasum_ms", "native_ms", "rvh_sum_ms", "ratio", "ratio_rvh_sum"):
                record[key] = round(record[key], 3)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
