"""The step's settings, checked once at construction, and the inner optimizer's checks.

`StepSettings.create` validates what `tf_adasum.AdasumOptimizer` and
`tf_adasum.SimulatedReplicas` share (the combiner, the mode, the local steps per
combine and the engine's options) and returns one frozen object; nothing
downstream checks them again. Each error names the argument and the value
received (`TypeError` for a wrong type, `ValueError` for a wrong value), before
anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from tf_adasum import combiners as combiners_lib
from tf_adasum.comm import compression as compression_lib
from tf_adasum.engines import select

__all__ = ["MODES", "Setting", "StepSettings", "check_bool", "check_inner"]

MODES = ("delta", "gradient")


def check_bool(name: str, value: Any) -> None:
    """Raises TypeError naming `name` unless `value` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool. Received: {name}={value!r}")


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What one training step does; build it with `create`, which checks it.

    Attributes:
      combiner: the combiner object (`tf_adasum.combiners`).
      mode: ``"delta"`` (combine the local updates) or ``"gradient"`` (combine
        the local gradients).
      backward_passes_per_step: K >= 1 local steps (delta) or averaged
        gradients (gradient mode) per combine.
      hierarchical: average each worker's replicas first (pair rules only).
      backend: the engine asked for (`tf_adasum.engines.select.BACKENDS`).
      compression: the wire format (`tf_adasum.comm.compression`), or None.
    """

    combiner: combiners_lib.Combiner
    mode: str
    backward_passes_per_step: int
    hierarchical: bool
    backend: str
    compression: str | None

    @classmethod
    def create(
        cls,
        *,
        combiner: str | dict | combiners_lib.Combiner = "adasum",
        mode: str = "delta",
        backward_passes_per_step: int = 1,
        hierarchical: bool = False,
        backend: str = "auto",
        compression: str | None = None,
    ) -> StepSettings:
        """The settings, each argument checked (the combiner resolved by
        `tf_adasum.combiners.get`)."""
        combiner = combiners_lib.get(combiner)
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
            raise TypeError(
                "`backward_passes_per_step` must be an int. "
                f"Received: backward_passes_per_step={backward_passes_per_step!r}"
            )
        if backward_passes_per_step < 1:
            raise ValueError(
                "`backward_passes_per_step` must be >= 1. "
                f"Received: backward_passes_per_step={backward_passes_per_step}"
            )
        check_bool("hierarchical", hierarchical)
        if hierarchical and not combiner.pairwise:
            raise ValueError(
                f"`hierarchical=True` is not supported with {combiner!r}: its weights compare every replica "
                "with the consensus. Received: hierarchical=True"
            )
        if backend not in select.BACKENDS:
            raise ValueError(f"`backend` must be one of {select.BACKENDS}. Received: backend={backend!r}")
        compression_lib.check_compression(compression)
        return cls(combiner, mode, backward_passes_per_step, hierarchical, backend, compression)

    @property
    def local_steps_per_combine(self) -> int:
        """Inner steps between two combines: K in delta mode, 1 in gradient mode."""
        return self.backward_passes_per_step if self.mode == "delta" else 1


class Setting:
    """A read-only attribute of a class holding a `StepSettings` as ``_settings``:
    ``combiner = Setting()`` reads ``self._settings.combiner``, so the owner
    sets ``_settings`` first in its constructor, before anything reads one.
    Settings are fixed at construction (they were checked then)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return getattr(instance._settings, self.name)

    def __set__(self, instance: Any, value: Any) -> None:
        raise AttributeError(f"`{self.name}` is fixed at construction. Received: {self.name}={value!r}")


def check_inner(inner) -> None:
    """The inner optimizer (the wrapper refuses itself as inner before calling this)."""
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` must not be a LossScaleOptimizer: put it outside, "
            "LossScaleOptimizer(AdasumOptimizer(inner)), so that the loss scale applies to the "
            "combined step (model.compile does this itself under the mixed_float16 policy). "
            f"Received: inner_optimizer={inner!r}"
        )
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer`. "
            f"Received: inner_optimizer={inner!r} of type {type(inner).__name__}"
        )
    if inner.use_ema:
        raise ValueError(
            "`inner_optimizer` must not use EMA: it would average each replica's diverged local weights. "
            "Set `use_ema=True` on the AdasumOptimizer instead, which averages the combined weights. "
            "Received: inner_optimizer.use_ema=True"
        )
    if inner.gradient_accumulation_steps:
        raise ValueError(
            "`inner_optimizer` must not use `gradient_accumulation_steps`; use the AdasumOptimizer's "
            "`backward_passes_per_step` instead. Received: inner_optimizer.gradient_accumulation_steps="
            f"{inner.gradient_accumulation_steps}"
        )
