"""Start N workers of a `MultiWorkerMirroredStrategy` cluster on localhost.

``tf-adasum launch -n 4 train.py --epochs 3`` (or ``python -m tf_adasum.launch``)
picks N free ports, starts ``python train.py --epochs 3`` N times, each with a
``TF_CONFIG`` naming the whole cluster and its own index, prefixes every output
line with ``[worker i]``, and returns the first non-zero exit code. When a
worker fails, the others are stopped (SIGTERM, then SIGKILL after a grace
period) with everything they started, so no process is left behind.

Each worker starts through `tf_adasum/_worker_bootstrap.py`, a small supervisor
that leads the worker's process group and, on Linux, kills that group when the
launcher dies, even by SIGKILL (``prctl(PR_SET_PDEATHSIG)``; elsewhere it
notices within half a second by polling ``getppid()``).

Security: TensorFlow's gRPC server listens on every interface (``[::]:port``)
whatever host ``TF_CONFIG`` names, and accepts unauthenticated connections that
can run any graph. The launcher says so on stderr, with the ports, before it
starts the workers. ``--isolate-network`` (Linux) runs them in a private
network namespace that holds only loopback: nothing outside can reach them, and
they cannot reach the network either.

The script is the same one a real cluster runs: it builds
``tf.distribute.MultiWorkerMirroredStrategy()``, which reads ``TF_CONFIG``.
This module imports only the standard library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["NetworkIsolationError", "cluster_configs", "free_ports", "launch", "main"]

#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
GRACE_SECONDS = 5.0

#: The supervisor of each worker and maker of the private network (run by path, not imported).
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_bootstrap.py")


class NetworkIsolationError(OSError):
    """The system refused the private network namespace ``isolate_network=True`` asks for."""


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that were free on localhost a moment ago."""
    with contextlib.ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("localhost", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]


def cluster_configs(num_workers: int, ports: Sequence[int] | None = None) -> list[str]:
    """The ``TF_CONFIG`` of each worker of a localhost cluster (worker 0 is the chief)."""
    ports = list(ports) if ports is not None else free_ports(num_workers)
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    return [json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}) for i in range(num_workers)]


def _forward(stream, prefix: str, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        with lock:
            sys.stdout.write(prefix + text if text.endswith("\n") else prefix + text + "\n")
            sys.stdout.flush()
    stream.close()


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each running worker's process group, then SIGKILL what is left."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        # The group may hold children even after its leader exited.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _bootstrap(role: str, *args: str) -> list[str]:
    return [sys.executable, "-I", "-S", BOOTSTRAP, role, str(os.getpid()), *args]


def _private_network() -> list[int]:
    """Makes a network namespace holding only loopback; returns descriptors of it and its user namespace."""
    if not sys.platform.startswith("linux"):
        raise NetworkIsolationError(f"network namespaces need Linux. Received: sys.platform={sys.platform!r}")
    holder = subprocess.Popen(
        _bootstrap("network"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        answer = holder.stdout.readline().strip()
        if answer != "ready":
            raise NetworkIsolationError(
                f"cannot create a private network namespace for the workers ({answer.removeprefix('error: ')}). "
                "Run as root (CAP_SYS_ADMIN) or where unprivileged user namespaces are allowed, "
                "or run without it on a private network or behind a firewall."
            )
        return [os.open(f"/proc/{holder.pid}/ns/{kind}", os.O_RDONLY) for kind in ("net", "user")]
    finally:
        holder.stdin.close()  # the holder exits; the namespace lives on in our descriptors
        holder.stdout.close()
        try:
            holder.wait(GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


def _exposure_notice(ports: Sequence[int], isolated: bool) -> str:
    listed = ", ".join(map(str, ports))
    if isolated:
        return (
            "tf-adasum launch: the workers run in a private network namespace (loopback only): their unauthenticated "
            f"gRPC servers (ports {listed}) cannot be reached from outside it, and they cannot reach other hosts."
        )
    return (
        f"tf-adasum launch: the workers' gRPC servers (ports {listed}) accept unauthenticated connections on all "
        "network interfaces: use only on a private network or behind a firewall (or --isolate-network)."
    )


def launch(
    num_workers: int,
    command: Sequence[str],
    env: dict[str, str] | None = None,
    *,
    isolate_network: bool = False,
) -> int:
    """Runs `command` as `num_workers` workers of a localhost cluster.

    Prints one line on stderr first: which ports the workers' gRPC servers
    will open, and who can reach them. Each worker runs under a supervisor
    (`tf_adasum/_worker_bootstrap.py`) that kills the worker's process group
    if this process dies, even by SIGKILL.

    Args:
      num_workers: N >= 1.
      command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
      env: the base environment (default: this process's).
      isolate_network: run the workers in one private network namespace that
        holds only loopback (Linux; as root, or where unprivileged user
        namespaces are allowed). They reach each other on localhost and
        nothing else.

    Returns:
      0 when every worker exits 0, else the first non-zero exit code observed
      (a worker killed by signal S gives 128 + S; a program that cannot be
      started gives 127, with the reason in the output).

    Raises:
      NetworkIsolationError: `isolate_network` is set and the system refuses
        a network namespace; no worker was started.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` must be an int >= 1. Received: num_workers={num_workers!r}")
    if not command:
        raise ValueError("`command` must name a program to run. Received: command=[]")
    if not isinstance(isolate_network, bool):
        raise TypeError(f"`isolate_network` must be a bool. Received: isolate_network={isolate_network!r}")
    base = dict(os.environ if env is None else env)
    ports = free_ports(num_workers)
    network = _private_network() if isolate_network else []
    print(_exposure_notice(ports, isolate_network), file=sys.stderr, flush=True)
    network_args = ["--network", *map(str, network)] if network else []
    lock = threading.Lock()
    processes, threads = [], []
    try:
        for index, tf_config in enumerate(cluster_configs(num_workers, ports)):
            worker_env = dict(base, TF_CONFIG=tf_config, PYTHONUNBUFFERED="1")
            process = subprocess.Popen(
                _bootstrap("worker", *network_args, "--", *command),
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so _stop (and its supervisor) reach its children
                pass_fds=network,
            )
            processes.append(process)
            thread = threading.Thread(target=_forward, args=(process.stdout, f"[worker {index}] ", lock), daemon=True)
            thread.start()
            threads.append(thread)
        for fd in network:
            os.close(fd)
        network = []
        while True:
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or None not in codes:
                code = failed[0] if failed else 0
                break
            time.sleep(0.1)
    except BaseException:
        for fd in network:
            os.close(fd)
        _stop(processes)
        raise
    _stop(processes)
    for thread in threads:
        thread.join(timeout=GRACE_SECONDS)
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    """``tf-adasum launch [-n N] [--isolate-network] script.py [args...]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="tf-adasum launch",
        epilog="Example: tf-adasum launch -n 4 examples/mnist_multiworker.py --epochs 3",
        description="Start N local workers of a MultiWorkerMirroredStrategy cluster (TF_CONFIG on localhost).",
    )
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="number of worker processes")
    parser.add_argument(
        "--isolate-network",
        action="store_true",
        help="run the workers in a private network namespace holding only loopback (Linux; root or user namespaces)",
    )
    parser.add_argument("script", help="the Python script each worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error(f"-n must be >= 1. Received: -n {args.num_workers}")
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script!r}")
    # SIGTERM (a scheduler stopping the job) unwinds like Ctrl-C, so the workers are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return launch(args.num_workers, [sys.executable, args.script, *args.args], isolate_network=args.isolate_network)
    except NetworkIsolationError as error:
        print(f"tf-adasum launch: error: --isolate-network: {error.strerror or error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
