"""The chaos run: logical replicas through random SIGKILLs, ending with the model of the uninterrupted run.

LeNet (``lenet_caffe``, the evaluation's recipe: Adam 1e-3 with a cosine
decay over the run, 64 examples a replica) on real MNIST as
``tf_adasum.SimulatedReplicas`` of L = REPLICAS logical replicas, run by
``tf-adasum launch -n WORKERS --mpirun --logical-replicas L`` with elastic
options and ``BackupAndRestore(save_freq=K, save_before_preemption=True)``:

1. the reference: the same job, uninterrupted;
2. the chaos: a seeded schedule of KILLS SIGKILLs. Kill i ends round i: a
   random rank of that round SIGKILLs itself as a random batch begins, first
   leaving the discovery command a random count of available workers
   (WORKERS or WORKERS - 1: the next round runs on the largest count that
   holds L, the others spare). The launcher relaunches from the backup.

Prints one JSON object: each run's final test accuracy and wall time, the
schedule and each round's size, whether the chaos run's weights equal the
reference's bit for bit (``bitwise_equal``), the batches redone (kill batch
minus the backup's), the commit, the processor.

Usage: python benchmarks/elastic_chaos.py [--epochs 3] [--kills 10] [--seed 0] [--workers 4] [--replicas 8]
       [--save-freq 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from elastic import LAUNCH_PY  # noqa: E402

from tf_adasum.eval import provenance  # noqa: E402
from tf_adasum.launcher.elastic import holding_counts  # noqa: E402

BATCH_PER_REPLICA, TRAIN_EXAMPLES = 64, 60000


def _steps(replicas: int) -> int:
    return TRAIN_EXAMPLES // (replicas * BATCH_PER_REPLICA)


def _worker(out: str, replicas: int, epochs: int, save_freq: int, schedule: list) -> None:
    """One rank: trains, and SIGKILLs itself where the schedule says (after writing the discovery's count)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_adasum
    from tf_adasum import backup
    from tf_adasum.eval.data import load_mnist
    from tf_adasum.eval.models import lenet_caffe

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    round_number = int(os.environ.get("TF_ADASUM_ELASTIC_ROUND", "0"))
    steps = _steps(replicas)
    (x, y), (x_test, y_test) = load_mnist()
    x, x_test = (x[..., None] / 255.0).astype("float32"), (x_test[..., None] / 255.0).astype("float32")
    keras.utils.set_random_seed(0)
    trainer = tf_adasum.SimulatedReplicas(lenet_caffe(), replicas)
    rate = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=epochs * steps)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer.compile(optimizer=keras.optimizers.Adam(rate), loss=loss)
    folder = os.path.join(out, "backup")
    start = backup.saved_epoch(folder)
    # Each epoch its own seeded order, cut to whole batches: epoch e's batches are the same whether or not
    # the run was interrupted (a batch across two epochs would not be, once a resume starts at an epoch).
    orders = [
        np.random.default_rng(1000 + e).permutation(len(x))[: steps * replicas * BATCH_PER_REPLICA]
        for e in range(start, epochs)
    ]
    rows = np.concatenate(orders)
    data = tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(replicas * BATCH_PER_REPLICA, True)

    class Chaos(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_begin(self, logs=None):  # after the backup's restore
            if rank == 0:
                with open(os.path.join(out, f"restored{round_number}"), "w") as f:
                    f.write(f"{restoring.restored_epoch * steps + restoring.restored_batch}\n")

        def on_train_batch_begin(self, batch, logs=None):
            run_batch = self.epoch * steps + batch
            for kill_round, victim, kill_batch, available in schedule:
                if [kill_round, victim, kill_batch] == [round_number, rank, run_batch]:
                    with open(os.path.join(out, "slots.tmp"), "w") as f:
                        f.write(f"{available}\n")
                    os.replace(os.path.join(out, "slots.tmp"), os.path.join(out, "slots"))
                    os.kill(os.getpid(), signal.SIGKILL)

    restoring = backup.BackupAndRestore(folder, save_freq=save_freq, save_before_preemption=True)
    trainer.fit(data, epochs=epochs, steps_per_epoch=steps, callbacks=[restoring, Chaos()], verbose=0)
    if rank == 0:
        model = trainer.model
        model.compile(loss=loss, metrics=["accuracy"])
        _, accuracy = model.evaluate(x_test, y_test, batch_size=1000, verbose=0)
        np.savez(os.path.join(out, "final.npz"), *[v.numpy() for v in trainer.model.weights])
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump({"test_accuracy": float(accuracy), "round": round_number}, f)


def _launch(out: str, args, schedule: list) -> float:
    """Runs one job under the elastic launcher; returns its wall time."""
    with open(os.path.join(out, "slots"), "w") as f:
        f.write(f"{args.workers}\n")
    with open(os.path.join(out, "schedule.json"), "w") as f:
        json.dump(schedule, f)
    command = [sys.executable, LAUNCH_PY, "-n", str(args.workers), "--mpirun"]
    command += ["--logical-replicas", str(args.replicas), "--min-workers", "1", "--max-restarts", str(len(schedule))]
    command += ["--discover", f"cat {os.path.join(out, 'slots')}", os.path.abspath(__file__), "--worker", out]
    command += ["--replicas", str(args.replicas), "--epochs", str(args.epochs), "--save-freq", str(args.save_freq)]
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the run in {out} failed ({result.returncode}): {result.stderr[-3000:]}")
    with open(os.path.join(out, "launcher.log"), "w") as f:
        f.write(result.stderr)
    return time.monotonic() - started


def _schedule(args) -> list:
    """[round, victim rank, run batch, workers left available] per kill, seeded."""
    chance = random.Random(args.seed)
    total = args.epochs * _steps(args.replicas)
    batches = sorted(chance.sample(range(1, total - 1), args.kills))
    schedule, workers = [], args.workers
    for round_number, batch in enumerate(batches):
        available = chance.choice([args.workers, args.workers - 1])
        schedule.append([round_number, chance.randrange(workers), batch, available])
        workers = max(m for m in holding_counts(args.replicas) if m <= available)
    return schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--save-freq", type=int, default=10)
    parser.add_argument("--out", help="a folder for the runs (default: a temporary one)")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        with open(os.path.join(args.worker, "schedule.json")) as f:
            _worker(args.worker, args.replicas, args.epochs, args.save_freq, json.load(f))
        return
    out = args.out or tempfile.mkdtemp(prefix="elastic_chaos_")
    runs = {}
    for name, schedule in (("reference", []), ("chaos", _schedule(args))):
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        seconds = _launch(folder, args, schedule)
        with open(os.path.join(folder, "final.json")) as f:
            runs[name] = {**json.load(f), "wall_s": round(seconds, 1), "folder": folder}
    import numpy as np

    finals = [np.load(os.path.join(out, name, "final.npz")) for name in ("reference", "chaos")]
    equal = all(finals[0][k].tobytes() == finals[1][k].tobytes() for k in finals[0].files)
    chaos = os.path.join(out, "chaos")
    with open(os.path.join(chaos, "launcher.log")) as f:
        sizes = [int(m.group(1)) for m in re.finditer(r"tf-adasum launch: round \d+: (\d+) workers", f.read())]
    redone = []
    for round_number, _, batch, _ in _schedule(args):
        with open(os.path.join(chaos, f"restored{round_number + 1}")) as f:
            redone.append(batch - int(f.read()))
    print(
        json.dumps(
            {
                "benchmark": "elastic_chaos",
                "replicas": args.replicas,
                "workers": args.workers,
                "epochs": args.epochs,
                "save_freq": args.save_freq,
                "seed": args.seed,
                "schedule": _schedule(args),
                "round_workers": sizes,
                "batches_redone": redone,
                "bitwise_equal": equal,
                "reference": runs["reference"],
                "chaos": runs["chaos"],
                **provenance.fields(),
            }
        )
    )


if __name__ == "__main__":
    main()
