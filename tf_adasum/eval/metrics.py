"""The evaluation's metrics: epochs to a target accuracy, and the score."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["epochs_or_inf", "epochs_until_convergence", "format_score", "score"]


def epochs_until_convergence(accuracy_per_epoch: Sequence[float], target: float) -> int:
    """The 1-based index of the first epoch whose accuracy reaches `target`; -1 if none does."""
    for epoch, accuracy in enumerate(accuracy_per_epoch, start=1):
        if accuracy >= target:
            return epoch
    return -1


def epochs_or_inf(record: dict) -> float:
    """A result record's epochs to its target, infinity when it never reached
    it (so a median or minimum over seeds orders a miss after every hit)."""
    epochs = record["epochs_until_convergence"]
    return epochs if epochs > 0 else math.inf


def score(epochs: int, minutes_per_epoch: float) -> float | None:
    """Minutes to reach the target: epochs x minutes per epoch; None when never reached."""
    if epochs < 1 or not math.isfinite(minutes_per_epoch):
        return None
    return epochs * minutes_per_epoch


def format_score(value: float | None) -> str:
    """The table's rendering: ``inf`` when the target was not reached."""
    return "inf" if value is None else f"{value:.2f}"
