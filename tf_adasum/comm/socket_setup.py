"""The socket transport's settings and its set-up between worker processes.

Settings, read when an engine is built:

* ``TF_ADASUM_WORKER_TRANSPORT`` (`worker_transport`): between the CPUs of
  worker processes, "sockets" (the default: `tf_adasum.comm.sockets`) or
  "collective" (TF collective ops).
* ``TF_ADASUM_WORKER_PORT_OFFSET`` (`worker_port_offset`): a worker listens
  on its TF port plus this offset (unset: on a port the system picks).

Set-up, on every worker together at the same point (the first combine over
sockets): `worker_mesh` makes this process's listener (`listen`: on the
address its cluster spec names) and exchanges every worker's port and token
in one tiny sum over the workers; `links_agreed` connects to the peers a
scope's trees pair this worker with, then agrees with a second sum that
every worker made its links. Where a worker could not listen on its port or
reach a peer's, every worker falls back to TF collective ops together (one
warning) and the mesh's key remembers it. A mesh in use is never closed: it
lives until the process exits, or stops listening when it fails.

The sum over the workers is the caller's (the TF engine's, over its
strategy): this module knows no strategy, engine or tree.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Sequence

from tf_adasum.comm import sockets
from tf_adasum.comm.socket_listener import Listener

__all__ = [
    "PORT_OFFSET_VARIABLE",
    "SETUP_CONNECT_SECONDS",
    "TRANSPORT_VARIABLE",
    "links_agreed",
    "listen",
    "worker_mesh",
    "worker_port_offset",
    "worker_transport",
]

#: Between the CPUs of worker processes: "sockets" (default) or "collective".
TRANSPORT_VARIABLE = "TF_ADASUM_WORKER_TRANSPORT"
_TRANSPORTS = ("sockets", "collective")
#: The socket transport's port: this worker's TF_CONFIG port plus this offset (unset: one the system picks).
PORT_OFFSET_VARIABLE = "TF_ADASUM_WORKER_PORT_OFFSET"
#: How long a worker tries to reach a peer's socket port at set-up, before every worker falls back.
SETUP_CONNECT_SECONDS = 60.0

#: Sums a few float64 numbers over the worker processes (each contributes
#: once); every worker calls it at the same point, with as many numbers.
SumOverWorkers = Callable[[Sequence[float]], list[float]]

# Per process and set of workers (a mesh key): its socket mesh, or None once the
# workers agreed to fall back to TF collective ops (a port that could not be opened or reached).
_MESHES: dict[Hashable, sockets.Mesh | None] = {}
_MESHES_LOCK = threading.Lock()
# (mesh key, scope) whose links every worker agreed on: later traces of that
# scope connect without a sum (which a dead peer would leave waiting for the
# whole timeout, where its closed connection fails at once).
_AGREED: set[tuple] = set()


def worker_transport() -> str:
    """The transport between the CPUs of worker processes that
    ``TF_ADASUM_WORKER_TRANSPORT`` asks for: "sockets" (the default) or "collective"."""
    value = os.environ.get(TRANSPORT_VARIABLE, "") or "sockets"
    if value not in _TRANSPORTS:
        raise ValueError(f"{TRANSPORT_VARIABLE} must be one of {_TRANSPORTS}. Received: {TRANSPORT_VARIABLE}={value!r}")
    return value


def worker_port_offset() -> int:
    """The offset ``TF_ADASUM_WORKER_PORT_OFFSET`` asks for (0: unset, the
    system picks the socket transport's port)."""
    value = os.environ.get(PORT_OFFSET_VARIABLE, "")
    if not value:
        return 0
    try:
        offset = int(value)
    except ValueError:
        offset = 0
    if not 1 <= offset <= 65535:
        raise ValueError(
            f"{PORT_OFFSET_VARIABLE} must be an integer from 1 to 65535 (the socket transport listens on the "
            f"worker's TF_CONFIG port plus it). Received: {PORT_OFFSET_VARIABLE}={value!r}"
        )
    return offset


def listen(address: tuple[str, int], offset: int) -> Listener:
    """This worker's listener: on the address its cluster spec names (on every
    interface where that address is not this machine's, e.g. behind NAT),
    at the TF port plus `offset` (0: a port the system picks)."""
    host, tf_port = address
    port = tf_port + offset if offset else 0
    if port > 65535:
        raise OSError(f"port {tf_port} + {PORT_OFFSET_VARIABLE}={offset} is above 65535")
    try:
        return Listener(host, port)
    except OSError as error:
        if error.errno != errno.EADDRNOTAVAIL:
            raise
        return Listener(None, port)


def worker_mesh(
    key: Hashable,
    index: int,
    addresses: Sequence[tuple[str, int]],
    port_offset: int,
    timeout_seconds: float,
    sum_over_workers: SumOverWorkers,
) -> sockets.Mesh | None:
    """This process's socket mesh for the workers `key` names, made once per
    process (every worker makes it at the same point), the ports and tokens
    exchanged with `sum_over_workers`; None once the workers fell back to TF
    collective ops together: here when a worker could not listen on its port,
    in `links_agreed` when one could not reach a peer's (either way this
    worker's listener is closed).

    Args:
      key: names this set of workers and their timeout, alike on every worker.
      index: this worker's index among `addresses`.
      addresses: every worker's ``(host, TF port)`` from the cluster spec.
      port_offset: `worker_port_offset` (0: a port the system picks).
      timeout_seconds: how long a message may take (0: forever).
      sum_over_workers: the sum over the workers of `addresses`.
    """
    with _MESHES_LOCK:
        if key not in _MESHES:
            count = len(addresses)
            listener, reason = None, ""
            try:
                listener = listen(addresses[index], port_offset)
            except OSError as error:
                reason = f": {error.strerror or error}"
            mine = [0.0] * (2 * count)
            if listener is not None:
                mine[2 * index : 2 * index + 2] = [float(listener.port), float(listener.token)]
            totals = sum_over_workers(mine)
            unable = [w for w in range(count) if totals[2 * w] == 0]
            if unable:
                _MESHES[key] = None
                if listener is not None:  # no mesh will take its connections: refuse them
                    listener.close()

                def wanted(w):
                    host, port = addresses[w]
                    return f"{host}:{port + port_offset}" if port_offset else f"{host}, any port"

                where = ", ".join(f"worker process {w} on {wanted(w)}" for w in unable)
                _warn_fallback(f"cannot listen: {where}{reason}")
            else:
                listening = [(addresses[w][0], int(totals[2 * w])) for w in range(count)]
                tokens = [int(totals[2 * w + 1]) for w in range(count)]
                _MESHES[key] = sockets.Mesh(listener, index, listening, tokens, timeout_seconds)
        return _MESHES[key]


def links_agreed(
    mesh: sockets.Mesh,
    key: Hashable,
    peers: Sequence[int],
    scope: str,
    timeout_seconds: float | None,
    sum_over_workers: SumOverWorkers,
) -> bool:
    """Connects `mesh` (made by `worker_mesh` for `key`) to `peers` on every
    worker together: first the links this worker opens, within
    `SETUP_CONNECT_SECONDS`, then one sum that tells every worker whether all
    of them succeeded; if one did not, every worker falls back to TF
    collective ops (one warning) and the mesh is closed. Else the links the
    peers opened are waited for (made by then). Once per `scope` (a name for
    the trees whose peers these are): every worker traces the same scopes,
    so every worker skips the sum together on a later trace."""
    agreed = (key, scope)
    if agreed in _AGREED:
        mesh.connect(peers, time.monotonic() + (timeout_seconds or sockets.CONNECT_TIMEOUT_SECONDS))
        return True
    failures = mesh.try_connect(
        peers, time.monotonic() + min(timeout_seconds or SETUP_CONNECT_SECONDS, SETUP_CONNECT_SECONDS)
    )
    (failed,) = sum_over_workers([float(bool(failures))])
    if failed:
        mesh.close()  # its listener, links and their threads: no worker uses the mesh again
        with _MESHES_LOCK:
            _MESHES[key] = None
        _warn_fallback("; ".join(failures) or f"{int(failed)} worker process(es) could not reach a peer")
        return False
    mesh.connect(peers, time.monotonic() + (timeout_seconds or sockets.CONNECT_TIMEOUT_SECONDS))
    with _MESHES_LOCK:
        _AGREED.add(agreed)
    return True


def _warn_fallback(problem: str) -> None:
    warnings.warn(
        f"tf_adasum: the socket transport between worker processes could not be set up ({problem}). "
        "Every worker combines over TensorFlow's collective ops instead (slower on CPUs). To use it, open "
        f"each worker's socket port in the firewall: set {PORT_OFFSET_VARIABLE} to make it the worker's "
        "TF_CONFIG port plus that offset.",
        RuntimeWarning,
        stacklevel=3,
    )
