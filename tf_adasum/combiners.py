"""Combiners: how the replicas' tensors are combined, all through one collective.

A combiner is a small object validated at construction and serialised with
``get_config``. ``"adasum"`` is the default; ``"sum"`` and ``"mean"`` are the
baselines, run through the same vector-halving machinery so that comparisons
measure the rule, not the transport.

Example:
  >>> from tf_adasum import combiners
  >>> combiners.get("adasum")
  Adasum()
  >>> combiners.get({"class_name": "Mean", "config": {}})
  Mean()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tf_adasum import ops
from tf_adasum.ops import Segments

__all__ = ["Adasum", "Combiner", "Mean", "Sum", "get", "serialize"]


class Combiner:
    """Base class: a pair rule for `tf_adasum.rvh` plus its configuration."""

    #: The name accepted by `get`.
    name: str = ""

    def prepare(self, flat: tf.Tensor, num_ranks: int) -> tf.Tensor:
        """Applied to each rank's fused buffer before the tree; identity by default."""
        return flat

    def combine(
        self,
        x: tf.Tensor,
        segments: Segments,
        sum_partials: Callable[[tf.Tensor], tf.Tensor],
    ) -> tf.Tensor:
        """Combines ``x = [a; b]`` (``[2, m]``, left subtree first); see `tf_adasum.rvh.PairRule`."""
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Combiner:
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.get_config().items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class Adasum(Combiner):
    """Adasum: ``(1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b`` per tensor, as a tree.

    Dot products are accumulated in float64 (see `tf_adasum.ops`).
    """

    name = "adasum"

    def combine(self, x, segments, sum_partials):
        c_a, c_b = ops.coefficients(sum_partials(ops.partial_dots(x, segments)))
        return ops.scaled_sum(x, c_a, c_b, segments)


class Sum(Combiner):
    """The plain sum over replicas (each level adds in the tensors' dtype)."""

    name = "sum"

    def combine(self, x, segments, sum_partials):
        return x[0] + x[1]


class Mean(Sum):
    """The plain mean, sum / N: each replica's values are first scaled by 1/N
    (in float64, cast back), then summed, so no weighting depends on the tree."""

    name = "mean"

    def prepare(self, flat, num_ranks):
        if num_ranks == 1:
            return flat
        return tf.cast(tf.cast(flat, tf.float64) * (1.0 / num_ranks), flat.dtype)


_BY_NAME = {cls.name: cls for cls in (Adasum, Sum, Mean)}
_BY_CLASS_NAME = {cls.__name__: cls for cls in (Adasum, Sum, Mean)}


def register(cls: type[Combiner]) -> type[Combiner]:
    """Makes a combiner class known to `get` by its `name` and class name."""
    _BY_NAME[cls.name] = cls
    _BY_CLASS_NAME[cls.__name__] = cls
    return cls


def serialize(combiner: Combiner) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}`` for `get` to rebuild it."""
    return {"class_name": type(combiner).__name__, "config": combiner.get_config()}


def get(identifier: str | dict | Combiner) -> Combiner:
    """Returns a combiner from a name, a serialised dict or a combiner object.

    Raises:
      ValueError: an unknown name.
      TypeError: anything else.
    """
    if isinstance(identifier, Combiner):
        return identifier
    if isinstance(identifier, str):
        if identifier not in _BY_NAME:
            raise ValueError(
                f"Unknown `combiner`. Expected one of {sorted(_BY_NAME)} or a "
                f"`tf_adasum.combiners` object. Received: combiner={identifier!r}"
            )
        return _BY_NAME[identifier]()
    if isinstance(identifier, dict) and set(identifier) >= {"class_name", "config"}:
        class_name = identifier["class_name"]
        if class_name not in _BY_CLASS_NAME:
            raise ValueError(
                f"Unknown `combiner` class. Expected one of {sorted(_BY_CLASS_NAME)}. "
                f"Received: class_name={class_name!r}"
            )
        return _BY_CLASS_NAME[class_name].from_config(identifier["config"])
    raise TypeError(
        "`combiner` must be a name, a serialised combiner dict or a `tf_adasum.combiners` "
        f"object. Received: combiner={identifier!r} of type {type(identifier).__name__}"
    )
