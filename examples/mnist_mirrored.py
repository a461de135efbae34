"""LeNet-5 on real MNIST with MirroredStrategy over N logical CPU devices and Adasum.

    python examples/mnist_mirrored.py --replicas 4 --epochs 6

Each replica takes local Adam steps on its shard of the batch; the AdasumOptimizer
combines the replicas' updates with Adasum. AdasumDiagnostics adds the model's
orthogonality (|combined|^2 / sum_i |delta_i|^2 over all weights) to the progress
line, and writes every per-tensor statistic to diagnostics.jsonl and a summary to
diagnostics.png in --out: the model's orthogonality over steps, a heat map of each
tensor's, and one heat map per tree level of the Adasum coefficients. Prints one
JSON summary line.
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer. Received: {text!r}")
    return int(text)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4, help="logical CPU devices, one replica each")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-per-replica", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (single-worker value)")
    parser.add_argument("--combiner", default="adasum", choices=["adasum", "mean", "sum"])
    parser.add_argument("--every-n-steps", type=int, default=100, help="diagnostics interval")
    parser.add_argument("--out", default="results/mnist_mirrored", help="folder for diagnostics")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--train-examples", type=_positive, default=None, help="train on the first N training images only (a quick try)"
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * args.replicas)
    import keras

    import tf_adasum
    from tf_adasum.eval import provenance
    from tf_adasum.eval.data import as_float_images, load_mnist, training_stream
    from tf_adasum.eval.models import lenet5

    keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_mnist()
    x_train, y_train = x_train[: args.train_examples], y_train[: args.train_examples]
    x_test = as_float_images(x_test)
    global_batch = args.batch_per_replica * args.replicas
    train, steps_per_epoch = training_stream(x_train, y_train, global_batch, args.seed)

    devices = [f"/cpu:{i}" for i in range(args.replicas)]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=tf_adasum.AdasumCrossDeviceOps())
    with strategy.scope():
        model = lenet5()
        model.compile(
            optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.Adam(args.lr), combiner=args.combiner),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    os.makedirs(args.out, exist_ok=True)
    diagnostics = tf_adasum.AdasumDiagnostics(
        every_n_steps=args.every_n_steps,
        jsonl_path=os.path.join(args.out, "diagnostics.jsonl"),
        png_path=os.path.join(args.out, "diagnostics.png"),
    )
    epoch_times = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_times.append(time.perf_counter() - self.start)

    test_accuracy = []

    class TestAccuracy(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            test_accuracy.append(float(self.model.evaluate(x_test, y_test, batch_size=1000, verbose=0)[1]))
            print(f"epoch {epoch + 1}: test accuracy {test_accuracy[-1]:.4f}, {epoch_times[-1]:.1f} s", flush=True)

    model.fit(
        train,
        epochs=args.epochs,
        steps_per_epoch=steps_per_epoch,
        shuffle=False,  # the stream is shuffled already
        verbose=2,
        callbacks=[EpochTimer(), TestAccuracy(), diagnostics],
    )
    summary = {
        "example": "mnist_mirrored",
        "replicas": args.replicas,
        "global_batch": global_batch,
        "combiner": args.combiner,
        "lr": args.lr,
        "epochs": args.epochs,
        "test_accuracy_per_epoch": test_accuracy,
        "final_test_accuracy": test_accuracy[-1],
        "seconds_per_epoch": [round(t, 1) for t in epoch_times],
        "diagnostics_png": diagnostics.png_path,
        **provenance.fields(provenance.command_line(__file__, argv)),  # date, commit, processor, command
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
