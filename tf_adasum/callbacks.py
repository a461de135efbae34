"""`AdasumDiagnostics`: per-tensor diagnostics of the Adasum combine, as a Keras callback.

Every `every_n_steps` training steps it reads, per trainable variable (tensor),
the statistics of the latest combine that the `AdasumOptimizer` records while
the callback is attached (nothing is computed when it is not):

* ``delta_norm_min``/``_mean``/``_max``: norms of the replicas' local deltas
  (local gradients in gradient mode);
* ``combined_norm``: norm of the combined update;
* ``orthogonality``: |combined|^2 / sum_i |delta_i|^2 (1 when the deltas are
  mutually orthogonal, 1/N when they are identical; for Adasum);
* ``delta_sq_sum``: sum_i |delta_i|^2, where the optimizer records it;
* per tree level k (the non-power-of-two fold is level 0 when N is not a power
  of two): ``levelk/cos_*`` the cosine between the two subtrees' values of each
  pair combined at that level, and ``levelk/coef_a_*``, ``levelk/coef_b_*``
  their Adasum coefficients; min/mean/max over that level's pairs. These come
  from the partial dot products the combine computes anyway.
* with the AdaCons combiner: ``adacons/weight_r`` (per replica r; per
  variable with ``per_tensor``) and ``adacons/fallbacks`` (combines that fell
  back to plain averaging).

And one model-level figure, the orthogonality of the whole update weighted by
squared norms: sum_t |combined_t|^2 / sum_t sum_i |delta_i,t|^2.

Outputs: Keras logs (so the progress line, and `History` at epoch end) get the
model-level ``adasum/orthogonality`` (and AdaCons' model-level weights and
fallbacks); per-tensor statistics ``adasum/<variable path>/<statistic>`` only
for the names in `logged` (``"all"``: every one). TensorBoard scalars of every
statistic when `log_dir` is given; one JSON object per recorded step in
`jsonl_path`; and at the end of training a PNG summary in `png_path`: the
model-level orthogonality over steps, a heat map of the per-tensor
orthogonality (tensors x steps) and, for Adasum, one heat map per tree level of
the mean coefficient. TensorBoard and PNG need the ``viz`` extra (tensorboard,
matplotlib); asking for them without it is an error at construction, and so
is a path that cannot be written.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re

import keras
import tensorflow as tf

from tf_adasum.optimizer import AdasumOptimizer
from tf_adasum.step.diagnostics import LEVEL_STATS, TENSOR_STATS

__all__ = ["AdasumDiagnostics", "model_orthogonality"]

LOG_PREFIX = "adasum"
_LEVEL_NAME = re.compile(r"level(\d+)/(\w+)")


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(
            f"{what} needs the `{module}` package, which is not installed. "
            "Install the viz extra: pip install 'tf_adasum[viz]'."
        )


def _path_argument(name: str, value, folder: bool) -> str | None:
    """`value` as a path where a file (or, with `folder`, a folder) can be written."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{name}` must be a path (str or os.PathLike). Received: {name}={value!r}")
    path = os.fspath(value)
    received = f"Received: {name}={path!r}"
    if os.path.isdir(path) and not folder:
        raise ValueError(f"`{name}` names a folder; it must name a file. {received}")
    if os.path.lexists(path) and not os.path.isdir(path) and folder:
        raise ValueError(f"`{name}` names a file; it must name a folder. {received}")
    if os.path.lexists(path):
        if not os.access(path, os.W_OK | (os.X_OK if folder else 0)):
            raise ValueError(f"`{name}` cannot be written by this user. {received}")
        return path
    existing = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"`{name}` is under {existing}, which is a file, not a folder. {received}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"`{name}` cannot be created: this user cannot write to {existing}. {received}")
    return path


def _logged_argument(logged) -> str | tuple[str, ...]:
    if logged == "all":
        return "all"
    if isinstance(logged, str) or not all(isinstance(k, str) for k in logged):
        raise TypeError(f'`logged` must be a sequence of statistic names or "all". Received: logged={logged!r}')
    logged = tuple(logged)
    for stat in logged:
        level = _LEVEL_NAME.fullmatch(stat)
        if stat not in TENSOR_STATS and not (level and level.group(2) in LEVEL_STATS):
            raise ValueError(
                f'`logged` names an unknown statistic {stat!r}. Expected "all" or names among '
                f"{', '.join(TENSOR_STATS)}, or level<k>/<name> with <name> among {', '.join(LEVEL_STATS)}. "
                f"Received: logged={logged!r}"
            )
    return logged


def _find_adasum_optimizer(optimizer) -> AdasumOptimizer:
    while optimizer is not None and not isinstance(optimizer, AdasumOptimizer):
        optimizer = getattr(optimizer, "inner_optimizer", None)  # e.g. a LossScaleOptimizer around it
    if optimizer is None:
        raise ValueError("AdasumDiagnostics needs a model compiled with a tf_adasum.AdasumOptimizer.")
    return optimizer


def model_orthogonality(record: dict[str, dict[str, float]]) -> float:
    """The orthogonality of the whole update, weighted by squared norms:
    sum_t |combined_t|^2 / sum_t sum_i |delta_i,t|^2 (1 when nothing moved)."""
    combined = sum(stats["combined_norm"] ** 2 for stats in record.values())
    deltas = sum(stats["delta_sq_sum"] for stats in record.values())
    return combined / deltas if deltas > 0 else (math.nan if math.isnan(deltas) else 1.0)


class AdasumDiagnostics(keras.callbacks.Callback):
    """Records per-tensor Adasum diagnostics every `every_n_steps` steps.

    Args:
      every_n_steps: record every this many training steps (>= 1).
      log_dir: if given, write TensorBoard scalars there (needs tensorboard).
      jsonl_path: if given, append one JSON object per recorded step.
      png_path: if given, write a PNG summary at the end of training (needs
        matplotlib).
      logged: per-tensor statistics added to the Keras logs (and so History and
        the progress line) besides the model-level ``adasum/orthogonality``: a
        sequence of names (see the module docstring), or ``"all"``.

    Attributes:
      records: the recorded ``(step, {variable path: {statistic: value}})``.

    Examples:
      Two replicas on two logical CPUs of this machine (set up before
      TensorFlow's first operation), each with the same data, so their updates
      are identical and their orthogonality is 1/N:

      >>> import keras
      >>> import numpy as np
      >>> import tensorflow as tf
      >>> import tf_adasum
      >>> cpu = tf.config.list_physical_devices("CPU")[0]
      >>> if tf.config.get_logical_device_configuration(cpu) is None:
      ...     tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
      >>> with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
      ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
      ...     model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
      >>> diagnostics = tf_adasum.AdasumDiagnostics(every_n_steps=1, logged=["orthogonality"])
      >>> history = model.fit(np.ones((8, 3)), np.zeros((8, 1)), batch_size=8, callbacks=[diagnostics], verbose=0)
      >>> round(history.history["adasum/orthogonality"][-1], 3)
      0.5
      >>> step, statistics = diagnostics.records[0]
      >>> kernel = statistics[model.layers[0].kernel.path]
      >>> round(kernel["orthogonality"], 3), round(kernel["combined_norm"] / kernel["delta_norm_max"], 3)
      (0.5, 1.0)
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        log_dir: str | os.PathLike | None = None,
        jsonl_path: str | os.PathLike | None = None,
        png_path: str | os.PathLike | None = None,
        logged: str | tuple[str, ...] = (),
    ):
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise TypeError(f"`every_n_steps` must be an int. Received: every_n_steps={every_n_steps!r}")
        if every_n_steps < 1:
            raise ValueError(f"`every_n_steps` must be >= 1. Received: every_n_steps={every_n_steps}")
        self.logged = _logged_argument(logged)
        self.log_dir = _path_argument("log_dir", log_dir, folder=True)
        self.jsonl_path = _path_argument("jsonl_path", jsonl_path, folder=False)
        self.png_path = _path_argument("png_path", png_path, folder=False)
        if log_dir is not None:
            _require("tensorboard", "AdasumDiagnostics(log_dir=...)")
        if png_path is not None:
            _require("matplotlib", "AdasumDiagnostics(png_path=...)")
        self.every_n_steps = every_n_steps
        self.records: list[tuple[int, dict[str, dict[str, float]]]] = []
        self._optimizer: AdasumOptimizer | None = None
        self._num_replicas = 1
        self._writes_files = False
        self._writer = None
        self._step = 0
        self._latest_logged: dict[str, float] = {}

    def on_train_begin(self, logs=None):
        self._optimizer = _find_adasum_optimizer(self.model.optimizer)
        if not self._optimizer.diagnostics_enabled:
            self._optimizer.enable_diagnostics()
            # A train function traced before diagnostics were on would not record them.
            self.model.make_train_function(force=True)
        if self._optimizer.diagnostics_enabled:  # else the optimizer is built by the first step
            self._check_logged_columns()
        if self.jsonl_path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(self.jsonl_path)), exist_ok=True)

    def _check_logged_columns(self) -> None:
        if self.logged == "all":
            return
        columns = self._optimizer.diagnostics_columns()
        missing = [stat for stat in self.logged if stat not in columns]
        if missing:
            raise ValueError(
                f"`logged` names statistics this run does not record: {', '.join(missing)} (with "
                f"{self._optimizer.num_replicas_combined} replicas and this combiner it records "
                f"{', '.join(columns)}). Received: logged={self.logged!r}"
            )

    def on_train_batch_end(self, batch, logs=None):
        step = self._step
        self._step += 1
        if step % self.every_n_steps or not self._optimizer.diagnostics_enabled:
            return
        if not self.records:
            self._check_logged_columns()
            self._num_replicas = self._optimizer.num_replicas_combined
            # Every process records (a collective); the first one alone writes the files.
            self._writes_files = self._optimizer.engine.is_first_process
            if self.log_dir is not None and self._writes_files:
                self._writer = tf.summary.create_file_writer(self.log_dir)
        record = self._optimizer.read_diagnostics()
        adacons = self._optimizer.read_adacons()
        self.records.append((step, record))
        model = {"orthogonality": model_orthogonality(record)}
        flat = {f"{LOG_PREFIX}/{stat}": value for stat, value in model.items()}
        self._latest_logged = dict(flat)
        self._latest_logged.update(self._flatten(record, self.logged))
        flat.update(self._flatten(record))
        if adacons is not None:
            flat.update(self._flatten_adacons(adacons, per_tensor=True))
            self._latest_logged.update(self._flatten_adacons(adacons, per_tensor=self.logged == "all"))
        if logs is not None:
            logs.update(self._latest_logged)
        if self.jsonl_path is not None and self._writes_files:
            with open(self.jsonl_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "model": model, "tensors": record, "adacons": adacons}) + "\n")
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
        if self.png_path is not None and self.records and self._writes_files:
            _write_png(self.records, self._num_replicas, self.png_path)

    @staticmethod
    def _flatten(record: dict[str, dict[str, float]], selected: str | tuple[str, ...] = "all") -> dict[str, float]:
        return {
            f"{LOG_PREFIX}/{name}/{stat}": value
            for name, stats in record.items()
            for stat, value in stats.items()
            if selected == "all" or stat in selected
        }

    @staticmethod
    def _flatten_adacons(adacons: dict, per_tensor: bool) -> dict[str, float]:
        flat = {f"{LOG_PREFIX}/adacons/fallbacks": float(adacons["fallbacks"])}
        for name, weights in adacons["weights"].items():
            if name == "model" or per_tensor:
                prefix = "" if name == "model" else f"{name}/"
                flat.update({f"{LOG_PREFIX}/adacons/{prefix}weight_{r}": w for r, w in enumerate(weights)})
        return flat


# -- the PNG summary ---------------------------------------------------------------------


def _short_names(paths: list[str]) -> list[str]:
    """Variable paths without the components they all share in front (the model's name)."""
    parts = [path.split("/") for path in paths]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return ["/".join(p[common:]) for p in parts]


def _heat_map(axis, steps: list[int], values, names: list[str] | None, **colors):
    """`values[tensor][record]` as colours over (step, tensor); returns the mesh for a colour bar."""
    import numpy as np

    gap = (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else 1.0
    edges = np.concatenate(
        [[steps[0] - gap / 2], (np.array(steps[1:]) + np.array(steps[:-1])) / 2, [steps[-1] + gap / 2]]
    )
    mesh = axis.pcolormesh(edges, np.arange(len(values) + 1), np.ma.masked_invalid(values), **colors)
    every = -(-len(values) // 40)  # at most 40 names
    rows = np.arange(0, len(values), every)
    axis.set_yticks(rows + 0.5, [names[i] for i in rows] if names is not None else [])
    axis.invert_yaxis()
    axis.tick_params(axis="y", labelsize=7)
    return mesh


def _write_png(records, num_replicas: int, path: str) -> None:
    """Model-level orthogonality over steps; per-tensor orthogonality as a heat
    map; for Adasum, one heat map per tree level of the mean coefficient."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FixedLocator, MaxNLocator

    steps = [step for step, _ in records]
    paths = list(records[0][1])
    columns = list(records[0][1][paths[0]])
    levels = sorted({c.split("/")[0] for c in columns if "/" in c}, key=lambda level: int(level[5:]))
    series = lambda stat: np.array([[record[p][stat] for _, record in records] for p in paths])  # noqa: E731
    orthogonality = series("orthogonality")
    n = num_replicas
    heat_map_height = 0.3 + min(0.26 * len(paths), 8.0)  # inches; many tensors share 8
    rows = [2.2] + [heat_map_height] * (2 if levels else 1)
    fig = plt.figure(figsize=(11, sum(rows) + 1.2))
    grid = fig.add_gridspec(
        len(rows), max(1, len(levels)) + 1, height_ratios=rows, width_ratios=[1] * max(1, len(levels)) + [0.04]
    )

    top = fig.add_subplot(grid[0, :-1])
    top.plot(steps, [model_orthogonality(record) for _, record in records], color="black", marker=".", lw=1.2)
    for value, text in ((1.0, "orthogonal deltas: 1"), (1.0 / n, f"identical deltas: 1/N = {1.0 / n:.2f}")):
        top.axhline(value, color="gray", lw=0.7, ls="--")
        top.annotate(
            text, (1.0, value), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=7, color="gray"
        )
    top.set(
        title="Model orthogonality: sum |combined|^2 / sum sum_i |delta_i|^2 (weighted by squared norms)",
        ylabel="orthogonality",
    )
    top.title.set_fontsize(9)
    top.xaxis.set_major_locator(MaxNLocator(integer=True) if len(steps) > 1 else FixedLocator(steps))
    top.set_ylim(0, max(1.1, float(np.nanmax(orthogonality, initial=1.0)) * 1.05))
    top.grid(alpha=0.3)

    names = _short_names(paths)
    middle = fig.add_subplot(grid[1, :-1], sharex=top)
    vmax = max(1.0, float(np.nanmax(orthogonality, initial=1.0)))
    mesh = _heat_map(middle, steps, orthogonality, names, cmap="viridis", vmin=0.0, vmax=vmax)
    middle.set_title("Orthogonality per tensor", fontsize=9)
    bar = fig.colorbar(mesh, cax=fig.add_subplot(grid[1, -1]))
    ticks = {0.0: "0", 1.0 / n: f"1/N={1.0 / n:.2g}", 1.0: "1"} | ({vmax: f"{vmax:.2g}"} if vmax > 1.15 else {})
    bar.set_ticks(list(ticks), labels=list(ticks.values()), fontsize=7)
    bar.ax.axhline(1.0 / n, color="white", lw=1.5)
    if levels:
        from matplotlib.colors import TwoSlopeNorm

        norm = TwoSlopeNorm(vmin=0.5, vcenter=1.0, vmax=1.5)  # averaged, summed, opposed
        for k, level in enumerate(levels):
            axis = fig.add_subplot(grid[2, k], sharex=top)
            coefficient = (series(f"{level}/coef_a_mean") + series(f"{level}/coef_b_mean")) / 2
            mesh = _heat_map(axis, steps, coefficient, names if k == 0 else None, cmap="PuOr_r", norm=norm)
            axis.set_title(f"{level}: mean Adasum coefficient", fontsize=9)
            axis.set_xlabel("step")
        bar = fig.colorbar(mesh, cax=fig.add_subplot(grid[2, -1]), extend="both")
        bar.set_ticks([0.5, 0.75, 1.0, 1.25, 1.5])
        bar.set_label("0.5 averaged, 1 summed, 1.5 opposed", fontsize=7)
    else:
        middle.set_xlabel("step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
