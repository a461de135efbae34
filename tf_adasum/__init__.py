"""tf_adasum: Adasum (adaptive summation) for TensorFlow 2 and Keras 3.

Public API:
  reference              the numpy/float64 oracle (`adasum_pair`, `adasum_tree`, ...)
  adasum_pair            Adasum of two tensors, as a TF op
  AdasumCrossDeviceOps   a `tf.distribute.CrossDeviceOps` carrying the collective
  combiners              combiner objects ("adasum", "sum", "mean")
"""

__version__ = "0.1.0"


def _check_keras_backend() -> None:
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ImportError(
            "tf_adasum needs Keras' TensorFlow backend. Received: keras.backend.backend()="
            f"{backend!r}. Set the environment variable KERAS_BACKEND=tensorflow before importing "
            "keras, or set \"backend\": \"tensorflow\" in ~/.keras/keras.json."
        )


_check_keras_backend()

from tf_adasum import combiners, reference  # noqa: E402
from tf_adasum.cross_device_ops import AdasumCrossDeviceOps  # noqa: E402
from tf_adasum.ops import adasum_pair  # noqa: E402

__all__ = [
    "AdasumCrossDeviceOps",
    "__version__",
    "adasum_pair",
    "combiners",
    "reference",
]
