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

from typing import Any

import tensorflow as tf

from tf_adasum import ops
from tf_adasum.ops import Segments

__all__ = ["AdaCons", "Adasum", "Combiner", "Mean", "Sum", "get", "register", "serialize"]


class Combiner:
    """Base class: a pair rule for `tf_adasum.tree.rvh` plus its configuration."""

    #: The name accepted by `get`.
    name: str = ""
    #: Whether the combiner is a pair rule of the tree (AdaCons is not).
    pairwise: bool = True

    def prepare(self, flat: tf.Tensor, num_ranks: int) -> tf.Tensor:
        """Applied to each rank's fused buffer before the tree; identity by default."""
        return flat

    def partials(self, a: tf.Tensor, b: tf.Tensor, segments: Segments) -> tf.Tensor | None:
        """The float64 partials the rule needs summed over the ranks of the two
        subtrees (None by default); see `tf_adasum.tree.rvh.PairRule`."""
        return None

    def combine(self, a: tf.Tensor, b: tf.Tensor, segments: Segments, partials: tf.Tensor | None) -> tf.Tensor:
        """Combines the slices `a` (left subtree) and `b` (right) given the summed
        `partials`; see `tf_adasum.tree.rvh.PairRule`."""
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

    def partials(self, a, b, segments):
        return ops.partial_dots(a, b, segments)

    def combine(self, a, b, segments, partials):
        c_a, c_b = ops.coefficients(partials)
        return ops.scaled_sum(a, b, c_a, c_b, segments)


class Sum(Combiner):
    """The plain sum over replicas (each level adds in the tensors' dtype)."""

    name = "sum"

    def combine(self, a, b, segments, partials):
        return a + b


class Mean(Sum):
    """The plain mean, sum / N: each replica's values are first scaled by 1/N
    (in float64, cast back), then summed, so no weighting depends on the tree."""

    name = "mean"

    def prepare(self, flat, num_ranks):
        if num_ranks == 1:
            return flat
        return tf.cast(tf.cast(flat, tf.float64) * (1.0 / num_ranks), flat.dtype)


class AdaCons(Combiner):
    """AdaCons, adaptive consensus (Choukroun, Azoulay, Kisilev 2024, arXiv:2411.03742).

    Each replica's update is weighted by how much it agrees with the sum of all
    updates, with a "subspace momentum" on the sorted weights; see
    `tf_adasum.reference.adacons` for the exact rule. Not a pair rule: it runs
    through `tf_adasum.AdasumOptimizer`, which keeps its state (the momentum,
    identical on every replica and saved in checkpoints) and uses two SUM
    all-reduces of the vector-halving collective plus a gather of N scalars.

    Args:
      momentum: the subspace momentum beta in [0, 1) (the authors' demo: 0.99).
      restore_magnitude: rescale the result to the norm of the mean update.
        None (default): False in gradient mode (the paper), True in delta mode,
        where a unit-norm delta would be meaningless.
      per_tensor: one set of weights per tensor instead of one for the model.
    """

    name = "adacons"
    pairwise = False

    def __init__(self, momentum: float = 0.0, restore_magnitude: bool | None = None, per_tensor: bool = False):
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)):
            raise TypeError(f"`momentum` must be a float. Received: momentum={momentum!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"`momentum` must be in [0, 1). Received: momentum={momentum}")
        if restore_magnitude is not None and not isinstance(restore_magnitude, bool):
            raise TypeError(
                f"`restore_magnitude` must be None or a bool. Received: restore_magnitude={restore_magnitude!r}"
            )
        if not isinstance(per_tensor, bool):
            raise TypeError(f"`per_tensor` must be a bool. Received: per_tensor={per_tensor!r}")
        self.momentum = float(momentum)
        self.restore_magnitude = restore_magnitude
        self.per_tensor = per_tensor

    def combine(self, a, b, segments, partials):
        raise TypeError("AdaCons is not a pair rule of the Adasum tree; use it through tf_adasum.AdasumOptimizer.")

    def get_config(self):
        return {"momentum": self.momentum, "restore_magnitude": self.restore_magnitude, "per_tensor": self.per_tensor}


_BY_NAME = {cls.name: cls for cls in (Adasum, Sum, Mean, AdaCons)}
_BY_CLASS_NAME = {cls.__name__: cls for cls in (Adasum, Sum, Mean, AdaCons)}


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
