"""Time to accuracy per interconnect: the replica sweep's epochs to target
(`tf-adasum eval --preset replicas`) times the minutes an epoch would take on N
machines, one replica each, joined by a named link.

Per run (a method, `RunConfig.method`: a combiner and its variant, at N
replicas of batch b, K local steps):

  minutes per epoch = steps(N) x t_step + combines(N) x t_combine(N, link)
  steps(N)          = ceil(training examples / (N b))       (as the evaluation runs it)
  combines(N)       = steps(N) / K
  score             = epochs to target x minutes per epoch

t_step: one replica's step at batch b on this machine, from the evaluation's
own records (the median minutes per epoch of the single-replica ``keras``
runs, over their steps per epoch), or ``--step-ms``. t_combine: the cost
model of `benchmarks/cost_model.py` for the model's gradient bytes S,
one replica per machine:

  adasum         the vector-halving tree:  (2p + p(p+1)/2) a + u_link S (1 - 2^-p)
                 for N = 2^p (otherwise a fold adds 2 messages and S bytes)
  mean, sum      the tree with a plain sum: 2p a + u_link S (1 - 2^-p)
  adacons        two trees with a plain sum (2p a + u_link S (1 - 2^-p) each),
                 and a gather of 2N scalars (p messages)
  keras(-scaled) TensorFlow's ring all-reduce: 2 (N-1) a' + u'_link S (N-1)/N
  u_link = u + 2 / B, u'_link = u' + 2 / B

where a, u, a', u' are the cost model's constants (software: messages,
copies and arithmetic) and B the link's rate in TCP payload bytes per second
(`payload_rate`: a full Ethernet frame of 1538 bytes on the wire carries
1448 bytes of payload, so 1 GbE carries 0.118 GB/s): halving and gathering
(or the ring's two passes) each send S (N-1)/N bytes through every
machine's link. "this machine" adds no wire (the constants were fitted on
loopback). The constants are the fit published in the benchmarks guide
(`DEFAULT_CONSTANTS`, worker processes on this 2-core machine, 2026-12-04),
or fitted again from `benchmarks/collective.py` records with
``--collective RECORDS.jsonl``. `combine_seconds` also takes the cores that
N processes share (then u and u' grow by c(N) = max(1, N / cores), as in
the fit) and a 16-bit wire; `benchmarks/link_model.py` uses both to check the
model against the collective's records on emulated links. The model leaves
out what a real cluster adds: switch latency, congestion, stragglers; and
what it removes: the 2-core machine's contention (the fit's ``cores``).

Usage:
  python benchmarks/time_to_accuracy.py results/replicas/results.jsonl [MORE.jsonl ...] [--plot score.png]
                                       [--markdown]

Several record files are read as one (a configuration in more than one is
counted once, from the first). t_step is the same for every method: the
inner optimizer's own cost (LAMB's against Adam's) is left out.

Prints one JSON object per interconnect, method, K and N: the epochs to
target (median over seeds; None when the median run missed it), the modelled
minutes per epoch and the score, with the constants used; with
``--markdown``, the README's table of the scores on 1 and 10 GbE instead
(`markdown_table`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cost_model  # noqa: E402

#: a, u, a', u' (seconds, seconds per byte): fitted to the worker processes of
#: the N sweep in docs/guide/benchmarks.md ("Fitted to the N sweep", 2026-12-04).
DEFAULT_CONSTANTS = {"a": 0.75e-3, "u": 1 / 0.84e9, "a_ring": 1.34e-3, "u_ring": 1 / 0.40e9}
#: TCP payload of a full Ethernet frame (MTU 1500): less the IPv4 and TCP
#: headers (20 + 20 bytes) and TCP's timestamp option (12 bytes).
TCP_PAYLOAD = 1448
#: What a full frame occupies on an Ethernet link: 1500 bytes, its header and
#: checksum (14 + 4), the preamble and the gap between frames (8 + 12).
ETHERNET_FRAME = 1538
#: Bytes on a 16-bit wire per byte of float32 values: 2 bytes a value, and a
#: block of `tf_adasum.ops.BLOCK` (128) values carries its exponent in 4 bytes.
COMPRESSED_WIRE = (128 * 2 + 4) / (128 * 4)


def payload_rate(bits_per_second: float, frame: int = ETHERNET_FRAME) -> float:
    """TCP payload bytes per second through a link of `bits_per_second`, in
    full frames of `frame` bytes (each carrying `TCP_PAYLOAD`)."""
    return bits_per_second / 8 * TCP_PAYLOAD / frame


#: Interconnects: name -> TCP payload rate in bytes per second (None: no wire).
LINKS = {"this machine": None, "1 GbE": payload_rate(1e9), "10 GbE": payload_rate(10e9), "100 GbE": payload_rate(100e9)}
TRAINING_EXAMPLES = {"mnist": 60_000, "fashion_mnist": 60_000}


def combine_seconds(
    combiner: str,
    n: int,
    size: float,
    constants: dict,
    rate: float | None,
    *,
    cores: int | None = None,
    compressed: bool = False,
) -> float:
    """One combine of an S-byte gradient over N machines on a link of `rate`
    payload bytes/s (None: no wire).

    Args:
      cores: the cores the N processes share (None: a machine each); the
        software's per-byte costs u and u' then grow by c(N) = max(1, N / cores)
        (`cost_model.contention`). The link is each machine's own.
      compressed: a 16-bit wire (Adasum only): `COMPRESSED_WIRE` of the bytes
        through the link, and ``constants["u_code"]`` seconds per byte of the
        halved slices for encoding and decoding them.
    """
    if n == 1:
        return 0.0
    wire = 0.0 if rate is None else 2.0 / rate
    a, u, a_ring, u_ring = (constants[k] for k in cost_model.PARAMS)
    contention = cost_model.contention(n, cores)
    u, u_ring = contention * u, contention * u_ring
    if compressed:
        if combiner != "adasum":
            raise ValueError(f"A compressed wire is modelled for Adasum only. Received: combiner={combiner!r}")
        u, wire = u + contention * constants["u_code"], wire * COMPRESSED_WIRE
    p = int(math.floor(math.log2(n)))
    folded = n > 1 << p
    moved = size * (1.0 - 2.0**-p) + (size if folded else 0.0)
    fold_messages = 2 if folded else 0
    if combiner in ("keras", "keras-scaled"):
        return 2 * (n - 1) * a_ring + (u_ring + wire) * size * (n - 1) / n
    if combiner == "adasum":
        return (2 * p + p * (p + 1) // 2 + fold_messages) * a + (u + wire) * moved
    if combiner in ("mean", "sum"):  # the tree with a plain sum: no float64 partial sums
        return (2 * p + fold_messages) * a + (u + wire) * moved
    if combiner == "adacons":
        return 2 * ((2 * p + fold_messages) * a + (u + wire) * moved) + p * a
    raise ValueError(f"No communication model for `combiner`={combiner!r}")


def gradient_bytes(model: str) -> int:
    """The model's trainable bytes (float32), from the evaluation's own model."""
    from tf_adasum.eval.models import build

    return sum(int(v.numpy().nbytes) for v in build(model).trainable_variables)


def step_seconds(records: list[dict]) -> dict[tuple, float]:
    """Per (model, dataset, batch): one replica's step, from the single-replica
    ``keras`` runs, Adam at its base rate (median minutes per epoch over
    their steps per epoch)."""
    from tf_adasum.eval.summary import config_of

    steps: dict[tuple, list[float]] = {}
    for r in records:
        if config_of(r).method == "keras" and r["replicas"] == 1 and r["local_steps"] == 1:
            per_epoch = _steps_per_epoch(r)
            steps.setdefault((r["model"], r["dataset"], r["batch_per_replica"]), []).append(
                60.0 * r["minutes_per_epoch"] / per_epoch
            )
    return {key: statistics.median(values) for key, values in steps.items()}


def _steps_per_epoch(r: dict) -> int:
    examples = r.get("train_examples") or TRAINING_EXAMPLES[r["dataset"]]
    return -(-examples // (r["replicas"] * r["batch_per_replica"]))


def scores(records: list[dict], constants: dict, step_ms: float | None = None) -> list[dict]:
    """The JSON rows (see the module docstring)."""
    from tf_adasum.eval import metrics
    from tf_adasum.eval.summary import config_of

    t_steps = step_seconds(records)
    sizes: dict[str, int] = {}
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        key = (r["model"], r["dataset"], config_of(r).method, r["local_steps"], r["replicas"], r["batch_per_replica"])
        groups.setdefault(key, []).append(r)
    rows = []
    for link, rate in LINKS.items():
        for (model, dataset, method, k, n, batch), runs in groups.items():
            config = config_of(runs[0])
            combiner = config.combiner
            if step_ms is not None:
                t_step = step_ms / 1e3
            elif (model, dataset, batch) in t_steps:
                t_step = t_steps[(model, dataset, batch)]
            else:
                raise SystemExit(f"no single-replica keras run of {model}/{dataset} at batch {batch}; give --step-ms")
            if model not in sizes:
                sizes[model] = gradient_bytes(model)
            steps = _steps_per_epoch(runs[0])
            combine = combine_seconds(combiner, n, sizes[model], constants, rate)
            minutes = (steps * t_step + steps / k * combine) / 60.0
            reached = [metrics.epochs_or_inf(r) for r in runs]
            epochs = statistics.median_high(reached)
            rows.append({
                "link": link, "model": model, "dataset": dataset, "method": method, "combiner": combiner,
                "mode": config.mode, "inner": config.inner, "lr_rule": config.lr_rule, "local_steps": k,
                "replicas": n, "batch_per_replica": batch, "seeds": len(runs),
                "epochs_to_target": None if math.isinf(epochs) else epochs,
                "step_ms": round(t_step * 1e3, 3), "combine_ms": round(combine * 1e3, 3),
                "minutes_per_epoch": round(minutes, 4),
                "score": None if math.isinf(epochs) else round(epochs * minutes, 4),
            })  # fmt: skip
    return rows


def markdown_table(rows: list[dict], links=("1 GbE", "10 GbE"), counts=(1, 2, 4, 8, 16, 32, 64)) -> str:
    """The README's table of `scores` rows: minutes to target per method and
    K (rows, in the records' order) and N (columns), each cell the `links`'
    scores joined by " / " (two decimals; one where they agree); "not reached" at the first N where
    the median run missed, and nothing at larger N."""
    score = {(r["link"], r["method"], r["local_steps"], r["replicas"]): r["score"] for r in rows}
    lines = [
        f"| combiner | link | N={' | '.join(map(str, counts))} |",
        "|---|---|" + "---|" * len(counts),
    ]
    for method, k in dict.fromkeys((r["method"], r["local_steps"]) for r in rows):
        cells, missed = [], False
        for n in counts:
            values = [score.get((link, method, k, n)) for link in links]
            if missed:
                cells.append("")
            elif None in values:
                missed = True
                cells.append("not reached")
            else:
                shown = [f"{v:.2f}" for v in values]
                cells.append(shown[0] if len(set(shown)) == 1 else " / ".join(shown))  # N = 1: no combine
        name = method if k == 1 else f"{method}, K = {k}"
        lines.append(f"| {name} | {' / '.join(links)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from tf_adasum.eval import plots

    style = plots._Style(rows)
    series = plots._series(rows)
    links = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(5.0 * len(links), 4.2), squeeze=False)
    counts = sorted({r["replicas"] for r in rows})
    for axis, link in zip(axes[0], links):
        for s in series:
            mine = sorted(
                (r for r in rows if r["link"] == link and (r["method"], r["local_steps"]) == s and r["score"]),
                key=lambda r: r["replicas"],
            )
            axis.plot([r["replicas"] for r in mine], [r["score"] for r in mine], lw=1.3, **style(s))
        axis.set(xscale="log", yscale="log", xlabel="replicas N (one per machine)", ylabel="minutes to target")
        axis.set_xticks(counts, [str(n) for n in counts])
        axis.minorticks_off()
        axis.set_title(link, fontsize=10)
        axis.grid(alpha=0.3)
    plots._legend(fig, style, series)
    fig.suptitle("Time to the target accuracy (median epochs x modelled minutes per epoch)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="results.jsonl of `tf-adasum eval --preset replicas` (and more)")
    parser.add_argument("--collective", help="fit the constants to these benchmarks/collective.py records (workers)")
    parser.add_argument("--cores", type=int, default=2, help="cores the collective records' workers shared")
    parser.add_argument("--step-ms", type=float, help="one replica's step in ms (default: from the records)")
    parser.add_argument("--plot", help="write a PNG of the score against N per interconnect")
    parser.add_argument("--markdown", action="store_true", help="print the README's table instead of JSON lines")
    args = parser.parse_args(argv)
    from tf_adasum.eval.summary import config_of

    records, seen = [], set()
    for path in args.results:
        with open(path, encoding="utf-8") as f:
            for record in (json.loads(line) for line in f if line.strip()):
                key = config_of(record).key()
                if key not in seen:
                    seen.add(key)
                    records.append(record)
    constants, source = dict(DEFAULT_CONSTANTS), "DEFAULT_CONSTANTS (docs/guide/benchmarks.md, 2026-12-04)"
    if args.collective:
        with open(args.collective, encoding="utf-8") as f:
            collective = [json.loads(line) for line in f if line.startswith("{")]
        workers = [r for r in collective if r.get("benchmark") == "collective" and r.get("engine") == "workers"]
        if not workers:
            raise SystemExit(f"{args.collective}: no workers records of benchmarks/collective.py")
        constants = dict(zip(cost_model.PARAMS, map(float, cost_model.fit(workers, args.cores))))
        source = f"fitted to {args.collective} ({len(workers)} workers records)"
    rows = scores(records, constants, args.step_ms)
    if args.markdown:
        print(markdown_table(rows))
    else:
        print(json.dumps({
            "constants": source, "latency_ms": round(constants["a"] * 1e3, 3),
            "per_byte_GBps": cost_model._rate(constants["u"]), "ring_latency_ms": round(constants["a_ring"] * 1e3, 3),
            "ring_per_byte_GBps": cost_model._rate(constants["u_ring"]),
            "links_GBps": {k: None if v is None else v / 1e9 for k, v in LINKS.items()},
        }))  # fmt: skip
        for row in rows:
            print(json.dumps(row))
    if args.plot:
        _plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
