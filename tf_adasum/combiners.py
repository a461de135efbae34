"""Combiners: how the replicas' tensors are combined, all through one collective.

A combiner is a small object validated at construction and serialised with
``get_config``. ``"adasum"`` is the default; ``"sum"`` and ``"mean"`` are the
baselines, run through the same vector-halving machinery so that comparisons
measure the rule, not the transport; ``"adacons"`` is AdaCons (`AdaCons`).

Examples:
  >>> from tf_adasum import combiners
  >>> combiners.get("adasum")
  Adasum()
  >>> combiners.get({"class_name": "Mean", "config": {}})
  Mean()
  >>> combiners.serialize(combiners.AdaCons(momentum=0.99))
  {'class_name': 'AdaCons', 'config': {'momentum': 0.99, 'restore_magnitude': None, 'per_tensor': False}}
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_adasum import ops
from tf_adasum.ops import Segments

__all__ = ["AdaCons", "Adasum", "Combiner", "Mean", "Sum", "get", "register", "serialize"]


class Combiner:
    """Base class: a pair rule for `tf_adasum.tree.rvh` plus its configuration.

    A subclass sets `name`, implements `combine` (and `partials` when the rule
    needs sums over the ranks, as Adasum's dot products), and returns its
    settings from `get_config`; `register` makes it known by name.

    Examples:
      A pair rule with a setting: ``left * a + (1 - left) * b``.

      >>> from tf_adasum import combiners
      >>> class Blend(combiners.Combiner):
      ...     name = "blend"
      ...     def __init__(self, left=0.5):
      ...         self.left = left
      ...     def combine(self, a, b, segments, partials):
      ...         return self.left * a + (1.0 - self.left) * b
      ...     def get_config(self):
      ...         return {"left": self.left}
      >>> Blend(0.75)
      Blend(left=0.75)
      >>> Blend(0.75) == Blend.from_config({"left": 0.75})
      True
    """

    #: The name accepted by `get`.
    name: str = ""
    #: Whether the combiner is a pair rule of the tree (AdaCons is not).
    pairwise: bool = True

    def prepare(self, flat: tf.Tensor, num_ranks: int) -> tf.Tensor:
        """Applied to each rank's fused buffer before the tree; identity by default.

        Examples:
          >>> import tensorflow as tf
          >>> from tf_adasum import combiners
          >>> flat = tf.constant([2.0, 4.0])
          >>> combiners.Adasum().prepare(flat, num_ranks=2) is flat
          True
          >>> combiners.Mean().prepare(flat, num_ranks=2).numpy()  # the mean scales by 1/N first
          array([1., 2.], dtype=float32)
        """
        return flat

    def partials(self, a: tf.Tensor, b: tf.Tensor, segments: Segments) -> tf.Tensor | None:
        """The float64 partials the rule needs summed over the ranks of the two
        subtrees (None by default); see `tf_adasum.tree.rvh.PairRule`.

        Examples:
          A rule that needs no sums (Adasum's are its dot products):

          >>> import tensorflow as tf
          >>> from tf_adasum import combiners
          >>> print(combiners.Sum().partials(tf.constant([1.0]), tf.constant([2.0]), segments=None))
          None
        """
        return None

    def combine(self, a: tf.Tensor, b: tf.Tensor, segments: Segments, partials: tf.Tensor | None) -> tf.Tensor:
        """Combines the slices `a` (left subtree) and `b` (right) given the summed
        `partials`; see `tf_adasum.tree.rvh.PairRule`.

        Examples:
          >>> import tensorflow as tf
          >>> from tf_adasum import combiners
          >>> a, b = tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])
          >>> combiners.Sum().combine(a, b, segments=None, partials=None).numpy()
          array([4., 6.], dtype=float32)
        """
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

    Examples:
      The default combiner of `tf_adasum.AdasumOptimizer`, also by its name:

      >>> import keras
      >>> import tf_adasum
      >>> from tf_adasum import combiners
      >>> optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1))
      >>> optimizer.combiner
      Adasum()
      >>> optimizer.combiner == combiners.get("adasum") == combiners.Adasum()
      True
    """

    name = "adasum"

    def partials(self, a, b, segments):
        return ops.partial_dots(a, b, segments)

    def combine(self, a, b, segments, partials):
        c_a, c_b = ops.coefficients(partials)
        return ops.scaled_sum(a, b, c_a, c_b, segments)


class Sum(Combiner):
    """The plain sum over replicas (each level adds in the tensors' dtype).

    Examples:
      >>> import tensorflow as tf
      >>> from tf_adasum import combiners
      >>> a, b = tf.constant([1.0, 2.0]), tf.constant([3.0, 4.0])
      >>> combiners.Sum().combine(a, b, segments=None, partials=None).numpy()
      array([4., 6.], dtype=float32)
    """

    name = "sum"

    def combine(self, a, b, segments, partials):
        return a + b


class Mean(Sum):
    """The plain mean, sum / N: each replica's values are first scaled by 1/N
    (in float64, cast back), then summed, so no weighting depends on the tree.

    Examples:
      Each of 2 replicas' values before the tree:

      >>> import tensorflow as tf
      >>> from tf_adasum import combiners
      >>> combiners.Mean().prepare(tf.constant([2.0, 4.0]), num_ranks=2).numpy()
      array([1., 2.], dtype=float32)
    """

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

    Examples:
      >>> import keras
      >>> import tf_adasum
      >>> from tf_adasum import combiners
      >>> adacons = combiners.AdaCons(momentum=0.99)
      >>> adacons
      AdaCons(momentum=0.99, restore_magnitude=None, per_tensor=False)
      >>> optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1), combiner=adacons, mode="gradient")
      >>> optimizer.combiner is adacons
      True
      >>> combiners.get("adacons")  # by name: the defaults
      AdaCons(momentum=0.0, restore_magnitude=None, per_tensor=False)
      >>> combiners.AdaCons(momentum=1.5)
      Traceback (most recent call last):
      ...
      ValueError: `momentum` must be in [0, 1). Received: momentum=1.5
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
    """Makes a combiner class known to `get` by its `name` and class name.

    Returns the class, so it serves as a decorator. Register a class before
    loading a model or optimizer config that names it.

    Examples:
      >>> import tensorflow as tf
      >>> from tf_adasum import combiners
      >>> @combiners.register
      ... class Larger(combiners.Combiner):
      ...     name = "larger"
      ...     def combine(self, a, b, segments, partials):
      ...         return tf.maximum(a, b)
      >>> combiners.get("larger")
      Larger()
      >>> combiners.get({"class_name": "Larger", "config": {}})
      Larger()
    """
    _BY_NAME[cls.name] = cls
    _BY_CLASS_NAME[cls.__name__] = cls
    return cls


def serialize(combiner: Combiner) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}`` for `get` to rebuild it.

    Examples:
      >>> from tf_adasum import combiners
      >>> config = combiners.serialize(combiners.AdaCons(momentum=0.9, per_tensor=True))
      >>> config
      {'class_name': 'AdaCons', 'config': {'momentum': 0.9, 'restore_magnitude': None, 'per_tensor': True}}
      >>> combiners.get(config)
      AdaCons(momentum=0.9, restore_magnitude=None, per_tensor=True)
    """
    return {"class_name": type(combiner).__name__, "config": combiner.get_config()}


def get(identifier: str | dict | Combiner) -> Combiner:
    """Returns a combiner from a name, a serialised dict or a combiner object.

    Raises:
      ValueError: an unknown name.
      TypeError: anything else.

    Examples:
      >>> from tf_adasum import combiners
      >>> combiners.get("mean")
      Mean()
      >>> combiners.get({"class_name": "AdaCons", "config": {"momentum": 0.5}})
      AdaCons(momentum=0.5, restore_magnitude=None, per_tensor=False)
      >>> adasum = combiners.Adasum()
      >>> combiners.get(adasum) is adasum
      True
      >>> combiners.get("median")
      Traceback (most recent call last):
      ...
      ValueError: Unknown `combiner`. Expected one of ['adacons', 'adasum', 'mean', 'sum'] or a
      `tf_adasum.combiners` object. Received: combiner='median'
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
