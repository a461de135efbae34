"""MultiWorkerMirroredStrategy across real worker processes on localhost, and
the `tf-adasum launch` launcher. Each test starts its own cluster."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from multiprocess import (
    WORKER,
    check_collective,
    check_diagnostics,
    check_evaluation_engine,
    check_over_sockets,
    check_train,
    read_reports,
    transport_threads,
    worker_env,
)

from tf_adasum import launch, reference
from tf_adasum.launcher import tf_config

pytestmark = pytest.mark.multiworker

#: Collective timeout inside the workers for the failure tests (seconds).
FAILURE_TIMEOUT = 10


def _launch(n, tasks, out, timeout=600, **env):
    command = [sys.executable, "-m", "tf_adasum.launch", "-n", str(n), WORKER, tasks, str(out)]
    result = subprocess.run(command, env=worker_env(**env), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-6000:]
    return result.stdout


@pytest.mark.parametrize("n, compression", [(2, "float16"), (3, "bfloat16")])
def test_compressed_collective_across_workers(n, compression, tmp_path):
    # Swaps in pieces of 1 KiB of the wire format: several per level.
    _launch(n, "collective", tmp_path, TEST_COMPRESSION=compression, TEST_PIECE_BYTES="1024")
    check_collective(tmp_path, n, compression)
    check_over_sockets(tmp_path, n)


# N = 2 and 3 across workers: the compressed collective (N = 3: the fold), the
# backup test (N = 2, bitwise against an uninterrupted run) and the failure
# tests; the training check of N = 2 and 3 runs under mpirun.
@pytest.mark.parametrize("n", [4])
def test_collective_and_training_across_workers(n, tmp_path):
    # Swaps in pieces of 1 KiB over the socket transport: several per level.
    output = _launch(n, "collective,train,diagnostics", tmp_path, TEST_PIECE_BYTES="1024")
    for index in range(n):
        assert f"[worker {index}] " in output
    check_collective(tmp_path, n)
    check_over_sockets(tmp_path, n)
    # One device per worker: the hierarchical combine (mean inside a worker,
    # Adasum across workers) is Adasum over the workers.
    check_train(tmp_path, n, hierarchical_combine=reference.adasum_tree)
    initial = [np.load(tmp_path / f"train_rank{r}.npz")["plain_initial_kernel"] for r in range(n)]
    assert all(np.array_equal(i, initial[0]) for i in initial)  # the strategy broadcasts initial values
    check_diagnostics(tmp_path, n)


@pytest.mark.parametrize("n", [3, 4])
def test_collective_over_tf_collective_ops_across_workers(n, tmp_path):
    # TF_ADASUM_WORKER_TRANSPORT=collective: TF collective ops over gRPC, each
    # message between workers split into pieces of 1 KiB (several per message);
    # then the same combine over the socket transport, bitwise the same.
    env = {"TF_ADASUM_WORKER_TRANSPORT": "collective", "TEST_REMOTE_MESSAGE_BYTES": "1024"}
    _launch(n, "collective", tmp_path, TEST_ALSO_OVER_SOCKETS="1", **env)
    check_collective(tmp_path, n)
    assert transport_threads(tmp_path, n) == [[]] * n  # none before the second combine
    for r in range(n):
        results = np.load(tmp_path / f"collective_rank{r}.npz")
        bits = [k for k in results.files if k.startswith("bits")]
        assert bits and all(results[k].tobytes() == results[f"socket_{k}"].tobytes() for k in bits), r


def _collective_results(out, n):
    return [np.load(out / f"collective_rank{r}.npz") for r in range(n)]


def test_socket_port_is_the_tf_port_plus_the_offset_on_the_specified_address(two_processes):
    """TF_ADASUM_WORKER_PORT_OFFSET: each worker's socket transport listens on
    its TF_CONFIG port plus the offset, on the address TF_CONFIG names
    (localhost), so a firewall that opens those ports lets it through. (The
    launch of 2 workers that other tests read too sets the offset to 1000.)"""
    tmp_path = two_processes("tf-adasum launch")
    check_collective(tmp_path, 2)
    check_over_sockets(tmp_path, 2)
    for r, result in enumerate(_collective_results(tmp_path, 2)):
        host, port = result["listener"]
        assert int(port) == int(result["tf_port"]) + 1000, r
        assert host in ("127.0.0.1", "::1"), r  # localhost, not every interface
        assert list(result["fallback_warnings"]) == [], r


def test_an_unusable_socket_port_makes_every_worker_fall_back_together(tmp_path):
    """Worker 1's socket port is taken: every worker warns once, naming the
    port variable, and combines over TF collective ops; the results are right
    and no worker hangs."""
    _launch(3, "collective", tmp_path, TF_ADASUM_WORKER_PORT_OFFSET="1000", TEST_OCCUPY_SOCKET_PORT="1")
    check_collective(tmp_path, 3)
    for r, result in enumerate(_collective_results(tmp_path, 3)):
        (warning,) = result["fallback_warnings"]
        assert "TF_ADASUM_WORKER_PORT_OFFSET" in warning and "collective ops instead" in warning, warning
        tf_port = int(json.loads(result["tf_config"].item())["cluster"]["worker"][1].rsplit(":", 1)[1])
        assert f"cannot listen: worker process 1 on localhost:{tf_port + 1000}" in warning, warning
        assert not any(name.startswith("tf_adasum reader") for name in result["transport_threads"]), r
        assert list(result["unclosed_sockets"]) == [], r  # the listeners no mesh took were closed, not dropped


def test_mismatched_variables_raise_on_every_worker(two_processes):
    for report in read_reports(two_processes("tf-adasum launch"), "mismatch", 2):
        assert report["raised"] and report["type"] == "ValueError", report
        assert "trainable variables differ across the workers" in report["message"]
        assert report["seconds"] < 30


def _start_cluster(n, task, out, **env):
    """The workers of a localhost cluster, started directly (no launcher);
    worker i's output goes to ``out/worker{i}.log``."""
    workers = []
    for index, config in enumerate(tf_config.cluster_configs(n)):
        with open(os.path.join(out, f"worker{index}.log"), "w") as log:
            workers.append(
                subprocess.Popen(
                    [sys.executable, WORKER, task, str(out)],
                    env=worker_env(TF_CONFIG=config, **env),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return workers


def _logs(out, n):
    return "\n".join(open(os.path.join(out, f"worker{i}.log")).read()[-3000:] for i in range(n))


def test_killed_worker_makes_the_others_fail_within_the_timeout(tmp_path):
    workers = _start_cluster(2, "killed", tmp_path, TEST_COLLECTIVE_TIMEOUT=str(FAILURE_TIMEOUT))
    codes = [w.wait(timeout=300) for w in workers]
    assert codes == [0, 17], _logs(tmp_path, 2)  # worker 0 reported its error; worker 1 died with os._exit(17)
    report = read_reports(tmp_path, "killed", 1)[0]
    assert report["raised"], report
    assert report["type"] in ("UnavailableError", "DeadlineExceededError"), report
    # The strategy's heartbeat, a collective's timeout, or (when the combine
    # is where the others wait) the socket transport's closed connection.
    assert any(m in report["message"] for m in ("unhealthy", "timed out", "a worker failed or left")), report
    assert report["seconds"] < FAILURE_TIMEOUT + 60


def test_killed_worker_fails_a_combine_over_sockets_at_once(tmp_path):
    workers = _start_cluster(2, "killed_combine", tmp_path, TEST_COLLECTIVE_TIMEOUT=str(FAILURE_TIMEOUT))
    codes = [w.wait(timeout=300) for w in workers]
    assert codes == [0, 17], _logs(tmp_path, 2)
    report = read_reports(tmp_path, "killed_combine", 1)[0]
    # Raised inside a tf.numpy_function: TensorFlow reports it as UnknownError, with our text.
    assert report["raised"] and report["type"] == "UnknownError", report
    assert "tf_adasum socket transport" in report["message"] and "a worker failed or left" in report["message"]
    assert report["seconds"] < FAILURE_TIMEOUT, report  # the closed connection, not the timeout


def test_uneven_step_counts_end_in_an_error(tmp_path):
    workers = _start_cluster(2, "uneven", tmp_path, TEST_COLLECTIVE_TIMEOUT=str(FAILURE_TIMEOUT))
    assert [w.wait(timeout=300) for w in workers] == [0, 0], _logs(tmp_path, 2)
    report = read_reports(tmp_path, "uneven", 2)[0]
    # Rank 0's extra step waits for rank 1, which has left `fit`. Either the
    # collective times out, or, when rank 1's end-of-fit collective happens to
    # draw the same instance key first, TF reports the mismatch at once.
    timed_out = report["type"] == "DeadlineExceededError" and "timed out" in report["message"]
    mismatched = report["type"] == "InternalError" and "Collective instance" in report["message"]
    assert report["raised"] and (timed_out or mismatched), report
    assert report["seconds"] < FAILURE_TIMEOUT + 60


# -- the launcher (no TensorFlow in the workers) --------------------------------

_FAILING_SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    out = sys.argv[1]
    child = subprocess.Popen(["sleep", "300"])  # something the worker started
    with open(os.path.join(out, f"pids{index}"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    print("started", flush=True)
    if index == 1:
        time.sleep(1)
        sys.exit(3)
    time.sleep(300)
    """
)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split()[2] != "Z"


def test_launcher_stops_everything_when_a_worker_fails(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(_FAILING_SCRIPT)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "tf_adasum.launch", "-n", "3", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 3, result.stdout
    assert elapsed < 30, elapsed
    for index in range(3):
        assert f"[worker {index}] started" in result.stdout
    pids = [int(p) for i in range(3) for p in (tmp_path / f"pids{i}").read_text().split()]
    assert not [pid for pid in pids if _alive(pid)], "processes left behind"


def test_launcher_gives_each_worker_its_cluster(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint(os.environ['TF_CONFIG'], sys.argv[1:])\n")
    result = subprocess.run(
        [sys.executable, "-m", "tf_adasum.launch", "-n", "2", str(script), "a", "--b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("[worker"))
    assert len(lines) == 2
    for index, line in enumerate(lines):
        assert line.startswith(f"[worker {index}] ")
        assert f'"task": {{"type": "worker", "index": {index}}}' in line
        assert "['a', '--b']" in line
    assert lines[0].split("] ", 1)[1].split('"task"')[0] == lines[1].split("] ", 1)[1].split('"task"')[0]


def test_launcher_rejects_bad_arguments(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for args, message in ((["-n", "0", "x.py"], "-n must be >= 1"), (["-n", "2", "missing.py"], "no such script")):
        with pytest.raises(SystemExit) as exit_status:
            launch.main(args)
        assert exit_status.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="Received: num_workers=0"):
        launch.launch(0, ["true"])


@pytest.mark.multiworker
def test_scaling_evaluation_runs_on_this_engine(tmp_path):
    check_evaluation_engine("tf-collective", ["adasum", "keras"], tmp_path)


def test_launcher_stopped_by_sigterm_stops_its_workers(tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text(_FAILING_SCRIPT.replace("if index == 1:", "if False:"))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tf_adasum.launch", "-n", "2", str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pids{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    pids = [int(p) for i in range(2) for p in (tmp_path / f"pids{i}").read_text().split()]
    assert not [pid for pid in pids if _alive(pid)], "processes left behind"
