"""One configuration of the scaling evaluation, and the names it is checked against.

Standard library only (and the dataset names of `tf_adasum.eval.data`, which
needs numpy): the command line checks a whole grid before it loads TensorFlow.
"""

from __future__ import annotations

import dataclasses

from tf_adasum.eval.data import DATASETS
from tf_adasum.launcher import helper

__all__ = [
    "BASE_BATCH",
    "BASE_LR",
    "COMBINERS",
    "ENGINES",
    "INNER_OPTIMIZERS",
    "KERAS_BASELINES",
    "LR_RULES",
    "MODES",
    "OPTIONAL_FIELDS",
    "SCHEDULES",
    "TIMING_MODELS",
    "TRAINING_MODELS",
    "WARMUP_EPOCHS",
    "RunConfig",
]

COMBINERS = ("adasum", "adacons", "mean", "sum", "keras", "keras-scaled")
#: Combiners without local steps: Keras' own gradient averaging, at the base
#: learning rate (``keras``) or scaled to the effective batch (``keras-scaled``).
KERAS_BASELINES = ("keras", "keras-scaled")
#: How the replicas run: N logical CPU devices of one process, N worker processes
#: (MultiWorkerMirroredStrategy), N MPI ranks, or ``simulated``: N replicas
#: computed one after another in one process (`tf_adasum.SimulatedReplicas`;
#: the averaging baselines there train one replica at the effective batch,
#: which is the same method).
ENGINES = ("local-devices", "tf-collective", "mpi", "simulated")
#: Trained to a target accuracy.
TRAINING_MODELS = ("lenet_caffe", "lenet5", "resnet", "mlp")
#: Timed on synthetic data (time per step, communication share).
TIMING_MODELS = ("resnet50", "bert")
#: Learning rate over a run: ``constant``, or ``cosine``: decayed from the base
#: rate to zero over the run's epoch budget, per epoch (the same at every batch size).
SCHEDULES = ("cosine", "constant")
#: The batch the base learning rate is meant for (the recipe's single-replica
#: batch); ``keras-scaled`` multiplies the rate by sqrt(effective batch / BASE_BATCH).
BASE_BATCH = 64
#: ``keras-scaled`` ramps linearly from the base to the scaled rate over these first epochs.
WARMUP_EPOCHS = 2
#: What the replicas combine (`tf_adasum.AdasumOptimizer`'s ``mode``): the
#: inner optimizer's local steps (``delta``) or the gradients before one inner
#: step (``gradient``). The Keras baselines average gradients: ``delta`` only.
MODES = ("delta", "gradient")
#: The inner optimizer, at every combiner: Keras' ``Adam`` or ``Lamb`` (You et
#: al. 2020, layer-wise trust ratios), with Keras' default settings but the rate.
INNER_OPTIMIZERS = ("adam", "lamb")
#: Each inner optimizer's single-worker rate, the presets' ``lr``: Adam's 1e-3;
#: LAMB's 3e-3, chosen as Adam's was, on the recipe (one replica, batch 64,
#: cosine, 10 epochs, seed 0) against 1e-3 and 1e-2: the evaluation guide's
#: "Variants" section, records in docs/eval_edge/lamb_recipe.jsonl.
BASE_LR = {"adam": 1e-3, "lamb": 3e-3}
#: The learning-rate rule beside the combiner's own: ``""`` (the combiner's
#: own: the base rate, or for ``keras-scaled`` its scaled peak and warm-up),
#: ``warmup`` (``keras-scaled``'s warm-up over `WARMUP_EPOCHS`, from the same
#: fraction of the rate, but to the base rate), ``scaled`` (``keras-scaled``'s
#: rule: the scaled peak and its warm-up). The Keras baselines take ``""`` only.
LR_RULES = ("", "warmup", "scaled")


def _is_rate(link: str) -> bool:
    """Whether `link` is a positive rate in tc's syntax (``1gbit``, ``100mbit``), as `tf-adasum launch --link` takes."""
    return isinstance(link, str) and bool(helper.RATE_PATTERN.fullmatch(link)) and helper.rate_bits_per_second(link) > 0


#: `RunConfig` fields added after records were published: a record without
#: them reads as their defaults (this machine), for `--resume` and the summaries.
OPTIONAL_FIELDS = ("hosts", "link", "mode", "inner", "lr_rule")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One configuration of the grid; `validate` checks it."""

    model: str = "lenet5"
    dataset: str = "mnist"
    combiner: str = "adasum"
    engine: str = "local-devices"
    replicas: int = 4
    batch_per_replica: int = 32
    local_steps: int = 1
    lr: float = 1e-3
    schedule: str = "cosine"
    target: float = 0.98
    epochs: int = 10
    seed: int = 0
    train_examples: int = 0  # 0: the whole training set
    test_examples: int = 0  # 0: the whole test set
    hosts: int = 0  # tf-collective: its workers on this many emulated hosts (0: this machine)
    link: str = ""  # with hosts: each host's link rate, in tc's syntax ("1gbit", "100mbit")
    mode: str = "delta"  # MODES
    inner: str = "adam"  # INNER_OPTIMIZERS
    lr_rule: str = ""  # LR_RULES

    @property
    def method(self) -> str:
        """The method's name in tables and plots: the combiner, then what
        differs from its defaults (``adasum gradient lamb warmup``; ``lr=``
        where the rate is not its inner optimizer's `BASE_LR`); the
        ``keras-scaled`` baseline with LAMB reads ``lamb-scaled``. Tables
        group runs by all their fields but N and the seed, not by this name."""
        rate = f"lr={self.lr:g}" if self.lr != BASE_LR.get(self.inner) else ""
        if self.combiner == "keras-scaled" and self.inner == "lamb":
            return " ".join(p for p in ("lamb-scaled", rate) if p)
        parts = [self.combiner, self.mode if self.mode != "delta" else "", self.inner if self.inner != "adam" else ""]
        return " ".join(p for p in (*parts, self.lr_rule, rate) if p)

    @property
    def effective_batch(self) -> int:
        return self.replicas * self.batch_per_replica * self.local_steps

    def key(self) -> tuple:
        """What identifies a finished run for `--resume`."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def validate(self) -> RunConfig:
        if self.model not in TRAINING_MODELS:
            raise ValueError(f"Unknown `model`. Expected one of {TRAINING_MODELS}. Received: model={self.model!r}")
        if self.dataset not in DATASETS:
            raise ValueError(f"Unknown `dataset`. Expected one of {DATASETS}. Received: dataset={self.dataset!r}")
        if self.combiner not in COMBINERS:
            raise ValueError(f"Unknown `combiner`. Expected one of {COMBINERS}. Received: combiner={self.combiner!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"Unknown `engine`. Expected one of {ENGINES}. Received: engine={self.engine!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Unknown `schedule`. Expected one of {SCHEDULES}. Received: schedule={self.schedule!r}")
        if self.engine == "mpi" and self.combiner in KERAS_BASELINES:
            raise ValueError(
                f"The `{self.combiner}` baseline has no MPI path: without a strategy Keras does not all-reduce "
                "gradients across MPI ranks. Use engine='tf-collective' or 'local-devices'. Received: "
                f"combiner={self.combiner!r}, engine='mpi'"
            )
        for name in ("replicas", "batch_per_replica", "local_steps", "epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1. Received: {name}={value!r}")
        for name in ("train_examples", "test_examples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be an int >= 0 (0: all). Received: {name}={value!r}")
        if not 0.0 < self.target <= 1.0:
            raise ValueError(f"`target` must be in (0, 1]. Received: target={self.target}")
        if not self.lr > 0:
            raise ValueError(f"`lr` must be > 0. Received: lr={self.lr}")
        if isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or self.hosts < 0:
            raise ValueError(f"`hosts` must be an int >= 0 (0: this machine). Received: hosts={self.hosts!r}")
        if self.hosts and (self.engine != "tf-collective" or self.hosts > self.replicas or not self.link):
            raise ValueError(
                "`hosts` places the tf-collective engine's workers on emulated hosts (at most one host per "
                "replica), with a `link` rate. Received: "
                f"hosts={self.hosts}, engine={self.engine!r}, replicas={self.replicas}, link={self.link!r}"
            )
        if self.link and not self.hosts:
            raise ValueError(f"`link` needs `hosts`. Received: link={self.link!r}, hosts=0")
        if self.link and not _is_rate(self.link):
            raise ValueError(
                f"`link` must be a rate in tc's syntax such as '1gbit' or '100mbit'. Received: link={self.link!r}"
            )
        for name, allowed in (("mode", MODES), ("inner", INNER_OPTIMIZERS), ("lr_rule", LR_RULES)):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"Unknown `{name}`. Expected one of {allowed}. Received: {name}={getattr(self, name)!r}"
                )
        if self.combiner in KERAS_BASELINES and (self.mode != "delta" or self.lr_rule):
            raise ValueError(
                f"The `{self.combiner}` baseline averages gradients at its own learning-rate rule: it takes "
                f"mode='delta' and lr_rule='' only. Received: mode={self.mode!r}, lr_rule={self.lr_rule!r}"
            )
        if self.combiner in KERAS_BASELINES and self.local_steps != 1:
            raise ValueError(
                f"The `{self.combiner}` baseline (plain gradient averaging) has no local steps. "
                f"Received: combiner={self.combiner!r}, local_steps={self.local_steps}"
            )
        return self
