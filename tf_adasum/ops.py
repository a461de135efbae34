"""TensorFlow math of Adasum: float64 partial dots, coefficients, scaled sums.

These functions work on flat (1-D) slices of fused buffers. A slice may hold
pieces of several tensors; `Segments` says which tensor each element belongs
to, so that every dot product stays per tensor.

Precision: whatever the input dtype (float16, bfloat16, float32, float64),
elements are cast to float64 before they are multiplied, partial sums are
accumulated in float64, coefficients are float64, and the scaled sum
``c_a * a + c_b * b`` is computed in float64 and cast back to the input dtype
once. float32 inputs of magnitude 1e20 or 1e-25, whose squares overflow or
underflow float32, are therefore handled exactly as in `tf_adasum.reference`.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_adasum.reference import NORM_GUARD

#: The floating dtypes Adasum accepts.
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

__all__ = [
    "FLOAT_DTYPES",
    "Segments",
    "adasum_pair",
    "check_float_dtype",
    "coefficients",
    "partial_dots",
    "scaled_sum",
]


def check_float_dtype(dtype: tf.DType, name: str) -> None:
    """Raises `TypeError` naming `name` unless `dtype` is a float Adasum accepts."""
    if tf.as_dtype(dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"`{name}` must have a floating dtype (float16, bfloat16, float32 or float64). "
            f"Received: {name}.dtype={tf.as_dtype(dtype).name}"
        )


@dataclasses.dataclass(frozen=True)
class Segments:
    """Which tensors a flat slice holds: tensor ``first + i`` has ``counts[i]`` elements.

    Attributes:
      first: the index (within its bucket) of the first tensor in the slice.
      counts: the number of elements of each consecutive tensor in the slice.
      num_tensors: the number of tensors in the whole bucket; partial sums are
        returned for all of them (zeros for tensors outside the slice) so that
        ranks holding different slices can sum them elementwise.
    """

    first: int
    counts: tuple[int, ...]
    num_tensors: int

    @classmethod
    def single(cls, index: int = 0, num_tensors: int = 1) -> "Segments":
        """A slice that lies entirely inside tensor `index` (its length need not be static)."""
        return cls(first=index, counts=(-1,), num_tensors=num_tensors)

    def _ids(self) -> tf.Tensor:
        return tf.repeat(tf.range(self.first, self.first + len(self.counts)), self.counts)

    def expand(self, per_tensor: tf.Tensor) -> tf.Tensor:
        """Broadcasts a per-tensor vector ``[num_tensors]`` to the slice's elements."""
        if len(self.counts) == 1:
            return per_tensor[self.first]
        return tf.repeat(per_tensor[self.first : self.first + len(self.counts)], self.counts)

    def sum(self, x: tf.Tensor) -> tf.Tensor:
        """Sums a float64 vector of the slice's length per tensor; returns ``[num_tensors]``."""
        if len(self.counts) == 1:
            total = tf.reduce_sum(x)[tf.newaxis]
            return tf.pad(total, [[self.first, self.num_tensors - self.first - 1]])
        return tf.math.unsorted_segment_sum(x, self._ids(), self.num_tensors)


def partial_dots(a: tf.Tensor, b: tf.Tensor, segments: Segments) -> tf.Tensor:
    """Per-tensor partial sums ``[a.b, |a|^2, |b|^2]`` over a slice, in float64.

    Args:
      a: flat slice of the left operand (any accepted float dtype).
      b: flat slice of the right operand, same dtype and length.
      segments: the tensors the slice holds.

    Returns:
      A float64 tensor of shape ``[num_tensors, 3]``.
    """
    a64 = tf.cast(a, tf.float64)
    b64 = tf.cast(b, tf.float64)
    return tf.stack(
        [segments.sum(a64 * b64), segments.sum(a64 * a64), segments.sum(b64 * b64)], axis=1
    )


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


def scaled_sum(
    a: tf.Tensor, b: tf.Tensor, c_a: tf.Tensor, c_b: tf.Tensor, segments: Segments
) -> tf.Tensor:
    """``c_a * a + c_b * b`` per tensor, computed in float64, cast to ``a.dtype``."""
    out = segments.expand(c_a) * tf.cast(a, tf.float64) + segments.expand(c_b) * tf.cast(b, tf.float64)
    return tf.cast(out, a.dtype)


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
    a_flat = tf.reshape(a, [-1])
    b_flat = tf.reshape(b, [-1])
    segments = Segments.single()
    c_a, c_b = coefficients(partial_dots(a_flat, b_flat, segments))
    return tf.reshape(scaled_sum(a_flat, b_flat, c_a, c_b, segments), tf.shape(a))
