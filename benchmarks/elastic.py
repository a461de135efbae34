"""Recovery of an elastic run: a worker SIGKILLed (or sent SIGTERM), the launcher relaunching, the job resuming.

Runs ``tf-adasum launch -n WORKERS --max-restarts KILLS`` on this machine,
whose workers (this script with ``--worker``) train LeNet-5 on random
MNIST-shaped data under MultiWorkerMirroredStrategy with
``AdasumOptimizer(Adam)`` and ``BackupAndRestore(save_freq=K,
save_before_preemption=True)``; in each of the first KILLS rounds, worker 1
kills itself as a batch begins (a different batch each round). Prints one
JSON object per K, and one for SIGTERM:

  cold_start_s        launcher start to the first completed batch of round 0
  recovery_s          per kill: the kill to the first batch trained in the next round
  recovery_median_s   their median; ratio_to_cold_start = median / cold_start_s
  batches_redone      per kill: batches trained in the round the kill ended minus
                      the batches the restored backup holds (what the kill cost)
  signal              "SIGKILL" (a crash) or "SIGTERM" (a preemption notice:
                      every worker backs up after its batch, so nothing is redone)

Usage: python benchmarks/elastic.py [--save-freq 1 4 16] [--kills 5] [--workers 2] [--signals SIGKILL SIGTERM]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_PY = os.path.join(ROOT, "tf_adasum", "launch.py")
STEPS, BATCH_PER_WORKER = 40, 32
#: The run's batch at which worker 1 is killed in round r: spread over the run, never a multiple of 16.
FIRST_KILL, KILL_EVERY = 9, 11


def _worker(out: str, save_freq: int, kills: int, signal_name: str) -> None:
    """One worker: trains, logging every batch it trains (not those a resume skips)."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_adasum
    from tf_adasum import backup
    from tf_adasum.eval.models import lenet5
    from tf_adasum.processes import Processes

    round_number = int(os.environ["TF_ADASUM_ELASTIC_ROUND"])
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = Processes.of(strategy).index
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = lenet5()
        model.compile(
            optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.Adam(1e-3)),
            loss="sparse_categorical_crossentropy",
            jit_compile=False,
        )
    rng = np.random.default_rng(rank)
    x = rng.random((STEPS * BATCH_PER_WORKER, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, STEPS * BATCH_PER_WORKER)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_PER_WORKER).repeat()
    dataset = strategy.distribute_datasets_from_function(lambda context: dataset)
    restoring = backup.BackupAndRestore(os.path.join(out, "backup"), save_freq=save_freq, save_before_preemption=True)
    log = open(os.path.join(out, f"batches_rank{rank}.jsonl"), "a")  # noqa: SIM115 - open for the run

    class Log(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            done = self.epoch * STEPS + batch
            if rank == 1 and round_number < kills and done == FIRST_KILL + KILL_EVERY * round_number:
                record = {"round": round_number, "killed": time.time(), "done": done}
                log.write(json.dumps(record) + "\n")
                log.flush()
                os.kill(os.getpid(), getattr(signal, signal_name))

        def on_train_batch_end(self, batch, logs=None):
            done = self.epoch * STEPS + batch + 1
            restored = restoring.restored_epoch * STEPS + restoring.restored_batch
            if done > restored:  # trained, not skipped
                log.write(json.dumps({"round": round_number, "time": time.time(), "done": done}) + "\n")
                log.flush()

    epochs = 1 + (FIRST_KILL + KILL_EVERY * kills) // STEPS
    # Log first: a batch after which a notice's backup ends the round is logged before that exit.
    model.fit(dataset, epochs=epochs, steps_per_epoch=STEPS, verbose=0, callbacks=[Log(), restoring])
    log.close()
    os._exit(0)


def _measure(save_freq: int, kills: int, workers: int, signal_name: str) -> dict:
    from tf_adasum.eval import provenance

    with tempfile.TemporaryDirectory(prefix="tf_adasum_elastic_") as out:
        worker = [os.path.abspath(__file__), "--worker", out, str(save_freq), str(kills), signal_name]
        command = [sys.executable, LAUNCH_PY, "-n", str(workers), "--max-restarts", str(kills), *worker]
        start = time.time()
        result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            raise RuntimeError(f"the elastic run failed ({result.returncode}):\n{result.stderr[-3000:]}")
        records = [json.loads(line) for line in open(os.path.join(out, "batches_rank0.jsonl"))]
        killed = [json.loads(line) for line in open(os.path.join(out, "batches_rank1.jsonl")) if "killed" in line]
    first, last = {}, {}
    for record in records:
        first.setdefault(record["round"], record)
        last[record["round"]] = record
    recovery = [first[k["round"] + 1]["time"] - k["killed"] for k in killed]
    # Trained in the round the kill ended, minus what the next round restored (its first batch, less one).
    redone = [last[k["round"]]["done"] - (first[k["round"] + 1]["done"] - 1) for k in killed]
    cold = first[0]["time"] - start
    return {
        "benchmark": "elastic",
        "signal": signal_name,
        "save_freq": save_freq,
        "workers": workers,
        "kills": len(killed),
        "cold_start_s": round(cold, 2),
        "recovery_s": [round(r, 2) for r in recovery],
        "recovery_median_s": round(statistics.median(recovery), 2),
        "ratio_to_cold_start": round(statistics.median(recovery) / cold, 3),
        "batches_redone": redone,
        **provenance.fields(),
    }


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-freq", type=int, nargs="+", default=[1, 4, 16], help="K: a backup every K batches")
    parser.add_argument("--kills", type=int, default=5, help="kills per run (at least 5 for a median)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--signals", nargs="+", default=["SIGKILL", "SIGTERM"], choices=["SIGKILL", "SIGTERM"])
    args = parser.parse_args(argv)
    if "SIGKILL" in args.signals:
        for save_freq in args.save_freq:
            print(json.dumps(_measure(save_freq, args.kills, args.workers, "SIGKILL")), flush=True)
    if "SIGTERM" in args.signals:  # a backup after the batch: K does not matter
        print(json.dumps(_measure(max(args.save_freq), args.kills, args.workers, "SIGTERM")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
