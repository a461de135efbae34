"""`AdasumDiagnostics`: per-tensor diagnostics of the Adasum combine, as a Keras callback.

Every `every_n_steps` training steps it reads, per trainable variable (tensor),
the statistics of the latest combine that the `AdasumOptimizer` records while
the callback is attached (nothing is computed when it is not):

* ``delta_norm_min``/``_mean``/``_max``: norms of the replicas' local deltas
  (local gradients in gradient mode);
* ``combined_norm``: norm of the combined update;
* ``orthogonality``: |combined|^2 / sum_i |delta_i|^2 (1 when the deltas are
  mutually orthogonal, 1/N when they are identical; for Adasum);
* per tree level k (the non-power-of-two fold is level 0 when N is not a power
  of two): ``levelk/cos_*`` the cosine between the two subtrees' values of each
  pair combined at that level, and ``levelk/coef_a_*``, ``levelk/coef_b_*``
  their Adasum coefficients; min/mean/max over that level's pairs. These come
  from the partial dot products the combine computes anyway.
* with the AdaCons combiner: ``adacons/weight_r`` (per replica r; per
  variable with ``per_tensor``) and ``adacons/fallbacks`` (combines that fell
  back to plain averaging), always logged.

Outputs: Keras logs under ``adasum/<variable path>/<statistic>`` for the
statistics in `logged` (``orthogonality`` by default, ``"all"`` for every one;
they are added to the epoch logs too, so `History` holds the last values of
each epoch); TensorBoard scalars of every statistic under the same names when
`log_dir` is given; one JSON object per
recorded step in `jsonl_path`; and at the end of training a PNG summary (the
orthogonality index and the mean coefficients per variable over steps) in
`png_path`. TensorBoard and PNG need the ``viz`` extra (tensorboard,
matplotlib); asking for them without it is an error at construction.
"""

from __future__ import annotations

import importlib.util
import json
import os

import keras
import tensorflow as tf

from tf_adasum.optimizer import AdasumOptimizer

__all__ = ["AdasumDiagnostics"]

LOG_PREFIX = "adasum"


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"{what} needs the `{module}` package, which is not installed. "
            "Install the viz extra: pip install 'tf_adasum[viz]'."
        )


def _find_adasum_optimizer(optimizer) -> AdasumOptimizer:
    while optimizer is not None and not isinstance(optimizer, AdasumOptimizer):
        optimizer = getattr(optimizer, "inner_optimizer", None)  # e.g. a LossScaleOptimizer around it
    if optimizer is None:
        raise ValueError("AdasumDiagnostics needs a model compiled with a tf_adasum.AdasumOptimizer.")
    return optimizer


class AdasumDiagnostics(keras.callbacks.Callback):
    """Records per-tensor Adasum diagnostics every `every_n_steps` steps.

    Args:
      every_n_steps: record every this many training steps (>= 1).
      log_dir: if given, write TensorBoard scalars there (needs tensorboard).
      jsonl_path: if given, append one JSON object per recorded step.
      png_path: if given, write a PNG summary at the end of training (needs
        matplotlib).
      logged: the statistics added to Keras logs (and so History and the
        progress bar): a sequence of names, or ``"all"``.

    Attributes:
      records: the recorded ``(step, {variable path: {statistic: value}})``.
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        log_dir: str | None = None,
        jsonl_path: str | None = None,
        png_path: str | None = None,
        logged: str | tuple[str, ...] = ("orthogonality",),
    ):
        super().__init__()
        if logged != "all" and (isinstance(logged, str) or not all(isinstance(k, str) for k in logged)):
            raise TypeError(f'`logged` must be a sequence of statistic names or "all". Received: logged={logged!r}')
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise TypeError(f"`every_n_steps` must be an int. Received: every_n_steps={every_n_steps!r}")
        if every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be >= 1. Received: every_n_steps={every_n_steps}")
        if log_dir is not None:
            _require("tensorboard", "AdasumDiagnostics(log_dir=...)")
        if png_path is not None:
            _require("matplotlib", "AdasumDiagnostics(png_path=...)")
        self.every_n_steps = every_n_steps
        self.log_dir = log_dir
        self.jsonl_path = jsonl_path
        self.png_path = png_path
        self.logged = logged if logged == "all" else tuple(logged)
        self.records: list[tuple[int, dict[str, dict[str, float]]]] = []
        self._optimizer: AdasumOptimizer | None = None
        self._writer = None
        self._step = 0
        self._latest_logged: dict[str, float] = {}

    def on_train_begin(self, logs=None):
        self._optimizer = _find_adasum_optimizer(self.model.optimizer)
        if self._optimizer._diagnostics.variable is None:
            self._optimizer.enable_diagnostics()
            # A train function traced before diagnostics were on would not record them.
            self.model.make_train_function(force=True)
        if self.log_dir is not None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        if self.jsonl_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(self.jsonl_path)), exist_ok=True)

    def on_train_batch_end(self, batch, logs=None):
        step = self._step
        self._step += 1
        if step % self.every_n_steps or self._optimizer._diagnostics.variable is None:
            return
        record = self._optimizer.read_diagnostics()
        adacons = self._optimizer.read_adacons()
        self.records.append((step, record))
        flat = self._flatten(record)
        self._latest_logged = self._flatten(record, self.logged)
        if adacons is not None:
            flat.update(self._flatten_adacons(adacons))
            self._latest_logged.update(self._flatten_adacons(adacons))
        if logs is not None:
            logs.update(self._latest_logged)
        if self.jsonl_path is not None:
            with open(self.jsonl_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "tensors": record, "adacons": adacons}) + "\n")
        if self._writer is not None:
            with self._writer.as_default():
                for key, value in flat.items():
                    tf.summary.scalar(key, value, step=step)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._latest_logged)

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()
        if self.png_path is not None and self.records:
            self._write_png()

    @staticmethod
    def _flatten(record: dict[str, dict[str, float]], selected: str | tuple[str, ...] = "all") -> dict[str, float]:
        return {
            f"{LOG_PREFIX}/{name}/{stat}": value
            for name, stats in record.items()
            for stat, value in stats.items()
            if selected == "all" or stat in selected
        }

    @staticmethod
    def _flatten_adacons(adacons: dict) -> dict[str, float]:
        flat = {f"{LOG_PREFIX}/adacons/fallbacks": float(adacons["fallbacks"])}
        for name, weights in adacons["weights"].items():
            prefix = "" if name == "model" else f"{name}/"
            flat.update({f"{LOG_PREFIX}/adacons/{prefix}weight_{r}": w for r, w in enumerate(weights)})
        return flat

    def _write_png(self):
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        steps = [step for step, _ in self.records]
        names = list(self.records[0][1])
        levels = sorted({stat.split("/")[0] for stats in self.records[0][1].values() for stat in stats if "/" in stat})
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for name in names:
            axes[0].plot(steps, [record[name]["orthogonality"] for _, record in self.records], label=name)
            for level in levels:
                axes[1].plot(
                    steps,
                    [record[name][f"{level}/coef_a_mean"] for _, record in self.records],
                    label=f"{name} {level}",
                )
        n = self._optimizer._diagnostics.num_replicas
        axes[0].axhline(1.0, color="gray", lw=0.5)
        axes[0].axhline(1.0 / n, color="gray", lw=0.5, ls="--")
        axes[0].set(title="orthogonality index |combined|^2 / sum |delta_i|^2", xlabel="step")
        axes[1].set(title="Adasum coefficient (left operand), mean over pairs", xlabel="step")
        for axis in axes:
            axis.legend(fontsize=6)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(self.png_path)), exist_ok=True)
        fig.savefig(self.png_path, dpi=110)
        plt.close(fig)
