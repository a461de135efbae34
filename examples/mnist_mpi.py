"""LeNet-5 on real MNIST with one process per MPI rank and Adasum (mpirun).

    mpirun -np 4 python examples/mnist_mpi.py --epochs 6
    (as root: mpirun --allow-run-as-root --oversubscribe -np 4 ...)

The training code is plain single-process Keras: no strategy. AdasumOptimizer
sees that an MPI launcher started the process and combines the ranks' updates
over MPI; before the first step it gives every rank rank 0's weights. Each rank
reads its own shard of the training set (`tf_adasum.mpi.rank()`/`size()`), all
with the same number of steps per epoch. `MetricAverageCallback` averages the
epoch metrics over the ranks; every rank evaluates its shard of the test set
and the counts are summed. Rank 0 alone prints per-epoch lines and one JSON
summary line (and would write checkpoints).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-per-rank", type=int, default=32)
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="Adam learning rate (single-worker value), cosine-decayed to a tenth over the run",
    )
    parser.add_argument("--combiner", default="adasum", choices=["adasum", "mean", "sum"])
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import keras
    import numpy as np

    import tf_adasum
    from tf_adasum import mpi as adasum_mpi
    from tf_adasum.eval import provenance
    from tf_adasum.eval.data import as_float_images, load_mnist, training_stream
    from tf_adasum.eval.models import lenet5

    rank, size = adasum_mpi.rank(), adasum_mpi.size()
    keras.utils.set_random_seed(args.seed + rank)  # different on purpose: the optimizer broadcasts rank 0's
    (x_train, y_train), (x_test, y_test) = load_mnist()
    global_batch = args.batch_per_rank * size
    steps_per_epoch = -(-len(x_train) // global_batch)  # the same on every rank
    # The single-worker learning rate, no scaling with the number of workers (Adasum adapts).
    learning_rate = keras.optimizers.schedules.CosineDecay(args.lr, args.epochs * steps_per_epoch, alpha=0.1)
    # This rank's shard, repeated: every rank runs steps_per_epoch steps, whatever its shard's size.
    train, _ = training_stream(x_train[rank::size], y_train[rank::size], args.batch_per_rank, args.seed + rank)
    model = lenet5()
    model.compile(
        optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.Adam(learning_rate), combiner=args.combiner),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,  # the MPI engine calls MPI from Python, which XLA cannot compile
    )
    test_images, test_labels = as_float_images(x_test[rank::size]), y_test[rank::size]
    epoch_times, test_accuracy, train_loss = [], [], []

    class EpochEnd(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            epoch_times.append(time.perf_counter() - self.start)
            train_loss.append(float(logs["loss"]))  # averaged over ranks by MetricAverageCallback
            logits = self.model.predict(test_images, batch_size=1000, verbose=0)
            correct = int(np.sum(np.argmax(logits, axis=-1) == test_labels))
            totals = adasum_mpi.allreduce_sum({"correct": correct, "count": len(test_labels)})
            test_accuracy.append(totals["correct"] / totals["count"])
            if rank == 0:
                print(f"epoch {epoch + 1}: test accuracy {test_accuracy[-1]:.4f}, {epoch_times[-1]:.1f} s", flush=True)

    callbacks = [adasum_mpi.MetricAverageCallback(), EpochEnd()]
    model.fit(
        train,
        epochs=args.epochs,
        steps_per_epoch=steps_per_epoch,
        shuffle=False,  # the shard is shuffled already (training_stream)
        verbose=0,
        callbacks=callbacks,
    )
    summary = {
        "example": "mnist_mpi",
        "ranks": size,
        "global_batch": global_batch,
        "combiner": args.combiner,
        "lr": args.lr,
        "epochs": args.epochs,
        "train_loss_per_epoch": [round(x, 4) for x in train_loss],
        "test_accuracy_per_epoch": [round(a, 4) for a in test_accuracy],
        "final_test_accuracy": test_accuracy[-1],
        "seconds_per_epoch": [round(t, 1) for t in epoch_times],
        **provenance.fields(provenance.command_line(__file__, argv)),  # date, commit, processor, command
    }
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
