"""The processes of an evaluation run. Every run has processes of its own:
``--engine local-devices`` one process with N logical CPU devices (a
MirroredStrategy), ``--engine tf-collective`` N worker processes of a
MultiWorkerMirroredStrategy on localhost (via `tf_adasum.launch`; with
``--hosts H --link RATE`` on H emulated hosts, as ``tf-adasum launch
--hosts`` makes them: root and network namespaces) and
``--engine mpi`` N ranks under ``mpirun``, one replica per process, and
``--engine simulated`` one process computing the N replicas one after
another (`tf_adasum.SimulatedReplicas`).

`run_in_processes` (the parent) starts this module as a program, once or N
times; each process loads the dataset, trains on its shard of the training
set (every process runs the same number of steps per epoch), evaluates its
shard of the test set, and sums the counts over the processes
(`tf_adasum.processes`), so every process takes the same stop-at-target
decision. Process 0 prints one ``PROGRESS epoch accuracy seconds`` line per
epoch and, when training ends, ``RECORD`` and the result record as one JSON
line; then every process ends
itself from ``on_train_end`` (``os._exit``, after ``MPI_Finalize`` under
mpirun), so TensorFlow's teardown never runs: at `fit`'s return it waits for
tf.data's autotuning threads of the per-device iterators (seen in gdb: the
``RootDataset`` iterator's destructor), 10-60 s at a time, up to 160 s in
one run, which is no part of the run. The processes' other output is shown
only with ``verbose``, or when a run fails, as its last lines (without
TensorFlow's INFO and WARNING log lines unless ``verbose``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable

__all__ = ["run_in_processes"]

_PROGRESS, _RECORD = "PROGRESS ", "RECORD "
_WORKER_PREFIX = re.compile(r"^\[worker \d+\] ")  # tf_adasum.launch's, before each worker's line


def run_in_processes(
    config,
    stop_at_target: bool,
    progress: Callable[[int, float, float], None] | None,
    data_dir: str | None,
    verbose: bool = False,
) -> dict:
    """Runs `config` (validated) in its processes and returns its result record
    (see the README for the fields).

    An epoch is ``ceil(training examples / global batch)`` steps over one
    shuffled, repeated stream of the training set.

    Args:
      config: the configuration.
      stop_at_target: stop after the first epoch that reaches the target.
      progress: called after each epoch with (epoch, test accuracy, seconds).
      data_dir: where the processes find the dataset (`load_dataset`).
      verbose: show the processes' output, TensorFlow's log lines included.
    """
    from tf_adasum.eval.quiet import QUIET_ENVIRONMENT, is_startup_noise
    from tf_adasum.launcher.mpirun import mpirun_command

    n = config.replicas
    program = [os.path.abspath(__file__), json.dumps(dataclasses.asdict(config))]
    program += ["--data-dir", data_dir] if data_dir else []
    program += [] if stop_at_target else ["--no-stop"]
    if config.engine in ("local-devices", "simulated"):
        command, prefix = [sys.executable, *program], ""
    elif config.engine == "tf-collective":
        hosts = ["--hosts", str(config.hosts), "--link", config.link] if config.hosts else []
        command, prefix = [sys.executable, "-m", "tf_adasum.launch", "-n", str(n), *hosts, *program], "[worker 0] "
    else:
        command, prefix = mpirun_command(n) + [sys.executable, *program], ""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TF_CONFIG", None)
    if not verbose:
        env = {**QUIET_ENVIRONMENT, **env}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    record, bad_record = None, ""
    try:
        for line in process.stdout:
            if line.startswith(prefix + _PROGRESS):
                if progress is not None:
                    epoch, accuracy, seconds = line[len(prefix + _PROGRESS) :].split()
                    progress(int(epoch), float(accuracy), float(seconds))
            elif line.startswith(prefix + _RECORD):
                try:
                    record = json.loads(line[len(prefix + _RECORD) :])
                except json.JSONDecodeError as error:
                    bad_record = f"(its record line is not JSON: {error})\n"
            elif verbose:
                print(line, end="", flush=True)
            elif not is_startup_noise(_WORKER_PREFIX.sub("", line).encode()):
                tail = (tail + [line])[-60:]
        process.wait()
    finally:
        if process.poll() is None:  # the parent failed (e.g. interrupted): stop the run; mpirun
            process.terminate()  # and the launcher pass SIGTERM on to their processes
            process.wait()
        process.stdout.close()
    if record is None or process.returncode != 0:
        raise RuntimeError(
            f"The {config.engine} run with {n} replicas failed (exit code {process.returncode}); "
            f"its last output:\n{''.join(tail)}{bad_record}"
        )
    return record


# -- the program each process runs -------------------------------------------------


def _strategy(engine: str, replicas: int):
    """The strategy of this process's replicas: `replicas` logical CPU devices
    (local-devices), the workers' (tf-collective), else the default one (one
    replica per process: mpi, simulated)."""
    import tensorflow as tf

    if engine == "local-devices":
        import tf_adasum
        from tf_adasum.eval.runner import logical_cpus

        return tf.distribute.MirroredStrategy(logical_cpus(replicas), cross_device_ops=tf_adasum.AdasumCrossDeviceOps())
    if engine == "tf-collective":
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


def _main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="the processes of a tf_adasum evaluation run")
    parser.add_argument("config")
    parser.add_argument("--data-dir")
    parser.add_argument("--no-stop", action="store_true")
    args = parser.parse_args(argv)

    import keras

    from tf_adasum.eval import runner
    from tf_adasum.eval.data import as_float_images, load_dataset, training_stream
    from tf_adasum.processes import Processes

    config = runner.RunConfig(**json.loads(args.config)).validate()
    strategy = _strategy(config.engine, config.replicas)
    if config.engine in ("tf-collective", "mpi"):
        processes = Processes.of(strategy)  # a worker of the cluster, or a rank of mpirun
    else:  # local-devices, simulated: one process, whatever launcher variables it inherited
        processes = Processes.alone()
    rank, size = processes.index, processes.count
    keras.utils.set_random_seed(config.seed)
    (x_train, y_train), (x_test, y_test) = runner.subset(config, load_dataset(config.dataset, args.data_dir))
    global_batch = config.replicas * config.batch_per_replica
    steps_per_epoch = -(-len(x_train) // global_batch)  # the same on every process, whatever its shard's size
    train, _ = training_stream(x_train[rank::size], y_train[rank::size], global_batch // size, config.seed + rank)
    if config.engine == "tf-collective":
        dataset = train
        train = strategy.distribute_datasets_from_function(lambda context: dataset)
    with strategy.scope():
        model = runner.compiled_model(config, steps_per_epoch, jit_compile=False)
    test_images, test_labels = as_float_images(x_test[rank::size]), y_test[rank::size]
    count_correct = runner.correct_counter(model, test_images, test_labels)

    def measure_accuracy():
        """This process's shard of the test set, counts summed over the processes."""
        total_correct, total = processes.sum([count_correct(), len(test_labels)], "a sum of the test counts")
        return total_correct / total

    def report(epoch, accuracy, seconds):
        print(f"{_PROGRESS}{epoch} {accuracy} {seconds}", flush=True)

    class Finish(keras.callbacks.Callback):
        """Process 0 prints the record; once every process is past that point,
        each ends itself (see the module docstring)."""

        def on_train_end(self, logs=None):
            if rank == 0:
                record = runner.record(config, epoch_end.accuracy, epoch_end.seconds, not args.no_stop)
                print(_RECORD + json.dumps(record), flush=True)
            processes.barrier()
            sys.stdout.flush()
            if config.engine == "mpi":
                from tf_adasum.comm.mpi_transport import mpi

                mpi().Finalize()  # mpirun treats an exit without it as a failure
            os._exit(0)

    epoch_end = runner.EpochEnd(
        measure_accuracy, None if args.no_stop else config.target, report if rank == 0 else None
    )
    model.fit(
        train,
        epochs=config.epochs,
        steps_per_epoch=steps_per_epoch,
        shuffle=False,
        verbose=0,
        callbacks=[epoch_end, Finish()],
    )
    raise RuntimeError("tf_adasum: fit returned without calling on_train_end")


if __name__ == "__main__":
    _main()
