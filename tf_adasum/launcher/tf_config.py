"""Each worker's ``TF_CONFIG``: the launcher's workers', and this process's from a scheduler's environment.

A `tf.distribute.MultiWorkerMirroredStrategy` script reads its cluster from
``TF_CONFIG``. `tf-adasum launch` hands one to each of its workers
(`cluster_configs`); a scheduler announces the cluster in variables of its
own, which this module turns into one, so the same script runs under each
scheduler unchanged:

* ``slurm``: a task of an ``srun`` step. Worker i is task i (``SLURM_PROCID``);
  the step's nodes (``SLURM_STEP_NODELIST``, expanded by ``scontrol show
  hostnames``) hold their tasks in blocks (``SLURM_STEP_TASKS_PER_NODE``, e.g.
  ``2(x3),1``: Slurm's default block distribution; another distribution is
  refused), the j-th task of a node listening on ``port_base + j``. TF's own
  `tf.distribute.cluster_resolver.SlurmClusterResolver` makes the same cluster
  but requires ``nvidia-smi`` and fails on nodes without GPUs.

    srun bash -c 'export TF_CONFIG=$(tf-adasum tf-config slurm); exec python train.py'

* ``kubernetes``: a pod of an Indexed Job (``completionMode: Indexed``)
  whose pods share a headless Service as their ``subdomain``. Worker i is the
  pod of completion index i (``JOB_COMPLETION_INDEX``), reached as
  ``<job>-<i>.<service>:<port>`` (Kubernetes names an Indexed Job's pods
  ``<job>-<i>``); the worker count, job, service and port are the
  entrypoint's arguments (examples/kubernetes/indexed-job.yaml).

    tf-adasum tf-config kubernetes --workers 4 --job tf-adasum --service tf-adasum

Standard library only, and nothing of ours: `tf-adasum tf-config` answers
without loading TensorFlow (examples/slurm/multiworker.sbatch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_PORT_BASE",
    "SchedulerError",
    "cluster_configs",
    "free_ports",
    "from_kubernetes",
    "from_slurm",
    "main",
    "tasks_per_node",
    "worker_config",
]

#: The first port on each node (TF's SlurmClusterResolver uses the same).
DEFAULT_PORT_BASE = 8888
#: Every pod's worker port (the one Kubeflow's TFJob uses).
DEFAULT_PORT = 2222


def worker_config(workers: Sequence[str], index: int) -> dict:
    """The ``TF_CONFIG`` (as a dict) of worker `index` of the cluster `workers` (``host:port`` each)."""
    return {"cluster": {"worker": list(workers)}, "task": {"type": "worker", "index": index}}


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
    workers = [f"{host}:{port}" for host, port in zip(hosts, ports)]
    return [json.dumps(worker_config(workers, i)) for i in range(num_workers)]


class SchedulerError(ValueError):
    """The scheduler's variables do not describe a cluster (names the variable and its value)."""


def tasks_per_node(value: str) -> list[int]:
    """Slurm's compressed task counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise SchedulerError(
                f"SLURM_STEP_TASKS_PER_NODE must look like '2(x3),1'. Received: SLURM_STEP_TASKS_PER_NODE={value!r}"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _hostnames(nodelist: str) -> list[str]:
    """The node names of a Slurm node list (``node[01-03]``), by ``scontrol``."""
    result = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=False
    )
    if result.returncode != 0:
        raise SchedulerError(f"`scontrol show hostnames {nodelist}` failed: {result.stderr.strip()}")
    return result.stdout.split()


def _variable(env: Mapping[str, str], *names: str) -> tuple[str, str]:
    for name in names:
        if env.get(name):
            return name, env[name]
    raise SchedulerError(f"{' or '.join(names)} is not set: run this inside an srun step (one task per worker)")


def _integer(name: str, value: str) -> int:
    if not value.isdigit():
        raise SchedulerError(f"{name} must be a non-negative integer. Received: {name}={value!r}")
    return int(value)


def from_slurm(
    env: Mapping[str, str] | None = None,
    port_base: int = DEFAULT_PORT_BASE,
    hostnames: Callable[[str], list[str]] = _hostnames,
) -> dict:
    """This Slurm task's ``TF_CONFIG`` (as a dict), from `env` (default: this
    process's environment); `hostnames` expands a node list."""
    env = os.environ if env is None else env
    _check_port("port_base", port_base)
    distribution = env.get("SLURM_DISTRIBUTION", "block")
    if not distribution.startswith("block"):
        raise SchedulerError(
            "the workers' order is the tasks' block order: run srun with its default distribution. "
            f"Received: SLURM_DISTRIBUTION={distribution!r}"
        )
    rank_name, rank = _variable(env, "SLURM_PROCID")
    rank = _integer(rank_name, rank)
    nodelist_name, nodelist = _variable(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    counts_name, counts = _variable(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    counts = tasks_per_node(counts)
    nodes = hostnames(nodelist)
    if len(nodes) != len(counts):
        raise SchedulerError(
            f"{nodelist_name} names {len(nodes)} nodes but {counts_name} gives {len(counts)} counts. "
            f"Received: {nodelist_name}={nodelist!r}, {counts_name}={env[counts_name]!r}"
        )
    _check_port("port_base", port_base, max(counts))
    workers = [f"{node}:{port_base + j}" for node, count in zip(nodes, counts) for j in range(count)]
    if rank >= len(workers):
        raise SchedulerError(
            f"SLURM_PROCID is not one of the step's {len(workers)} tasks. Received: SLURM_PROCID={rank}"
        )
    return worker_config(workers, rank)


def _check_port(name: str, port, tasks: int = 1) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise SchedulerError(f"`{name}` must be an int in [1, 65535]. Received: {name}={port!r}")
    if port + tasks > 65536:
        raise SchedulerError(f"`{name}` leaves no port for {tasks} tasks a node. Received: {name}={port}")


#: A DNS label (RFC 1123), as Kubernetes requires of Job and Service names.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def from_kubernetes(
    workers: int, job: str, service: str, port: int = DEFAULT_PORT, env: Mapping[str, str] | None = None
) -> dict:
    """This Indexed Job pod's ``TF_CONFIG`` (as a dict): `workers` pods named
    ``<job>-<i>`` under the headless Service `service`, each listening on
    `port`; this pod's index from ``JOB_COMPLETION_INDEX`` in `env`."""
    env = os.environ if env is None else env
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise SchedulerError(f"`workers` must be an int >= 1. Received: workers={workers!r}")
    for name, value in (("job", job), ("service", service)):
        if not isinstance(value, str) or not _DNS_LABEL.fullmatch(value):
            raise SchedulerError(f"`{name}` must be a Kubernetes name (a DNS label). Received: {name}={value!r}")
    _check_port("port", port)
    index_name, index = _variable(env, "JOB_COMPLETION_INDEX")
    index = _integer(index_name, index)
    if index >= workers:
        raise SchedulerError(
            f"JOB_COMPLETION_INDEX must be below `workers` ({workers}). Received: JOB_COMPLETION_INDEX={index}"
        )
    return worker_config([f"{job}-{i}.{service}:{port}" for i in range(workers)], index)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tf-adasum tf-config", description="Print this process's TF_CONFIG from a scheduler's variables."
    )
    schedulers = parser.add_subparsers(dest="scheduler", required=True)
    slurm = schedulers.add_parser("slurm", help="a task of an srun step")
    slurm.add_argument("--port-base", type=int, default=DEFAULT_PORT_BASE, help="each node's first port")
    kubernetes = schedulers.add_parser("kubernetes", help="a pod of an Indexed Job under a headless Service")
    kubernetes.add_argument("--workers", type=int, required=True, help="the Job's completions (= parallelism)")
    kubernetes.add_argument("--job", required=True, help="the Job's name (its pods are <job>-<index>)")
    kubernetes.add_argument("--service", required=True, help="the headless Service, the pods' subdomain")
    kubernetes.add_argument("--port", type=int, default=DEFAULT_PORT, help="every pod's worker port")
    args = parser.parse_args(argv)
    try:
        if args.scheduler == "slurm":
            config = from_slurm(port_base=args.port_base)
        else:
            config = from_kubernetes(args.workers, args.job, args.service, args.port)
    except SchedulerError as error:
        print(f"tf-adasum tf-config: {error}", file=sys.stderr)
        return 2
    print(json.dumps(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
