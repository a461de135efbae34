"""Elastic runs of ``tf-adasum launch`` (issue 40): workers relaunched after a
failure, at the size a discovery command gives, resuming from their backup.

The scenarios of torchrun's and Horovod elastic's tests, with our exactness:
a worker SIGKILLed mid-run, or its emulated host's link cut under
``--mpirun`` (the run completes on the weights and every
worker's optimizer state of an uninterrupted run, bitwise, the step counter
epochs x steps); a discovery schedule 2 -> 4 -> 2 giving exactly those sizes
(after each resize every worker holds the backup's weights and its saved
replica's optimizer state by the rule, bitwise); below the minimum; every
worker failing; the restart limit; a discovery command that fails or prints
garbage, mid-run. The launcher runs as ``python tf_adasum/launch.py`` (no
TensorFlow in the launcher); the TensorFlow workers are
`tests/workers/elastic_worker.py`.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from multiprocess import TESTS, needs_emulated_hosts, worker_env

from tf_adasum import launch

LAUNCH_PY = launch.__file__
ELASTIC_WORKER = os.path.join(TESTS, "workers", "elastic_worker.py")
EPOCHS, STEPS = 4, 6


def _launch(arguments, tmp_path, timeout=600, env=None):
    command = [sys.executable, LAUNCH_PY, *arguments]
    return subprocess.run(command, env=env or worker_env(), capture_output=True, text=True, timeout=timeout)


def _train(tmp_path, name, arguments, plan, env=None):
    out = tmp_path / name
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    (out / "slots").write_text("2\n")
    result = _launch([*arguments, ELASTIC_WORKER, str(out), str(out / "plan.json")], tmp_path, env=env)
    return out, result


def _arrays(path):
    with np.load(path) as values:
        return [values[f"arr_{i}"] for i in range(len(values.files))]


def _assert_bitwise_equal(actual, expected, what):
    assert len(actual) == len(expected), what
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert a.tobytes() == b.tobytes(), (what, i, a, b)


def _rounds(out, rank=0):
    rounds = []
    while (out / f"restored{len(rounds)}_rank{rank}.json").exists():
        rounds.append(json.loads((out / f"restored{len(rounds)}_rank{rank}.json").read_text()))
    return rounds


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param("kill", marks=pytest.mark.multiworker),
        pytest.param("cut", marks=[pytest.mark.mpi, needs_emulated_hosts]),
    ],
)
def test_a_failed_worker_is_relaunched_and_the_run_ends_exactly(tmp_path, fault):
    """Round 0 first trains the reference, uninterrupted, in a folder of its
    own; then worker 1 is SIGKILLed as batch 9 begins ("kill", on this
    machine), or, under ``--mpirun`` across 2 emulated hosts ("cut"), rank
    1's host loses its link then: both ranks' MPI calls time out
    (``TF_ADASUM_MPI_TIMEOUT``) and mpirun fails. Round 1 (on hosts made
    anew) resumes from the backup of 8 batches."""
    plan = {fault: [0, 1, 9], "reference": True}
    arguments = ["-n", "2", "--max-restarts", "1"]
    env = None
    if fault == "cut":
        arguments += ["--mpirun", "--hosts", "2", "--link", "1gbit"]
        env = worker_env(TF_ADASUM_MPI_TIMEOUT="15")
    out, result = _train(tmp_path, "elastic", arguments, plan, env)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    assert "round 1: 2 workers" in result.stderr and "restart 1 of 1" in result.stderr, output
    rounds = _rounds(out)
    assert [r["workers"] for r in rounds] == [2, 2] and rounds[1]["restored"] == [1, 2], rounds  # 8 of 24 batches
    for rank in range(2):
        assert json.loads((out / f"final_rank{rank}.json").read_text()) == {"iterations": EPOCHS * STEPS, "round": 1}
        expected = _arrays(out / f"reference_rank{rank}.npz")
        _assert_bitwise_equal(_arrays(out / f"final_rank{rank}.npz"), expected, f"worker {rank}")


@pytest.mark.multiworker
def test_a_discovery_schedule_2_4_2_resizes_at_backups(tmp_path):
    """Worker 0 writes 4, then 2, to the file the discovery command prints:
    each change ends the round by SIGUSR1 (every worker backs up and exits),
    and the next has exactly that many workers; after each resize the weights
    are the backup's and worker j's optimizer state saved worker j mod N's.
    (Under mpirun, which forwards SIGUSR1 to its ranks, the resizes of
    `tests/test_logical_replicas.py`.)"""
    plan = {"slots": [[0, 3, 4], [1, 3, 2]]}  # after 3 batches trained in rounds 0 and 1
    arguments = ["-n", "4", "--min-workers", "2", "--discover", f"cat {tmp_path / 'elastic' / 'slots'}"]
    out, result = _train(tmp_path, "elastic", arguments, plan)
    output = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    rounds = _rounds(out)
    assert [r["workers"] for r in rounds] == [2, 4, 2], (rounds, output)
    assert "resize to 4 workers" in result.stderr and "resize to 2 workers" in result.stderr, output
    weights = 2  # kernel and bias, first in each state
    for number in (1, 2):
        saved_workers, workers = rounds[number - 1]["workers"], rounds[number]["workers"]
        saved = [_arrays(out / f"preempted{number - 1}_rank{j}.npz") for j in range(saved_workers)]
        for rank in range(workers):
            restored = _arrays(out / f"restored{number}_rank{rank}.npz")
            _assert_bitwise_equal(restored[:weights], saved[0][:weights], f"round {number} worker {rank} weights")
            source = saved[rank % saved_workers]
            _assert_bitwise_equal(restored[weights:], source[weights:], f"round {number} worker {rank} state")
    for rank in range(2):
        assert json.loads((out / f"final_rank{rank}.json").read_text()) == {"iterations": EPOCHS * STEPS, "round": 2}


_FAILING = """import os, sys
with open(sys.argv[1], "a") as f:
    f.write(os.environ["TF_ADASUM_ELASTIC_ROUND"] + "\\n")
sys.exit(3)
"""


def test_every_worker_failing_ends_at_the_restart_limit(tmp_path):
    script = tmp_path / "failing.py"
    script.write_text(_FAILING)
    result = _launch(["-n", "2", "--max-restarts", "2", str(script), str(tmp_path / "rounds")], tmp_path, timeout=120)
    assert result.returncode == 3, result.stderr
    # Each round's first failure stops the other worker, which may not have written its line yet.
    assert set((tmp_path / "rounds").read_text().split()) == {"0", "1", "2"}
    assert "the restart limit (--max-restarts 2) is reached" in result.stderr


def test_below_the_minimum_is_one_error_after_the_wait(tmp_path):
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w')\n")
    started = time.monotonic()
    result = _launch(["-n", "2", "--min-workers", "2", "--discover", "echo 1", "--wait", "2", str(script)], tmp_path)
    assert result.returncode == 2 and time.monotonic() - started < 30
    assert "1 workers available, fewer than --min-workers 2, for 2 s" in result.stderr, result.stderr
    assert not (tmp_path / "started").exists()


_SLEEPER = """import json, os, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
open(os.path.join(sys.argv[1], f"started{index}"), "w").close()
time.sleep(300)
"""


@pytest.mark.parametrize(
    "answer, message",
    [
        ("exit 5", "exited with code 5"),
        ("echo two workers", "must print the number of workers that can run now (one integer, e.g. 4). Received: 'two"),
    ],
)
def test_a_discovery_failing_mid_run_stops_the_run(tmp_path, answer, message):
    """The discovery answers 2, then (the test rewrites its script) fails or
    prints garbage: the launcher stops the workers and exits 2 with the error."""
    discovery = tmp_path / "discover.sh"
    discovery.write_text("echo 2\n")
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    command = [sys.executable, LAUNCH_PY, "-n", "2", "--discover", f"sh {discovery}", str(script), str(tmp_path)]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len([p for p in os.listdir(tmp_path) if p.startswith("started")]) < 2:
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()
        time.sleep(0.1)
    (tmp_path / "next.sh").write_text(answer + "\n")
    os.replace(tmp_path / "next.sh", discovery)  # the launcher never reads it half-written
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 2, stderr
    assert f"tf-adasum launch: error: the discovery command 'sh {discovery}' {message}" in stderr, stderr


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["-n", "2", "--min-workers", "3"], "--min-workers must not exceed the workers asked for (-n). Received: "),
        (["-n", "2", "--min-workers", "1"], "--min-workers below the workers asked for needs --discover"),
        (["-n", "2", "--max-restarts", "-1"], "--max-restarts must be an int >= 0. Received: --max-restarts -1"),
        (["-n", "2", "--discover", " "], "--discover must be a shell command. Received: --discover ' '"),
        (["-n", "2", "--max-restarts", "1", "--wait", "-1"], "--wait must be a number >= 0"),
        (["-n", "3", "--hosts", "2", "--min-workers", "1", "--discover", "echo 3"], "--min-workers >= --hosts"),
        (["-n", "3", "--hosts", "2", "--mpirun", "--min-workers", "1", "--discover", "echo 3"], "at least one worker"),
    ],
)
def test_bad_elastic_arguments_are_one_error(tmp_path, arguments, message):
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w')\n")
    result = _launch([*arguments, str(script)], tmp_path, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "started").exists()
