"""The socket transport's settings and set-up between worker processes
(`tf_adasum.comm.socket_setup`): the environment variables, the listener,
the mesh every worker makes together and the fallback they agree on, each
worker's sum over the workers played by a function in this process. Across
real worker processes: `test_multiworker.py`."""

import socket

import pytest
import tensorflow as tf

from tf_adasum.comm import socket_listener, socket_setup, sockets
from tf_adasum.engines import tf as tf_engine


def test_worker_transport_variable(monkeypatch):
    monkeypatch.delenv("TF_ADASUM_WORKER_TRANSPORT", raising=False)
    assert socket_setup.worker_transport() == "sockets"
    monkeypatch.setenv("TF_ADASUM_WORKER_TRANSPORT", "collective")
    assert socket_setup.worker_transport() == "collective"
    monkeypatch.setenv("TF_ADASUM_WORKER_TRANSPORT", "grpc")
    with pytest.raises(ValueError, match="Received: TF_ADASUM_WORKER_TRANSPORT='grpc'"):
        socket_setup.worker_transport()


def test_a_transport_set_differently_on_the_workers_is_an_error(monkeypatch):
    devices = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(2)]
    monkeypatch.setenv("TF_ADASUM_WORKER_TRANSPORT", "collective")
    engine = tf_engine.TFEngine(devices, (0,), strategy=object())
    variables = [tf.Variable(tf.zeros([3]))]

    def summed(strategy, values, timeout):  # this worker's values, and 'sockets' on the other
        return [2 * values[0], values[1] + 1.0] + [2 * v for v in values[2:]]

    monkeypatch.setattr(tf_engine, "sum_over_workers", summed)
    monkeypatch.setattr(tf_engine.cluster, "task_index", lambda strategy: 0)
    with pytest.raises(ValueError, match="Received: TF_ADASUM_WORKER_TRANSPORT='collective' on this worker"):
        engine.check_same_variables(variables)


def test_port_offset_variable(monkeypatch):
    monkeypatch.delenv("TF_ADASUM_WORKER_PORT_OFFSET", raising=False)
    assert socket_setup.worker_port_offset() == 0
    monkeypatch.setenv("TF_ADASUM_WORKER_PORT_OFFSET", "100")
    assert socket_setup.worker_port_offset() == 100
    for bad in ("0", "70000", "ten"):
        monkeypatch.setenv("TF_ADASUM_WORKER_PORT_OFFSET", bad)
        with pytest.raises(ValueError, match=f"Received: TF_ADASUM_WORKER_PORT_OFFSET='{bad}'"):
            socket_setup.worker_port_offset()


def test_listener_takes_the_specified_address_and_port():
    free = socket_listener.Listener("127.0.0.1")
    port = free.port
    free.socket.close()
    listener = socket_setup.listen(("127.0.0.1", port - 7), 7)
    assert listener.socket.getsockname()[:2] == ("127.0.0.1", port)
    with pytest.raises(OSError):  # taken: the engine's workers then fall back together
        socket_setup.listen(("127.0.0.1", port - 7), 7)
    with pytest.raises(OSError, match="above 65535"):
        socket_setup.listen(("127.0.0.1", 65000), 1000)
    # An address that is not this machine's (e.g. behind NAT): every interface, at that port.
    anywhere = socket_setup.listen(("192.0.2.1", 0), 0)
    assert anywhere.socket.getsockname()[0] in ("0.0.0.0", "::")


def test_links_the_workers_cannot_agree_on_close_the_mesh(monkeypatch):
    """A worker could not reach a peer: every worker falls back (one warning),
    and this one closes its mesh (listener, links, threads) instead of only
    dropping it."""
    listeners = [socket_listener.Listener("127.0.0.1") for _ in range(2)]
    unreachable = listeners[1].port
    listeners[1].socket.close()
    addresses = [("127.0.0.1", listeners[0].port), ("127.0.0.1", unreachable)]
    mesh = sockets.Mesh(listeners[0], 0, addresses, [listener.token for listener in listeners], 10)
    key = ("a test's mesh", 10.0)
    monkeypatch.setitem(socket_setup._MESHES, key, mesh)
    one_failed = lambda values: [1.0]  # noqa: E731
    with pytest.warns(RuntimeWarning, match="socket transport between worker processes could not be set up"):
        assert socket_setup.links_agreed(mesh, key, [1], "all", 10.0, one_failed) is False
    assert socket_setup._MESHES[key] is None
    mesh._door.thread.join(10)
    assert not mesh._door.thread.is_alive()
    assert mesh._listener.socket.fileno() == -1  # closed, not only stopped
    with pytest.raises(OSError):
        socket.create_connection(addresses[0], timeout=5).recv(1)


def _recording_listen(monkeypatch) -> list:
    """The listeners `socket_setup.worker_mesh` makes, as it makes them."""
    made, listen = [], socket_setup.listen
    monkeypatch.setattr(socket_setup, "listen", lambda *args: made.append(listen(*args)) or made[-1])
    return made


def test_a_worker_that_cannot_listen_makes_every_worker_fall_back(monkeypatch):
    """Worker 1's port reads 0 in the sum (it could not listen): no mesh on any
    worker, one warning naming worker 1, and this worker's listener closed."""
    monkeypatch.setattr(socket_setup, "_MESHES", {})
    made = _recording_listen(monkeypatch)
    addresses = [("127.0.0.1", 2222), ("127.0.0.1", 2223)]
    alone = lambda values: list(values)  # noqa: E731 - worker 1 added nothing
    with pytest.warns(RuntimeWarning, match="cannot listen: worker process 1 on 127.0.0.1, any port"):
        assert socket_setup.worker_mesh("a test's mesh", 0, addresses, 0, 10.0, alone) is None
    assert made[0].socket.fileno() == -1  # closed, not left to the garbage collector
    assert socket_setup._MESHES == {"a test's mesh": None}  # the fallback is remembered


def test_the_workers_mesh_holds_every_port_and_token_and_is_made_once(monkeypatch):
    monkeypatch.setattr(socket_setup, "_MESHES", {})
    made = _recording_listen(monkeypatch)
    peer = socket_listener.Listener("127.0.0.1")
    sums = []

    def with_peer(values):  # worker 1's port and token added to this worker's
        sums.append(list(values))
        return [values[0], values[1], float(peer.port), float(peer.token)]

    addresses = [("127.0.0.1", 2222), ("127.0.0.1", 2223)]
    mesh = socket_setup.worker_mesh("a test's mesh", 0, addresses, 0, 10.0, with_peer)
    try:
        assert sums == [[float(made[0].port), float(made[0].token), 0.0, 0.0]]
        assert mesh.addresses == (("127.0.0.1", made[0].port), ("127.0.0.1", peer.port))
        assert mesh.tokens == (made[0].token, peer.token)
        assert mesh.index == 0 and mesh.timeout == 10.0
        assert socket_setup.worker_mesh("a test's mesh", 0, addresses, 0, 10.0, with_peer) is mesh
        assert len(sums) == 1 and len(made) == 1  # made once per process: no second sum, no second listener
    finally:
        mesh.close()
        peer.close()
