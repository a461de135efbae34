"""tf_adasum.backup.BackupAndRestore: an interrupted `fit` resumes to the
weights of an uninterrupted one, in one process, under MirroredStrategy, and
with real processes (MultiWorkerMirroredStrategy workers, mpirun ranks)
killed at different points of an epoch and of a save.

Why the final weights are bitwise equal: the backup holds every variable of
the model and optimizer (in gradient mode, and in delta mode with plain SGD,
every replica's state is replica 0's), each epoch's batches are the same
whether or not the run was interrupted (the pipeline starts at `saved_epoch`,
one seeded order per epoch), and each step is deterministic (the same
collectives in the same order, float64 tree partials).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored
from multiprocess import TESTS, needs_emulated_hosts, worker_env
from simulation import BATCH, IN, OUT
from simulation import data as simulation_data

import tf_adasum
from tf_adasum import backup
from tf_adasum.launcher.mpirun import mpirun_command
from tf_adasum.processes import Processes

BACKUP_WORKER = os.path.join(TESTS, "workers", "backup_worker.py")
EPOCHS, STEPS = 4, 3


# -- in this process -------------------------------------------------------------------


class _Interrupt(keras.callbacks.Callback):
    """Raises at the beginning of epoch `epoch` (after the previous epoch's backup)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


def _job(strategy, seed, mode="gradient", inner=lambda: keras.optimizers.Adam(0.01)):
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
        model.compile(optimizer=tf_adasum.AdasumOptimizer(inner(), mode=mode), loss="mse")
    return model


def _fit(model, folder, callbacks=()):
    """Epochs saved_epoch(folder)..EPOCHS-1, each its own seeded order of the batches."""
    x, y = simulation_data(STEPS)
    start = backup.saved_epoch(folder)
    order = np.concatenate([np.random.default_rng(e).permutation(STEPS * BATCH) for e in range(start, EPOCHS)])
    dataset = tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(BATCH)
    restoring = backup.BackupAndRestore(folder)
    callbacks = [restoring, *callbacks]
    model.fit(dataset, epochs=EPOCHS, steps_per_epoch=STEPS, shuffle=False, verbose=0, callbacks=callbacks)
    return restoring


def _state(model):
    return [v.numpy() for v in model.weights] + [v.numpy() for v in model.optimizer.variables]


def _assert_bitwise_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected):
        assert a.tobytes() == b.tobytes(), (a, b)


def _interrupted_then_resumed(strategy_fn, tmp_path, interrupt_at, **job):
    """The reference run, and a run interrupted at `interrupt_at` then resumed
    with a new model (other initial weights) on the same folder."""
    reference = _job(strategy_fn(), seed=1, **job)
    _fit(reference, tmp_path / "reference")
    assert not (tmp_path / "reference").exists()  # deleted once training completed
    folder = tmp_path / "backup"
    interrupted = _job(strategy_fn(), seed=1, **job)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(interrupted, folder, [_Interrupt(interrupt_at)])
    assert backup.saved_epoch(folder) == interrupt_at  # kept when interrupted
    resumed = _job(strategy_fn(), seed=2, **job)
    restoring = _fit(resumed, folder)
    assert restoring.restored_epoch == interrupt_at
    assert resumed._initial_epoch is None  # this `fit` only
    assert not folder.exists()
    return _state(resumed), _state(reference)


def test_one_process_resumes_exactly(tmp_path):
    resumed, reference = _interrupted_then_resumed(tf.distribute.get_strategy, tmp_path, interrupt_at=2)
    _assert_bitwise_equal(resumed, reference)


def test_mirrored_strategy_resumes_exactly_in_delta_mode_with_sgd(tmp_path):
    """Delta mode with a slot-free optimizer: nothing per replica is lost
    (gradient mode is tested with real processes below)."""
    strategy_fn = lambda: mirrored(2)[0]  # noqa: E731
    inner = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    resumed, reference = _interrupted_then_resumed(strategy_fn, tmp_path, 3, mode="delta", inner=inner)
    _assert_bitwise_equal(resumed, reference)


def test_torn_and_stale_files(tmp_path):
    """A temporary file and an orphan weights file (a kill inside a save) are
    ignored, then removed by the next save; a metadata file naming a missing
    or truncated weights file, or not ours, is an error naming the remedy."""
    folder = tmp_path / "backup"
    model = _job(tf.distribute.get_strategy(), seed=1)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(model, folder, [_Interrupt(1)])
    (current,) = [f for f in os.listdir(folder) if f.endswith(".weights.h5")]
    (folder / ".tmp-0123abcd-epoch-000002-0123abcd.weights.h5").write_bytes(b"partial")
    (folder / "epoch-000002-89abcdef.weights.h5").write_bytes(b"never named")
    (folder / "notes.txt").write_text("not ours")
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_job(tf.distribute.get_strategy(), seed=2), folder, [_Interrupt(2)])
    names = sorted(os.listdir(folder))
    assert names[0] == "backup.json" and names[2] == "notes.txt" and len(names) == 3, names
    assert names[1] != current and names[1].startswith("epoch-000002-")

    metadata = json.loads((folder / "backup.json").read_text())
    os.truncate(folder / metadata["weights"], metadata["bytes"] - 1)
    with pytest.raises(ValueError, match=r"is damaged: .* but it has \d+"):
        _fit(_job(tf.distribute.get_strategy(), seed=3), folder)
    os.remove(folder / metadata["weights"])
    with pytest.raises(ValueError, match="is damaged: .* but it is missing. Remove `backup_dir`"):
        _fit(_job(tf.distribute.get_strategy(), seed=3), folder)
    (folder / "backup.json").write_text('{"epoch": 3}')
    with pytest.raises(ValueError, match="is not a tf_adasum backup"):
        backup.saved_epoch(folder)
    # Training completed elsewhere: only this callback's files go, the folder stays.
    (folder / "backup.json").unlink()
    _fit(_job(tf.distribute.get_strategy(), seed=3), folder)
    assert sorted(os.listdir(folder)) == ["notes.txt"]


def test_arguments_are_checked(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for value, error, message in (
        (3, TypeError, "must be a path .* Received: backup_dir=3"),
        ("", ValueError, "must not be empty"),
        ("gs://bucket/backup", ValueError, "URLs are not supported"),
        (a_file, ValueError, "names a file; it must name a folder"),
        (a_file / "sub" / "dir", ValueError, "which is a file, not a folder"),
    ):
        with pytest.raises(error, match=message):
            backup.BackupAndRestore(value)
    with pytest.raises(NotImplementedError, match="Received: save_freq=100"):
        backup.BackupAndRestore(tmp_path, save_freq=100)
    with pytest.raises(ValueError, match="Received: save_freq='batch'"):
        backup.BackupAndRestore(tmp_path, save_freq="batch")
    with pytest.raises(TypeError, match="Received: delete_checkpoint='yes'"):
        backup.BackupAndRestore(tmp_path, delete_checkpoint="yes")
    assert backup.saved_epoch(tmp_path / "missing") == 0


def test_missing_keras_attribute_is_a_loud_error(tmp_path):
    model = _job(tf.distribute.get_strategy(), seed=1)
    del model._initial_epoch
    with pytest.raises(RuntimeError, match="keras.Model._initial_epoch"):
        _fit(model, tmp_path)


def _checked(index, count, epochs, failed=(), own_error=None):
    """`_agree` on process `index` when the processes' sum gives `epochs` and `failed`."""
    callback = backup.BackupAndRestore("unused")
    totals = [float(e) for e in epochs] + [float(j in failed) for j in range(count)]
    callback._processes = Processes("worker", index, count, lambda values, what: totals)
    return callback._agree(epochs[index], own_error)


def test_every_process_checks_the_epochs():
    assert _checked(1, 3, [2, 2, 2]) == 2
    with pytest.raises(ValueError, match=r"different epochs .* \(worker 0: epoch 3, worker 1: epoch 0\)"):
        _checked(1, 2, [3, 0])
    with pytest.raises(RuntimeError, match="worker 1 could not restore from unused"):
        _checked(0, 2, [3, 0], failed=[1])
    with pytest.raises(OSError, match="disk"):
        _checked(1, 2, [3, 0], failed=[1], own_error=OSError("disk"))


def test_which_saves_communicate():
    strategy = mirrored(2)[0]
    with strategy.scope():
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
        summed = keras.Variable(0.0, synchronization="on_read", aggregation="sum", trainable=False)
        first = keras.Variable(0.0, synchronization="on_read", aggregation="only_first_replica", trainable=False)
    assert not backup._reading_communicates(model.weights)
    assert not backup._reading_communicates([first])
    assert backup._reading_communicates([*model.weights, summed])


# -- real processes ------------------------------------------------------------------------


#: Which of the writer's two deaths each engine's chain gets (the file
#: protocol is the same on both; each engine also loses its other process).
WRITER_FAULTS = {"workers": "inside", "mpi": "between"}
KILLED = 23


#: Chains whose step 2 cuts worker 1's link on an emulated host instead of killing it.
LINK_FAULTS = {"hosts-link-down": "down", "hosts-link-trickle": "trickle"}
#: Their collective timeout: every worker must fail within it after the cut (plus start-up slack).
LINK_FAULT_TIMEOUT = 20


def _launch(engine, step, out):
    env = worker_env()
    if engine == "mpi":
        command = mpirun_command(2) + [sys.executable]
    else:
        command = [sys.executable, "-m", "tf_adasum.launch", "-n", "2"]
    if engine in LINK_FAULTS:
        command += ["--hosts", "2", "--link", "1gbit"]
        env.update(TEST_LINK_FAULT=LINK_FAULTS[engine], TEST_COLLECTIVE_TIMEOUT=str(LINK_FAULT_TIMEOUT))
    command += [BACKUP_WORKER, str(step), str(out), WRITER_FAULTS.get(engine, "inside")]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _reports(out, name):
    return [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(2)]


def _backup_files(out):
    names = sorted(os.listdir(out / "backup"))
    metadata = json.loads((out / "backup" / "backup.json").read_text())
    return metadata, [n for n in names if n.startswith(".tmp-")], [n for n in names if n.startswith("epoch-")]


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param("workers", marks=pytest.mark.multiworker),
        pytest.param("mpi", marks=pytest.mark.mpi),
        *(pytest.param(fault, marks=[pytest.mark.multiworker, needs_emulated_hosts]) for fault in LINK_FAULTS),
    ],
)
def test_killed_processes_resume_exactly(engine, tmp_path):
    """One backup folder, three launches (see tests/workers/backup_worker.py):
    the writer killed in its save at the end of epoch 1 (inside the weights
    file under MultiWorkerMirroredStrategy, between the weights file and the
    metadata under mpirun), then the other process killed in the middle of
    epoch 2 (or, on emulated hosts, its link taken down or cut to a trickle:
    every worker fails within the collective timeout and the launcher exits
    non-zero), then the run completes with the weights and optimizer state of
    an uninterrupted run; then a folder per process is an error on every
    process."""
    outputs = []

    def step(number, code):
        result = _launch(engine, number, tmp_path)
        outputs.append(result.stdout[-3000:] + result.stderr[-3000:])
        assert result.returncode == code, "\n".join(outputs)
        return _reports(tmp_path, f"step{number}")

    reports = step(1, KILLED)
    assert [r["restored"] for r in reports] == [0, 0] and reports[0]["begun"] == [0, 1]
    metadata, temporaries, weights = _backup_files(tmp_path)
    assert metadata["epoch"] == 1
    if WRITER_FAULTS.get(engine, "inside") == "inside":  # a partial temporary file, never named
        assert len(temporaries) == 1 and weights == [metadata["weights"]]
    else:  # the weights file of epoch 2, never named
        assert not temporaries and len(weights) == 2
        assert [w.startswith("epoch-000002-") for w in weights if w != metadata["weights"]] == [True]

    if engine in LINK_FAULTS:  # the workers fail, with a clear error, within the timeout after the cut
        reports = step(2, 1)
        cut = json.loads((tmp_path / "link_cut.json").read_text())["time"]
        # The first to fail reports; the launcher then stops the other, which
        # reports too if its own error came first (TF's wait cannot be interrupted).
        paths = [tmp_path / f"step2_error_rank{rank}.json" for rank in range(2)]
        errors = [json.loads(path.read_text()) for path in paths if path.exists()]
        assert errors, "\n".join(outputs)
        for error in errors:
            assert error["type"] in ("DeadlineExceededError", "UnavailableError"), error
            # TF's coordination service (a peer's heartbeats stop, or this worker's own do not
            # get through) or the combine's own timeout; which comes first depends on the cut
            clear = ("timed out", "unhealthy", "a worker failed or left", "CoordinationService/Heartbeat")
            assert any(m in error["message"] for m in clear), error
            assert error["time"] - cut < LINK_FAULT_TIMEOUT + 30, (error, cut)
    else:
        reports = step(2, KILLED)  # process 1 died in the middle of epoch 2, after the backup at the end of epoch 1
    assert [r["restored"] for r in reports] == [1, 1] and reports[1]["begun"] == [1, 2]
    metadata, temporaries, weights = _backup_files(tmp_path)
    assert metadata["epoch"] == 2 and not temporaries and weights == [metadata["weights"]]

    reports = step(3, 0)
    assert all(r["restored"] == 2 and r["begun"] == [2, 3] for r in reports)
    assert not (tmp_path / "backup").exists() and not (tmp_path / "reference_backup").exists()
    reference = np.load(tmp_path / "reference_rank0.npz")
    for rank in range(2):
        for name in ("reference", "final"):
            result = np.load(tmp_path / f"{name}_rank{rank}.npz")
            assert result.files == reference.files
            _assert_bitwise_equal([result[f] for f in result.files], [reference[f] for f in reference.files])

    label = "rank" if engine == "mpi" else "worker"
    for report in _reports(tmp_path, "mismatch"):  # a folder per process: only the writer's holds a backup
        assert report["raised"] and report["type"] == "ValueError", report
        assert f"different epochs in {tmp_path}/own" in report["message"]
        assert f"({label} 0: epoch 1, {label} 1: epoch 0)" in report["message"]
