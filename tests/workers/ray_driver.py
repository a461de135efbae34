"""The Ray Train tests' driver: a `TensorflowTrainer` of 2 CPU workers on a
one-machine Ray started here (on loopback), each worker a
MultiWorkerMirroredStrategy worker with the TF_CONFIG Ray gives it.

    python ray_driver.py SCENARIO[,SCENARIO...] OUTDIR

The scenarios run in turn on the one Ray (started once), each in
``OUTDIR/SCENARIO``:

* ``train``: the ``collective`` and ``train`` tasks of distributed_worker.py
  (the test compares them with `tf_adasum.reference`);
* ``restart``: backup_worker.py's job: an uninterrupted run in its own folder,
  then the same run with `tf_adasum.BackupAndRestore` in which worker 1 dies in
  the middle of epoch 2; `FailureConfig(max_failures=1)` restarts both
  workers, which resume from the backup of epoch 1
  (``attempt{A}_rank{R}.json``, ``reference_rank{R}.npz``, ``final_rank{R}.npz``);
* ``fail``: the same run with `tf_adasum.BackupAndRestore` (no uninterrupted
  run first: nothing compares with it) and no restart allowed
  (``max_failures=0``): the run must fail, naming the dead worker.

Prints one JSON line per scenario: its name, its run's error, if any, and
the seconds its run took.
"""

import json
import os
import sys
import time

# Ray keeps a one-machine cluster on 127.0.0.1 with this (its default gives the
# node, and so TF_CONFIG, the machine's outward address); set before Ray starts.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
WORKERS = os.path.dirname(os.path.abspath(__file__))


def _import(name):
    for path in (WORKERS, os.path.dirname(WORKERS)):
        if path not in sys.path:
            sys.path.insert(0, path)
    return __import__(name)


def train_loop(config):
    worker = _import("distributed_worker")
    engine = worker.Engine()
    for task in ("collective", "train"):
        worker.TASKS[task](engine, config["out"])


def restart_loop(config):
    backup_worker = _import("backup_worker")
    from tf_adasum import backup

    out, job = config["out"], backup_worker.Job()
    marker = os.path.join(out, f"started_rank{job.rank}")
    first = not os.path.exists(marker)
    open(marker, "w").close()
    if first and config["reference"]:
        backup_worker.run_reference(job, out)
    folder = os.path.join(out, "backup")
    restoring = backup.BackupAndRestore(folder)
    report = os.path.join(out, f"attempt{1 if first else 2}_rank{job.rank}.json")
    callbacks = [restoring, backup_worker.Report(report, restoring)]
    if first and job.rank == 1:
        callbacks.append(backup_worker.DieMidEpoch(backup_worker.MID_EPOCH_FAULT_EPOCH))
    model = job.model()
    job.fit(model, backup.saved_epoch(folder), callbacks)
    backup_worker.save_state(model, os.path.join(out, f"final_rank{job.rank}.npz"))


def run(scenario, out):
    """One scenario's `TensorflowTrainer` on the running Ray: its run's error (None: none)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    os.makedirs(out, exist_ok=True)
    trainer = TensorflowTrainer(
        {"train": train_loop, "restart": restart_loop, "fail": restart_loop}[scenario],
        train_loop_config={"out": out, "reference": scenario == "restart"},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=scenario,
            storage_path=os.path.join(out, "ray_storage"),
            failure_config=FailureConfig(max_failures=1 if scenario == "restart" else 0),
        ),
    )
    try:
        error = trainer.fit().error
    except Exception as raised:  # noqa: BLE001 - Ray Train raises TrainingFailedError: reported to the test
        error = f"{type(raised).__name__}: {raised}"
    return None if error is None else str(error)


def main():
    scenarios, out = sys.argv[1].split(","), os.path.abspath(sys.argv[2])
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        for scenario in scenarios:
            start = time.monotonic()
            error = run(scenario, os.path.join(out, scenario))
            report = {"scenario": scenario, "error": error, "seconds": time.monotonic() - start}
            print(json.dumps(report), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
