"""The launcher's guarantees (issue 12): it says what its workers expose, its
workers die with it even when it is SIGKILLed, and ``--isolate-network`` keeps
their unauthenticated gRPC servers out of the host's network.

The launcher runs here as ``python tf_adasum/launch.py``: the same code as
``python -m tf_adasum.launch`` without the package's TensorFlow import, which
costs seconds per start on a small machine (test_multiworker.py and
test_packaging.py run the installed entry points).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tf_adasum import launch
from tf_adasum.launcher import children

LAUNCH_PY = launch.__file__
HELPER_PY = children.HELPER

#: A worker without TensorFlow: starts a child, writes "pid child_pid", sleeps.
_SLEEPER = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(sys.argv[1], f"pids{index}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(os.path.join(sys.argv[1], f"pids{index}.tmp"), os.path.join(sys.argv[1], f"pids{index}"))
    time.sleep(300)
    """
)

#: A worker without TensorFlow: listens on its TF_CONFIG port on every interface
#: (as TensorFlow does), reaches the next worker on 127.0.0.1, reports, waits.
_RING = textwrap.dedent(
    """
    import json, os, socket, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    index, out = config["task"]["index"], sys.argv[1]
    ports = [int(address.rsplit(":", 1)[1]) for address in config["cluster"]["worker"]]
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("0.0.0.0", ports[index]))
    server.listen()
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", ports[(index + 1) % len(ports)]), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        sys.exit("cannot reach the next worker")
    report = {"pid": os.getpid(), "port": ports[index], "uid": os.getuid()}
    with open(os.path.join(out, f"worker{index}.tmp"), "w") as f:
        json.dump(report, f)
    os.rename(os.path.join(out, f"worker{index}.tmp"), os.path.join(out, f"worker{index}.json"))
    while not os.path.exists(os.path.join(out, "release")):
        time.sleep(0.05)
    """
)

#: A TensorFlow worker: one `strategy.reduce` across the cluster, reports, waits.
_COLLECTIVE = textwrap.dedent(
    """
    import json, os, sys, time
    import tensorflow as tf
    out = sys.argv[1]
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = strategy.cluster_resolver.task_id
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(index + 1.0)), axis=None)
    port = int(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][index].rsplit(":", 1)[1])
    with open(os.path.join(out, f"worker{index}.tmp"), "w") as f:
        json.dump({"pid": os.getpid(), "port": port, "sum": float(total)}, f)
    os.rename(os.path.join(out, f"worker{index}.tmp"), os.path.join(out, f"worker{index}.json"))
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "release")) and time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone for our purposes
    except FileNotFoundError:
        return False


def _wait_for(paths, launcher, seconds):
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths):
        if launcher.poll() is not None:
            pytest.fail(f"the launcher exited {launcher.returncode}: {launcher.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {paths} after {seconds} s")
        time.sleep(0.05)


def _listening(pid: int | str) -> dict[int, set[str]]:
    """``{port: {local addresses}}`` of the TCP sockets listening in `pid`'s network namespace."""
    ports: dict[int, set[str]] = {}
    for name in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{name}") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # TCP_LISTEN
                    address, port = local.split(":")
                    ports.setdefault(int(port, 16), set()).add(address)
    return ports


def _namespace(pid: int | str, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _start(tmp_path, script_text, *options, prefix=()):
    script = tmp_path / "worker.py"
    script.write_text(script_text)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2")
    command = [*prefix, sys.executable, LAUNCH_PY, "-n", "2", *options, str(script), str(tmp_path)]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _private_network_refusal() -> str | None:
    """Why this system refuses the private network, or None when it allows it."""
    try:
        for fd in children.private_network():
            os.close(fd)
    except launch.NetworkIsolationError as error:
        return str(error)
    return None


def _unshare_works(*options: str) -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", *options, "true"], capture_output=True).returncode == 0


def test_launcher_imports_only_the_standard_library():
    for path, args in ((LAUNCH_PY, ["--help"]), (HELPER_PY, ["network", "1", "extra"])):
        result = subprocess.run([sys.executable, "-I", "-S", path, *args], capture_output=True, text=True, timeout=60)
        assert "ModuleNotFoundError" not in result.stderr, result.stderr
        assert result.returncode == (0 if path == LAUNCH_PY else 1), result.stderr


def test_launcher_says_once_which_ports_are_open_to_everyone(tmp_path):
    launcher = _start(tmp_path, "import os\nprint(os.environ['TF_CONFIG'])\n")
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, stdout + stderr
    config = json.loads(stdout.splitlines()[0].split("] ", 1)[1])
    ports = [address.rsplit(":", 1)[1] for address in config["cluster"]["worker"]]
    notices = [line for line in stderr.splitlines() if line.startswith("tf-adasum launch:")]
    assert len(notices) == 1, stderr
    assert f"(ports {', '.join(ports)}) accept unauthenticated connections on all network interfaces" in notices[0]
    assert "private network or behind a firewall" in notices[0]


def test_launcher_rejects_a_non_bool_isolate_network():
    with pytest.raises(TypeError, match="Received: isolate_network='yes'"):
        launch.launch(1, ["true"], isolate_network="yes")


@pytest.mark.multiworker
def test_workers_and_their_children_die_with_a_sigkilled_launcher(tmp_path):
    launcher = _start(tmp_path, _SLEEPER)
    pids = []
    try:
        _wait_for([tmp_path / f"pids{i}" for i in range(2)], launcher, 60)
        pids = [int(p) for i in range(2) for p in (tmp_path / f"pids{i}").read_text().split()]
        assert all(_alive(pid) for pid in pids)
        start = time.monotonic()
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        while [pid for pid in pids if _alive(pid)] and time.monotonic() - start < 5:
            time.sleep(0.01)
        left = [pid for pid in pids if _alive(pid)]
        assert not left, f"alive {time.monotonic() - start:.1f} s after the launcher's SIGKILL: {left}"
    finally:
        for pid in [pid for pid in pids if _alive(pid)] + [launcher.pid] * (launcher.poll() is None):
            os.kill(pid, signal.SIGKILL)
        launcher.communicate()


def _isolated_run(tmp_path, script, seconds, prefix=()):
    """Runs a 2-worker cluster with --isolate-network; returns (reports, launcher pid, listening, stderr)."""
    launcher = _start(tmp_path, script, "--isolate-network", prefix=prefix)
    try:
        _wait_for([tmp_path / f"worker{i}.json" for i in range(2)], launcher, seconds)
        reports = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
        spaces = {(_namespace(r["pid"], "net"), _namespace(r["pid"], "user")) for r in reports}
        seen = {"host": _listening("self"), "workers": _listening(reports[0]["pid"]), "launcher": launcher.pid}
        seen["launcher_spaces"] = (_namespace(launcher.pid, "net"), _namespace(launcher.pid, "user"))
        (tmp_path / "release").touch()
        stdout, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, stdout + stderr
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert len(spaces) == 1, spaces  # one namespace for all workers
    seen["spaces"] = spaces.pop()
    return reports, seen, stderr


@pytest.mark.multiworker
def test_isolated_workers_are_unreachable_from_the_host_and_complete_a_collective(tmp_path):
    refusal = _private_network_refusal()
    if refusal:
        pytest.skip(f"this system refuses network namespaces: {refusal}")
    reports, seen, stderr = _isolated_run(tmp_path, _COLLECTIVE, seconds=150)
    assert [r["sum"] for r in reports] == [3.0, 3.0]
    assert seen["spaces"][0] != _namespace("self", "net")
    for report in reports:
        # TensorFlow listens on every interface of its namespace (the claim the notice makes) ...
        assert seen["workers"][report["port"]] & {"00000000", "0" * 32}, seen["workers"].get(report["port"])
        # ... and the host's namespace has no such socket.
        assert report["port"] not in seen["host"], seen["host"][report["port"]]
    assert "private network namespace (loopback only)" in stderr
    assert "all network interfaces" not in stderr


@pytest.mark.multiworker
@pytest.mark.skipif(
    not _unshare_works("--user", "--map-user=65534", "--map-group=65534"), reason="needs unshare --map-user"
)
def test_isolate_network_without_privileges_uses_a_user_namespace(tmp_path):
    """Run as uid 65534 without capabilities (inside ``unshare --user``): the
    launcher falls back to a user namespace of its own and keeps the uid."""
    reports, seen, _ = _isolated_run(
        tmp_path, _RING, seconds=60, prefix=["unshare", "--user", "--map-user=65534", "--map-group=65534"]
    )
    assert [r["uid"] for r in reports] == [65534, 65534]
    assert seen["spaces"][0] != seen["launcher_spaces"][0]
    assert seen["spaces"][1] != seen["launcher_spaces"][1]  # the fallback's own user namespace
    assert not {r["port"] for r in reports} & set(seen["host"])


@pytest.mark.skipif(not _unshare_works("--user"), reason="needs unshare --user")
def test_isolate_network_refused_is_one_line_and_exit_code_2(tmp_path):
    """Inside ``unshare --user`` without a uid map, no namespace can be made."""
    launcher = _start(tmp_path, _SLEEPER, "--isolate-network", prefix=["unshare", "--user"])
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 2, stdout + stderr
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith("tf-adasum launch: error: --isolate-network: cannot create a private network namespace")
    assert "unshare(CLONE_NEWNET): Operation not permitted" in stderr
    assert not list(tmp_path.glob("pids*")), "a worker started"


def test_a_child_that_prints_its_failure_line_and_exits_0_failed():
    """mpirun (PRRTE) says it lost a remote daemon and ended the job, then
    exits 0: the launcher counts that as a failure (`Child.failure_line`);
    the same child without the line succeeded."""
    line = "PRTE has lost communication with a remote daemon"
    said = ["sh", "-c", f"echo '{line}.'; exit 0"]
    assert children.run([children.Child(said, dict(os.environ), "[c] ", failure_line=line)]) == 1
    quiet = ["sh", "-c", "echo 'all is well'; exit 0"]
    assert children.run([children.Child(quiet, dict(os.environ), "[c] ", failure_line=line)]) == 0


def test_tensorflows_start_up_lines_are_dropped_unless_asked_for(capfd):
    """The notices every TensorFlow import writes, whatever
    TF_CPP_MIN_LOG_LEVEL says, do not reach the launcher's output; errors,
    warnings logged later and the worker's own lines do; with
    TF_CPP_MIN_LOG_LEVEL=0 everything does."""
    lines = [
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "I0000 00:00:1796603176.854737   20743 cpu_feature_guard.cc:227] This TensorFlow binary is optimized.",
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow.",
        "I0000 00:00:1796603176.854737   20743 port.cc:153] oneDNN custom operations are on.",
        "E0000 00:00:1796603176.854737   20743 op_kernel.cc:1] a real error",
        "epoch 1: test accuracy 0.9812",
        "W0000 00:00:1796603180.123456   20743 collective_ops.cc:9] a warning at run time",
    ]
    worker = ["sh", "-c", "printf '%s\\n' " + " ".join(f"'{line}'" for line in lines) + " 1>&2"]
    for level, shown in (("2", lines[4:]), (None, lines[4:]), ("0", lines)):
        env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
        env.update({} if level is None else {"TF_CPP_MIN_LOG_LEVEL": level})
        assert children.run([children.Child(worker, env, "[worker 0] ")]) == 0
        assert capfd.readouterr().out.splitlines() == [f"[worker 0] {line}" for line in shown], level
