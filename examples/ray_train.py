"""LeNet-5 on real MNIST with Adasum under Ray Train (`TensorflowTrainer`).

    python examples/ray_train.py --workers 2 --epochs 2

Ray starts the workers and gives each its `TF_CONFIG`; each worker runs
`examples/mnist_multiworker.py` unchanged (MultiWorkerMirroredStrategy,
AdasumOptimizer), with `tf_adasum.BackupAndRestore` in a folder under the
run's storage: with ``--max-failures K``, Ray restarts the workers after a
failure (up to K times) and training resumes from the last epoch's backup.

Ray also sets ``TF_USE_LEGACY_KERAS=1`` on its TensorFlow workers (it assumes
Keras 2). tf_adasum and this script import `keras` (Keras 3) directly, which
the variable does not touch; only `tf.keras` would then look for the
`tf_keras` package. `--address` joins a running cluster; without it, Ray
starts one on this machine, on loopback.
"""

import argparse
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

EXAMPLES = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray Train workers, one replica each")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-failures", type=int, default=1, help="restarts of the workers after a failure")
    parser.add_argument("--storage", default=os.path.abspath("ray_results"), help="Ray's storage path (shared)")
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: start one here)")
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds")
    return parser.parse_args(argv)


def train_loop(config):
    """One Ray Train worker: mnist_multiworker's training with a backup."""
    # Ray's workers log at INFO, which would print every TensorFlow notice
    # (the strategy's devices, each all-reduce's packing); keep its warnings.
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    sys.path.insert(0, config["examples"])
    import mnist_multiworker

    argv = ["--epochs", str(config["epochs"]), "--timeout", str(config["timeout"]), "--backup", config["backup"]]
    mnist_multiworker.main(argv)  # worker 0 prints each epoch's test accuracy and a JSON summary


def main(argv=None):
    args = parse_args(argv)
    if not args.address:
        # A one-machine Ray on loopback: Ray otherwise gives its nodes, and so
        # the workers' TF_CONFIG, the machine's outward address (this variable
        # is how Ray keeps a local cluster on 127.0.0.1, as it does on macOS).
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Ray Train 2.60 sends each print of a worker both to its stdout and
    # through a logger to the console, so every line reached the driver
    # twice; this variable of Ray's (passed on to the workers) keeps print
    # as it is.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer

    if args.address:
        ray.init(address=args.address, log_to_driver=True)
    else:
        ray.init(include_dashboard=False, num_cpus=args.workers, log_to_driver=True)
    name = "tf_adasum_mnist"
    trainer = TensorflowTrainer(
        train_loop,
        train_loop_config={
            "examples": EXAMPLES,
            "epochs": args.epochs,
            "timeout": args.timeout,
            "backup": os.path.join(args.storage, name, "backup"),
        },
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(
            name=name, storage_path=args.storage, failure_config=FailureConfig(max_failures=args.max_failures)
        ),
    )
    return trainer.fit()  # raises when training fails (after --max-failures restarts)


if __name__ == "__main__":
    main()
