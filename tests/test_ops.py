"""`tf_adasum.adasum_pair` (the TF op) and the kernels of `tf_adasum.ops` against the numpy reference."""

import os
import warnings

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from conftest import TOLERANCE, relative_error

import tf_adasum
from tf_adasum import ops, reference

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


# -- the two kernels of ops.partial_dots / ops.scaled_sum ---------------------------------


def _reference_dots(x, block_tensor, num_tensors):
    """Per tensor [a.b, |a|^2, |b|^2] in float64 (numpy), blocks of BLOCK."""
    a, b = (row.astype(np.float64).reshape(-1, ops.BLOCK) for row in x)
    out = np.zeros((num_tensors, 3))
    for t, row_a, row_b in zip(block_tensor, a, b):
        out[t] += [row_a @ row_b, row_a @ row_a, row_b @ row_b]
    return out


# Slices as the tree makes them: one tensor, several (crossing the native
# kernel's 32768-element chunks), small and large (the XLA threshold is 65536).
SEGMENTS = [
    (ops.Segments.single(2, 5), 3),
    (ops.Segments(first=1, counts=(3, 1, 250, 4, 300), num_tensors=7), None),
    (ops.Segments(first=0, counts=(2, 5), num_tensors=2), None),
]


@pytest.fixture(params=["native", "tensorflow"])
def kernels(request, monkeypatch):
    """Runs a test with the native CPU kernels and with TensorFlow's ops."""
    monkeypatch.setattr(ops, "_cpu_loaded", [])  # as in a fresh process
    if request.param == "native":
        assert ops.cpu_kernels() is not None, "the native CPU kernels did not build (see the warning)"
    else:
        monkeypatch.setenv("TF_ADASUM_CPU_KERNELS", "0")
    return request.param


def _op_types(fn, *args):
    """The op types `fn` builds for `args` (traced, on the CPU)."""
    with tf.device("/CPU:0"):
        graph = tf.function(fn, autograph=False).get_concrete_function(*args).graph
    return {op.type for op in graph.get_operations()}


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
@pytest.mark.parametrize("segments, blocks", SEGMENTS)
def test_kernels_match_reference(kernels, dtype, segments, blocks, rng):
    counts = [blocks] if segments.counts == (-1,) else list(segments.counts)
    m = sum(counts) * ops.BLOCK
    x_np = (rng.standard_normal((2, m)) * 3).astype(NUMPY_DTYPES[dtype])
    block_tensor = np.repeat(np.arange(segments.first, segments.first + len(counts)), counts)
    expected = _reference_dots(x_np, block_tensor, segments.num_tensors)
    with tf.device("/CPU:0"):
        a, b = tf.constant(x_np[0]), tf.constant(x_np[1])
        dots = ops.partial_dots(a, b, segments).numpy()
        c_a, c_b = ops.coefficients(tf.constant(expected))
        out = ops.scaled_sum(a, b, c_a, c_b, segments).numpy()
    assert dots.dtype == np.float64 and dots.shape == (segments.num_tensors, 3)
    np.testing.assert_allclose(dots, expected, rtol=1e-12, atol=0)
    per_element = block_tensor.repeat(ops.BLOCK)
    want = c_a.numpy()[per_element] * x_np[0].astype(np.float64) + c_b.numpy()[per_element] * x_np[1].astype(np.float64)
    assert out.dtype == x_np.dtype and out.shape == (m,)
    assert relative_error(out, want) <= TOLERANCE[dtype]
    native_ops = {"TfAdasumPartialDots", "TfAdasumScaledSum"}
    types = _op_types(
        lambda a, b: ops.scaled_sum(a, b, *ops.coefficients(ops.partial_dots(a, b, segments)), segments), a, b
    )
    assert (native_ops <= types) if kernels == "native" else not (native_ops & types), types


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_native_and_tensorflow_kernels_agree(dtype, rng, monkeypatch):
    """Given the same coefficients, both round the same float64 value once
    (up to a multiply-add XLA may fuse); the dots differ in the order of additions."""
    monkeypatch.setattr(ops, "_cpu_loaded", [])
    assert ops.cpu_kernels() is not None, "the native CPU kernels did not build (see the warning)"
    segments = SEGMENTS[1][0]
    with tf.device("/CPU:0"):
        a, b = tf.unstack(tf.constant(rng.standard_normal((2, 558 * ops.BLOCK)).astype(NUMPY_DTYPES[dtype])))
        native_dots = ops.partial_dots(a, b, segments)
        c_a, c_b = ops.coefficients(native_dots)
        native_sum = ops.scaled_sum(a, b, c_a, c_b, segments)
        monkeypatch.setattr(ops, "_cpu_loaded", [])
        monkeypatch.setenv("TF_ADASUM_CPU_KERNELS", "0")
        tf_dots, tf_sum = ops.partial_dots(a, b, segments), ops.scaled_sum(a, b, c_a, c_b, segments)
    np.testing.assert_allclose(tf_dots.numpy(), native_dots.numpy(), rtol=1e-13)
    ulp = float(np.finfo(NUMPY_DTYPES[dtype]).eps)
    np.testing.assert_allclose(tf_sum.numpy(), native_sum.numpy(), rtol=ulp, atol=0)


def test_native_kernels_reject_a_slice_that_does_not_match_its_counts():
    native = ops.cpu_kernels()
    assert native is not None
    zeros = tf.zeros([256])
    with pytest.raises(tf.errors.InvalidArgumentError, match="not the 3 blocks of 128"):
        native.tf_adasum_partial_dots(zeros, zeros, first=0, counts=[1, 2], num_tensors=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not within num_tensors=2"):
        native.tf_adasum_partial_dots(zeros, zeros, first=1, counts=[1, 1], num_tensors=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must be >= 0"):
        native.tf_adasum_partial_dots(zeros[:128], zeros[:128], first=0, counts=[-1, 2], num_tensors=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="c_a and c_b must have num_tensors=2"):
        native.tf_adasum_scaled_sum(
            zeros,
            zeros,
            tf.ones([1], tf.float64),
            tf.ones([2], tf.float64),
            first=0,
            counts=[1, 1],
            num_tensors=2,
        )
    with pytest.raises(ValueError, match="must be rank 1"):
        _op_types(
            lambda x: native.tf_adasum_partial_dots(x, x, first=0, counts=[-1], num_tensors=1), tf.zeros([2, 128])
        )
    with pytest.raises(ValueError, match="must be equal"):
        _op_types(
            lambda a, b: native.tf_adasum_scaled_sum(
                a, b, tf.ones([1], tf.float64), tf.ones([1], tf.float64), first=0, counts=[-1], num_tensors=1
            ),
            tf.zeros([256]),
            tf.zeros([128]),
        )


def test_adasum_pair_stays_differentiable_and_xla_compilable(rng):
    a = tf.constant(rng.standard_normal(300))
    b = tf.constant(rng.standard_normal(300))
    compiled = tf.function(tf_adasum.adasum_pair, jit_compile=True)
    np.testing.assert_allclose(compiled(a, b).numpy(), reference.adasum_pair(a.numpy(), b.numpy()), rtol=1e-12)
    weights = rng.standard_normal(300)  # a random cotangent: every output element counts
    with tf.GradientTape() as tape:
        tape.watch([a, b])
        out = tf.reduce_sum(tf.constant(weights) * tf_adasum.adasum_pair(a, b))
    grad_a, grad_b = tape.gradient(out, [a, b])
    a, b = a.numpy(), b.numpy()
    numerical_a = _numerical_gradient(lambda x: np.dot(weights, reference.adasum_pair(x, b)), a)
    numerical_b = _numerical_gradient(lambda x: np.dot(weights, reference.adasum_pair(a, x)), b)
    assert relative_error(grad_a.numpy(), numerical_a) < 1e-7
    assert relative_error(grad_b.numpy(), numerical_b) < 1e-7


def _numerical_gradient(f, x, h=1e-6):
    """Central differences of a float64 function, one element at a time."""
    grad = np.empty_like(x)
    for j in range(x.size):
        step = np.zeros_like(x)
        step[j] = h
        grad[j] = (f(x + step) - f(x - step)) / (2 * h)
    return grad


def test_unbuildable_native_kernels_fall_back_with_one_warning(monkeypatch, tmp_path, rng):
    monkeypatch.setenv("TF_ADASUM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(ops, "_cpu_loaded", [])  # as in a fresh process
    a, b = rng.standard_normal(300), rng.standard_normal(300)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ops.cpu_kernels() is None
        _check(a, b)
    assert len(caught) == 1 and caught[0].category is RuntimeWarning, [str(w.message) for w in caught]
    assert "no C++ compiler" in str(caught[0].message) and "XLA" in str(caught[0].message)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
@pytest.mark.parametrize("special", [None, np.inf, -np.inf, np.nan, "overflow"])
def test_scale_and_check(kernels, dtype, special, rng):
    x_np = rng.standard_normal(70_000).astype(NUMPY_DTYPES[dtype])  # 3 native chunks
    scale = 4.0
    if special == "overflow":  # finite, but not once scaled
        x_np[40_000] = {"float16": 3e4, "bfloat16": 3e38, "float32": 3e38, "float64": 1e308}[dtype]
    elif special is not None:
        x_np[69_999] = special
    with tf.device("/CPU:0"):
        y, finite = ops.scale_and_check(tf.constant(x_np), scale)
        want = tf.constant(x_np) * tf.constant(scale, x_np.dtype)  # TensorFlow's rounding
    assert y.dtype == want.dtype
    np.testing.assert_array_equal(y.numpy().astype(np.float64), want.numpy().astype(np.float64))  # NaN == NaN
    assert bool(finite) is (special is None)
    native = "TfAdasumScaleAndCheck" in _op_types(lambda x: ops.scale_and_check(x, scale), tf.constant(x_np))
    assert native is (kernels == "native")
