"""Start N workers of a `MultiWorkerMirroredStrategy` cluster on localhost.

``tf-adasum launch -n 4 train.py --epochs 3`` (or ``python -m tf_adasum.launch``)
picks N free ports, starts ``python train.py --epochs 3`` N times, each with a
``TF_CONFIG`` naming the whole cluster and its own index, prefixes every output
line with ``[worker i]``, and returns the first non-zero exit code. When a
worker fails, the others are stopped (SIGTERM, then SIGKILL after a grace
period) with everything they started, so no process is left behind.

The script is the same one a real cluster runs: it builds
``tf.distribute.MultiWorkerMirroredStrategy()``, which reads ``TF_CONFIG``.
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

__all__ = ["cluster_configs", "free_ports", "launch", "main"]

#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
GRACE_SECONDS = 5.0


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


def launch(num_workers: int, command: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Runs `command` as `num_workers` workers of a localhost cluster.

    Args:
      num_workers: N >= 1.
      command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
      env: the base environment (default: this process's).

    Returns:
      0 when every worker exits 0, else the first non-zero exit code observed
      (a worker killed by signal S gives 128 + S).
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` must be an int >= 1. Received: num_workers={num_workers!r}")
    if not command:
        raise ValueError("`command` must name a program to run. Received: command=[]")
    base = dict(os.environ if env is None else env)
    lock = threading.Lock()
    processes, threads = [], []
    try:
        for index, tf_config in enumerate(cluster_configs(num_workers)):
            worker_env = dict(base, TF_CONFIG=tf_config, PYTHONUNBUFFERED="1")
            process = subprocess.Popen(
                list(command),
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so _stop reaches its children
            )
            processes.append(process)
            thread = threading.Thread(target=_forward, args=(process.stdout, f"[worker {index}] ", lock), daemon=True)
            thread.start()
            threads.append(thread)
        while True:
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or None not in codes:
                code = failed[0] if failed else 0
                break
            time.sleep(0.1)
    except BaseException:
        _stop(processes)
        raise
    _stop(processes)
    for thread in threads:
        thread.join(timeout=GRACE_SECONDS)
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tf-adasum launch",
        epilog="Example: tf-adasum launch -n 4 examples/mnist_multiworker.py --epochs 3",
        description="Start N local workers of a MultiWorkerMirroredStrategy cluster (TF_CONFIG on localhost).",
    )
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="number of worker processes")
    parser.add_argument("script", help="the Python script each worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error(f"-n must be >= 1. Received: -n {args.num_workers}")
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script!r}")
    # SIGTERM (a scheduler stopping the job) unwinds like Ctrl-C, so the workers are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return launch(args.num_workers, [sys.executable, args.script, *args.args])


if __name__ == "__main__":
    sys.exit(main())
