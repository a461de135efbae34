"""The K-step state of `tf_adasum.AdasumOptimizer` (``backward_passes_per_step`` > 1).

Delta mode takes K local inner steps between combines and keeps, per variable,
the weights at the last combine; gradient mode sums the K local gradients and
combines their mean once. Both count local steps in one int64 variable per
replica (saved with the optimizer, so a restored run resumes mid-cycle).
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

__all__ = ["LocalSteps"]


@dataclasses.dataclass
class LocalSteps:
    """Local steps taken, and per variable the weights at the last combine
    (delta mode, K > 1) or the summed local gradients since then (gradient
    mode, K > 1); empty lists otherwise."""

    k: int
    count: tf.Variable
    starts: list = dataclasses.field(default_factory=list)
    accumulators: list = dataclasses.field(default_factory=list)

    @classmethod
    def create(
        cls, optimizer: keras.optimizers.Optimizer, var_list: list, k: int, mode: str, count: tf.Variable
    ) -> LocalSteps:
        """The state of `optimizer` (a Keras optimizer being built) for `var_list`."""
        copies = lambda name: [optimizer.add_variable_from_reference(v, name=name) for v in var_list]  # noqa: E731
        return cls(
            k=k,
            count=count,
            starts=copies("adasum_start") if k > 1 and mode == "delta" else [],
            accumulators=copies("adasum_accumulator") if k > 1 and mode == "gradient" else [],
        )

    def is_first(self) -> tf.Tensor:
        """Whether the coming local step is the first of a cycle of K."""
        return tf.equal(self.count % self.k, 0)

    def is_last(self) -> tf.Tensor:
        """Whether the coming local step is the last of a cycle of K (then combine)."""
        return tf.equal((self.count + 1) % self.k, 0)
