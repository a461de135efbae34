"""Start N workers of a `MultiWorkerMirroredStrategy` cluster on localhost.

``tf-adasum launch -n 4 train.py --epochs 3`` (or ``python -m tf_adasum.launch``)
picks N free ports, starts ``python train.py --epochs 3`` N times, each with a
``TF_CONFIG`` naming the whole cluster and its own index, prefixes every output
line with ``[worker i]``, and returns the first non-zero exit code. When a
worker fails, the others are stopped (SIGTERM, then SIGKILL after a grace
period) with everything they started, so no process is left behind.

Each worker starts through `tf_adasum/launcher/helper.py`, a small supervisor
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
(the same helper builds them).

With ``--mpirun`` the launcher starts no TF_CONFIG workers: it runs Open
MPI's ``mpirun -np N`` on this machine, or with ``--hosts`` on host 0, with the hosts as its
node list (the same contiguous blocks of ranks) and
``helper.py rsh`` in place of ssh to start its daemon on each other
host, every host with a host name of its own; MPI's TCP traffic goes over the
hosts' ``eth0`` links. This needs root (``mpirun --allow-run-as-root``).

Without ``--mpirun``, the script is the same one a real cluster runs: it builds
``tf.distribute.MultiWorkerMirroredStrategy()``, which reads ``TF_CONFIG``.
This module imports only the standard library and the launcher's own
modules (`tf_adasum/launcher/`); run by path, it loads them without the
package, so no TensorFlow loads.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence

if __package__:
    from tf_adasum.launcher import children, elastic, helper, tf_config
    from tf_adasum.launcher.children import NetworkIsolationError
    from tf_adasum.launcher.elastic import ElasticError
    from tf_adasum.launcher.mpirun import LOST_DAEMON_LINE, emulated_hosts_command, mpirun_command, require_mpirun
else:  # run by path (python [-I -S] tf_adasum/launch.py): the package beside it, without tf_adasum's (TF's) import
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from launcher import children, elastic, helper, tf_config
    from launcher.children import NetworkIsolationError
    from launcher.elastic import ElasticError
    from launcher.mpirun import LOST_DAEMON_LINE, emulated_hosts_command, mpirun_command, require_mpirun

__all__ = ["ElasticError", "NetworkIsolationError", "launch", "main"]

#: The TF_CONFIG port of worker i on an emulated host (each host's ports are its own).
HOST_PORT_BASE = 20000


def _is_rate(link) -> bool:
    """Whether `link` is a positive rate in tc's syntax (lower case)."""
    return isinstance(link, str) and bool(helper.RATE_PATTERN.fullmatch(link)) and helper.rate_bits_per_second(link) > 0


def _host_of(num_workers: int, hosts: int) -> list[int]:
    """The host of each worker: contiguous blocks, as even as they come."""
    return [i * hosts // num_workers for i in range(num_workers)]


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


def _launch_mpirun(
    num_ranks: int, command: Sequence[str], env: dict[str, str], hosts: int, link: str | None, resize=None
) -> int:
    """`launch` with ``mpirun=True`` and `hosts`: one mpirun on host 0 (see the
    module docstring); the hosts made anew for each elastic round."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        raise NetworkIsolationError(
            f"mpirun across emulated hosts needs Linux and root. Received: sys.platform={sys.platform!r}, "
            f"euid={os.geteuid() if hasattr(os, 'geteuid') else None}"
        )
    try:
        program = require_mpirun()
    except FileNotFoundError as error:
        raise NetworkIsolationError(str(error)) from None
    network, addresses = children.emulated_hosts(hosts, link)
    # MPI's session directories are named by process ids, which repeat in the
    # PID namespace: a folder of their own (a killed run leaves one behind).
    session = tempfile.mkdtemp(prefix="tf-adasum-mpirun-")
    try:
        blocks = [_host_of(num_ranks, hosts).count(h) for h in range(hosts)]
        env = dict(env, TMPDIR=session)
        env[helper.HOSTS_VARIABLE] = " ".join(
            [str(os.getpid()), str(network[0]), *(f"{a}={fd}" for a, fd in zip(addresses, network[2:]))]
        )
        agent = children.helper_command("rsh")
        mpirun = emulated_hosts_command(program, list(zip(addresses, blocks)), agent, helper.HOST_INTERFACE)
        print(
            f"tf-adasum launch: {num_ranks} MPI ranks on {hosts} emulated hosts ({', '.join(addresses)}; links of "
            f"{link or 'unlimited rate'} each way; ranks per host {blocks}), private network namespaces that "
            "nothing outside can reach.",
            file=sys.stderr,
            flush=True,
        )
        on_host_0 = [*children.helper_command("enter", addresses[0]), *mpirun, *command]
        return children.run([children.Child(on_host_0, env, "[mpirun] ", failure_line=LOST_DAEMON_LINE)], resize=resize)
    finally:
        for fd in network:  # held until mpirun is gone: its daemons enter the hosts through them
            os.close(fd)
        shutil.rmtree(session, ignore_errors=True)


def launch(
    num_workers: int,
    command: Sequence[str],
    env: dict[str, str] | None = None,
    *,
    isolate_network: bool = False,
    hosts: int | None = None,
    link: str | None = None,
    mpirun: bool = False,
    min_workers: int | None = None,
    max_restarts: int = 0,
    discover: str | None = None,
    wait_seconds: float = 60.0,
    logical_replicas: int | None = None,
) -> int:
    """Runs `command` as `num_workers` workers of a cluster on this machine
    (localhost, or emulated hosts), or with `mpirun` as MPI ranks.

    Prints one line on stderr first: which ports the workers' gRPC servers
    will open, and who can reach them. Each worker runs under a supervisor
    (`tf_adasum/launcher/helper.py`) that kills the worker's process group
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
      mpirun: run `command` as `num_workers` MPI ranks under one ``mpirun``
        (the one beside this Python, else on PATH) instead of as TF_CONFIG
        workers: on this machine, or with `hosts` across the emulated hosts
        (as root).
      min_workers: an elastic run (`tf_adasum/launcher/elastic.py`): rounds
        of as many workers as are available, at least this many (None:
        `num_workers`); with `mpirun`, rounds of ``mpirun -np W``, on this
        machine or across `hosts`.
      max_restarts: relaunch a failed round at most this many times.
      discover: a shell command printing how many workers can run now (one
        integer), asked every second; a change ends the round with SIGTERM
        (the workers back up) and starts one at the new size. None:
        `num_workers` are always available.
      wait_seconds: how long to wait for `min_workers` before failing.
      logical_replicas: the job's replica count L (`tf_adasum.SimulatedReplicas`
        on the workers, or under `mpirun`), given to every worker in ``TF_ADASUM_LOGICAL_REPLICAS``;
        `num_workers` must hold L, and each elastic round runs the largest
        count that does (the others spare).

    Returns:
      0 when every worker exits 0, else the first non-zero exit code observed
      (a worker killed by signal S gives 128 + S; a program that cannot be
      started gives 127, with the reason in the output); with `mpirun`,
      mpirun's exit code. Elastic: 0 once a round finished, else the last
      failed round's code.

    Raises:
      NetworkIsolationError: `isolate_network` or `hosts` is set and the
        system refuses a network namespace (or `ip`/`tc` fail), or `mpirun`
        is set without root or without an mpirun; no worker was started.
      TypeError, ValueError: an argument of the wrong type or value, named
        with the value received.
      ElasticError: an elastic run's discovery failed or printed garbage,
        or too few workers were available for `wait_seconds`.

    Examples:
      One worker that prints its task from ``TF_CONFIG`` (the port notice
      goes to stderr):

      >>> import sys
      >>> from tf_adasum.launch import launch
      >>> program = "import json, os; print(json.loads(os.environ['TF_CONFIG'])['task'])"
      >>> launch(1, [sys.executable, "-c", program])
      [worker 0] {'type': 'worker', 'index': 0}
      0
      >>> launch(1, [sys.executable, "-c", "raise SystemExit(3)"])  # the worker's exit code
      3
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"`num_workers` must be an int >= 1. Received: num_workers={num_workers!r}")
    if not command:
        raise ValueError("`command` must name a program to run. Received: command=[]")
    if not isinstance(isolate_network, bool):
        raise TypeError(f"`isolate_network` must be a bool. Received: isolate_network={isolate_network!r}")
    if hosts is not None and (isinstance(hosts, bool) or not isinstance(hosts, int)):
        raise TypeError(f"`hosts` must be an int or None. Received: hosts={hosts!r}")
    if hosts is not None and not 1 <= hosts <= min(num_workers, helper.MAX_HOSTS):
        raise ValueError(
            f"`hosts` must be from 1 to num_workers={num_workers} (at most {helper.MAX_HOSTS}). "
            f"Received: hosts={hosts!r}"
        )
    if link is not None and (hosts is None or not _is_rate(link)):
        raise ValueError(
            "`link` must be a positive rate in tc's syntax such as '1gbit' or '100mbit', with `hosts`. "
            f"Received: link={link!r}, hosts={hosts!r}"
        )
    if not isinstance(mpirun, bool):
        raise TypeError(f"`mpirun` must be a bool. Received: mpirun={mpirun!r}")
    if mpirun and isolate_network:
        raise ValueError(
            "`mpirun` and `isolate_network` exclude each other (mpirun's ranks use the machine's network). "
            "Received: mpirun=True, isolate_network=True"
        )
    if isolate_network and hosts is not None:
        raise ValueError(
            "`isolate_network` and `hosts` exclude each other (the emulated hosts are private already). "
            f"Received: isolate_network=True, hosts={hosts!r}"
        )
    settings = elastic.settings(num_workers, min_workers, max_restarts, discover, wait_seconds, hosts, logical_replicas)
    base = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    if logical_replicas is not None:
        base[elastic.REPLICAS_VARIABLE] = str(logical_replicas)

    def start(workers, env, resize=None):
        if mpirun and hosts is not None:
            return _launch_mpirun(workers, command, env, hosts, link, resize)
        if mpirun:
            return _launch_local_mpirun(workers, command, env, resize)
        return _launch_workers(workers, command, env, isolate_network, hosts, link, resize)

    if settings.is_elastic():

        def start_round(number, workers, resize):
            return start(workers, dict(base, **{elastic.ROUND_VARIABLE: str(number)}), resize)

        return elastic.run(settings, start_round)
    return start(num_workers, base)


def _launch_local_mpirun(num_ranks: int, command: Sequence[str], env: dict[str, str], resize=None) -> int:
    """`launch` with ``mpirun=True`` on this machine: ``mpirun -np N command``."""
    try:
        program = mpirun_command(num_ranks)
    except FileNotFoundError as error:
        raise NetworkIsolationError(str(error)) from None
    return children.run([children.Child([*program, *command], env, "[mpirun] ")], resize=resize)


def _launch_workers(num_workers, command, base, isolate_network, hosts, link, resize=None) -> int:
    """`launch` of TF_CONFIG workers, once all is checked."""
    if hosts is not None:
        network, addresses = children.emulated_hosts(hosts, link)
        host_of = _host_of(num_workers, hosts)
        ports = [HOST_PORT_BASE + i for i in range(num_workers)]
        # Worker i joins (user namespace, its host's namespace); the switch stays with us.
        joins = [[network[0], network[2 + h]] for h in host_of]
        worker_hosts, keep = [addresses[h] for h in host_of], network[1:2]
    else:
        ports, worker_hosts, addresses = tf_config.free_ports(num_workers), None, []
        network = children.private_network() if isolate_network else []
        joins, keep = [network] * num_workers, []
    print(_exposure_notice(ports, isolate_network, addresses, link), file=sys.stderr, flush=True)
    workers = [
        children.Child(command, dict(base, TF_CONFIG=config), f"[worker {index}] ", joins[index])
        for index, config in enumerate(tf_config.cluster_configs(num_workers, ports, worker_hosts))
    ]
    try:
        # The workers hold their namespaces once started; the switch's links live as long as we hold it.
        return children.run(workers, release=[fd for fd in network if fd not in keep], resize=resize)
    finally:
        for fd in keep:
            os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    """``tf-adasum launch -n N [--isolate-network | --hosts H [--link RATE] [--mpirun]]
    [--min-workers M] [--max-restarts R] [--discover CMD] [--wait S] script.py [args...]``;
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
        help="run the script as N MPI ranks under one mpirun, on this machine or across --hosts (as root)",
    )
    elastic.add_options(parser)
    parser.add_argument("script", help="the Python script each worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    args = parser.parse_args(argv)
    if args.num_workers < 1:
        parser.error(f"-n must be >= 1. Received: -n {args.num_workers}")
    if args.hosts is not None and not 1 <= args.hosts <= min(args.num_workers, helper.MAX_HOSTS):
        parser.error(
            f"--hosts must be from 1 to -n ({args.num_workers}), at most {helper.MAX_HOSTS}. "
            f"Received: --hosts {args.hosts}"
        )
    if args.mpirun and args.isolate_network:
        parser.error("`mpirun` and `isolate_network` exclude each other (mpirun's ranks use the machine's network)")
    if args.hosts is not None and args.isolate_network:
        parser.error("--isolate-network and --hosts exclude each other (the emulated hosts are private already)")
    if args.link is not None and (args.hosts is None or not _is_rate(args.link)):
        parser.error(f"--link must be a rate such as 1gbit or 100mbit, with --hosts. Received: --link {args.link}")
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script!r}")
    try:
        elastic.settings(
            args.num_workers,
            args.min_workers,
            args.max_restarts,
            args.discover,
            args.wait,
            args.hosts,
            args.logical_replicas,
        )
    except (TypeError, ValueError) as error:
        parser.error(elastic.as_options(str(error)))
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
            min_workers=args.min_workers,
            max_restarts=args.max_restarts,
            discover=args.discover,
            wait_seconds=args.wait,
            logical_replicas=args.logical_replicas,
        )
    except ElasticError as error:
        print(f"tf-adasum launch: error: {error}", file=sys.stderr)
        return 2
    except NetworkIsolationError as error:
        option = "--mpirun" if args.mpirun else "--hosts" if args.hosts is not None else "--isolate-network"
        print(f"tf-adasum launch: error: {option}: {error.strerror or error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
