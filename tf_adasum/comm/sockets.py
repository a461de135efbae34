"""Pairwise messages between the worker processes of a TF cluster, over TCP.

TensorFlow's collective ops move a tensor between processes through gRPC's
``RecvBuf``: the sender copies it into protobuf strings, gRPC serialises them,
the receiver parses them and copies the bytes into the result. Between the
CPUs of worker processes the vector-halving tree needs only pairwise
messages, so this transport sends each one from the tensor's memory over one
TCP connection per pair of processes, and the receiving thread reads it into
the memory the result lives in: one copy into the kernel and one out.

* `Listener` (from `tf_adasum.comm.socket_listener`, which also keeps
  strangers at the door): this process's listening socket and the token a
  peer presents when it connects.
* `Mesh`: one process's connections to its peers, made on first use (the
  lower index connects), each read by a thread of its own. A message carries
  a 64-bit tag; the k-th message a peer sends with a tag fills the k-th
  receive posted for that tag, so messages match whatever order TensorFlow's
  threads run in.
(`tf_adasum.comm.socket_communicator` builds the tree's steps on a mesh.)

Failures never hang, and a link that failed once stays failed (every later
use raises) and fails the mesh's other links (the failed step left messages
unmatched there too; the process must start over), and the mesh's listener
stops listening (`Mesh.close` closes it, which the engine does only when the
workers fall back to TF collective ops; a mesh in use lives until the process
exits): a wait past the timeout raises
`DeadlineExceededError`; a connection that closes or resets (a peer that
died or left) fails every wait on it with `UnavailableError`; TCP keepalive
(idle connections) and ``TCP_USER_TIMEOUT`` (unacknowledged data) notice a
peer host that vanished without closing, within about a minute; a message of
another size than the one expected (processes running different programs)
fails the link, so its sender's next wait fails too. A message that comes
before its receive is posted is buffered only up to the largest message the
mesh expects (`Mesh.allow`, which the communicators call with their steps'
sizes: the agreed layout's); a larger one waits, unread, for its receive, and
fails the link when none comes within the timeout, so a 64-bit length never
decides an allocation. Raised inside a ``tf.numpy_function``, these reach the
caller as TensorFlow's `UnknownError` whose message carries the class name
and this module's "tf_adasum socket transport:" text.

(About 460 lines: the link's reader, its sender and the failure latch share
one state and are kept together; the listener lives in
`tf_adasum.comm.socket_listener`.)
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_adasum.comm import ordering, socket_listener
from tf_adasum.comm.socket_listener import Listener

__all__ = ["CONNECT_TIMEOUT_SECONDS", "Listener", "Mesh", "aligned_empty"]

_HEADER = struct.Struct("<QQ")  # tag, payload bytes
_HANDSHAKE_SECONDS = 30.0  # the connecting side's wait for the answer to its hello
_KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}
_USER_TIMEOUT_MS = 60_000

#: How long `Mesh.connect` waits for its peers when messages may wait forever.
CONNECT_TIMEOUT_SECONDS = 600.0
_READER_POLL_SECONDS = 60.0
#: A message that comes before its receive is buffered up to this many bytes
#: at least (more as `Mesh.allow` raises the limit).
_MIN_EARLY_BYTES = 1 << 16
_FOREVER_SECONDS = 365 * 86400.0
_ALIGN = 64  # TensorFlow takes a numpy result without a copy when it is this aligned


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of `nbytes` starting on a `_ALIGN` boundary."""
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    offset = -raw.ctypes.data % _ALIGN
    return raw[offset : offset + nbytes]


def _recv_exactly(sock: socket.socket, view: memoryview, idle_ok: bool = False) -> None:
    """Fills `view` from `sock`; a socket timeout raises unless `idle_ok`
    (then it only means that nothing has come yet)."""
    while view.nbytes:
        try:
            count = sock.recv_into(view)
        except TimeoutError:
            if idle_ok:
                continue
            raise
        if not count:
            raise ConnectionError("the connection was closed")
        view = view[count:]


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in {**_KEEPALIVE, "TCP_USER_TIMEOUT": _USER_TIMEOUT_MS}.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Receive:
    """One message expected (or arrived early) on a link."""

    def __init__(self, buffer: np.ndarray):
        self.buffer = buffer  # uint8, where the reading thread puts the bytes
        self.target: np.ndarray | None = None  # where the caller wants them, if elsewhere
        self.done = False


def _error(kind, message: str) -> tf.errors.OpError:
    return kind(None, None, f"tf_adasum socket transport: {message}")


def _fresh(failure: tf.errors.OpError) -> tf.errors.OpError:
    """A new exception like `failure`: one instance raised in many threads would share its traceback."""
    return type(failure)(None, None, failure.message)


class _Link:
    """The connection to one peer: a reading thread and a lock for sending."""

    def __init__(self, sock: socket.socket, name: str, timeout: float, on_failure=None, limit=lambda: 0):
        _tune(sock)
        # Two socket objects on one connection, each with its own timeout. Both
        # must have one: a timeout makes the (shared) descriptor non-blocking.
        self.name = name
        self._socket = sock
        self._socket.settimeout(_READER_POLL_SECONDS)
        self._sender = sock.dup()
        self._sender.settimeout(timeout or _FOREVER_SECONDS)
        self._send_lock = threading.Lock()
        self._state = threading.Condition()
        self._posted: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._early: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self._failure: tf.errors.OpError | None = None
        self._on_failure = on_failure  # called once with the first failure (the mesh fails the others)
        self._timeout = timeout
        self._limit = limit  # the most bytes a message may bring before its receive is posted
        self.withheld: tuple[int, int] | None = None  # see `_claim`
        threading.Thread(target=self._read_forever, name=f"tf_adasum reader ({name})", daemon=True).start()

    def _claim(self, tag: int, nbytes: int) -> _Receive:
        """Where the message with `tag` and `nbytes` goes: its posted receive,
        or a buffer of its own (at most `_limit()` bytes; a larger message
        waits, unread, for its receive to be posted, within the timeout)."""
        deadline = time.monotonic() + self._timeout if self._timeout else None
        with self._state:
            while True:
                posted = self._posted.get(tag)
                if posted:
                    self.withheld = None
                    receive = posted.popleft()
                    if receive.buffer.nbytes != nbytes:
                        raise ValueError(f"a message of {nbytes} bytes where {receive.buffer.nbytes} were expected")
                    return receive
                limit = max(self._limit(), _MIN_EARLY_BYTES)
                if nbytes <= limit:
                    self.withheld = None
                    receive = _Receive(aligned_empty(nbytes))
                    self._early[tag].append(receive)
                    return receive
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._failure is not None or (remaining is not None and remaining <= 0):
                    self.withheld = None
                    raise ValueError(
                        f"a message of {nbytes} bytes came that no receive took within {self._timeout:g} s, more "
                        f"than the {limit} bytes of the largest message this process expects"
                    )
                if self.withheld is None:
                    self.withheld = (tag, nbytes)  # (tag, bytes) of the message left unread meanwhile
                    self._state.notify_all()
                self._state.wait(remaining)

    def notify(self) -> None:
        """Wakes a reader waiting in `_claim` (a limit was raised)."""
        with self._state:
            self._state.notify_all()

    def _read_forever(self) -> None:
        header = bytearray(_HEADER.size)
        try:
            while True:
                _recv_exactly(self._socket, memoryview(header), idle_ok=True)
                receive = self._claim(*_HEADER.unpack(header))
                _recv_exactly(self._socket, memoryview(receive.buffer), idle_ok=True)
                with self._state:
                    receive.done = True
                    self._state.notify_all()
        except ValueError as error:
            self._fail(
                _error(tf.errors.InvalidArgumentError, f"{self.name}: {error} (the processes run different programs).")
            )
        except OSError as error:
            self._fail(
                _error(
                    tf.errors.UnavailableError,
                    f"the connection to {self.name} failed: {error} (a worker failed or left).",
                )
            )
        except BaseException as error:  # e.g. MemoryError: never leave the waits hanging
            self._fail(_error(tf.errors.InternalError, f"reading from {self.name} failed: {error!r}."))
        finally:
            for sock in (self._socket, self._sender):
                sock.close()

    def _fail(self, failure: tf.errors.OpError) -> tf.errors.OpError:
        """Fails the link for good (the first failure is kept) and closes the
        connection, so the peer's waits fail too; returns the failure to raise."""
        with self._state:
            first = self._failure is None
            if first:
                self._failure = failure
            self._state.notify_all()
        if first:
            for sock in (self._socket, self._sender):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if self._on_failure is not None:
                self._on_failure(self._failure)
        return _fresh(self._failure)

    def post(self, tag: int, into: np.ndarray | int) -> _Receive:
        """Expects the next message with `tag`: in `into` (uint8), or, given a
        byte count, in a fresh buffer (the early message's own, if it came early)."""
        nbytes = into if isinstance(into, int) else into.nbytes
        with self._state:  # (a failure is raised outside it: `_fail` takes other links' locks)
            early = self._early.get(tag)
            if not early:
                receive = _Receive(aligned_empty(into) if isinstance(into, int) else into)
                self._posted[tag].append(receive)
                self._state.notify_all()  # a reader may wait for it (`_claim`)
                return receive
            receive = early.popleft()
            if receive.buffer.nbytes == nbytes:
                receive.target = None if isinstance(into, int) else into
                return receive
        message = f"{self.name} sent {receive.buffer.nbytes} bytes where {nbytes} were expected"
        raise self._fail(_error(tf.errors.InvalidArgumentError, f"{message} (the processes run different programs)."))

    def wait(self, receive: _Receive, deadline: float | None, what: str) -> np.ndarray:
        """The bytes of `receive` once they are in, in the buffer it was posted with."""
        timed_out = False
        with self._state:  # (a failure is raised outside it: `_fail` takes other links' locks)
            while not receive.done and self._failure is None and not timed_out:
                remaining = None if deadline is None else deadline - time.monotonic()
                timed_out = remaining is not None and remaining <= 0
                if not timed_out:
                    self._state.wait(remaining)
        if not receive.done:
            if self._failure is not None:
                raise _fresh(self._failure)
            # Failed for good: a late message must not fill the next execution's receive.
            raise self._fail(_error(tf.errors.DeadlineExceededError, f"{what} timed out waiting for {self.name}."))
        if receive.target is not None:
            receive.target[...] = receive.buffer
            return receive.target
        return receive.buffer

    def send(self, tag: int, payload: np.ndarray, what: str) -> None:
        """Sends `payload` as the next message with `tag` (whole, or the link fails)."""
        data = memoryview(np.ascontiguousarray(payload)).cast("B")
        with self._send_lock:
            if self._failure is not None:
                raise _fresh(self._failure)
            try:
                self._sender.sendall(_HEADER.pack(tag, data.nbytes))
                self._sender.sendall(data)
            except TimeoutError:  # part of a message may have left: the link is unusable
                failure = _error(tf.errors.DeadlineExceededError, f"{what} timed out sending to {self.name}.")
                raise self._fail(failure) from None
            except OSError as error:
                failure = _error(tf.errors.UnavailableError, f"sending to {self.name} failed: {error}.")
                raise self._fail(failure) from None


class Mesh:
    """One process's connections to the other processes of a cluster.

    Args:
      listener: this process's `Listener` (its port and token already known to
        every peer).
      index: this process's index among `addresses`.
      addresses: ``(host, port)`` of every process's listener, by index.
      tokens: every process's listener token, by index.
      timeout_seconds: how long a message may take (0: forever).
    """

    def __init__(
        self,
        listener: Listener,
        index: int,
        addresses: Sequence[tuple[str, int]],
        tokens: Sequence[int],
        timeout_seconds: float = 0.0,
    ):
        if len(tokens) != len(addresses) or not 0 <= index < len(addresses):
            raise ValueError(
                f"`index` must name one of the {len(addresses)} addresses, with a token each. Received: "
                f"index={index}, {len(tokens)} tokens"
            )
        self.index, self.addresses, self.tokens = index, tuple(addresses), tuple(tokens)
        self.timeout = float(timeout_seconds or 0)
        self.chain = ordering.Chain("The socket transport of tf_adasum calls Python")
        self._listener = listener
        self._links: dict[int, _Link] = {}
        self._connecting: set[int] = set()
        self._failure: tf.errors.OpError | None = None
        self._state = threading.Condition()
        self._largest_message = 0  # see `allow`
        self._door = socket_listener.Door(listener, self._admit)

    def _name(self, peer: int) -> str:
        host, port = self.addresses[peer]
        return f"worker process {peer} ({host}:{port})"

    def _fail_all(self, failure: tf.errors.OpError) -> None:
        """One failed link fails them all: the failed step left messages
        unmatched on the other links too, and a later step would take them.
        The listener stops listening: this mesh takes no new connection."""
        with self._state:
            if self._failure is None:
                self._failure = failure
            links = list(self._links.values())
            self._state.notify_all()
        self._door.stop()
        for link in links:
            link._fail(failure)

    def close(self) -> None:
        """Shuts the transport down: every link fails (a later exchange raises
        `UnavailableError`) and the listener is closed."""
        self._fail_all(_error(tf.errors.UnavailableError, "the transport was closed."))
        self._door.close()

    def allow(self, nbytes: int) -> None:
        """Lets a message of up to `nbytes` bytes be buffered when it comes
        before its receive is posted (the communicators call this with the
        sizes of the steps they build, so the limit is the largest message of
        the agreed layout); a larger one waits, unread, for its receive."""
        with self._state:
            if nbytes <= self._largest_message:
                return
            self._largest_message = int(nbytes)
            links = list(self._links.values())
        for link in links:
            link.notify()

    def _new_link(self, sock: socket.socket, peer: int) -> _Link:
        return _Link(sock, self._name(peer), self.timeout, self._fail_all, lambda: self._largest_message)

    def _admit(self, sock: socket.socket, peer: int) -> bool:
        """Takes a connection from a lower peer whose hello had this listener's token."""
        if not 0 <= peer < self.index:
            return False
        with self._state:
            if peer in self._links or self._failure is not None:
                return False  # connected already, or this mesh failed
            sock.sendall(socket_listener.ACCEPTED)  # before the link exists: a failed answer fails no link
            link = self._new_link(sock, peer)
            self._links[peer] = link
            self._state.notify_all()
        return True

    def link(self, peer: int, deadline: float | None) -> _Link:
        """The connection to `peer`, made (the lower index connects) or awaited."""
        if peer == self.index or not 0 <= peer < len(self.addresses):
            raise ValueError(f"`peer` must be another process's index. Received: peer={peer}")
        with self._state:
            while peer not in self._links:
                if self._failure is not None:
                    raise _fresh(self._failure)
                if peer > self.index and peer not in self._connecting:
                    self._connecting.add(peer)
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise _error(tf.errors.DeadlineExceededError, f"{self._name(peer)} never connected.")
                self._state.wait(remaining)
            else:
                return self._links[peer]
        link = None
        try:
            link = self._connect(peer, deadline)
            return link
        finally:
            with self._state:  # stored and announced at once: no second caller connects meanwhile
                self._connecting.discard(peer)
                if link is not None:
                    self._links[peer] = link
                self._state.notify_all()

    def _connect(self, peer: int, deadline: float | None) -> _Link:
        sock = None
        try:
            remaining = _HANDSHAKE_SECONDS if deadline is None else max(deadline - time.monotonic(), 1e-3)
            sock = socket.create_connection(self.addresses[peer], timeout=remaining)
            sock.sendall(socket_listener.hello(self.index, self.tokens[peer]))
            if sock.recv(1) != socket_listener.ACCEPTED:
                raise ConnectionError("it refused the connection (not this cluster's worker at that address?)")
            return self._new_link(sock, peer)
        except OSError as error:
            if sock is not None:
                sock.close()
            raise _error(tf.errors.UnavailableError, f"cannot connect to {self._name(peer)}: {error}.") from None

    def try_connect(self, peers: Sequence[int], deadline: float | None) -> list[str]:
        """Connects to each of `peers` with a higher index (this process is
        the one that connects to them) until `deadline`; returns what failed,
        one message per peer, and raises nothing."""
        failures = []
        for peer in sorted(p for p in set(peers) if p > self.index):
            try:
                self.link(peer, deadline)
            except tf.errors.OpError as error:
                failures.append(error.message.removeprefix("tf_adasum socket transport: "))
        return failures

    def connect(self, peers: Sequence[int], deadline: float | None) -> None:
        """Makes (or awaits) the connections to `peers` now, so that a peer
        that dies later closes a connection this process is reading."""
        for peer in sorted(set(peers)):
            self.link(peer, deadline)

    def exchange(
        self,
        peer: int,
        tag: int,
        outgoing: np.ndarray | None,
        into: np.ndarray | int | None,
        what: str,
        while_receiving: Callable[[], None] | None = None,
    ) -> np.ndarray | None:
        """Sends `outgoing` (if any) to `peer` while receiving its message with
        `tag` into `into` (a uint8 array, or a byte count for a fresh buffer;
        None: nothing to receive); returns the received bytes (uint8).
        `while_receiving`, if given, runs after the send is handed to the
        kernel, before the wait: work that overlaps the transfer's tail."""
        deadline = time.monotonic() + self.timeout if self.timeout else None
        link = self.link(peer, deadline)
        try:
            receive = None if into is None else link.post(tag, into)
            if outgoing is not None:
                link.send(tag, outgoing, what)
            if while_receiving is not None:
                while_receiving()
            return None if receive is None else link.wait(receive, deadline, what)
        except BaseException as error:  # a receive posted but never waited for must not take a later message
            if not isinstance(error, tf.errors.OpError):
                error = _error(tf.errors.InternalError, f"{what} failed: {error!r}.")
            raise link._fail(error) from None
