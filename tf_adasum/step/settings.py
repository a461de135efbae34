"""What `tf_adasum.AdasumOptimizer` accepts: its arguments, checked at construction.

Each error names the argument and the value received (`TypeError` for a wrong
type, `ValueError` for a wrong value), before anything is built.
"""

from __future__ import annotations

import keras

from tf_adasum.comm import compression as compression_lib
from tf_adasum.engines import select

__all__ = ["MODES", "check_inner", "check_settings"]

MODES = ("delta", "gradient")


def check_settings(mode, backward_passes_per_step, hierarchical, backend, use_ema, combiner, compression) -> None:
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}. Received: mode={mode!r}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
        raise TypeError(
            "`backward_passes_per_step` must be an int. "
            f"Received: backward_passes_per_step={backward_passes_per_step!r}"
        )
    if backward_passes_per_step < 1:
        raise ValueError(
            f"`backward_passes_per_step` must be >= 1. Received: backward_passes_per_step={backward_passes_per_step}"
        )
    for name, value in (("hierarchical", hierarchical), ("use_ema", use_ema)):
        if not isinstance(value, bool):
            raise TypeError(f"`{name}` must be a bool. Received: {name}={value!r}")
    if hierarchical and not combiner.pairwise:
        raise ValueError(
            f"`hierarchical=True` is not supported with {combiner!r}: its weights compare every replica "
            "with the consensus. Received: hierarchical=True"
        )
    if backend not in select.BACKENDS:
        raise ValueError(f"`backend` must be one of {select.BACKENDS}. Received: backend={backend!r}")
    compression_lib.check_compression(compression)


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
