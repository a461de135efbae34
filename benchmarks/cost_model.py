"""A latency-bandwidth cost model of the vector-halving Adasum tree and of the
ring all-reduce, fitted to `benchmarks/collective.py` records, extrapolated to
N = 1024.

Per rank, for N ranks and an S-byte buffer (2^p the largest power of two <= N,
r = N - 2^p ranks folded):

  Adasum tree  T = F + 2 p a + a L(p) + c(N) u S (1 - 2^-p)
               F = r > 0 ? 2 a + c(N) u S : 0     (the fold: a send each way of
                   the whole buffer and one combine of it)
  ring         R = 2 (N - 1) a' + c(N) u' S (N - 1) / N

a: the latency of one message; each of the p halving and p gathering levels
sends one, and level k (from 0) sums its float64 partials over the 2^(k+1)
ranks of its two subtrees by recursive doubling (k + 1 pairwise exchanges,
`TFCollectiveCommunicator.sum_float64`, as MPI's Allreduce does for small
messages), so L(p) = sum_k (k + 1) = p (p + 1) / 2. (Before 2026-12-02 they
were a ring CollectiveReduceV2, 2 (2^(k+1) - 1) messages a level, about 4 N
in all.) u: seconds per byte of the slices a level halves, for moving them
(sent and received: twice the bytes) and combining them (float64 dots and
scaled sum): within one transport the bytes moved and the bytes combined
grow together, so the wire and the arithmetic cannot be told apart by
these timings and are fitted as one. u': the same for the ring (its sends
and its adds). The tree's transport and the ring's have parameters of their
own (a, u against a', u'): between CPU worker processes the tree's messages
travel over tf_adasum's own sockets (`tf_adasum.comm.sockets`), the ring's
over TensorFlow's gRPC. c(N) = max(1, N / cores) when N replicas share a
machine's cores (every byte moved or combined then competes for the same
memory and cores), else 1.

Both move 2 S (N - 1) / N bytes for N = 2^p (a fold costs two whole-buffer
transfers more); the tree's latency grows as 2 log2 N + log2^2 N / 2 messages
against the ring all-reduce's 2 (N - 1). Within one process on CPUs the tree
exchanges nothing through collectives (a replica reads its partner's half in
place), so points of the local engine fit a per-message cost that is mostly
dispatch, not a wire. A compressed wire (`--compression`) would halve the
bytes moved; the model leaves it out.

Usage:
  python benchmarks/cost_model.py RECORDS.jsonl [--cores 2] [--plot out.png]

RECORDS.jsonl: the JSON lines `benchmarks/collective.py` prints (engines local
and workers). Prints, per engine, the fitted `PARAMS` and each measured point
against the model, then the model's Adasum/ring ratio for N up to 1024 at 1, 16
and 64 MiB, as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

MODEL_SIZES = [1 << 20, 16 << 20, 64 << 20]
MODEL_REPLICAS = [2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 1024]


def contention(n: int, cores: int | None) -> float:
    """c(N): how many replicas share one core (1 when each has its own, `cores` None)."""
    return 1.0 if cores is None else max(1.0, n / cores)


#: The fitted parameters, in this order.
PARAMS = ("a", "u", "a_ring", "u_ring")


def tree_terms(n: int, size: float, cores: int | None) -> np.ndarray:
    """Coefficients of `PARAMS` in the Adasum tree's time."""
    p = int(math.floor(math.log2(n)))
    folded = n - (1 << p)
    c = contention(n, cores)
    moved = 1.0 - 2.0**-p
    a = 2 * p + p * (p + 1) // 2 + (2 if folded else 0)
    u = c * (size * moved + (size if folded else 0))
    return np.array([a, u, 0.0, 0.0])


def ring_terms(n: int, size: float, cores: int | None) -> np.ndarray:
    """Coefficients of `PARAMS` in the ring all-reduce's time."""
    c = contention(n, cores)
    share = (n - 1) / n
    return np.array([0.0, 0.0, 2 * (n - 1), c * size * share])


def fit(records: list[dict], cores: int | None) -> np.ndarray:
    """Non-negative least squares on relative error: `PARAMS` in seconds (per byte)."""
    rows, times = [], []
    for r in records:
        for terms, ms in ((tree_terms, r["adasum_ms"]), (ring_terms, r["native_ms"])):
            rows.append(terms(r["replicas"], r["bytes"], cores) / (ms * 1e-3))
            times.append(1.0)
    return _nnls(np.array(rows), np.array(times))


def _nnls(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """min |A x - t| with x >= 0 (active set; four unknowns, so by enumeration)."""
    best, best_error = np.zeros(matrix.shape[1]), float("inf")
    columns = range(matrix.shape[1])
    for mask in range(1, 1 << matrix.shape[1]):
        chosen = [j for j in columns if mask >> j & 1]
        solution, *_ = np.linalg.lstsq(matrix[:, chosen], target, rcond=None)
        if np.any(solution < 0):
            continue
        x = np.zeros(matrix.shape[1])
        x[chosen] = solution
        error = float(np.sum((matrix @ x - target) ** 2))
        if error < best_error:
            best, best_error = x, error
    return best


def predict(params: np.ndarray, n: int, size: float, cores: int | None) -> tuple[float, float]:
    """(Adasum tree, ring) in milliseconds."""
    return 1e3 * float(tree_terms(n, size, cores) @ params), 1e3 * float(ring_terms(n, size, cores) @ params)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", help="JSON lines from benchmarks/collective.py")
    parser.add_argument("--cores", type=int, default=2, help="cores the local-device replicas shared")
    parser.add_argument("--plot", help="write a PNG of the measured points on the model")
    args = parser.parse_args(argv)
    with open(args.records) as f:
        records = [json.loads(line) for line in f if line.startswith("{")]
    records = [r for r in records if r.get("benchmark") == "collective" and r["engine"] in ("local", "workers")]
    if not records:
        raise SystemExit(f"{args.records}: no local or workers records of benchmarks/collective.py")
    fitted = {}
    for engine in sorted({r["engine"] for r in records}):
        mine = [r for r in records if r["engine"] == engine]
        cores = args.cores  # workers share the machine's cores too
        params = fit(mine, cores)
        fitted[engine] = params
        a, u, a_ring, u_ring = params
        print(json.dumps({
            "engine": engine, "cores": cores, "latency_us": round(a * 1e6, 2), "per_byte_GBps": _rate(u),
            "ring_latency_us": round(a_ring * 1e6, 2), "ring_per_byte_GBps": _rate(u_ring),
        }))  # fmt: skip
        for r in sorted(mine, key=lambda r: (r["bytes"], r["replicas"])):
            tree, ring = predict(params, r["replicas"], r["bytes"], cores)
            print(json.dumps({
                "engine": engine, "replicas": r["replicas"], "bytes": r["bytes"],
                "adasum_ms": r["adasum_ms"], "model_adasum_ms": round(tree, 3),
                "native_ms": r["native_ms"], "model_ring_ms": round(ring, 3),
            }))  # fmt: skip
        for size in MODEL_SIZES:
            for n in MODEL_REPLICAS:
                tree, ring = predict(params, n, size, None)  # one machine per replica
                print(json.dumps({
                    "engine": engine, "model": "one replica per machine", "replicas": n, "bytes": size,
                    "adasum_ms": round(tree, 3), "ring_ms": round(ring, 3), "ratio": round(tree / ring, 3),
                }))  # fmt: skip
    if args.plot:
        _plot(records, fitted, args.cores, args.plot)


def _rate(seconds_per_byte: float) -> float | None:
    return None if seconds_per_byte <= 0 else round(1e-9 / seconds_per_byte, 3)


def _plot(records, fitted, cores, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = sorted(fitted)
    figure, axes = plt.subplots(1, len(engines) + 1, figsize=(5.2 * (len(engines) + 1), 4.2))
    for axis, engine in zip(axes, engines):
        mine = [r for r in records if r["engine"] == engine]
        for size, color in zip(sorted({r["bytes"] for r in mine}), plt.cm.viridis(np.linspace(0, 0.85, 8))):
            points = sorted((r for r in mine if r["bytes"] == size), key=lambda r: r["replicas"])
            ns = np.arange(2, max(r["replicas"] for r in points) + 1)
            label = f"{size / 2**20:g} MiB"
            axis.plot(ns, [predict(fitted[engine], n, size, cores)[0] for n in ns], color=color, label=label)
            axis.plot(ns, [predict(fitted[engine], n, size, cores)[1] for n in ns], color=color, linestyle=":")
            axis.plot([r["replicas"] for r in points], [r["adasum_ms"] for r in points], "o", color=color)
            axis.plot([r["replicas"] for r in points], [r["native_ms"] for r in points], "x", color=color)
        axis.set(xscale="log", yscale="log", xlabel="replicas N", ylabel="ms per all-reduce")
        axis.set_title(f"{engine}: model (line: Adasum, dotted: ring)\nmeasured (o Adasum, x native)", fontsize=9)
        axis.legend(fontsize=8)
    axis = axes[-1]
    ns = np.array(MODEL_REPLICAS[:-2] + [1024])
    for engine, style in zip(engines, ("-", "--")):
        for size, color in zip(MODEL_SIZES, ("tab:blue", "tab:orange", "tab:green")):
            ratios = [np.divide(*predict(fitted[engine], n, size, None)) for n in ns]
            axis.plot(ns, ratios, style, color=color, label=f"{engine} fit, {size / 2**20:g} MiB")
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set(xscale="log", xlabel="replicas N (one per machine)", ylabel="Adasum tree / ring, model")
    axis.set_title("extrapolated to N = 1024", fontsize=9)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
