"""Logical replicas (issue 40): a job of L = 8 replicas
(`tf_adasum.SimulatedReplicas`) gives the same model on any number of MPI
ranks or MultiWorkerMirroredStrategy workers that holds them, bit for bit,
and an elastic run of it (``tf-adasum launch [--mpirun] --logical-replicas
8``) through resizes and spares ends with the model of an uninterrupted
run. The workers are `tests/workers/logical_worker.py`."""

import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from multiprocess import EMULATED_HOSTS_REFUSAL, TESTS, load_worker, worker_env

import tf_adasum
from tf_adasum import launch, reference
from tf_adasum.engines.base import pair_rule
from tf_adasum.engines.simulated import SimulatedEngine
from tf_adasum.launcher.elastic import REPLICAS_VARIABLE, holding_counts
from tf_adasum.launcher.mpirun import mpirun_command
from tf_adasum.step import keras_step
from tf_adasum.step.replica_loop import replica_seed, seed_after_step
from tf_adasum.tree import rvh
from tf_adasum.tree.buckets import make_buckets, pack

WORKER = os.path.join(TESTS, "workers", "logical_worker.py")
sys.path.insert(0, os.path.join(TESTS, "workers"))
from elastic_worker import EPOCHS, STEPS  # noqa: E402

logical_worker = load_worker(WORKER)


def _states(folder, prefix="rank"):
    """Every process's file merged; each key's value checked equal wherever two processes hold it."""
    merged = {}
    for path in sorted(folder.glob(f"{prefix}*.npz")):
        with np.load(path) as values:
            for key in values.files:
                if key in merged:
                    assert merged[key].tobytes() == values[key].tobytes(), (path, key)
                merged[key] = values[key]
    return merged


def _run(processes, out, combiner="adasum", mode="delta", launcher="mpirun"):
    """The worker's states on `processes` MPI ranks (`launcher` "mpirun") or
    workers of TF_CONFIG ("workers": ``tf-adasum launch -n``)."""
    out.mkdir()
    command = [sys.executable, WORKER, str(out), combiner, mode]
    if launcher == "mpirun":
        command = mpirun_command(processes) + command
    else:
        command = [sys.executable, launch.__file__, "-n", str(processes), *command[1:]]
    result = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return _states(out)


def _in_this_process(out, combiner="adasum", mode="delta"):
    """The worker's states with all 8 replicas in one process, run here (as
    ``python logical_worker.py`` runs it, without a process's start-up)."""
    out.mkdir()
    with warnings.catch_warnings():  # Keras' note on `fit`'s default shuffle=True, which a process's stderr hid
        warnings.filterwarnings("ignore", "`shuffle=True` was passed", UserWarning)
        logical_worker.main(str(out), combiner, mode)
    return _states(out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The states of the job in one process (Adasum, delta mode): what every
    process count and every elastic run must give."""
    return _in_this_process(tmp_path_factory.mktemp("logical") / "one")


@pytest.fixture(scope="module")
def one_process_adacons(tmp_path_factory):
    """The same with AdaCons in gradient mode."""
    return _in_this_process(tmp_path_factory.mktemp("logical") / "one", "adacons", "gradient")


def _assert_same(actual, expected, what):
    assert sorted(actual) == sorted(expected), what
    differing = [key for key in expected if actual[key].tobytes() != expected[key].tobytes()]
    assert not differing, (what, differing)


@pytest.mark.mpi
def test_a_job_of_8_replicas_gives_the_same_model_on_1_2_4_and_8_processes(tmp_path, one_process):
    """Weights and every replica's Adam state after 24 steps (delta mode),
    bitwise, whatever the process count; the ranks started from weights of
    their own (the broadcast made rank 0's the start)."""
    one = one_process
    assert len([key for key in one if key.startswith("replica")]) == 8 * 9  # two moments of 4 variables, iterations
    for processes in (2, 4, 8):
        _assert_same(_run(processes, tmp_path / f"p{processes}"), one, f"{processes} processes")
        held = [json.loads((tmp_path / f"p{processes}" / f"rank{r}.json").read_text()) for r in range(processes)]
        assert held == [{"first": r * 8 // processes, "count": 8 // processes} for r in range(processes)]


@pytest.mark.mpi
def test_adacons_in_gradient_mode_gives_the_same_model_on_2_processes(tmp_path, one_process_adacons):
    """AdaCons' gathers and sums over the processes: the same bits as in one."""
    _assert_same(_run(2, tmp_path / "two", "adacons", "gradient"), one_process_adacons, "")


@pytest.mark.multiworker
def test_adacons_gives_the_same_model_on_2_workers(tmp_path, one_process_adacons):
    """On the workers of TF_CONFIG (``tf-adasum launch -n 2``), which
    exchange over TF collective ops: AdaCons in gradient mode (the blocks
    gathered, its sums), the same bits as in one process. (Adasum in delta
    mode on 4 and 2 workers: the elastic test below.)"""
    two = _run(2, tmp_path / "two", "adacons", "gradient", launcher="workers")
    _assert_same(two, one_process_adacons, "2 workers")
    held = [json.loads((tmp_path / "two" / f"rank{r}.json").read_text()) for r in range(2)]
    assert held == [{"first": 0, "count": 4}, {"first": 4, "count": 4}]


@pytest.mark.parametrize(
    "launcher", [pytest.param("mpirun", marks=pytest.mark.mpi), pytest.param("workers", marks=pytest.mark.multiworker)]
)
def test_an_elastic_run_through_a_spare_and_two_resizes_ends_with_the_uninterrupted_model(
    tmp_path, launcher, one_process
):
    """4 ranks (or workers); the discovery says 3 (2 of them hold 8
    replicas, one spare): a resize to 2 (SIGUSR1, which mpirun forwards:
    every process backs up and exits); then 4: a resize to 4. The last
    round's model and every replica's optimizer state (Adam, and dropout
    drawn per replica) are the uninterrupted run's, bitwise, and the step
    counter is epochs x steps. Across 2 emulated hosts where namespaces can
    be made (each round's hosts made anew), else on this machine. (A SIGKILL
    relaunch: test_elastic.py, and with logical replicas,
    benchmarks/elastic_chaos.py.)"""
    expected = one_process
    out = tmp_path / "elastic"
    out.mkdir()
    (out / "slots").write_text("4\n")
    (out / "plan.json").write_text(json.dumps({"slots": [[0, 2, 3], [1, 2, 4]]}))
    arguments = ["-n", "4", "--logical-replicas", "8", "--min-workers", "2"]
    arguments += ["--mpirun"] if launcher == "mpirun" else []
    if EMULATED_HOSTS_REFUSAL is None:
        arguments += ["--hosts", "2", "--link", "1gbit"]
    arguments += ["--discover", f"cat {out / 'slots'}", WORKER, str(out), "adasum", "delta", str(out / "plan.json")]
    result = subprocess.run(
        [sys.executable, launch.__file__, *arguments], env=worker_env(), capture_output=True, text=True, timeout=900
    )
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    rounds = []
    while (out / f"restored{len(rounds)}_rank0.json").exists():
        rounds.append(json.loads((out / f"restored{len(rounds)}_rank0.json").read_text()))
    assert [r["workers"] for r in rounds] == [4, 2, 4], (rounds, output)
    assert "resize to 2 workers" in result.stderr and "resize to 4 workers" in result.stderr, output
    if EMULATED_HOSTS_REFUSAL is None:
        on_hosts = "2 MPI ranks on 2 emulated hosts" if launcher == "mpirun" else "the workers run on 2 emulated hosts"
        assert on_hosts in result.stderr, output
    _assert_same(_states(out, "final_rank"), expected, "the elastic run")
    assert json.loads((out / "final_rank0.json").read_text()) == {"iterations": EPOCHS * STEPS, "round": 2}


def test_the_launchers_counts_are_the_trees_blocks():
    """The launcher's rule (no numpy) against the reference's, and what it means."""
    for replicas in range(1, 70):
        assert holding_counts(replicas) == sorted(replicas // b for b in reference.block_sizes(replicas)), replicas
    assert holding_counts(8) == [1, 2, 4, 8] and holding_counts(6) == [1, 3, 6] and holding_counts(12) == [1, 3, 6, 12]


def test_the_tree_over_blocks_is_the_tree_bit_for_bit():
    rng = np.random.default_rng(3)
    for replicas in (6, 8, 12):
        values = [rng.normal(size=7).astype(np.float32) for _ in range(replicas)]
        whole = reference.tree_reduce(values, reference.adasum_pair)
        for size in reference.block_sizes(replicas):
            firsts = range(0, replicas, size)
            pair = reference.adasum_pair
            blocks = [reference.tree_with_blocks(values[p : p + size], pair, replicas, p) for p in firsts]
            for p in firsts:
                top = reference.tree_with_blocks(values[p : p + size], pair, replicas, p, lambda v, b=blocks: b)
                assert top.tobytes() == whole.tobytes(), (replicas, size, p)
    with pytest.raises(ValueError, match=r"Ranks 0..2 of 6 are not one block of the tree \(block sizes: \[1, 2, 6\]"):
        reference.tree_with_blocks(values[:3], reference.adasum_pair, 6, 0)


@pytest.mark.parametrize("replicas, size", [(6, 2), (12, 4), (12, 1), (8, 2), (8, 4)])
def test_the_tf_tree_over_blocks_is_the_whole_tree_bit_for_bit(replicas, size):
    """`rvh.reduce_on_one_device` over one block, the others' values gathered
    (here computed beforehand), against the whole tree on one device; the
    trees of 6 and 12 fold pairs inside the blocks."""
    rng = np.random.default_rng(replicas + size)
    values = [[tf.constant(rng.normal(size=[5, 3]).astype(np.float32))] for _ in range(replicas)]
    (bucket,) = make_buckets([tf.float32], [15], replicas, 0)
    flats = [pack(v, bucket) for v in values]
    rule = pair_rule("adasum")
    whole = rvh.reduce_on_one_device(flats, bucket, rule)
    blocks = [
        rvh.reduce_on_one_device(flats[p : p + size], bucket, rule, replicas, p, None) for p in range(0, replicas, size)
    ]
    for p in range(0, replicas, size):
        top = rvh.reduce_on_one_device(flats[p : p + size], bucket, rule, replicas, p, lambda v: tf.stack(blocks))
        assert top.numpy().tobytes() == whole.numpy().tobytes(), p
    expected = reference.adasum_tree([[v[0].numpy()] for v in values])[0].reshape(-1)
    np.testing.assert_allclose(whole.numpy()[:15], expected, rtol=1e-5)


def test_each_replica_draws_a_stream_of_its_own():
    """Keras reduces a seed's words modulo 2^31 - 2: the streams of replicas
    0..3 over two steps, 6 draws each, never meet."""
    generator = keras.random.SeedGenerator(12345)
    start, draws = tf.identity(generator.state.value), set()
    state = start
    for _ in range(2):
        for replica in range(4):
            generator.state.assign(replica_seed(state, replica))
            draws.update(float(keras.random.uniform([], seed=generator)) for _ in range(6))
        state = seed_after_step(state, 4)
    assert len(draws) == 2 * 4 * 6


def test_one_process_advances_the_generators_by_the_replicas_per_step():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    trainer = tf_adasum.SimulatedReplicas(model, 4, backend="local")
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    (state,) = keras_step.seed_states(trainer)
    before = state.numpy()
    trainer.fit(np.ones((3 * 8, 3), np.float32), np.ones((3 * 8, 2), np.float32), batch_size=8, verbose=0)
    assert list(state.numpy()) == [before[0] + 3 * 4, before[1]]


class _Ranks:
    """Stands in for an engine of one replica per process (only what the check reads)."""

    local_replicas = 1

    def __init__(self, count):
        self.num_replicas = count

    def replica_id(self):
        return 0


def test_processes_that_cannot_hold_the_replicas_are_one_error():
    with pytest.raises(ValueError, match=r"3 processes cannot hold num_replicas=8 .* can are \[1, 2, 4, 8\]"):
        SimulatedEngine(8, processes=_Ranks(3))
    with pytest.raises(ValueError, match=r"2 processes cannot hold num_replicas=6 .* can are \[1, 3, 6\]"):
        SimulatedEngine(6, processes=_Ranks(2))
    assert SimulatedEngine(6, processes=_Ranks(3)).local_replicas == 2


def test_the_launchers_replica_count_must_be_the_models(monkeypatch):
    monkeypatch.setenv(REPLICAS_VARIABLE, "8")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"TF_ADASUM_LOGICAL_REPLICAS=8 .* num_replicas=4"):
        tf_adasum.SimulatedReplicas(model, 4)
    with pytest.raises(ValueError, match=r"`backend` must be one of \('auto', 'local', 'mpi', 'workers'\). Rec"):
        tf_adasum.SimulatedReplicas(model, 8, backend="tf")


def test_workers_that_cannot_run_the_replicas_are_one_error_before_any_exchange(monkeypatch):
    """No TF_CONFIG; 3 workers for 8 replicas; a program that ran TensorFlow
    before creating its MultiWorkerMirroredStrategy (this one)."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"it names 0 with this process among them\. Received: TF_CONFIG=''"):
        tf_adasum.SimulatedReplicas(model, 8, backend="workers")

    def cluster(workers):
        spec = {"worker": [f"localhost:{20000 + i}" for i in range(workers)]}
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "worker", "index": 0}}))

    cluster(3)
    with pytest.raises(ValueError, match=r"3 processes cannot hold num_replicas=8 .* can are \[1, 2, 4, 8\]"):
        tf_adasum.SimulatedReplicas(model, 8)  # "auto": the workers of TF_CONFIG
    cluster(2)
    with pytest.raises(RuntimeError, match=r"create `tf.distribute.MultiWorkerMirroredStrategy\(\)` first"):
        tf_adasum.SimulatedReplicas(model, 8)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["-n", "3", "--mpirun", "--logical-replicas", "8"], "-n must be a count of workers that can hold --logical"),
        (["-n", "2", "--mpirun", "--logical-replicas", "0"], "--logical-replicas must be an int >= 1. Received:"),
        (
            ["-n", "4", "--mpirun", "--logical-replicas", "8", "--min-workers", "3", "--discover", "echo 4"],
            "[1, 2, 4, 8]",
        ),
    ],
)
def test_bad_logical_replica_arguments_are_one_error(tmp_path, arguments, message):
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w')\n")
    command = [sys.executable, launch.__file__, *arguments, str(script)]
    result = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "started").exists()
