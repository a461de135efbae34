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

  minutes per epoch = steps(N) x t_step x c(N) + combines x t_combine(N, link)

with t_step one replica's step at batch b on this machine (the same
configuration's ``keras`` run at N = 1 on the ``local-devices`` engine, its
second epoch), c(N) = max(1, N / cores) (N processes share this machine's
cores) and t_combine `time_to_accuracy.combine_seconds` for the run's
combiner (``keras``: TensorFlow's ring) with the constants and the emulated
link of `benchmarks/link_model.py` (the workers' engine, checked against the
collective's own records on these links), N processes on this machine's
cores.

Usage (as root: network namespaces):
  python benchmarks/emulated_training.py --out results/emulated_training [--resume]

Prints one JSON line per configuration (measured and predicted minutes per
epoch, their ratio, the command, the date, the commit and the processor)
and appends it to ``OUT/records.jsonl``; with ``--resume`` the
configurations already there are not run again. Each run's evaluation
output stays in ``OUT/runs/``.
"""

from __future__ import annotations

import argparse
import datetime
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


def _git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def _processor() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return f"{os.cpu_count()} cores"


def eval_command(model: str, combiner: str, local_steps: int, replicas: int, out: str, hosts: int = 0, link: str = ""):
    """The evaluation's command line for one timed configuration."""
    command = [sys.executable, "-m", "tf_adasum.eval", "--models", model, "--combiners", combiner]
    command += ["--local-steps", str(local_steps), "--replicas", str(replicas), "--batch-per-replica", str(BATCH)]
    command += ["--epochs", "2", "--no-stop", "--train-examples", str(MODELS[model]), "--test-examples", "1000"]
    if hosts:
        command += ["--engine", "tf-collective", "--hosts", str(hosts), "--link", link]
    else:
        command += ["--engine", "local-devices"]
    return command + ["--out", out]


def timed_step_seconds(command: list[str], out: str, steps: int) -> float:
    """Runs `command` (unless its record exists) and returns its second
    epoch's seconds per step."""
    results = os.path.join(out, "results.jsonl")
    if not os.path.exists(results):
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    with open(results) as f:
        (record,) = [json.loads(line) for line in f if line.strip()]
    return record["seconds_per_epoch"][1] / steps


def predicted_minutes(model: str, combiner: str, local_steps: int, hosts: int, link: str, t_step: float) -> dict:
    """The model's minutes per whole epoch (see the module docstring), with its parts."""
    steps = math.ceil(MNIST_EXAMPLES / (hosts * BATCH))
    cores = os.cpu_count() or 1
    compute = steps * t_step * max(1.0, hosts / cores)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/emulated_training")
    parser.add_argument("--resume", action="store_true", help="skip the configurations already recorded")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--hosts", nargs="+", type=int, default=list(HOSTS))
    parser.add_argument("--links", nargs="+", default=list(LINKS))
    args = parser.parse_args(argv)
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    records_path = os.path.join(args.out, "records.jsonl")
    done = set()
    if args.resume and os.path.exists(records_path):
        with open(records_path) as f:
            done = {tuple(json.loads(line)["key"]) for line in f if line.strip()}
    elif os.path.exists(records_path):
        os.remove(records_path)
    provenance = {
        "command": " ".join(["python", "benchmarks/emulated_training.py", *(argv or sys.argv[1:])]),
        "commit": _git_commit(),
        "processor": _processor(),
    }
    for model in args.models:
        examples = MODELS[model]
        single = os.path.join(args.out, "runs", f"{model}-single")
        t_step = timed_step_seconds(eval_command(model, "keras", 1, 1, single), single, math.ceil(examples / BATCH))
        for hosts in args.hosts:
            for link in args.links:
                for combiner, local_steps in METHODS:
                    key = [model, hosts, link, combiner, local_steps]
                    if tuple(key) in done:
                        continue
                    out = os.path.join(args.out, "runs", "-".join(str(k) for k in key))
                    command = eval_command(model, combiner, local_steps, hosts, out, hosts, link)
                    seconds = timed_step_seconds(command, out, math.ceil(examples / (hosts * BATCH)))
                    measured = seconds * math.ceil(MNIST_EXAMPLES / (hosts * BATCH)) / 60.0
                    prediction = predicted_minutes(model, combiner, local_steps, hosts, link, t_step)
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
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        **provenance,
                    }
                    print(json.dumps(row), flush=True)
                    with open(records_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
