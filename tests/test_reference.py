"""The numpy oracle: Adasum's algebraic properties and the tree's shape."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tf_adasum import reference


def test_orthogonal_vectors_add():
    a = np.array([3.0, 0.0, 0.0])
    b = np.array([0.0, -2.0, 5.0])
    np.testing.assert_array_equal(reference.adasum_pair(a, b), a + b)


def test_equal_vectors_give_the_same_vector():
    a = np.array([1.5, -2.0, 4.0])
    np.testing.assert_allclose(reference.adasum_pair(a, a), a, rtol=1e-15)


def test_opposite_vectors():
    # a.b = -|a|^2: both coefficients are 1.5, so the result is 1.5 (a - a) = 0.
    a = np.array([1.0, 2.0])
    np.testing.assert_allclose(reference.adasum_pair(a, -a), np.zeros(2), atol=1e-15)


def test_known_value():
    a = np.array([1.0, 0.0])
    b = np.array([1.0, 1.0])
    # a.b = 1, |a|^2 = 1, |b|^2 = 2: (1 - 1/2) a + (1 - 1/4) b
    np.testing.assert_allclose(reference.adasum_pair(a, b), 0.5 * a + 0.75 * b, rtol=1e-15)


def test_zero_handling():
    b = np.array([1.0, -2.0, 3.0])
    zero = np.zeros(3)
    np.testing.assert_array_equal(reference.adasum_pair(zero, b), b)
    np.testing.assert_array_equal(reference.adasum_pair(b, zero), b)
    np.testing.assert_array_equal(reference.adasum_pair(zero, zero), zero)


def test_guard_is_sqrt_dbl_min_and_has_no_epsilon():
    assert reference.NORM_GUARD == pytest.approx(1.4916681462400413e-154)
    tiny = np.array([1e-78, 0.0])  # |a|^2 = 1e-156 < guard: coefficient exactly 1
    b = np.array([1.0, 1.0])
    np.testing.assert_array_equal(reference.adasum_pair(tiny, b), tiny * 1.0 + b * 1.0)
    small = np.array([1e-70, 0.0])  # |a|^2 = 1e-140 > guard: the formula applies in full
    c_a, c_b = reference.adasum_coefficients(1e-70, 1e-140, 2.0)
    assert c_a == 1.0 - 1e-70 / 2e-140
    np.testing.assert_allclose(reference.adasum_pair(small, b), c_a * small + c_b * b, rtol=1e-15)


def test_not_associative():
    a, b, c = np.array([1.0, 0.0]), np.array([1.0, 1.0]), np.array([0.0, 1.0])
    left = reference.adasum_pair(reference.adasum_pair(a, b), c)
    right = reference.adasum_pair(a, reference.adasum_pair(b, c))
    assert not np.allclose(left, right)


def test_result_dtype_is_input_dtype_and_math_is_float64():
    a = np.array([1e20, 3e19], dtype=np.float32)
    b = np.array([2e19, -1e20], dtype=np.float32)
    out = reference.adasum_pair(a, b)
    assert out.dtype == np.float32
    expected = reference.adasum_pair(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(out, expected)
    assert np.all(np.isfinite(out))


def test_bfloat16_is_accepted():
    a = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16)
    assert reference.adasum_pair(a, a).dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize(
    "n, leaves, folded", [(1, 1, 0), (2, 2, 0), (3, 2, 1), (4, 4, 0), (5, 4, 1), (6, 4, 2), (7, 4, 3), (8, 8, 0)]
)
def test_tree_shape(n, leaves, folded):
    assert reference.tree_shape(n) == (leaves, folded)


@pytest.mark.parametrize(
    "n, expected",
    [
        (1, "0"),
        (2, "(0,1)"),
        (3, "((0,1),2)"),
        (4, "((0,1),(2,3))"),
        (5, "((((0,1),2),(3,4)))"[1:-1]),
        (6, "(((0,1),(2,3)),(4,5))"),
        (7, "(((0,1),(2,3)),((4,5),6))"),
        (8, "(((0,1),(2,3)),((4,5),(6,7)))"),
    ],
)
def test_tree_order(n, expected):
    assert reference.tree_reduce([str(i) for i in range(n)], lambda a, b: f"({a},{b})") == expected


def test_adasum_tree_equals_nested_pairs():
    rng = np.random.default_rng(0)
    x = [rng.standard_normal(5) for _ in range(3)]
    expected = reference.adasum_pair(reference.adasum_pair(x[0], x[1]), x[2])
    np.testing.assert_allclose(reference.adasum_tree([[v] for v in x])[0], expected, rtol=1e-15)


def test_adasum_tree_is_per_tensor():
    rng = np.random.default_rng(1)
    per_rank = [[rng.standard_normal((2, 3)), rng.standard_normal(4)] for _ in range(4)]
    out = reference.adasum_tree(per_rank)
    for t in range(2):
        expected = reference.tree_reduce([r[t] for r in per_rank], reference.adasum_pair)
        np.testing.assert_allclose(out[t], expected, rtol=1e-15)


def test_sum_and_mean():
    per_rank = [[np.array([1.0, 2.0])], [np.array([3.0, 4.0])], [np.array([5.0, 9.0])]]
    np.testing.assert_array_equal(reference.sum_(per_rank)[0], [9.0, 15.0])
    np.testing.assert_array_equal(reference.mean(per_rank)[0], [3.0, 5.0])


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((np.array([1, 2]), np.array([1, 2])), TypeError, "Received: a.dtype=int64"),
        ((np.zeros(2), np.zeros(2, np.float32)), TypeError, "same dtype"),
        ((np.zeros(2), np.zeros(3)), ValueError, r"a.shape=\(2,\), b.shape=\(3,\)"),
    ],
)
def test_pair_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        reference.adasum_pair(*args)


def test_tree_bad_input():
    with pytest.raises(ValueError, match="per_rank=\\[\\]"):
        reference.adasum_tree([])
    with pytest.raises(ValueError, match="rank 1 has 2"):
        reference.adasum_tree([[np.zeros(2)], [np.zeros(2), np.zeros(2)]])
    with pytest.raises(ValueError, match="Tensor 0 differs"):
        reference.adasum_tree([[np.zeros(2)], [np.zeros(3)]])
    with pytest.raises(TypeError, match="per_rank\\[0\\]\\[0\\]"):
        reference.adasum_tree([[np.zeros(2, np.int32)]])


# -- properties ---------------------------------------------------------------

_magnitudes = st.sampled_from([1e-60, 1e-20, 1e-3, 1.0, 1e3, 1e20, 1e60])


@st.composite
def _pairs(draw):
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, max_side=6))
    elements = st.floats(-1.0, 1.0, allow_nan=False, width=64)
    a = draw(hnp.arrays(np.float64, shape, elements=elements)) * draw(_magnitudes)
    b = draw(hnp.arrays(np.float64, shape, elements=elements)) * draw(_magnitudes)
    return a, b


def _above_guard(*xs):
    return all(np.dot(x.ravel(), x.ravel()) >= reference.NORM_GUARD for x in xs)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_pairs())
def test_symmetric(pair):
    a, b = pair
    np.testing.assert_allclose(reference.adasum_pair(a, b), reference.adasum_pair(b, a), rtol=1e-12, atol=0)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_pairs(), st.sampled_from([1e-10, 0.5, 3.0, 1e10]))
def test_positively_homogeneous(pair, scale):
    a, b = pair
    assume(_above_guard(a, b, a * scale, b * scale))
    expected = scale * reference.adasum_pair(a, b)
    # Relative to the vector: elements far below its largest may be subnormal.
    atol = max(1e-12 * np.abs(expected).max(), 1e-300)
    np.testing.assert_allclose(reference.adasum_pair(scale * a, scale * b), expected, rtol=1e-9, atol=atol)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_pairs())
def test_odd(pair):
    a, b = pair
    np.testing.assert_allclose(reference.adasum_pair(-a, -b), -reference.adasum_pair(a, b), rtol=1e-15, atol=0)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_pairs())
def test_idempotent_and_orthogonal(pair):
    a, b = pair
    if _above_guard(a):
        np.testing.assert_allclose(reference.adasum_pair(a, a), a, rtol=1e-12, atol=1e-300)  # subnormals
    # Project b onto the orthogonal complement of a: then Adasum adds them.
    if _above_guard(a) and np.linalg.norm(a) > 0:
        b_orth = b - np.dot(a.ravel(), b.ravel()) / np.dot(a.ravel(), a.ravel()) * a
        if abs(np.dot(a.ravel(), b_orth.ravel())) <= 1e-12 * np.linalg.norm(a) * np.linalg.norm(b_orth):
            np.testing.assert_allclose(
                reference.adasum_pair(a, b_orth), a + b_orth, rtol=1e-9, atol=1e-9 * np.abs(a + b_orth).max()
            )
