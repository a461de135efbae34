"""`tf_adasum.adasum_pair` (the TF op) against the numpy reference."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from conftest import TOLERANCE, relative_error

import tf_adasum
from tf_adasum import reference

NUMPY_DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float64": np.float64,
}


def _check(a, b):
    out = tf_adasum.adasum_pair(tf.constant(a), tf.constant(b))
    expected = reference.adasum_pair(a, b)
    assert out.dtype.name == np.dtype(a.dtype).name
    assert out.shape == a.shape
    assert np.all(np.isfinite(out.numpy().astype(np.float64)))
    assert relative_error(out.numpy(), expected) <= TOLERANCE[np.dtype(a.dtype).name]
    return out.numpy()


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 4)])
def test_matches_reference(dtype, shape, rng):
    a = rng.standard_normal(shape).astype(NUMPY_DTYPES[dtype])
    b = rng.standard_normal(shape).astype(NUMPY_DTYPES[dtype])
    _check(a, b)


@pytest.mark.parametrize("scale", [1e20, 1e-25])
def test_float32_extreme_magnitudes(scale, rng):
    # |a|^2 overflows (1e40) or underflows (1e-50) float32: dots must be float64.
    # (Subnormal inputs, below 1.2e-38, are flushed to zero by TF's CPU kernels.)
    a = (rng.standard_normal(64) * scale).astype(np.float32)
    b = (rng.standard_normal(64) * scale).astype(np.float32)
    _check(a, b)
    _check(a, a)


def test_float32_mixed_magnitudes(rng):
    # Coefficients near -1e44 would overflow float32; the scaled sum runs in float64.
    a = (rng.standard_normal(16) * 1e-25).astype(np.float32)
    b = (a.astype(np.float64) * 1e45 + 0).astype(np.float32) + (rng.standard_normal(16) * 1e18).astype(np.float32)
    _check(a, b)


def test_float16_extreme_magnitudes(rng):
    # float16 squares overflow at 256 and underflow below 1e-4.
    for scale in (300.0, 1e-3):
        a = (rng.standard_normal(32) * scale).astype(np.float16)
        b = (rng.standard_normal(32) * scale).astype(np.float16)
        _check(a, b)


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
def test_special_cases_exact(dtype):
    np_dtype = NUMPY_DTYPES[dtype]
    a = np.array([3.0, 0.0, 0.0, 0.0], np_dtype)
    b = np.array([0.0, 2.0, -1.0, 0.0], np_dtype)
    zero = np.zeros(4, np_dtype)
    np.testing.assert_array_equal(tf_adasum.adasum_pair(a, b).numpy(), a + b)
    np.testing.assert_array_equal(tf_adasum.adasum_pair(zero, b).numpy(), b)
    np.testing.assert_array_equal(tf_adasum.adasum_pair(zero, zero).numpy(), zero)
    np.testing.assert_array_equal(tf_adasum.adasum_pair(a, a).numpy(), a)


def test_below_guard_coefficient_is_one():
    a = np.array([1e-78, 0.0])  # |a|^2 = 1e-156 < sqrt(DBL_MIN)
    b = np.array([1.0, 1.0])
    np.testing.assert_array_equal(tf_adasum.adasum_pair(a, b).numpy(), a + b)


def test_inside_tf_function():
    fn = tf.function(tf_adasum.adasum_pair)
    a = tf.constant([1.0, 2.0, 3.0])
    np.testing.assert_allclose(fn(a, a).numpy(), a.numpy(), rtol=1e-7)


@pytest.mark.parametrize(
    "a, b, error, match",
    [
        (tf.constant([1, 2]), tf.constant([1, 2]), TypeError, "Received: a.dtype=int32"),
        (tf.constant([1.0]), tf.constant([1], tf.int64), TypeError, "Received: b.dtype=int64"),
        (tf.constant([1.0], tf.float32), tf.constant([1.0], tf.float64), TypeError, "a.dtype=float32, b.dtype=float64"),
        (tf.zeros([2]), tf.zeros([3]), ValueError, r"a.shape=\(2,\), b.shape=\(3,\)"),
    ],
)
def test_bad_input(a, b, error, match):
    with pytest.raises(error, match=match):
        tf_adasum.adasum_pair(a, b)
