"""The socket mesh between worker processes (`tf_adasum.comm.sockets`) and
its links (`tf_adasum.comm.socket_link`), its processes played by meshes in
this process over loopback. The tree over it,
against the reference, runs across real worker processes in
`test_multiworker.py`."""

import socket
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from conftest import TOLERANCE, relative_error
from multiprocess import COMPRESSED_TOLERANCE

from tf_adasum import combiners, reference
from tf_adasum.comm import compression, socket_communicator, socket_listener, sockets
from tf_adasum.engines.base import combine_with_communicators
from tf_adasum.tree import topology


def _meshes(count, timeout=30.0):
    listeners = [socket_listener.Listener() for _ in range(count)]
    addresses = [("127.0.0.1", listener.port) for listener in listeners]
    tokens = [listener.token for listener in listeners]
    return [sockets.Mesh(listener, i, addresses, tokens, timeout) for i, listener in enumerate(listeners)]


def _in_threads(*calls):
    """Runs `calls` at once; returns their results (re-raising the first error)."""
    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except Exception as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def _started(call):
    """Starts `call` in a thread; returns a function that waits for its result."""
    box = []
    thread = threading.Thread(target=lambda: box.append(_raised_or_result(call)))
    thread.start()

    def result():
        thread.join(60)
        return box[0]

    return result


def _raised_or_result(call):
    try:
        return call()
    except tf.errors.OpError as error:
        return error


def _bytes(rng, n):
    return rng.integers(0, 256, n, dtype=np.uint8)


def _until(link, condition, what: str) -> None:
    """Waits on `link`'s own notifications (a message read, a receive posted,
    a failure) until `condition()` holds; fails the test after 30 s."""
    with link._state:
        assert link._state.wait_for(condition, timeout=30), f"never: {what}"


def _arrived(mesh, peer, tag, count=1):
    """Waits until `count` messages with `tag` from `peer` wait, read, for their receives."""
    link = mesh.link(peer, time.monotonic() + 30)
    _until(link, lambda: sum(r.done for r in link._early.get(tag, ())) >= count, f"{count} early message(s) {tag}")


def _waiting(mesh, peer, tag):
    """Waits until a receive with `tag` from `peer` is posted (its caller then waits)."""
    link = mesh.link(peer, time.monotonic() + 30)
    _until(link, lambda: bool(link._posted.get(tag)), f"a receive posted for tag {tag}")


def test_every_pair_exchanges_messages_of_any_size(rng):
    meshes = _meshes(3)
    for mesh in meshes:  # as the communicators do: the largest message of the layout may come early
        mesh.allow(3 << 20)
    sizes = [0, 1, 1000, 3 << 20]
    sent = {(a, b, n): _bytes(rng, n) for a in range(3) for b in range(3) if a != b for n in sizes}

    def run(me):
        got = {}
        for n in sizes:
            for peer in range(3):
                if peer != me:
                    tag = 1000 * min(me, peer) + 10 * max(me, peer) + sizes.index(n)
                    got[(peer, me, n)] = meshes[me].exchange(peer, tag, sent[(me, peer, n)], n, "a test").copy()
        return got

    for got in _in_threads(*(lambda me=me: run(me) for me in range(3))):
        for key, value in got.items():
            assert value.tobytes() == sent[key].tobytes(), key


def test_messages_match_by_tag_whatever_the_order(rng):
    first, second = _meshes(2)
    a, b = _bytes(rng, 100), _bytes(rng, 200)
    first.exchange(1, 7, a, None, "a test")
    first.exchange(1, 8, b, None, "a test")
    _arrived(second, 0, 7)  # both arrive before anyone asks for them
    _arrived(second, 0, 8)
    assert second.exchange(0, 8, None, 200, "a test").tobytes() == b.tobytes()  # adopted as it came
    into = np.zeros(100, np.uint8)
    assert second.exchange(0, 7, None, into, "a test") is into  # copied where asked
    assert into.tobytes() == a.tobytes()
    # The k-th message with a tag fills the k-th receive of that tag.
    for value in (1, 2, 3):
        first.exchange(1, 9, np.full(4, value, np.uint8), None, "a test")
    assert [second.exchange(0, 9, None, 4, "a test")[0] for _ in range(3)] == [1, 2, 3]


def test_received_buffers_are_aligned_for_tensorflow(rng):
    first, second = _meshes(2)
    first.exchange(1, 1, _bytes(rng, 4099), None, "a test")
    assert second.exchange(0, 1, None, 4099, "a test").ctypes.data % 64 == 0


@pytest.mark.parametrize("early", [True, False])
def test_a_message_of_another_size_fails_the_receiver(early, rng):
    first, second = _meshes(2)
    if early:
        first.exchange(1, 5, _bytes(rng, 10), None, "a test")
        _arrived(second, 0, 5)
        with pytest.raises(tf.errors.InvalidArgumentError, match="sent 10 bytes where 12 were expected"):
            second.exchange(0, 5, None, 12, "a test")
        # The receiver closed the link: the sender's next wait fails too, it does not hang.
        with pytest.raises(tf.errors.UnavailableError, match="a worker failed or left"):
            first.exchange(1, 6, None, 4, "a test")
    else:
        first.link(1, None)  # connected, so that the receive can be posted
        waiting = _started(lambda: second.exchange(0, 5, None, 12, "a test"))
        _waiting(second, 0, 5)
        # The receiver drops the connection on the header: the sender may see
        # that before its payload has left.
        sent = _raised_or_result(lambda: first.exchange(1, 5, _bytes(rng, 10), None, "a test"))
        assert sent is None or isinstance(sent, tf.errors.UnavailableError), sent
        error = waiting()
        assert isinstance(error, tf.errors.InvalidArgumentError) and "different programs" in str(error)


def test_wait_past_the_timeout_names_the_peer():
    first, second = _meshes(2, timeout=0.5)
    first.link(1, None)  # connected, but worker process 0 never sends
    start = time.monotonic()
    with pytest.raises(
        tf.errors.DeadlineExceededError, match=r"gather of rank 1 timed out waiting for worker process 0"
    ):
        second.exchange(0, 3, None, 8, "gather of rank 1")
    assert time.monotonic() - start < 5
    # A message that comes after the deadline must not fill a later receive: the link stays failed.
    with pytest.raises(tf.errors.DeadlineExceededError):
        second.exchange(0, 3, None, 8, "the next gather")


def test_a_closed_connection_fails_every_wait_on_it():
    first, second = _meshes(2)
    link = first.link(1, None)
    second.link(0, time.monotonic() + 10)
    waiting = _started(lambda: second.exchange(0, 4, None, 8, "a test"))
    _waiting(second, 0, 4)
    link.fail(tf.errors.UnavailableError(None, None, "closed by the test"))  # as a dying process closes it
    error = waiting()
    assert isinstance(error, tf.errors.UnavailableError) and "a worker failed or left" in str(error)
    with pytest.raises(tf.errors.UnavailableError):
        second.exchange(0, 5, None, 8, "a test")


def test_a_send_the_peer_cut_off_says_a_worker_failed_or_left(monkeypatch):
    # Whichever side notices a dead peer first, the sender or the reader,
    # the error says what happened (a killed worker's peer may be mid-send).
    first, second = _meshes(2)
    link = first.link(1, None)
    second.link(0, time.monotonic() + 10)

    class _CutOff:
        def sendall(self, data):
            raise BrokenPipeError(32, "Broken pipe")

        def shutdown(self, how):
            pass

        def close(self):
            pass

    real = link._sender
    monkeypatch.setattr(link, "_sender", _CutOff())
    with pytest.raises(
        tf.errors.UnavailableError, match=r"sending to worker process 1 .* failed: .*\(a worker failed or left\)"
    ):
        first.exchange(1, 1, np.zeros(8, np.uint8), None, "a test")
    real.close()


def test_a_stranger_is_refused_and_the_mesh_works_on(rng):
    first, second = _meshes(2)
    stranger = socket.create_connection(second.addresses[1], timeout=10)
    stranger.sendall(b"tfadasum" + (0).to_bytes(4, "little") + (second._listener.token ^ 1).to_bytes(8, "little"))
    assert stranger.recv(1) == b""  # closed: wrong token
    data = _bytes(rng, 64)
    first.exchange(1, 1, data, None, "a test")
    assert second.exchange(0, 1, None, 64, "a test").tobytes() == data.tobytes()


def test_concurrent_callers_share_one_connection():
    first, second = _meshes(2)
    links = _in_threads(*(lambda: first.link(1, time.monotonic() + 10) for _ in range(4)))
    assert all(link is links[0] for link in links)
    assert second.link(0, time.monotonic() + 10) is not None


def test_one_failed_link_fails_the_whole_mesh(rng):
    meshes = _meshes(3)
    meshes[0].link(1, None)
    meshes[0].link(2, None)
    meshes[2].link(0, time.monotonic() + 10)
    waiting = _started(lambda: meshes[2].exchange(0, 1, None, 8, "a test"))
    _waiting(meshes[2], 0, 1)
    meshes[0].link(1, None).fail(tf.errors.UnavailableError(None, None, "link 0-1 failed in the test"))
    # Process 0's other link fails too (its step's messages there are now unmatched), and so does its peer's wait.
    with pytest.raises(tf.errors.UnavailableError, match="link 0-1 failed in the test"):
        meshes[0].exchange(2, 1, _bytes(rng, 8), None, "a test")
    assert isinstance(waiting(), tf.errors.UnavailableError)


def test_a_connection_the_peer_refuses_is_an_error():
    listeners = [socket_listener.Listener() for _ in range(2)]
    addresses = [("127.0.0.1", listener.port) for listener in listeners]
    sockets.Mesh(listeners[1], 1, addresses, [0, listeners[1].token])
    wrong = sockets.Mesh(listeners[0], 0, addresses, [listeners[0].token, listeners[1].token ^ 1], timeout_seconds=10)
    with pytest.raises(tf.errors.UnavailableError, match="refused the connection"):
        wrong.exchange(1, 1, np.zeros(4, np.uint8), None, "a test")


def test_mesh_arguments_are_checked():
    listener = socket_listener.Listener()
    with pytest.raises(ValueError, match="Received: index=2, 2 tokens"):
        sockets.Mesh(listener, 2, [("127.0.0.1", 1), ("127.0.0.1", 2)], [1, 2])


def test_peer_must_be_another_process():
    (mesh,) = _meshes(1)
    with pytest.raises(ValueError, match="Received: peer=0"):
        mesh.link(0, None)


def test_try_connect_reports_unreachable_peers_without_raising():
    listeners = [socket_listener.Listener("127.0.0.1") for _ in range(3)]
    closed = listeners[2].port
    listeners[2].socket.close()  # nothing listens there any more
    addresses = [("127.0.0.1", listener.port) for listener in listeners[:2]] + [("127.0.0.1", closed)]
    tokens = [listener.token for listener in listeners]
    sockets.Mesh(listeners[1], 1, addresses, tokens, 10)
    mesh = sockets.Mesh(listeners[0], 0, addresses, tokens, 10)
    failures = mesh.try_connect([1, 2], time.monotonic() + 5)
    assert len(failures) == 1 and f"127.0.0.1:{closed}" in failures[0], failures
    assert mesh.link(1, time.monotonic() + 5) is not None  # the reachable peer is connected


# -- strangers at the door, and the listener's life --------------------------------------

_DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]


def _tree_over(meshes, inputs):
    """The Adasum tree of `inputs` (per rank) over two meshes of this process,
    each rank's steps in a thread of its own; every rank's results."""
    out = {}

    def run(rank):
        communicator = socket_communicator.SocketCommunicator(_DEVICES, rank, [0, 1], meshes[rank])
        with tf.device(_DEVICES[rank]):
            values = [(tf.constant(x),) for x in inputs[rank]]
        combined, _ = combine_with_communicators(values, [communicator], combiners.get("adasum"))
        return [np.asarray(c[0]) for c in combined]

    results = _in_threads(*(lambda rank=rank: run(rank) for rank in range(2)))
    out = {rank: result for rank, result in enumerate(results)}
    return out


def test_strangers_cost_no_threads_are_cut_off_at_the_hello_deadline_and_change_nothing(rng, monkeypatch):
    hello_seconds = 1.5
    monkeypatch.setattr(socket_listener, "HELLO_SECONDS", hello_seconds)
    inputs = [[rng.standard_normal(s).astype(np.float32) for s in [(1000,), (300, 7), (5,)]] for _ in range(2)]
    listeners = [socket_listener.Listener("127.0.0.1") for _ in range(2)]
    addresses = [("127.0.0.1", listener.port) for listener in listeners]
    tokens = [listener.token for listener in listeners]
    meshes = [sockets.Mesh(listener, i, addresses, tokens, 30.0) for i, listener in enumerate(listeners)]
    before = threading.active_count()
    # 300 idle connections to the worker that is connected to, then 10 that trickle a valid-looking hello
    # (the right magic and index, a wrong token) one byte every 0.25 s: 5 s for the whole hello.
    idle = [socket.create_connection(addresses[1], timeout=30) for _ in range(300)]
    hello = b"tfadasum" + (0).to_bytes(4, "little") + (tokens[1] ^ 1).to_bytes(8, "little")
    trickling = [socket.create_connection(addresses[1], timeout=30) for _ in range(10)]
    for sock in trickling:
        sock.setblocking(False)
    cut_after = {}

    def trickle():
        start = time.monotonic()
        for sent in range(len(hello)):
            for i, sock in enumerate(trickling):
                if i in cut_after:
                    continue
                try:
                    if sock.recv(1) == b"":
                        cut_after[i] = time.monotonic() - start
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    cut_after[i] = time.monotonic() - start
                    continue
                try:
                    sock.send(hello[sent : sent + 1])
                except OSError:
                    cut_after[i] = time.monotonic() - start
            if len(cut_after) == len(trickling):
                return
            time.sleep(0.25)

    trickler = threading.Thread(target=trickle)
    trickler.start()
    try:
        # Meanwhile the workers connect and combine: the same bits as the reference tree's rounding allows,
        # on both ranks, and the same bits again with the strangers still there.
        first = _tree_over(meshes, inputs)
        during = threading.active_count() - 1  # the trickling thread is the test's
        second = _tree_over(meshes, inputs)
        trickler.join(30)
        # The idle ones were dropped as well (at most MAX_PENDING wait at once; the rest went earlier).
        for sock in idle:
            sock.settimeout(hello_seconds + 10)
            try:
                assert sock.recv(1) == b""
            except ConnectionError:
                pass  # reset by the worker: dropped too
    finally:
        for sock in idle + trickling:
            sock.close()
    expected = reference.adasum_tree([[x.astype(np.float64) for x in rank] for rank in inputs])
    for i, want in enumerate(expected):
        assert relative_error(first[0][i], want) < TOLERANCE["float32"], i
        for result in (first[1], second[0], second[1]):
            assert result[i].tobytes() == first[0][i].tobytes(), i
    # Bounded threads: one listener thread per mesh serves every stranger (the links' readers and
    # senders are the only new ones: two of each per connected pair, made by the workers' own connection).
    assert during <= before + 4, (before, during)
    # One deadline for the whole hello, however the bytes trickle in.
    assert len(cut_after) == len(trickling), cut_after
    assert max(cut_after.values()) < hello_seconds + 2.0 < 0.25 * len(hello), cut_after


def test_closing_the_mesh_closes_its_listener():
    first, second = _meshes(2)
    first.link(1, None)
    port = second.addresses[1][1]
    second.close()
    second._door.thread.join(10)
    assert not second._door.thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).recv(1)  # refused, or closed at once
    with pytest.raises(tf.errors.UnavailableError, match="the transport was closed"):
        second.exchange(0, 1, None, 8, "a test")
    # The peer's link saw the connection close.
    with pytest.raises(tf.errors.UnavailableError):
        first.exchange(1, 1, None, 8, "a test")


def test_a_failed_mesh_stops_listening():
    first, second = _meshes(2)
    first.link(1, None).fail(tf.errors.UnavailableError(None, None, "failed in the test"))
    first._door.thread.join(10)
    assert not first._door.thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(first.addresses[0], timeout=5).recv(1)  # refused, or closed at once
    assert first._listener.socket.getsockname()[1] == first.addresses[0][1]  # its address can still be read


def _sending(call):
    """Starts the send `call` in a helper thread, so that the test's own thread
    (which posts the receive) never waits on a message the reader leaves
    unread; returns a function that joins it (30 s) and returns its result
    or the `OpError` it raised."""
    box = []
    thread = threading.Thread(target=lambda: box.append(_raised_or_result(call)), daemon=True)
    thread.start()

    def joined():
        thread.join(30)
        assert not thread.is_alive(), "the send never finished"
        return box[0]

    return joined


def test_a_message_larger_than_any_expected_waits_unread_for_its_receive(rng):
    first, second = _meshes(2, timeout=2.0)
    big = _bytes(rng, 1 << 20)  # above the early-message limit: nothing was allowed
    sent = _sending(lambda: first.exchange(1, 1, big, None, "a test"))
    link = second.link(0, time.monotonic() + 10)
    _until(link, lambda: link.withheld == (1, 1 << 20), "the reader to leave the message unread")
    assert not link._early.get(1), "buffered although larger than any message expected"
    assert second.exchange(0, 1, None, big.nbytes, "a test").tobytes() == big.tobytes()  # posted in time: taken
    assert not isinstance(sent(), tf.errors.OpError)
    # Allowed: buffered as it comes, before any receive.
    second.allow(1 << 20)
    sent = _sending(lambda: first.exchange(1, 2, big, None, "a test"))
    _arrived(second, 0, 2)
    assert not isinstance(sent(), tf.errors.OpError)
    # Not allowed and never received: the link fails once the timeout has passed (the send may end
    # either way: absorbed by the socket buffers, or cut off when the failed link closes).
    sent = _sending(lambda: first.exchange(1, 3, _bytes(rng, 2 << 20), None, "a test"))
    _until(link, lambda: link._failure is not None, "the link to fail")
    with pytest.raises(tf.errors.InvalidArgumentError, match="no receive took within 2 s, more than the 1048576"):
        second.exchange(0, 4, None, 8, "a test")
    sent()


# -- the tree's swaps in pieces -----------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("name, wire", [("adasum", None), ("sum", None), ("adasum", "bfloat16"), ("sum", "float16")])
def test_swaps_in_pieces_match_the_reference_and_are_identical_on_every_rank(n, name, wire, rng, monkeypatch):
    # Pieces of 1 KiB: a level's half of the float32 bucket travels in 11 or 12
    # messages, each piece's partials computed as it comes (called twice); then
    # the same tree with whole halves (`swap_halves`), for comparison.
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(n)]
    meshes = _meshes(n)
    sizes = [(3000,), (40, 70), (5,)]
    inputs = [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]
    messages = []
    exchange = sockets.Mesh.exchange_in_pieces

    def counting(mesh, peer, tag, outgoing, into, what):
        messages.append(len(outgoing))
        return exchange(mesh, peer, tag, outgoing, into, what)

    monkeypatch.setattr(sockets.Mesh, "exchange_in_pieces", counting)

    def tree(piece_bytes):
        def run(rank):
            communicator = socket_communicator.SocketCommunicator(devices, rank, list(range(n)), meshes[rank])
            communicator.piece_bytes = piece_bytes
            communicator = compression.compressed([communicator], wire)[0]  # unchanged for None
            with tf.device(devices[rank]):
                values = [(tf.constant(x),) for x in inputs[rank]]

            def combine():
                combined, partials = combine_with_communicators(values, [communicator], combiners.get(name))
                return [c[0] for c in combined], partials

            if n == 2:  # in a graph, as a step runs it; more ranks would wait on each other for the
                # threads of this one process's shared TensorFlow pool (4 processes: test_multiworker.py)
                combine = tf.function(combine)
            first, _ = combine()
            again, partials = combine()
            assert all(np.array_equal(a, b) for a, b in zip(first, again))
            return [np.asarray(c) for c in again], np.asarray(partials)

        return _in_threads(*(lambda rank=rank: run(rank) for rank in range(n)))

    results = tree(1024)
    assert messages and max(messages) >= 11, messages
    per_rank = [[x.astype(np.float64) for x in rank] for rank in inputs]
    expected = reference.adasum_tree(per_rank) if name == "adasum" else [sum(xs) for xs in zip(*per_rank)]
    tolerance = TOLERANCE["float32"] if wire is None else COMPRESSED_TOLERANCE[wire]
    for got, want in zip(results[0][0], expected):
        assert relative_error(got, want) < tolerance
    for rank, _ in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(rank, results[0][0]))
    if name == "adasum" and wire is None:  # the first level's [a.b, |a|^2, |b|^2]: a the lower rank's, b the upper's
        for r in topology.level_representatives(n)[0]:
            a, b = per_rank[r], per_rank[r + 1]
            want = [[np.vdot(x, y), np.vdot(x, x), np.vdot(y, y)] for x, y in zip(a, b)]
            np.testing.assert_allclose(results[r][1][0][0], want, rtol=1e-6)  # [local rank][level]
    messages.clear()
    whole = tree(0)  # `swap_halves`: one message a level
    assert not messages, messages
    for got, want in zip(whole[0][0], results[0][0]):
        if name == "sum":  # the same additions, whatever the pieces
            assert np.array_equal(got, want)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
