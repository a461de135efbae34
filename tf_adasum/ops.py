"""TensorFlow math of Adasum: float64 partial dots, coefficients, scaled sums.

These functions work on the same slice of two fused buffers, given as two
``[m]`` tensors (``a`` of the left operand, ``b`` of the right). A slice may
hold pieces of several tensors, in whole blocks of `BLOCK` elements;
`Segments` says which tensor each block belongs to, so that every dot product
stays per tensor.

Precision: whatever the input dtype (float16, bfloat16, float32, float64),
elements are cast to float64 before they are multiplied, partial sums are
accumulated in float64, coefficients are float64, and the scaled sum
``c_a * a + c_b * b`` is computed in float64 and cast back to the input dtype
once. float32 inputs of magnitude 1e20 or 1e-25, whose squares overflow or
underflow float32, are therefore handled exactly as in `tf_adasum.reference`.

Kernels: on CPUs, `partial_dots` and `scaled_sum` run native kernels
(``tf_adasum/native/adasum_cpu_ops.cc``, built on first use by
`tf_adasum.native.build`): one pass over the slice, AVX2 where the CPU has
it, spread over the intra-op threads. Elsewhere (GPUs), with
``TF_ADASUM_CPU_KERNELS=0``, or where the library cannot be built (one
warning per process), they run as XLA-compiled TensorFlow ops (plain ops for
small slices). The two differ in the order of the float64 additions (and
XLA may fuse a multiply-add). `adasum_pair` always runs TensorFlow's ops
(differentiable, XLA-compilable).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import warnings

import tensorflow as tf

from tf_adasum.native import build as native_build
from tf_adasum.reference import NORM_GUARD

#: The floating dtypes Adasum accepts.
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

__all__ = [
    "BLOCK",
    "FLOAT_DTYPES",
    "Segments",
    "adasum_pair",
    "check_float_dtype",
    "coefficients",
    "cpu_kernels",
    "partial_dots",
    "scale_and_check",
    "scaled_sum",
]


def check_float_dtype(dtype: tf.DType, name: str) -> None:
    """Raises `TypeError` naming `name` unless `dtype` is a float Adasum accepts."""
    if tf.as_dtype(dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"`{name}` must have a floating dtype (float16, bfloat16, float32 or float64). "
            f"Received: {name}.dtype={tf.as_dtype(dtype).name}"
        )


#: Fused buffers are laid out in blocks of this many elements; a block never
#: holds two tensors, so per-tensor sums are a regular reduction over each
#: block followed by a small sum over the blocks of each tensor.
BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Segments:
    """Which tensors a slice of a fused buffer holds, block by block.

    Tensor ``first + i`` owns ``counts[i]`` consecutive blocks of `BLOCK`
    elements. A count of -1 (see `single`) means the whole slice, of any
    length, belongs to tensor `first`.

    Attributes:
      first: the index (within its bucket) of the first tensor in the slice.
      counts: the number of blocks of each consecutive tensor in the slice.
      num_tensors: the number of tensors in the whole bucket; partial sums are
        returned for all of them (zeros for tensors outside the slice) so that
        ranks holding different slices can sum them elementwise.
    """

    first: int
    counts: tuple[int, ...]
    num_tensors: int

    @classmethod
    def single(cls, index: int = 0, num_tensors: int = 1) -> Segments:
        """A slice that lies entirely inside tensor `index`."""
        return cls(first=index, counts=(-1,), num_tensors=num_tensors)

    def block_ids(self, num_blocks: tf.Tensor | int) -> tf.Tensor:
        """The tensor index of each of the slice's `num_blocks` blocks (int32)."""
        if self.counts == (-1,):
            return tf.fill([num_blocks], self.first)
        return tf.repeat(tf.range(self.first, self.first + len(self.counts)), self.counts)


#: Slices of at least this many elements run the two float64 kernels below
#: XLA-compiled: fused, they read the input once and materialise no float64
#: copy (3-4x faster on large buffers). Smaller slices run them as plain ops,
#: which costs no compilation.
XLA_MIN_ELEMENTS = 1 << 16


def _blocks(x: tf.Tensor) -> tf.Tensor:
    """``[m]`` (m a multiple of `BLOCK`) as float64 ``[m / BLOCK, BLOCK]``."""
    return tf.reshape(tf.cast(x, tf.float64), [-1, BLOCK])


def _partial_dots_kernel(a: tf.Tensor, b: tf.Tensor, block_ids: tf.Tensor, num_tensors: int) -> tf.Tensor:
    a, b = _blocks(a), _blocks(b)
    # Each block's sums as a float64 matrix-vector product with ones: XLA's CPU
    # backend vectorises a dot, not a reduction over short rows (measured
    # 2026-12-01, [2, 2^21] float32 on an AVX2 EPYC: 3.0 ms against 31.7 ms).
    ones = tf.ones([BLOCK, 1], tf.float64)
    per_block = tf.concat([tf.matmul(a * b, ones), tf.matmul(a * a, ones), tf.matmul(b * b, ones)], axis=1)
    return tf.math.unsorted_segment_sum(per_block, block_ids, num_tensors)


def _scaled_sum_kernel(a: tf.Tensor, b: tf.Tensor, c_a: tf.Tensor, c_b: tf.Tensor, block_ids: tf.Tensor) -> tf.Tensor:
    out = tf.gather(c_a, block_ids)[:, tf.newaxis] * _blocks(a) + tf.gather(c_b, block_ids)[:, tf.newaxis] * _blocks(b)
    return tf.cast(tf.reshape(out, [-1]), a.dtype)


_xla_partial_dots = tf.function(_partial_dots_kernel, jit_compile=True, autograph=False)
_xla_scaled_sum = tf.function(_scaled_sum_kernel, jit_compile=True, autograph=False)


def _use_xla(a: tf.Tensor) -> bool:
    return a.shape[0] is not None and a.shape[0] >= XLA_MIN_ELEMENTS


def _tf_partial_dots(a: tf.Tensor, b: tf.Tensor, segments: Segments) -> tf.Tensor:
    block_ids = segments.block_ids(tf.shape(a)[0] // BLOCK)
    kernel = _xla_partial_dots if _use_xla(a) else _partial_dots_kernel
    return kernel(a, b, block_ids, segments.num_tensors)


def _tf_scaled_sum(a: tf.Tensor, b: tf.Tensor, c_a: tf.Tensor, c_b: tf.Tensor, segments: Segments) -> tf.Tensor:
    block_ids = segments.block_ids(tf.shape(a)[0] // BLOCK)
    kernel = _xla_scaled_sum if _use_xla(a) else _scaled_sum_kernel
    return kernel(a, b, c_a, c_b, block_ids)


_cpu_lock = threading.Lock()
_cpu_loaded: list = []  # [module or None] once the library was looked for
_sees_gpu: list = []  # [whether this process has a logical GPU], once asked


def cpu_kernels():
    """The native CPU kernels' op module, built and loaded once per process
    (``TF_ADASUM_CPU_KERNELS`` is read then); None with
    ``TF_ADASUM_CPU_KERNELS=0``, or (with one `RuntimeWarning` per process
    naming the cause) where the library cannot be built or loaded."""
    with _cpu_lock:
        if not _cpu_loaded:
            if os.environ.get("TF_ADASUM_CPU_KERNELS", "1").strip() == "0":
                _cpu_loaded.append(None)
                return None
            module, _, reason = native_build.load(native_build.build_cpu_kernels)
            if module is None:
                warnings.warn(
                    f"tf_adasum: the native CPU kernels are unavailable: {reason}. Adasum's arithmetic "
                    "on CPUs uses XLA-compiled TensorFlow ops (slower).",
                    RuntimeWarning,
                    stacklevel=3,
                )
            _cpu_loaded.append(module)
        return _cpu_loaded[0]


def native_for(x: tf.Tensor):
    """The native kernels' module when `x` is on a CPU (or, placed nowhere
    yet, when this process sees no GPU) and they are available; else None."""
    device_type = tf.DeviceSpec.from_string(x.device or "").device_type
    if device_type is None:
        if not _sees_gpu:
            _sees_gpu.append(bool(tf.config.list_logical_devices("GPU")))
        on_cpu = not _sees_gpu[0]
    else:
        on_cpu = device_type.upper() == "CPU"
    return cpu_kernels() if on_cpu else None


def partial_dots(a: tf.Tensor, b: tf.Tensor, segments: Segments) -> tf.Tensor:
    """Per-tensor partial sums ``[a.b, |a|^2, |b|^2]`` over a slice, in float64.

    Args:
      a: ``[m]``, the slice of the left operand (any accepted float dtype; m a
        multiple of `BLOCK`).
      b: ``[m]``, the same slice of the right operand (the dtype of `a`).
      segments: the tensors the slice holds.

    Returns:
      A float64 tensor of shape ``[num_tensors, 3]``.
    """
    native = native_for(a)
    if native is not None:
        return native.tf_adasum_partial_dots(
            a, b, first=segments.first, counts=list(segments.counts), num_tensors=segments.num_tensors
        )
    return _tf_partial_dots(a, b, segments)


def coefficients(partials: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Adasum coefficients from float64 partials ``[..., 3]`` = [a.b, |a|^2, |b|^2].

    Returns:
      ``(c_a, c_b)`` in float64 with ``c_a = 1 - a.b / (2 |a|^2)`` (exactly 1
      when ``|a|^2 < sqrt(DBL_MIN)``), likewise ``c_b``. No epsilon.
    """
    dot, a_norm_sq, b_norm_sq = tf.unstack(partials, num=3, axis=-1)
    one = tf.ones_like(dot)
    c_a = tf.where(a_norm_sq < NORM_GUARD, one, one - dot / (2.0 * a_norm_sq))
    c_b = tf.where(b_norm_sq < NORM_GUARD, one, one - dot / (2.0 * b_norm_sq))
    return c_a, c_b


def scaled_sum(a: tf.Tensor, b: tf.Tensor, c_a: tf.Tensor, c_b: tf.Tensor, segments: Segments) -> tf.Tensor:
    """``c_a * a + c_b * b`` per tensor for two ``[m]`` slices, computed in float64
    and cast to ``a.dtype``; returns ``[m]``."""
    native = native_for(a)
    if native is not None:
        out = native.tf_adasum_scaled_sum(
            a, b, c_a, c_b, first=segments.first, counts=list(segments.counts), num_tensors=segments.num_tensors
        )
        out.set_shape(a.shape)
        return out
    return _tf_scaled_sum(a, b, c_a, c_b, segments)


def scale_and_check(x: tf.Tensor, scale) -> tuple[tf.Tensor, tf.Tensor]:
    """``x * scale`` (rounded in ``x.dtype``, as `tf.multiply` rounds it) and
    whether every element of it is finite (a bool scalar); on CPUs in one
    native pass over `x`."""
    x = tf.convert_to_tensor(x)
    scale = tf.cast(scale, x.dtype)
    native = native_for(x)
    if native is not None:
        return native.tf_adasum_scale_and_check(x, scale)
    y = x * scale
    return y, tf.reduce_all(tf.math.is_finite(y))


def adasum_pair(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """Adasum of two tensors of the same shape and floating dtype, as a TF op.

    The same semantics as `tf_adasum.reference.adasum_pair`: dot products
    accumulated in float64, coefficients in float64, exactly 1 below the
    sqrt(DBL_MIN) guard, one cast to the input dtype at the end.

    Args:
      a: the left operand: float16, bfloat16, float32 or float64.
      b: the right operand, same shape and dtype as `a`.

    Returns:
      ``Adasum(a, b)`` with the shape and dtype of `a`.

    Raises:
      TypeError: a non-float dtype, or `a` and `b` of different dtypes.
      ValueError: `a` and `b` of different shapes.

    Examples:
      >>> import tensorflow as tf
      >>> import tf_adasum
      >>> tf_adasum.adasum_pair(tf.constant([1.0, 0.0]), tf.constant([0.0, 2.0])).numpy()  # orthogonal: the sum
      array([1., 2.], dtype=float32)
      >>> tf_adasum.adasum_pair(tf.constant([3.0, 4.0]), tf.constant([3.0, 4.0])).numpy()  # identical: the average
      array([3., 4.], dtype=float32)
      >>> a = tf.constant([[1.0, 0.0], [0.0, 0.0]], tf.float16)
      >>> b = tf.constant([[1.0, 1.0], [0.0, 0.0]], tf.float16)
      >>> tf_adasum.adasum_pair(a, b).numpy()  # 0.5 a + 0.75 b, computed in float64
      array([[1.25, 0.75],
             [0.  , 0.  ]], dtype=float16)
    """
    a = tf.convert_to_tensor(a)
    b = tf.convert_to_tensor(b)
    check_float_dtype(a.dtype, "a")
    check_float_dtype(b.dtype, "b")
    if a.dtype != b.dtype:
        raise TypeError(
            f"`a` and `b` must have the same dtype. Received: a.dtype={a.dtype.name}, b.dtype={b.dtype.name}"
        )
    if not a.shape.is_compatible_with(b.shape):
        raise ValueError(f"`a` and `b` must have the same shape. Received: a.shape={a.shape}, b.shape={b.shape}")
    size = tf.size(a)
    flat_a, flat_b = (tf.pad(tf.reshape(x, [-1]), [[0, -size % BLOCK]]) for x in (a, b))  # zeros add nothing
    # TensorFlow's kernels, never the native ones: this op stays differentiable
    # and compiles under jit_compile=True.
    segments = Segments.single()
    c_a, c_b = coefficients(_tf_partial_dots(flat_a, flat_b, segments))
    return tf.reshape(_tf_scaled_sum(flat_a, flat_b, c_a, c_b, segments)[:size], tf.shape(a))
