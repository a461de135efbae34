"""The vector-halving collective on logical CPU devices against `adasum_tree`."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from conftest import TOLERANCE, distribute, local_results, mirrored, relative_error

from tf_adasum import reference

NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def _combine(n, per_rank, combiner="adasum", devices=None, **options):
    strategy, cross_device_ops = mirrored(n, devices=devices, **options)
    with strategy.scope():
        values = distribute(strategy, per_rank)
        out = cross_device_ops.batch_reduce_combine(values, combiner)
    return local_results(strategy, out)


def _assert_matches(results, expected):
    for t, (per_replica, ref) in enumerate(zip(results, expected)):
        for r, value in enumerate(per_replica):
            assert value.dtype == ref.dtype, f"tensor {t}"
            assert value.shape == ref.shape, f"tensor {t}"
            assert value.tobytes() == per_replica[0].tobytes(), f"tensor {t}: replica {r} differs from replica 0"
        error = relative_error(per_replica[0], ref)
        assert error <= TOLERANCE[np.dtype(ref.dtype).name], f"tensor {t}: relative error {error:.3g}"


def _awkward_tensors(n, dtype, rng, big=True):
    """Random tensors of awkward lengths, plus an all-zero tensor."""
    shapes = [(1,), (2 * n + 1,), (20 * n - 17,), (3, 5), (4,)] + ([(1 << 19,)] if big else [])
    per_rank = [[rng.standard_normal(s).astype(dtype) for s in shapes] for _ in range(n)]
    for r in range(n):
        per_rank[r][4] = np.zeros(4, dtype)
    return per_rank


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, *(pytest.param(n, marks=pytest.mark.slow) for n in (5, 6, 7, 8))])
def test_matches_reference(n, dtype, rng):
    per_rank = _awkward_tensors(n, NUMPY_DTYPES[dtype], rng)
    _assert_matches(_combine(n, per_rank), reference.adasum_tree(per_rank))


@pytest.mark.parametrize("n", [2, 3, 4, 5, pytest.param(8, marks=pytest.mark.slow)])
def test_mixed_dtypes_in_one_call(n, rng):
    dtypes = [np.float32, np.float64, ml_dtypes.bfloat16, np.float32, np.float16, np.float64]
    per_rank = [[rng.standard_normal(7 * (i + 1)).astype(d) for i, d in enumerate(dtypes)] for _ in range(n)]
    _assert_matches(_combine(n, per_rank), reference.adasum_tree(per_rank))


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_parallel_inputs_are_averaged(n, rng):
    # Identical updates: Adasum gives the update itself.
    base = rng.standard_normal(37)
    per_rank = [[base.copy()] for _ in range(n)]
    out = _combine(n, per_rank)
    np.testing.assert_allclose(out[0][0], base, rtol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 8])
def test_orthogonal_inputs_are_added(n, rng):
    # Replica r updates only coordinates r::n: mutually orthogonal, so they add.
    size = 8 * n + 3
    per_rank = []
    for r in range(n):
        x = np.zeros(size)
        x[r::n] = rng.standard_normal(len(range(r, size, n)))
        per_rank.append([x])
    out = _combine(n, per_rank)
    np.testing.assert_allclose(out[0][0], np.sum([p[0] for p in per_rank], axis=0), rtol=1e-12)


@pytest.mark.parametrize("n", [3, 4])
def test_zero_on_some_replicas(n, rng):
    per_rank = [[rng.standard_normal(9)] for _ in range(n)]
    per_rank[0][0] = np.zeros(9)
    _assert_matches(_combine(n, per_rank), reference.adasum_tree(per_rank))


@pytest.mark.parametrize("n", [2, 3, 5])
def test_reversed_device_order(n, rng):
    # Replica order need not follow device order; rank r lives on /cpu:(n-1-r).
    devices = [f"/cpu:{n - 1 - i}" for i in range(n)]
    per_rank = [[rng.standard_normal(11).astype(np.float32), rng.standard_normal(4)] for _ in range(n)]
    _assert_matches(_combine(n, per_rank, devices=devices), reference.adasum_tree(per_rank))


@pytest.mark.parametrize("n", [3, 4])
def test_small_buckets(n, rng):
    # 64-byte buckets: every tensor in its own bucket, some split across several.
    per_rank = [[rng.standard_normal(s).astype(np.float32) for s in (3, 40, 5, 1, 17)] for _ in range(n)]
    _assert_matches(_combine(n, per_rank, bytes_per_pack=64), reference.adasum_tree(per_rank))


@pytest.mark.parametrize("combiner, oracle", [("sum", reference.sum_), ("mean", reference.mean)])
@pytest.mark.parametrize("n", [2, 3, 4, 6])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_sum_and_mean_through_the_same_collective(combiner, oracle, n, dtype, rng):
    per_rank = [[rng.standard_normal(s).astype(NUMPY_DTYPES[dtype]) for s in [(5,), (2, 9)]] for _ in range(n)]
    _assert_matches(_combine(n, per_rank, combiner), oracle(per_rank))


def test_inside_a_tf_function_with_strategy_run(rng):
    n = 4
    strategy, cross_device_ops = mirrored(n)
    data = rng.standard_normal((n, 6)).astype(np.float32)
    table = tf.constant(data)

    @tf.function
    def step():
        per_replica = strategy.run(
            lambda: tf.gather(table, tf.distribute.get_replica_context().replica_id_in_sync_group)
        )
        return cross_device_ops.batch_reduce_adasum([per_replica])

    with strategy.scope():
        first = local_results(strategy, step())
        second = local_results(strategy, step())  # the same graph runs again
    expected = reference.adasum_tree([[row] for row in data])
    _assert_matches(first, expected)
    assert first[0][0].tobytes() == second[0][0].tobytes()


def test_nan_propagates_to_every_replica(rng):
    per_rank = [[rng.standard_normal(6)] for _ in range(3)]
    per_rank[1][0][2] = np.nan
    out = _combine(3, per_rank)
    # Every dot product of the tensor is NaN, so every coefficient and element is, as in the reference.
    assert np.isnan(reference.adasum_tree(per_rank)[0]).all()
    for value in out[0]:
        assert np.isnan(value).all()
        assert value.tobytes() == out[0][0].tobytes()
