"""tf_adasum.backup.BackupAndRestore: an interrupted `fit` resumes to the
weights of an uninterrupted one, in one process, under MirroredStrategy, and
with real processes (MultiWorkerMirroredStrategy workers, mpirun ranks)
killed at different points of an epoch and of a save; and a backup of N
replicas restores on M replicas by the documented rule (replica j takes saved
replica j mod N's optimizer state).

Why the final weights are bitwise equal: the backup holds every variable of
the model and every replica's own copy of each optimizer variable (delta mode
with Adam: the moments differ between replicas), each epoch's batches are the same
whether or not the run was interrupted (the pipeline starts at `saved_epoch`,
one seeded order per epoch), and each step is deterministic (the same
collectives in the same order, float64 tree partials).
"""

import json
import os
import signal
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
from tf_adasum.resume import replica_states

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


def _job(strategy, seed, mode="gradient", inner=lambda: keras.optimizers.Adam(0.01), combiner="adasum"):
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
        optimizer = tf_adasum.AdasumOptimizer(inner(), mode=mode, combiner=combiner)
        model.compile(optimizer=optimizer, loss="mse")
    return model


def _fit(model, folder, callbacks=(), **options):
    """Epochs saved_epoch(folder)..EPOCHS-1, each its own seeded order of the
    batches (a backup inside an epoch: the callback skips the batches it holds)."""
    x, y = simulation_data(STEPS)
    start = backup.saved_epoch(folder)
    order = np.concatenate([np.random.default_rng(e).permutation(STEPS * BATCH) for e in range(start, EPOCHS)])
    dataset = tf.data.Dataset.from_tensor_slices((x[order], y[order])).batch(BATCH)
    restoring = backup.BackupAndRestore(folder, **options)
    callbacks = [restoring, *callbacks]
    model.fit(dataset, epochs=EPOCHS, steps_per_epoch=STEPS, shuffle=False, verbose=0, callbacks=callbacks)
    return restoring


def _state(model):
    """The weights, then every replica's copy of each optimizer variable."""
    copies = [c.numpy() for v in model.optimizer.variables for c in replica_states.local_copies(v)]
    return [v.numpy() for v in model.weights] + copies


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


def test_mirrored_strategy_resumes_exactly_in_delta_mode_with_adam(tmp_path):
    """Delta mode with Adam: each replica's moments are its own (they differ
    after one step) and each comes back from the backup's shard."""
    strategy_fn = lambda: mirrored(2)[0]  # noqa: E731
    resumed, reference = _interrupted_then_resumed(strategy_fn, tmp_path, 3, mode="delta")
    _assert_bitwise_equal(resumed, reference)
    model = _job(strategy_fn(), seed=1, mode="delta")
    _fit(model, tmp_path / "differ")
    moments = [replica_states.local_copies(v) for v in model.optimizer.variables if "momentum" in v.path]
    assert moments and all(c[0].numpy().tobytes() != c[1].numpy().tobytes() for c in moments)


class _Snapshot(keras.callbacks.Callback):
    """Records every replica's copy of each optimizer variable at the start of
    epoch `epoch` (after the backup's restore), then interrupts."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch, self.copies = epoch, None

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.copies = [[c.numpy() for c in replica_states.local_copies(v)] for v in self.model.optimizer.variables]
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("saved, resumed, combiner", [(2, 4, "adasum"), (4, 3, "adacons")])
def test_resume_at_another_replica_count(tmp_path, saved, resumed, combiner):
    """A backup of `saved` replicas restored on `resumed` in delta mode with
    Adam: the weights exact; replica j's copy of every variable of the inner
    optimizer (Adam's moments and step count) saved replica j mod N's,
    bitwise; the wrapper's own state as `model.load_weights` left it (replica
    0's; AdaCons' weights and step count restarted); then training goes on."""
    folder = tmp_path / "backup"
    snapshot, restored = _Snapshot(2), _Snapshot(2)
    model = _job(mirrored(saved)[0], seed=1, mode="delta", combiner=combiner)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(model, folder, [snapshot])
    other = _job(mirrored(resumed)[0], seed=2, mode="delta", combiner=combiner)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(other, folder, [restored])
    _assert_bitwise_equal([w.numpy() for w in other.weights], [w.numpy() for w in model.weights])
    inner = {id(v) for v in other.optimizer.inner_optimizer.variables}
    assert any("momentum" in v.path for v in other.optimizer.inner_optimizer.variables)
    for variable, before, after in zip(other.optimizer.variables, snapshot.copies, restored.copies):
        assert len(before) == saved and len(after) == resumed
        if id(variable) in inner:
            _assert_bitwise_equal(after, [before[j % saved] for j in range(resumed)])
        elif "adacons_steps" in variable.path:
            assert int(before[0]) > 0 and all(int(a) == 0 for a in after), variable.path  # restarted
        elif before[0].shape == after[0].shape:
            _assert_bitwise_equal(after, [before[0]] * resumed)  # replica 0's, from the weights file
    _fit(other, folder)  # and trains on to the end
    assert not folder.exists()


class _InterruptAtBatch(keras.callbacks.Callback):
    """Raises before the run's batch `number` (counted over the epochs from 0)."""

    def __init__(self, number):
        super().__init__()
        self.number, self.epoch = number, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch * STEPS + batch == self.number:
            raise RuntimeError("interrupted")


def test_resumes_inside_an_epoch_exactly(tmp_path):
    """save_freq=2 over epochs of 3 batches: killed before batch 9 (epoch 3's
    first), the backup holds 8 batches (epoch 2 and 2 of its batches); the
    resumed run reads epoch 2 from its start, trains on none of the two
    batches the backup holds, and ends on the uninterrupted run's weights and every replica's state;
    the step counter is epochs x steps."""
    strategy_fn = lambda: mirrored(2)[0]  # noqa: E731
    reference = _job(strategy_fn(), seed=1, mode="delta")
    _fit(reference, tmp_path / "reference", save_freq=2)
    folder = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_job(strategy_fn(), seed=1, mode="delta"), folder, [_InterruptAtBatch(9)], save_freq=2)
    assert backup.saved_position(folder) == (2, 2) and backup.saved_epoch(folder) == 2
    x, y = simulation_data(STEPS + 1)
    longer = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    with pytest.raises(ValueError, match="stands at batch 2 of epoch 2 of 3 batches; this `fit` has steps_per_epoch=4"):
        callback = backup.BackupAndRestore(folder, save_freq=2)
        _job(strategy_fn(), seed=2, mode="delta").fit(longer, epochs=EPOCHS, steps_per_epoch=4, callbacks=[callback])
    resumed = _job(strategy_fn(), seed=2, mode="delta")
    restoring = _fit(resumed, folder, save_freq=2)
    assert (restoring.restored_epoch, restoring.restored_batch) == (2, 2)
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * STEPS
    _assert_bitwise_equal(_state(resumed), _state(reference))


class _SigtermAtBatch(_InterruptAtBatch):
    """Sends this process SIGTERM as the run's batch `number` begins."""

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch * STEPS + batch == self.number:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_backs_up_after_its_batch_then_exits(tmp_path):
    """SIGTERM during batch 7: a backup after it, holding 8 batches (none lost),
    SystemExit(143), SIGTERM's handler given back; the resumed run ends on
    the uninterrupted run's state."""
    reference = _job(tf.distribute.get_strategy(), seed=1)
    _fit(reference, tmp_path / "reference")
    folder = tmp_path / "backup"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        _fit(_job(tf.distribute.get_strategy(), seed=1), folder, [_SigtermAtBatch(7)], save_before_preemption=True)
    assert exited.value.code == backup.PREEMPTED_EXIT_CODE == 143
    assert signal.getsignal(signal.SIGTERM) is before
    assert backup.saved_position(folder) == (2, 2)
    resumed = _job(tf.distribute.get_strategy(), seed=2)
    _fit(resumed, folder, save_before_preemption=True)
    assert int(resumed.optimizer.iterations.numpy()) == EPOCHS * STEPS
    _assert_bitwise_equal(_state(resumed), _state(reference))


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
    # The weights file's name holds random hex: it may sort before or after the replica file.
    names = sorted(os.listdir(folder), key=lambda name: (name.endswith(".npz"), name))
    assert names[0] == "backup.json" and names[2] == "notes.txt" and len(names) == 4, names
    assert names[1] != current and names[1].startswith("epoch-000002-") and names[1].endswith(".weights.h5")
    names[2:] = [names[3], names[2]]  # backup.json, the weights, the replica file, notes.txt
    assert names[2] == "epoch-000002-batch-000000.replicas-00000.npz"

    metadata = json.loads((folder / "backup.json").read_text())
    assert metadata["replicas"] == 1 and metadata["shards"][0]["file"] == names[2]
    os.remove(folder / names[2])
    with pytest.raises(ValueError, match=f"is damaged: .* names {names[2]} of .* but it is missing"):
        _fit(_job(tf.distribute.get_strategy(), seed=3), folder)
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


def test_a_backup_without_shards_restores_replica_0s_state(tmp_path):
    """Format 1 (before the shards): every replica takes replica 0's copies,
    as `model.load_weights` gives them."""
    folder = tmp_path / "backup"
    snapshot, restored = _Snapshot(2), _Snapshot(2)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_job(mirrored(2)[0], seed=1, mode="delta"), folder, [snapshot])
    metadata = json.loads((folder / "backup.json").read_text())
    for name in ("replicas", "variables", "shards"):
        del metadata[name]
    (folder / "backup.json").write_text(json.dumps({**metadata, "format": "tf_adasum.backup/1"}))
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_job(mirrored(2)[0], seed=2, mode="delta"), folder, [restored])
    for before, after in zip(snapshot.copies, restored.copies):
        _assert_bitwise_equal(after, [before[0], before[0]])
    assert any(b[0].tobytes() != b[1].tobytes() for b in snapshot.copies)


def test_a_failed_shard_is_an_error_and_the_last_backup_stays(tmp_path, monkeypatch):
    folder = tmp_path / "backup"
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(_job(tf.distribute.get_strategy(), seed=1), folder, [_Interrupt(2)])

    def full_disk(path, values):
        raise OSError("No space left on device")

    monkeypatch.setattr(backup.folder, "write_arrays", full_disk)
    with pytest.raises(OSError, match="No space left"):
        _fit(_job(tf.distribute.get_strategy(), seed=2), folder)
    assert backup.saved_epoch(folder) == 2 and not [n for n in os.listdir(folder) if n.startswith(".tmp-")]


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
    with pytest.raises(ValueError, match="an integer >= 1. Received: save_freq=0"):
        backup.BackupAndRestore(tmp_path, save_freq=0)
    with pytest.raises(ValueError, match="Received: save_freq='batch'"):
        backup.BackupAndRestore(tmp_path, save_freq="batch")
    with pytest.raises(TypeError, match="Received: delete_checkpoint='yes'"):
        backup.BackupAndRestore(tmp_path, delete_checkpoint="yes")
    with pytest.raises(TypeError, match="Received: save_before_preemption=1"):
        backup.BackupAndRestore(tmp_path, save_before_preemption=1)
    x, y = simulation_data(STEPS)
    model = _job(tf.distribute.get_strategy(), seed=1)
    endless = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat().filter(lambda a, b: True)
    with pytest.raises(ValueError, match="multiple of the model's `steps_per_execution`.* steps_per_execution=2"):
        model.compile(optimizer=model.optimizer, loss="mse", steps_per_execution=2)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        model.fit(
            dataset,
            epochs=1,
            steps_per_epoch=3,
            verbose=0,
            shuffle=False,
            callbacks=[backup.BackupAndRestore(tmp_path, save_freq=2)],
        )
    model = _job(tf.distribute.get_strategy(), seed=1)
    with pytest.raises(ValueError, match="pass `steps_per_epoch` to `fit`. Received: save_freq=2"):
        model.fit(
            endless.take(STEPS),
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[backup.BackupAndRestore(tmp_path, save_freq=2)],
        )
    assert backup.saved_epoch(tmp_path / "missing") == 0


def test_missing_keras_attribute_is_a_loud_error(tmp_path):
    model = _job(tf.distribute.get_strategy(), seed=1)
    del model._initial_epoch
    with pytest.raises(RuntimeError, match="keras.Model._initial_epoch"):
        _fit(model, tmp_path)


def _checked(index, count, epochs, failed=(), own_error=None):
    """`_agree` on process `index` when the processes' sum gives `epochs` and `failed`."""
    callback = backup.BackupAndRestore("unused")
    totals = [float(e) for e in epochs] + [float(j in failed) for j in range(count)] + [1.0] * count + [0.0] * count
    callback._processes = Processes("worker", index, count, lambda values, what: totals)
    position = callback._agree(backup.Position(epochs[index], 0), own_error)
    assert callback._first_replica == index  # one replica a process
    return position.epoch


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
    assert not replica_states.reading_communicates(model.weights)
    assert not replica_states.reading_communicates([first])
    assert replica_states.reading_communicates([*model.weights, summed])


# -- real processes ------------------------------------------------------------------------


#: Which of the writer's two deaths each engine's chain gets (the file
#: protocol is the same on both; each engine also loses its other process).
WRITER_FAULTS = {"workers": "inside", "mpi": "between"}
KILLED = 23


#: Chains whose step 2 cuts worker 1's link on an emulated host instead of killing it.
#: (A host's link taken down: tests/test_elastic.py, under mpirun, with the relaunch.)
LINK_FAULTS = {"hosts-link-trickle": "trickle"}
#: Their collective timeout: every worker must fail within it after the cut (plus start-up
#: slack). Each chain waits it out once, so it is short; the multi-worker failure tests use 10 s.
LINK_FAULT_TIMEOUT = 12


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
    weights = [n for n in names if n.startswith("epoch-") and n.endswith(".weights.h5")]
    return metadata, [n for n in names if n.startswith(".tmp-")], weights


@pytest.mark.multiworker
def test_sigterm_to_one_process_backs_up_every_process(tmp_path):
    """Worker 1 alone gets SIGTERM during batch 7: every worker backs up after
    that batch (8 of 12 held: none lost) and exits with 143; the relaunch
    resumes at epoch 2 batch 2 and ends on the uninterrupted run's weights
    and each worker's own optimizer state, with 12 steps counted. (Under
    mpirun, the resize of tests/test_logical_replicas.py sends the same notice, SIGUSR1.)"""
    env = worker_env()
    command = [sys.executable, "-m", "tf_adasum.launch", "-n", "2"]
    outputs = []
    for step in (1, 2):
        run = [*command, BACKUP_WORKER, str(step), str(tmp_path), "preempt"]
        result = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
        outputs.append(result.stdout[-3000:] + result.stderr[-3000:])
        assert (result.returncode != 0) == (step == 1), "\n".join(outputs)
        if step == 1:
            assert backup.saved_position(tmp_path / "backup") == (2, 2), "\n".join(outputs)
            assert not [p for p in os.listdir(tmp_path) if p.startswith("preempt_rank")]
    for report in _reports(tmp_path, "preempt"):
        assert report == {"restored": [2, 2], "iterations": EPOCHS * STEPS}
    for rank in range(2):
        reference, final = (np.load(tmp_path / f"{name}_rank{rank}.npz") for name in ("reference", "final"))
        _assert_bitwise_equal([final[f] for f in final.files], [reference[f] for f in reference.files])


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
    epoch 2 (or, on emulated hosts, its link cut to a trickle:
    every worker fails within the collective timeout and the launcher exits
    non-zero), then the run completes with the weights and every process's
    own optimizer state (delta mode: Adam's moments differ between the
    processes) of an uninterrupted run; then a folder per process is an
    error on every process at its first backup."""
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
            # The socket transport's own error, raised inside a tf.numpy_function, reaches
            # the worker as TensorFlow's UnknownError with the class and our text in it.
            kinds = ("DeadlineExceededError", "UnavailableError")
            ours = any(f"{kind}: tf_adasum socket transport" in error["message"] for kind in kinds)
            assert error["type"] in kinds or (error["type"] == "UnknownError" and ours), error
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
    references = [np.load(tmp_path / f"reference_rank{rank}.npz") for rank in range(2)]
    weights = 2  # the Dense layer's kernel and bias come first (`save_state`)
    _assert_bitwise_equal(*[[r[f] for f in r.files[:weights]] for r in references])  # the weights: one model
    assert any(references[0][f].tobytes() != references[1][f].tobytes() for f in references[0].files)
    for rank, reference in enumerate(references):  # every process's own optimizer state, restored
        final = np.load(tmp_path / f"final_rank{rank}.npz")
        assert final.files == reference.files
        _assert_bitwise_equal([final[f] for f in final.files], [reference[f] for f in reference.files])

    label = "rank" if engine == "mpi" else "worker"
    for rank, report in enumerate(_reports(tmp_path, "mismatch")):  # a folder per process
        assert report["raised"] and report["type"] == "ValueError", report
        assert (
            f"{label} 0, {label} 1 cannot see every process's part of the backup in {tmp_path}/own"
            in (report["message"])
        )
        assert f"this one misses epoch-000001-batch-000000.replicas-{1 - rank:05d}.npz" in report["message"]
