"""Which devices and processes a `tf.distribute` strategy spans, from public facts.

* `num_workers`: the worker processes whose replicas are combined: the
  strategy's replicas over this process's replicas (every worker of a
  `MultiWorkerMirroredStrategy` has as many devices as this one, as the
  strategy itself assumes).
* `cluster_devices`: every replica's device in global replica order, and the
  ranks of this process's replicas.
* `task_addresses`, `task_hosts`: the ``(host, port)`` (the host) of every
  worker, in the same order.
* `process_of`, `is_cpu`: what a device string says of its process and type.
* `resolver_tasks`: the tasks of a cluster resolver that hold replicas, in order.

Only public API: ``num_replicas_in_sync``, ``extended.worker_devices`` and the
strategy's ``cluster_resolver`` (its cluster spec, task type and task id).
"""

from __future__ import annotations

import tensorflow as tf

__all__ = [
    "cluster_devices",
    "is_cpu",
    "num_workers",
    "process_of",
    "resolver_tasks",
    "task_addresses",
    "task_hosts",
    "task_index",
]

#: The task types that hold replicas, in the strategy's replica order.
_REPLICA_JOBS = ("chief", "worker")


#: The one replica of the default strategy, which has no device list.
_DEFAULT_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"


def _local_devices(strategy) -> tuple[str, ...]:
    if strategy.num_replicas_in_sync == 1:
        try:
            return tuple(strategy.extended.worker_devices)
        except RuntimeError:  # the default strategy: "worker_devices() method unsupported"
            return (_DEFAULT_DEVICE,)
    return tuple(strategy.extended.worker_devices)


def process_of(device: str) -> tuple:
    """The process a device belongs to: its (job, replica, task)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.job, spec.replica, spec.task


def is_cpu(device: str) -> bool:
    """Whether `device` is a CPU (a device string without a type counts as one)."""
    return (tf.DeviceSpec.from_string(device).device_type or "CPU").upper() == "CPU"


def num_workers(strategy) -> int:
    """The number of worker processes of `strategy` (1 within one process)."""
    local = len(_local_devices(strategy))
    total = strategy.num_replicas_in_sync
    if local < 1 or total % local:
        raise RuntimeError(
            f"Cannot tell the worker count of {type(strategy).__name__}: {total} replicas in sync over "
            f"{local} local devices. tf_adasum assumes every worker has as many devices as this one."
        )
    return total // local


def _tasks(strategy) -> list[tuple[str, int]]:
    resolver = strategy.cluster_resolver
    if resolver is None:
        raise RuntimeError(
            f"{type(strategy).__name__} spans {num_workers(strategy)} workers but has no cluster_resolver; "
            "tf_adasum needs it to order the workers' devices."
        )
    return resolver_tasks(resolver)


def resolver_tasks(resolver) -> list[tuple[str, int]]:
    """The ``(job, index)`` of every task of a cluster resolver that holds
    replicas, in replica order: the chief first, then workers by index."""
    cluster = resolver.cluster_spec().as_dict()
    tasks = []
    for job in _REPLICA_JOBS:
        members = cluster.get(job, [])
        indices = sorted(members) if isinstance(members, dict) else range(len(members))
        tasks += [(job, int(i)) for i in indices]
    return tasks


def task_addresses(strategy) -> list[tuple[str, int]]:
    """The ``(host, port)`` of every worker (chief first, then workers by
    index), from the cluster spec's ``host:port`` addresses (an IPv6 host
    without its brackets)."""
    spec = strategy.cluster_resolver.cluster_spec()
    addresses = []
    for job, task in _tasks(strategy):
        host, port = spec.task_address(job, task).rsplit(":", 1)
        addresses.append((host[1:-1] if host.startswith("[") else host, int(port)))
    return addresses


def task_hosts(strategy) -> list[str]:
    """The host of every worker, in the order of `task_addresses`."""
    return [host for host, _ in task_addresses(strategy)]


def task_index(strategy) -> int:
    """This worker's position among the workers (chief first, then workers by index)."""
    if num_workers(strategy) == 1:
        return 0
    resolver = strategy.cluster_resolver
    return _tasks(strategy).index((resolver.task_type, int(resolver.task_id)))


def cluster_devices(strategy) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """All replica devices of `strategy` in global replica order, and the
    global ranks of this process's replicas.

    One process: its worker devices, ranks 0..N-1. Across processes: every
    task's devices (chief first, then workers by index), this process's at
    ``task_index * local count``.
    """
    local = _local_devices(strategy)
    if num_workers(strategy) == 1:
        return local, tuple(range(len(local)))
    tasks = _tasks(strategy)
    if len(tasks) != num_workers(strategy):
        raise RuntimeError(
            f"The cluster spec lists {len(tasks)} chief/worker tasks, but the strategy has "
            f"{num_workers(strategy)} workers' replicas in sync."
        )
    specs = [tf.DeviceSpec.from_string(d) for d in local]
    devices = tuple(spec.replace(job=job, replica=0, task=task).to_string() for job, task in tasks for spec in specs)
    offset = task_index(strategy) * len(local)
    return devices, tuple(range(offset, offset + len(local)))
