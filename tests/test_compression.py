"""Compressed transport (`tf_adasum.comm.compression`): float32/float64 values
travel as float16 or bfloat16, against `tf_adasum.reference`."""

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from conftest import TOLERANCE, distribute, local_results, relative_error
from multiprocess import COMPRESSED_TOLERANCE
from simulation import BATCH, IN, OUT, Adam, simulate
from simulation import data as _data

import tf_adasum
from tf_adasum import reference
from tf_adasum.comm import compression
from tf_adasum.ops import BLOCK

WIRES = {"float16": (tf.float16, 2.0**-11), "bfloat16": (tf.bfloat16, 2.0**-8)}


def _combine(n, per_rank, wire, combiner="adasum"):
    ops = tf_adasum.AdasumCrossDeviceOps(compression=wire)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)], cross_device_ops=ops)
    with strategy.scope():
        return local_results(strategy, ops.batch_reduce_combine(distribute(strategy, per_rank), combiner))


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_trip_keeps_the_relative_precision_of_the_wire_at_any_magnitude(wire, dtype, rng):
    wire_dtype, unit_roundoff = WIRES[wire]
    # Far beyond float16's range (65504) and below its smallest normal (6e-5),
    # in one row: every block of BLOCK elements is scaled on its own.
    scales = 10.0 ** rng.integers(-12, 12, size=(4, 8, 1))
    blocks = (rng.standard_normal((4, 8, BLOCK)) * scales).astype(dtype)
    rows = blocks.reshape(4, 8 * BLOCK)
    back = compression.round_trip(tf.constant(rows), wire_dtype).numpy()
    assert back.dtype == dtype and back.shape == rows.shape
    assert np.all(np.isfinite(back))
    error = np.abs(back - rows).reshape(blocks.shape)
    peaks = np.max(np.abs(blocks), axis=2, keepdims=True)
    significant = np.abs(blocks) > peaks * 2.0**-12  # far from the wire's subnormal range
    assert np.max(error[significant] / np.abs(blocks[significant])) <= unit_roundoff
    # Smaller elements: an absolute error far below their block's peak.
    assert np.all(error <= peaks * unit_roundoff * 2.0**-11 + (error * significant))


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_round_trip_of_special_values(wire):
    rows = np.zeros((4, BLOCK), np.float32)
    rows[1, :3] = [np.inf, 1.0, -2.0]
    rows[2, :3] = [np.nan, 1.0, 0.5]
    rows[3, 0] = 2.0**-126
    back = compression.round_trip(tf.constant(rows), WIRES[wire][0]).numpy()
    np.testing.assert_array_equal(back[0], 0.0)
    assert np.isposinf(back[1, 0]) and np.isnan(back[2, 0])
    np.testing.assert_array_equal(back[1:3, 1:3], [[1.0, -2.0], [1.0, 0.5]])
    assert back[3, 0] == np.float32(2.0**-126)  # float32's smallest normal, scaled up and back exactly


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_native_kernels_encode_and_decode_bitwise_as_the_tf_ops(wire, dtype, rng):
    """The CPU kernels (TfAdasumEncodeBlocks, TfAdasumDecodeBlocks) against the
    TensorFlow ops they replace, over magnitudes from subnormal to float32's
    largest, zeros, infinities, NaNs and peaks that round up on the wire."""
    if tf_adasum.ops.cpu_kernels() is None:
        pytest.fail("the native CPU kernels are unavailable here (see the RuntimeWarning)")
    x = rng.standard_normal((3, 64 * BLOCK)) * np.exp(rng.standard_normal((3, 64 * BLOCK)) * 20)
    x[0, :BLOCK], x[0, BLOCK : 2 * BLOCK], x[0, 300], x[1, 700], x[1, 1000] = 0.0, 1e-310, np.inf, np.nan, -np.inf
    x[2, :BLOCK], x[2, BLOCK : 2 * BLOCK], x[2, 2 * BLOCK : 3 * BLOCK] = 65504.0, 3e38, 1e-40
    x[2, 3 * BLOCK : 4 * BLOCK], x[2, 4 * BLOCK : 5 * BLOCK] = 2.0**14 - 1, -(2.0**-149)
    wire_dtype = WIRES[wire][0]
    with tf.device("/CPU:0"):  # where the native kernels run, also on a machine with a GPU
        with np.errstate(over="ignore"):
            rows = tf.constant(np.concatenate([x, np.tile(_blocks_rounding_up(rng, wire), (1, 4))]).astype(dtype))
        packed = compression._encode(rows, wire_dtype)
        assert packed.numpy().tobytes() == compression._tf_encode(rows, wire_dtype).numpy().tobytes()
        back = compression._decode(packed, rows.dtype)
        assert back.numpy().tobytes() == compression._tf_decode(packed, rows.dtype).numpy().tobytes()


def _blocks_rounding_up(rng, wire):
    """Blocks whose scaled peak rounds up to the next power of two on the
    wire, with tiny elements beside it: the case that makes a second trip
    differ unless the encoding is idempotent."""
    step = 2.0 ** (14 - (11 if wire == "float16" else 8))  # the wire's spacing just below 2^14
    blocks = rng.standard_normal((64, BLOCK)) * 2.0 ** rng.integers(-30, -2, size=(64, 1)) * 2.0**14
    blocks[:, 0] = 2.0**14 - step * rng.uniform(0.0, 0.5, size=64)  # rounds to 2^14
    blocks *= 2.0 ** rng.integers(-60, 60, size=(64, 1))
    return blocks.reshape(4, 16 * BLOCK)


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_trip_is_idempotent(wire, dtype, rng):
    rows = tf.constant(_blocks_rounding_up(rng, wire).astype(dtype))
    once = compression.round_trip(rows, WIRES[wire][0])
    twice = compression.round_trip(once, WIRES[wire][0])
    assert once.numpy().tobytes() == twice.numpy().tobytes()


def test_round_trip_of_float64_extremes_and_of_finite_values_beside_infinity():
    rows = np.zeros((3, BLOCK))
    rows[0, :3] = [1e300, -3e299, 1.0]
    rows[1, :3] = [1e-300, 2e-301, 0.0]
    rows[2, :3] = [np.inf, 1.0, -3.0]
    back = compression.round_trip(tf.constant(rows), tf.float16).numpy()
    np.testing.assert_allclose(back[:2, :2], rows[:2, :2], rtol=2.0**-11)
    assert back[0, 2] == 0.0  # 2^-997 of its block's peak
    assert np.isposinf(back[2, 0]) and list(back[2, 1:3]) == [1.0, -3.0]


@pytest.mark.parametrize("wire", sorted(WIRES))
def test_replicas_stay_identical_through_the_fold_on_values_that_round_up(wire, rng):
    # N = 3: rank 0 combines with rank 1's buffer and sends the result back to
    # it; every rank must hold the bits the others hold.
    per_rank = [[_blocks_rounding_up(rng, wire).reshape(-1).astype(np.float32)] for _ in range(3)]
    per_rank[1] = [x.copy() for x in per_rank[0]]  # parallel updates: the result is close to the input
    results = _combine(3, per_rank, wire)[0]
    assert results[1].tobytes() == results[0].tobytes() and results[2].tobytes() == results[0].tobytes()


@pytest.mark.parametrize("wire", sorted(WIRES))
@pytest.mark.parametrize("n", [2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_collective_matches_reference_within_the_wire_precision(n, wire, rng):
    shapes = [(1,), (2 * n + 1,), (1000,), (3, 5), (4,), (1 << 16,)]
    per_rank = [
        [(rng.standard_normal(s) * 10.0 ** rng.integers(-8, 8)).astype(np.float32) for s in shapes] for _ in range(n)
    ]
    for r in range(n):
        per_rank[r][4] = np.zeros(4, np.float32)
    results = _combine(n, per_rank, wire)
    for t, (per_replica, want) in enumerate(zip(results, reference.adasum_tree(per_rank))):
        assert all(value.tobytes() == per_replica[0].tobytes() for value in per_replica), f"tensor {t}"
        assert per_replica[0].dtype == np.float32
        error = relative_error(per_replica[0], want)
        assert error <= COMPRESSED_TOLERANCE[wire], f"tensor {t}: relative error {error:.3g}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_sixteen_bit_values_travel_unchanged(n, rng):
    dtypes = [np.float16, ml_dtypes.bfloat16, np.float32]
    per_rank = [[rng.standard_normal(300).astype(d) for d in dtypes] for _ in range(n)]
    compressed = _combine(n, per_rank, "float16")
    plain = _combine(n, per_rank, None)
    for t in (0, 1):  # the float16 and bfloat16 tensors: bitwise as without compression
        assert compressed[t][0].tobytes() == plain[t][0].tobytes()
        assert relative_error(compressed[t][0], reference.adasum_tree(per_rank)[t]) <= TOLERANCE["float16"]
    assert compressed[2][0].tobytes() != plain[2][0].tobytes()  # the float32 one was compressed


@pytest.mark.parametrize("combiner, oracle", [("sum", reference.sum_), ("mean", reference.mean)])
def test_sum_and_mean_compressed(combiner, oracle, rng):
    per_rank = [[rng.standard_normal(777).astype(np.float32)] for _ in range(4)]
    result = _combine(4, per_rank, "float16", combiner)[0]
    assert relative_error(result[0], oracle(per_rank)[0]) <= COMPRESSED_TOLERANCE["float16"]


def _train_two_replicas(compression):
    """The weights after 3 Adam steps of a Dense layer on 2 replicas, and the start."""
    x, y = _data(3)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
        initial = [w.numpy() for w in model.weights]
        optimizer = tf_adasum.AdasumOptimizer(Adam().keras(), compression=compression)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert optimizer.engine.compression == compression
    for variable in model.weights:
        values = [v.numpy() for v in strategy.experimental_local_results(variable)]
        assert all(v.tobytes() == values[0].tobytes() for v in values), variable.name
    return [w.numpy() for w in model.weights], initial


@pytest.fixture(scope="module")
def uncompressed_training():
    return _train_two_replicas(None)


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_training_with_compression_matches_the_simulation(wire, uncompressed_training):
    weights, initial = _train_two_replicas(wire)
    x, y = _data(3)
    expected = simulate(initial, x, y, 2, 3, Adam(), reference.adasum_tree)
    plain, plain_initial = uncompressed_training
    for got, want, start, exact, plain_start in zip(weights, expected, initial, plain, plain_initial):
        # The compressed combine is within the wire's tolerance of the exact one, step by step.
        step = np.linalg.norm(want - start)
        assert np.linalg.norm(got - want) <= 3 * COMPRESSED_TOLERANCE[wire] * step
        # And it was compressed: the same run without compression ends elsewhere.
        np.testing.assert_array_equal(plain_start, start)
        assert not np.array_equal(exact, got), "the same weights as without compression"
        assert np.linalg.norm(exact - want) <= TOLERANCE["float32"] * step


def test_the_optimizer_takes_the_cross_device_ops_compression():
    ops = tf_adasum.AdasumCrossDeviceOps(compression="bfloat16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=ops)
    with strategy.scope():
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
        for compression in (None, "bfloat16"):
            optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(), compression=compression)
            optimizer.build(model.trainable_variables)
            assert optimizer.engine.compression == "bfloat16"
        conflicting = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(), compression="float16")
        with pytest.raises(ValueError, match="Received: compression='float16', the cross-device ops' compression="):
            conflicting.build(model.trainable_variables)


def test_compression_setting_is_checked_and_saved():
    for make in (
        lambda value: tf_adasum.AdasumCrossDeviceOps(compression=value),
        lambda value: tf_adasum.AdasumOptimizer(keras.optimizers.SGD(), compression=value),
    ):
        with pytest.raises(ValueError, match=r"`compression` must be one of .* Received: compression='fp16'"):
            make("fp16")
        with pytest.raises(
            TypeError, match=r"`compression` must be a string or None. Received: compression=tf.float16"
        ):
            make(tf.float16)
    optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(), compression="bfloat16")
    restored = tf_adasum.AdasumOptimizer.from_config(optimizer.get_config())
    assert restored.compression == "bfloat16"
