"""The README's MPI recipe (`model.fit` with `MetricAverageCallback`), run by
`mpirun` in tests/test_engines.py with one of two faults:

    python mpi_recipe.py uneven   # rank 0 runs one step more than the others
    python mpi_recipe.py names    # validation data on rank 0 only: metric names differ

Nothing is caught: what reaches the user is what the test sees (stderr, mpirun's
exit code and wall time).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_adasum  # noqa: E402
from tf_adasum import mpi  # noqa: E402


def main():
    fault = sys.argv[1]
    rng = np.random.default_rng(mpi.rank())
    steps = 6 if fault == "uneven" and mpi.rank() == 0 else 5
    x, y = rng.standard_normal((steps * 8, 4)).astype("float32"), rng.standard_normal((steps * 8, 2)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.01)), loss="mse", jit_compile=False)
    validation = (x[:8], y[:8]) if fault == "names" and mpi.rank() == 0 else None
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, validation_data=validation,
              callbacks=[mpi.MetricAverageCallback()])  # fmt: skip
    print(f"rank {mpi.rank()} finished", flush=True)


if __name__ == "__main__":
    main()
