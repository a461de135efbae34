"""LeNet-5 on real MNIST across worker processes (MultiWorkerMirroredStrategy) with Adasum.

    tf-adasum launch -n 4 examples/mnist_multiworker.py --epochs 6

Run by the launcher above (N workers on localhost) or, unchanged, by every
worker of a real cluster whose TF_CONFIG names the cluster and the worker's
task. Each worker reads its own shard of the training set; each replica takes
local Adam steps and the AdasumOptimizer combines the replicas' updates with
Adasum across the workers. Every worker evaluates its shard of the test set;
the counts are summed over the workers. The chief (worker 0) prints per-epoch
lines and one JSON summary line.
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
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-per-replica", type=int, default=32)
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="Adam learning rate (single-worker value), cosine-decayed to a tenth over the run",
    )
    parser.add_argument("--combiner", default="adasum", choices=["adasum", "mean", "sum"])
    parser.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        help="collective timeout in seconds (0: none; a crashed worker is still detected by the strategy's "
        "heartbeat; TensorFlow keeps one sleeping thread per timed collective for the whole timeout)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--train-examples", type=_positive, default=None, help="train on the first N training images only (a quick try)"
    )
    parser.add_argument(
        "--backup",
        default=None,
        help="a folder every worker sees: back up at each epoch's end, and resume from it after a restart "
        "(tf_adasum.BackupAndRestore)",
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_adasum
    from tf_adasum.eval import provenance
    from tf_adasum.eval.data import as_float_images, load_mnist, training_stream
    from tf_adasum.eval.models import lenet5
    from tf_adasum.processes import Processes

    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    workers = Processes.of(strategy)  # this worker's index, their count, sums under the timeout above
    is_chief = workers.index == 0

    keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = load_mnist()
    x_train, y_train = x_train[: args.train_examples], y_train[: args.train_examples]
    global_batch = args.batch_per_replica * strategy.num_replicas_in_sync
    steps_per_epoch = -(-len(x_train) // global_batch)  # the same on every worker
    # The single-worker learning rate, no scaling with the number of workers (Adasum adapts).
    learning_rate = keras.optimizers.schedules.CosineDecay(args.lr, args.epochs * steps_per_epoch, alpha=0.1)

    def dataset_fn(context):
        # This worker's shard, repeated: every worker runs steps_per_epoch steps per epoch.
        index, count = context.input_pipeline_id, context.num_input_pipelines
        batch = context.get_per_replica_batch_size(global_batch)
        return training_stream(x_train[index::count], y_train[index::count], batch, args.seed + index)[0]

    train = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        model = lenet5()
        model.compile(
            optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.Adam(learning_rate), combiner=args.combiner),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    test_images = as_float_images(x_test[workers.index :: workers.count])
    test_labels = y_test[workers.index :: workers.count]
    predict = tf.function(lambda x: tf.argmax(model(x, training=False), axis=-1))
    epoch_times, test_accuracy = [], []

    class EpochEnd(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_times.append(time.perf_counter() - self.start)
            correct = sum(
                int(np.sum(predict(test_images[i : i + 1000]).numpy() == test_labels[i : i + 1000]))
                for i in range(0, len(test_images), 1000)
            )
            total_correct, total = workers.sum([correct, len(test_images)])
            test_accuracy.append(total_correct / total)
            if is_chief:
                print(f"epoch {epoch + 1}: test accuracy {test_accuracy[-1]:.4f}, {epoch_times[-1]:.1f} s", flush=True)

    callbacks = [EpochEnd()] if args.backup is None else [tf_adasum.BackupAndRestore(args.backup), EpochEnd()]
    model.fit(
        train,
        epochs=args.epochs,
        steps_per_epoch=steps_per_epoch,
        shuffle=False,  # each shard is shuffled already (training_stream)
        verbose=0,
        callbacks=callbacks,
    )
    workers.barrier()  # no worker leaves while another still trains
    summary = {
        "example": "mnist_multiworker",
        "workers": workers.count,
        "replicas": strategy.num_replicas_in_sync,
        "global_batch": global_batch,
        "combiner": args.combiner,
        "lr": args.lr,
        "epochs": args.epochs,
        "test_accuracy_per_epoch": [round(a, 4) for a in test_accuracy],
        "final_test_accuracy": test_accuracy[-1],
        "seconds_per_epoch": [round(t, 1) for t in epoch_times],
        **provenance.fields(provenance.command_line(__file__, argv)),  # date, commit, processor, command
    }
    if is_chief:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
