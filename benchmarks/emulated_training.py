"""Minutes per epoch of training on emulated hosts, measured, beside the cost
model's prediction with this machine's compute (issue 42, item 2).

Each configuration is one run of the scaling evaluation on the
``tf-collective`` engine with its N workers on N emulated hosts
(``tf-adasum eval --engine tf-collective --hosts N --link RATE``: one
worker a host, each host's link at RATE each way), two epochs of
``--train-examples`` images, no stop at a target; the second epoch is the
one timed (the first also traces the step). Measured: that epoch's seconds
over its steps, times the steps of a whole MNIST epoch (60 000 images).

Predicted, for a whole epoch of steps(N) = ceil(60 000 / (N b)) steps and
steps(N) / K combines (K local steps):

  minutes per epoch = steps(N) x t_step x N + combines x t_combine(N, link)

with t_step one replica's step at batch b on this machine (the same
configuration's ``keras`` run at N = 1 on the ``local-devices`` engine, its
second epoch), which already keeps every core busy (TensorFlow's threads
within an op), so N processes sharing the machine take N times as long, and
t_combine `time_to_accuracy.combine_seconds` for the run's
combiner (``keras``: TensorFlow's ring) with the constants and the emulated
link of `benchmarks/link_model.py` (the workers' engine, checked against the
collective's own records on these links), N processes on this machine's
cores.

Usage (as root: network namespaces):
  python benchmarks/emulated_training.py --out results/emulated_training [--resume]
  python benchmarks/emulated_training.py --markdown docs/cluster/training_links.jsonl

Prints one JSON line per configuration (measured and predicted minutes per
epoch, their ratio, the command, the date, the commit and the processor,
and ``runs_commit``, the commit the configuration's evaluation ran on) and
appends it to ``OUT/records.jsonl``; with ``--resume`` the
configurations already there are not run again. Each run's evaluation
output stays in ``OUT/runs/``, and a run whose results are there is not
run again (delete ``records.jsonl`` to recompute every prediction from
them). ``--markdown RECORDS`` prints the evaluation guide's table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import link_model  # noqa: E402
import time_to_accuracy as tta  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST_EXAMPLES = 60_000
BATCH = 64
#: Per model: the training images of each timed epoch (a whole epoch of the
#: MLP at 100 Mbit/s would take 20 minutes), and its link rates.
MODELS = {"lenet_caffe": 16_384, "mlp": 2_048}
LINKS = ("1gbit", "100mbit")
HOSTS = (2, 4)
#: (combiner, local steps): Adasum, Adasum with 4 local steps, Keras' averaging.
METHODS = (("adasum", 1), ("adasum", 4), ("keras", 1))
#: Most a prediction may differ from its measurement, as |measured / predicted - 1|.
TOLERANCE = 0.15
#: The configurations measured beyond it (docs/cluster/training_links.jsonl,
#: 2026-12-07): Keras' ring at N = 4 on 1 Gbit/s faster than predicted (0.84:
#: the ring keeps chunks in flight, the model adds its software in full, as
#: for the ring's exceptions in link_model.py); and two runs with 4 local
#: steps slower (1.15, 1.17), whose combines took 1.2-1.3x the link model's.
#: With local steps a combine follows the longest compute (0.45-0.91 s here)
#: with the connections idle, and Linux restarts TCP's slow start after an
#: idle period longer than the retransmission timeout
#: (``net.ipv4.tcp_slow_start_after_idle``): our reading, not verified.
BEYOND_TOLERANCE = {
    ("lenet_caffe", 4, "1gbit", "keras", 1),
    ("mlp", 2, "1gbit", "adasum", 4),
    ("mlp", 4, "100mbit", "adasum", 4),
}


#: The `tf-adasum` command beside this Python: started so, the evaluation sets its own kernels
#: (`python -m tf_adasum.eval` would load TensorFlow first and keep TensorFlow's).
TF_ADASUM = os.path.join(os.path.dirname(sys.executable), "tf-adasum")


def eval_command(model: str, combiner: str, local_steps: int, replicas: int, out: str, hosts: int = 0, link: str = ""):
    """The evaluation's command line for one timed configuration."""
    command = [TF_ADASUM, "eval", "--models", model, "--combiners", combiner]
    command += ["--local-steps", str(local_steps), "--replicas", str(replicas), "--batch-per-replica", str(BATCH)]
    command += ["--epochs", "2", "--no-stop", "--train-examples", str(MODELS[model]), "--test-examples", "1000"]
    if hosts:
        command += ["--engine", "tf-collective", "--hosts", str(hosts), "--link", link]
    else:
        command += ["--engine", "local-devices"]
    return command + ["--out", out]


def timed_step_seconds(command: list[str], out: str, steps: int) -> tuple[float, str, str]:
    """Runs `command` (unless its record exists) and returns its second
    epoch's seconds per step, and the run's date and commit."""
    results = os.path.join(out, "results.jsonl")
    if not os.path.exists(results):
        if not os.path.exists(command[0]):
            raise RuntimeError(f"no {command[0]}: install the package into this Python (pip install -e .)")
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    with open(results) as f:
        (record,) = [json.loads(line) for line in f if line.strip()]
    return record["seconds_per_epoch"][1] / steps, record["date"], record["commit"]


def predicted_minutes(
    model: str, combiner: str, local_steps: int, hosts: int, link: str, t_step: float, cores: int
) -> dict:
    """The model's minutes per whole epoch (see the module docstring), with
    its parts, for N = `hosts` processes sharing `cores` cores."""
    steps = math.ceil(MNIST_EXAMPLES / (hosts * BATCH))
    compute = steps * t_step * hosts  # one replica's step keeps every core busy: N share them
    combine = tta.combine_seconds(
        combiner,
        hosts,
        tta.gradient_bytes(model),
        link_model.ENGINE_CONSTANTS["workers"],
        link_model.link_rate(link),
        cores=cores,
    )
    return {
        "predicted_minutes": (compute + steps / local_steps * combine) / 60.0,
        "predicted_compute_minutes": compute / 60.0,
        "predicted_combine_ms": 1e3 * combine,
    }


def markdown(records: list[dict]) -> str:
    """The evaluation guide's table of `records`: measured against predicted
    minutes per epoch, and their ratio, per model, hosts, link and method."""
    lines = [
        "| model | N hosts | link | method | measured min/epoch | predicted | ratio | of which combine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        method = r["combiner"] + (f", K = {r['local_steps']}" if r["local_steps"] > 1 else "")
        combine = r["predicted_minutes"] - r["predicted_compute_minutes"]
        lines.append(
            f"| {r['model']} | {r['hosts']} | {r['link']} | {method} | {r['measured_minutes']:.2f} | "
            f"{r['predicted_minutes']:.2f} | {r['ratio']:.2f} | {combine / r['predicted_minutes']:.0%} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/emulated_training")
    parser.add_argument("--resume", action="store_true", help="skip the configurations already recorded")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--hosts", nargs="+", type=int, default=list(HOSTS))
    parser.add_argument("--links", nargs="+", default=list(LINKS))
    parser.add_argument("--markdown", metavar="RECORDS", help="print the guide's table of these records, run nothing")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown([json.loads(line) for line in f if line.strip()]))
        return 0
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    records_path = os.path.join(args.out, "records.jsonl")
    done = set()
    if args.resume and os.path.exists(records_path):
        with open(records_path) as f:
            done = {tuple(json.loads(line)["key"]) for line in f if line.strip()}
    elif os.path.exists(records_path):
        os.remove(records_path)
    cores = os.cpu_count() or 1
    from tf_adasum.eval import provenance as provenance_of

    # The script's commit, which computed the prediction; the date is each
    # row's run's, and runs_commit the commit its evaluation ran on.
    provenance = provenance_of.fields(provenance_of.command_line(__file__, argv))
    del provenance["date"]
    for model in args.models:
        examples = MODELS[model]
        single = os.path.join(args.out, "runs", f"{model}-single")
        t_step, _, _ = timed_step_seconds(
            eval_command(model, "keras", 1, 1, single), single, math.ceil(examples / BATCH)
        )
        for hosts in args.hosts:
            for link in args.links:
                for combiner, local_steps in METHODS:
                    key = [model, hosts, link, combiner, local_steps]
                    if tuple(key) in done:
                        continue
                    out = os.path.join(args.out, "runs", "-".join(str(k) for k in key))
                    command = eval_command(model, combiner, local_steps, hosts, out, hosts, link)
                    seconds, date, runs_commit = timed_step_seconds(command, out, math.ceil(examples / (hosts * BATCH)))
                    measured = seconds * math.ceil(MNIST_EXAMPLES / (hosts * BATCH)) / 60.0
                    prediction = predicted_minutes(model, combiner, local_steps, hosts, link, t_step, cores)
                    row = {
                        "key": key,
                        "model": model,
                        "hosts": hosts,
                        "link": link,
                        "combiner": combiner,
                        "local_steps": local_steps,
                        "measured_minutes": measured,
                        **prediction,
                        "ratio": measured / prediction["predicted_minutes"],
                        "step_ms_one_replica": 1e3 * t_step,
                        "cpu_count": cores,
                        "date": date,  # the run's
                        **provenance,
                        "runs_commit": runs_commit,
                    }
                    print(json.dumps(row), flush=True)
                    with open(records_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
