"""A cluster on one machine (issue 31): ``tf-adasum launch --hosts H --link RATE``.

Each host is a network namespace with an address of its own, joined to the
others by a rate-limited link. These tests check the network itself (addresses,
placement, both directions limited, a host's link limiting what several hosts
send it, nothing left behind, a clear refusal) and
training across the hosts with MultiWorkerMirroredStrategy; the link faults run
in test_backup.py (the relaunch must resume bitwise). They skip, with the
reason, where this system refuses network namespaces.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from multiprocess import (
    EMULATED_HOSTS_REFUSAL,
    WORKER,
    check_collective,
    check_over_sockets,
    check_train,
    needs_emulated_hosts,
    worker_env,
)

from tf_adasum import launch, reference

LAUNCH_PY = launch.__file__


pytestmark = pytest.mark.multiworker

#: A worker without TensorFlow: reports its address, namespace and link, then
#: times a transfer to the worker on the next host and back.
_PROBE = textwrap.dedent(
    """
    import json, os, socket, subprocess, sys, time
    config = json.loads(os.environ["TF_CONFIG"])
    index, out, nbytes = config["task"]["index"], sys.argv[1], int(sys.argv[2])
    workers = config["cluster"]["worker"]
    host, port = workers[index].rsplit(":", 1)
    addresses = json.loads(subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True).stdout)
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
    report = {
        "pid": os.getpid(), "net": os.readlink("/proc/self/ns/net"), "host": host, "qdisc": qdisc,
        "addresses": [a["local"] for i in addresses for a in i["addr_info"] if a["family"] == "inet"],
    }
    server = socket.create_server((host, int(port)))
    if index in (0, len(workers) - 1):  # the first worker sends to the last, which sends it back
        peer = workers[-1 if index == 0 else 0].rsplit(":", 1)
        if index == 0:
            for _ in range(200):
                try:
                    sock = socket.create_connection((peer[0], int(peer[1])), timeout=60)
                    break
                except OSError:
                    time.sleep(0.05)
            start = time.monotonic()
            sock.sendall(b"x" * nbytes)
            got = 0
            while got < nbytes:
                got += len(sock.recv(1 << 20))
            report["round_trip_seconds"] = time.monotonic() - start
        else:
            sock, _ = server.accept()
            got = 0
            while got < nbytes:
                got += len(sock.recv(1 << 20))
            sock.sendall(b"x" * nbytes)
        sock.close()
    with open(os.path.join(out, f"worker{index}.tmp"), "w") as f:
        json.dump(report, f)
    os.rename(os.path.join(out, f"worker{index}.tmp"), os.path.join(out, f"worker{index}.json"))
    while not os.path.exists(os.path.join(out, "release")):
        time.sleep(0.05)
    """
)


def _start(tmp_path, script_text, *options, args=(), env=None):
    script = tmp_path / "worker.py"
    script.write_text(script_text)
    command = [sys.executable, LAUNCH_PY, *options, str(script), str(tmp_path), *args]
    return subprocess.Popen(command, env=env or worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(paths, process, seconds):
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if process.poll() is not None:
            pytest.fail(f"the launcher exited {process.returncode}: {process.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {paths} after {seconds} s")
        time.sleep(0.05)


def _communicate(process, seconds):
    """`process`'s (stdout, stderr) once it ends; killed if it has not ended
    within `seconds` (then `TimeoutExpired` fails the test)."""
    try:
        return process.communicate(timeout=seconds)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def _namespace_holders(inodes: set[str]) -> list[str]:
    """Which processes still use (are in, or hold a descriptor of) the network namespaces `inodes`."""
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/ns/net")]
            links += [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # gone meanwhile
            continue
        holders += [f"{pid}: {link}" for link in links if link in inodes]
    return holders


@needs_emulated_hosts
def test_hosts_have_their_own_addresses_and_links_limited_both_ways(tmp_path):
    """4 workers on 2 hosts at 10 Mbit/s: workers 0, 1 share host 0's
    namespace and address, 2, 3 host 1's; TF_CONFIG names those addresses;
    0.5 MB from host 0 to host 1 and back cannot take less than the link
    allows, less each token bucket's burst (0.69 s)."""
    nbytes = 500_000
    launcher = _start(tmp_path, _PROBE, "-n", "4", "--hosts", "2", "--link", "10mbit", args=[str(nbytes)])
    try:
        _wait_for([tmp_path / f"worker{i}.json" for i in range(4)], launcher, 120)
        reports = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(4)]
        (tmp_path / "release").touch()
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    assert [r["host"] for r in reports] == ["10.241.0.1", "10.241.0.1", "10.241.0.2", "10.241.0.2"]
    for r in reports:
        assert r["addresses"] == ["127.0.0.1", r["host"]], r
        assert "tbf" in r["qdisc"] and "rate 10Mbit" in r["qdisc"], r
    assert reports[0]["net"] == reports[1]["net"] != reports[2]["net"] == reports[3]["net"]
    assert reports[0]["net"] != os.readlink("/proc/self/ns/net")
    burst = 64 * 1024 + 1514  # what a full bucket lets through at once (launcher/helper.py's _token_bucket)
    floor = 2 * (nbytes - burst) * 8 / 10e6
    assert reports[0]["round_trip_seconds"] > floor, reports[0]
    notice = [line for line in stderr.splitlines() if line.startswith("tf-adasum launch:")]
    assert notice and "2 emulated hosts (10.241.0.1, 10.241.0.2; links of 10mbit each way)" in notice[0], stderr


#: Workers 1 and 2 each send a message to worker 0 at once (incast): both
#: connect, worker 0 tells both to go, and reports how long it then took to
#: receive both messages.
_INCAST = textwrap.dedent(
    """
    import json, os, socket, sys, threading, time
    config = json.loads(os.environ["TF_CONFIG"])
    index, out, nbytes = config["task"]["index"], sys.argv[1], int(sys.argv[2])
    host, port = config["cluster"]["worker"][0].rsplit(":", 1)
    report = {}
    if index == 0:
        server = socket.create_server((host, int(port)))
        senders = [server.accept()[0] for _ in range(2)]
        def receive(sock):
            got = 0
            while got < nbytes:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise ConnectionError(f"the sender closed after {got} bytes")
                got += len(chunk)
        threads = [threading.Thread(target=receive, args=(sock,)) for sock in senders]
        start = time.monotonic()
        for sock in senders:
            sock.sendall(b"g")
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        report["seconds"] = time.monotonic() - start
    else:
        for _ in range(400):
            try:
                sock = socket.create_connection((host, int(port)), timeout=60)
                break
            except OSError:
                time.sleep(0.05)
        assert sock.recv(1) == b"g"
        sock.sendall(b"x" * nbytes)
        sock.close()
    with open(os.path.join(out, f"worker{index}.tmp"), "w") as f:
        json.dump(report, f)
    os.rename(os.path.join(out, f"worker{index}.tmp"), os.path.join(out, f"worker{index}.json"))
    """
)


@needs_emulated_hosts
def test_a_hosts_link_limits_what_it_receives_from_several_hosts(tmp_path):
    """Incast: hosts 1 and 2 send 0.5 MB each to host 0 at once over
    10 Mbit/s links. Their own links would let both through in about 0.4 s;
    the switch's side of host 0's link holds the pair to its rate, so the
    1 MB cannot arrive in less than the link allows, less one bucket's burst
    (0.75 s)."""
    nbytes = 500_000
    launcher = _start(tmp_path, _INCAST, "-n", "3", "--hosts", "3", "--link", "10mbit", args=[str(nbytes)])
    stdout, stderr = _communicate(launcher, 120)
    assert launcher.returncode == 0, stdout + stderr
    seconds = json.loads((tmp_path / "worker0.json").read_text())["seconds"]
    burst = 64 * 1024 + 1514  # what a full bucket lets through at once (launcher/helper.py's _token_bucket)
    assert seconds > (2 * nbytes - burst) * 8 / 10e6, seconds


def _unprivileged_user_namespaces() -> bool:
    command = ["unshare", "--user", "--map-user=65534", "--map-group=65534", "true"]
    return shutil.which("unshare") is not None and subprocess.run(command, capture_output=True).returncode == 0


@needs_emulated_hosts
@pytest.mark.skipif(not _unprivileged_user_namespaces(), reason="needs unshare --map-user")
def test_hosts_without_privileges_are_made_in_a_user_namespace(tmp_path):
    """As uid 65534 without capabilities (inside ``unshare --user``), the
    launcher makes the hosts inside a user namespace of its own."""
    script = tmp_path / "worker.py"
    script.write_text(_PROBE)
    command = ["unshare", "--user", "--map-user=65534", "--map-group=65534", sys.executable, LAUNCH_PY]
    command += ["-n", "2", "--hosts", "2", "--link", "100mbit", str(script), str(tmp_path), "1000"]
    launcher = subprocess.Popen(command, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for([tmp_path / f"worker{i}.json" for i in range(2)], launcher, 120)
        reports = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
        (tmp_path / "release").touch()
        stdout, stderr = _communicate(launcher, 60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    assert [r["addresses"] for r in reports] == [["127.0.0.1", "10.241.0.1"], ["127.0.0.1", "10.241.0.2"]]
    assert all("rate 100Mbit" in r["qdisc"] for r in reports), reports


@needs_emulated_hosts
def test_killed_launcher_leaves_no_namespace_behind(tmp_path):
    launcher = _start(tmp_path, _PROBE, "-n", "2", "--hosts", "2", args=["1"])
    try:
        _wait_for([tmp_path / f"worker{i}.json" for i in range(2)], launcher, 120)
        reports = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
        held = {os.readlink(f"/proc/{launcher.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{launcher.pid}/fd")}
        switch = {link for link in held if link.startswith("net:")}
        assert len(switch) == 1, held  # the launcher holds the switch, the workers their hosts
        inodes = switch | {r["net"] for r in reports}
        assert len(inodes) == 3
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _namespace_holders(inodes) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _namespace_holders(inodes)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate()


#: A rank that reports its process id (as this test sees it), its host's namespace, then waits.
_SLEEPER = textwrap.dedent(
    """
    import json, os, sys, time
    rank = os.environ["OMPI_COMM_WORLD_RANK"]
    report = {"pid": int(os.readlink("/proc/self")), "net": os.readlink("/proc/self/ns/net")}
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    time.sleep(600)
    """
)


@pytest.mark.mpi
@needs_emulated_hosts
@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() != 0, reason="mpirun across emulated hosts needs root")
def test_killed_launcher_leaves_no_rank_or_namespace_behind_under_mpirun(tmp_path):
    """MPI's ranks lead process groups of their own, out of the launcher's
    reach; mpirun runs as process 1 of a PID namespace, so they die with it."""
    # TMPDIR: where the killed launcher's MPI session folder stays behind
    launcher = _start(tmp_path, _SLEEPER, "-n", "4", "--hosts", "2", "--mpirun", env=worker_env(TMPDIR=str(tmp_path)))
    try:
        _wait_for([tmp_path / f"rank{i}.json" for i in range(4)], launcher, 120)
        reports = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(4)]
        inodes = {r["net"] for r in reports}
        assert len(inodes) == 2, reports
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        alive = lambda: [r["pid"] for r in reports if os.path.exists(f"/proc/{r['pid']}")]  # noqa: E731
        while (alive() or _namespace_holders(inodes)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive() and not _namespace_holders(inodes)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate()


def test_hosts_refused_is_one_line_and_exit_code_2(tmp_path):
    """Without iproute2 (no ``ip`` on PATH) no host can be made: one line, exit 2, no worker started."""
    env = worker_env(PATH=str(tmp_path / "no-such-bin"))
    launcher = _start(tmp_path, "import sys\nopen(sys.argv[1] + '/started', 'w')\n", "-n", "2", "--hosts", "2", env=env)
    stdout, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 2, stdout + stderr
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith("tf-adasum launch: error: --hosts: cannot create 2 emulated hosts"), stderr
    if EMULATED_HOSTS_REFUSAL is None:
        assert "ip not found (iproute2 is needed)" in stderr, stderr
    assert not (tmp_path / "started").exists()


@pytest.mark.parametrize(
    "options, message",
    [
        (["--hosts", "3"], "--hosts must be from 1 to -n (2), at most 253. Received: --hosts 3"),
        (["--hosts", "2", "--link", "fast"], "--link must be a rate such as 1gbit"),
        (["--hosts", "2", "--link", "0gbit"], "Received: --link 0gbit"),
        (["--link", "1gbit"], "with --hosts. Received: --link 1gbit"),
        (["--hosts", "2", "--isolate-network"], "--isolate-network and --hosts exclude each other"),
    ],
)
def test_bad_host_options_are_refused(tmp_path, options, message):
    launcher = _start(tmp_path, "pass\n", "-n", "2", *options)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 2 and message in stderr, stderr


def test_launch_checks_hosts_and_link():
    with pytest.raises(ValueError, match="Received: hosts=0"):
        launch.launch(2, ["true"], hosts=0)
    with pytest.raises(ValueError, match="Received: link='1 gbit', hosts=2"):
        launch.launch(2, ["true"], hosts=2, link="1 gbit")
    with pytest.raises(TypeError, match="Received: hosts='2'"):
        launch.launch(2, ["true"], hosts="2")
    with pytest.raises(ValueError, match="Received: isolate_network=True, hosts=2"):
        launch.launch(2, ["true"], hosts=2, isolate_network=True)
    with pytest.raises(TypeError, match="Received: mpirun='yes'"):
        launch.launch(2, ["true"], hosts=2, mpirun="yes")


@needs_emulated_hosts
def test_training_across_hosts(tmp_path):
    """MultiWorkerMirroredStrategy across 2 hosts x 2 workers on 1 Gbit/s
    links: the combine and training against the reference, the socket
    transport listening on each worker's host address from the cluster spec."""
    command = [sys.executable, "-m", "tf_adasum.launch", "-n", "4", "--hosts", "2", "--link", "1gbit"]
    command += [WORKER, "collective,train", str(tmp_path)]
    result = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    check_collective(tmp_path, 4)
    check_over_sockets(tmp_path, 4)
    check_train(tmp_path, 4, hierarchical_combine=reference.adasum_tree)  # one device per worker
    for rank in range(4):
        host, _ = np.load(tmp_path / f"collective_rank{rank}.npz")["listener"]
        assert host == f"10.241.0.{1 + rank // 2}", (rank, host)


def _mean_per_host_then_adasum(per_rank):
    """The hierarchical combine of 2 hosts x 2 ranks: each host's mean, then Adasum across the hosts."""
    return reference.adasum_tree([reference.mean(per_rank[:2]), reference.mean(per_rank[2:])])


@pytest.mark.mpi
@needs_emulated_hosts
@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() != 0, reason="mpirun across emulated hosts needs root")
def test_mpirun_across_hosts(tmp_path):
    """``--mpirun``: 4 MPI ranks on 2 hosts (1 Gbit/s links), MPI's daemon
    started on host 1 through the launcher's remote-shell agent: each host is
    an MPI node of its own (its host name, its ranks' shared-memory group), the
    collective and training equal the reference, and the hierarchical combine
    is the mean within each host, then Adasum across the hosts."""
    command = [sys.executable, "-m", "tf_adasum.launch", "-n", "4", "--hosts", "2", "--link", "1gbit", "--mpirun"]
    command += [WORKER, "collective,train", str(tmp_path)]
    result = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "4 MPI ranks on 2 emulated hosts (10.241.0.1, 10.241.0.2; links of 1gbit" in result.stderr
    check_collective(tmp_path, 4)
    check_train(tmp_path, 4, hierarchical_combine=_mean_per_host_then_adasum)
    for rank in range(4):
        world = list(np.load(tmp_path / f"train_rank{rank}.npz")["mpi_world"])
        assert world == [rank, 4, rank % 2, 2], (rank, world)  # rank, size, rank and size on its host


def test_mpirun_and_a_private_network_exclude_each_other():
    with pytest.raises(ValueError, match="Received: mpirun=True, isolate_network=True"):
        launch.launch(2, ["true"], mpirun=True, isolate_network=True)
    result = subprocess.run(
        [sys.executable, "-I", "-S", LAUNCH_PY, "-n", "2", "--mpirun", "--isolate-network", LAUNCH_PY],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "`mpirun` and `isolate_network` exclude each other" in result.stderr
