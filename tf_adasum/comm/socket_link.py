"""One connection of the socket transport: framed messages over TCP.

A `Link` joins this process to one peer (`tf_adasum.comm.sockets.Mesh` makes
them). A message is a header (a 64-bit tag and the payload's byte count) and
its bytes, sent from the tensor's memory under the link's send lock, by the
caller (`Link.send`) or by the link's sending thread (`Link.send_later`: the
caller waits for its receives meanwhile). The
link's own thread reads every message as it comes: the k-th message with a
tag fills the k-th receive posted for that tag (`Link.post`), so messages
match whatever order TensorFlow's threads run in, and is read into the
receive's memory (or, when it comes before its receive, into a buffer of its
own: at most the limit the mesh sets, a larger one waits, unread, for its
receive, and fails the link when none comes within the timeout, so a 64-bit
length never decides an allocation).

A link that failed stays failed (the failure latch: every later use raises)
and is shut down, so the peer's waits fail too: a wait past the timeout
raises `DeadlineExceededError`; a connection that closes or resets (a peer
that died or left) fails every wait on it with `UnavailableError`; TCP
keepalive (idle connections) and ``TCP_USER_TIMEOUT`` (unacknowledged data)
notice a peer host that vanished without closing, within about a minute; a
message of another size than the one expected (processes running different
programs) fails the link with `InvalidArgumentError`.
"""

from __future__ import annotations

import collections
import queue
import socket
import struct
import threading
import time
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

__all__ = ["Link", "aligned_empty", "copy_of", "transport_error"]

_HEADER = struct.Struct("<QQ")  # tag, payload bytes
_KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}
_USER_TIMEOUT_MS = 60_000
_READER_POLL_SECONDS = 60.0
#: A message that comes before its receive is buffered up to this many bytes
#: at least (more as `tf_adasum.comm.sockets.Mesh.allow` raises the limit).
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


def transport_error(kind, message: str) -> tf.errors.OpError:
    """An `OpError` of type `kind` whose message says it comes from this transport."""
    return kind(None, None, f"tf_adasum socket transport: {message}")


def copy_of(failure: tf.errors.OpError) -> tf.errors.OpError:
    """A new exception like `failure`: one instance raised in many threads would share its traceback."""
    return type(failure)(None, None, failure.message)


class Link:
    """The connection to one peer: a reading thread, a lock for sending, and
    a sending thread for `send_later` (started on first use, ended when the
    link fails).

    Args:
      sock: the connected socket (its hello answered); the link owns it.
      name: the peer, as messages name it.
      timeout: how long a message may take (0: forever).
      on_failure: called once with the link's first failure.
      limit: the most bytes a message may bring before its receive is
        posted (at least `_MIN_EARLY_BYTES`).
    """

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
        self._outbox: queue.SimpleQueue | None = None  # see `send_later`
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
            self.fail(
                transport_error(
                    tf.errors.InvalidArgumentError, f"{self.name}: {error} (the processes run different programs)."
                )
            )
        except OSError as error:
            self.fail(
                transport_error(
                    tf.errors.UnavailableError,
                    f"the connection to {self.name} failed: {error} (a worker failed or left).",
                )
            )
        except BaseException as error:  # e.g. MemoryError: never leave the waits hanging
            self.fail(transport_error(tf.errors.InternalError, f"reading from {self.name} failed: {error!r}."))
        finally:
            for sock in (self._socket, self._sender):
                sock.close()

    def fail(self, failure: tf.errors.OpError) -> tf.errors.OpError:
        """Fails the link for good (the first failure is kept) and closes the
        connection, so the peer's waits fail too; returns the failure to raise."""
        with self._state:
            first = self._failure is None
            if first:
                self._failure = failure
                if self._outbox is not None:
                    self._outbox.put(None)  # the sending thread ends after what was queued before
            self._state.notify_all()
        if first:
            for sock in (self._socket, self._sender):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if self._on_failure is not None:
                self._on_failure(self._failure)
        return copy_of(self._failure)

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
        raise self.fail(
            transport_error(tf.errors.InvalidArgumentError, f"{message} (the processes run different programs).")
        )

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
                raise copy_of(self._failure)
            # Failed for good: a late message must not fill the next execution's receive.
            raise self.fail(
                transport_error(tf.errors.DeadlineExceededError, f"{what} timed out waiting for {self.name}.")
            )
        if receive.target is not None:
            receive.target[...] = receive.buffer
            return receive.target
        return receive.buffer

    def send(self, tag: int, payload: np.ndarray, what: str) -> None:
        """Sends `payload` as the next message with `tag` (whole, or the link fails)."""
        data = memoryview(np.ascontiguousarray(payload)).cast("B")
        with self._send_lock:
            if self._failure is not None:
                raise copy_of(self._failure)
            try:
                self._sender.sendall(_HEADER.pack(tag, data.nbytes))
                self._sender.sendall(data)
            except TimeoutError:  # part of a message may have left: the link is unusable
                failure = transport_error(tf.errors.DeadlineExceededError, f"{what} timed out sending to {self.name}.")
                raise self.fail(failure) from None
            except OSError as error:
                failure = transport_error(
                    tf.errors.UnavailableError, f"sending to {self.name} failed: {error} (a worker failed or left)."
                )
                raise self.fail(failure) from None

    def send_later(self, tag: int, payloads: Sequence[np.ndarray], what: str) -> threading.Event:
        """Sends `payloads`, in order, as the next messages with `tag`, from
        the link's sending thread (started on first use), so that the caller
        may wait for its receives meanwhile; returns an event set once they
        are all sent or the link failed (see `wait_sent`). The payloads must
        not change until then."""
        sent = threading.Event()
        with self._state:
            if self._failure is not None:
                sent.set()  # nothing to send: `wait_sent` raises the failure
                return sent
            if self._outbox is None:
                self._outbox = queue.SimpleQueue()
                threading.Thread(target=self._send_forever, name=f"tf_adasum sender ({self.name})", daemon=True).start()
            self._outbox.put((tag, list(payloads), what, sent))
        return sent

    def _send_forever(self) -> None:
        while True:
            job = self._outbox.get()
            if job is None:  # the link failed (`fail`): nothing is queued after this
                return
            tag, payloads, what, sent = job
            try:
                for payload in payloads:
                    self.send(tag, payload, what)
            except tf.errors.OpError:
                pass  # the link failed (`send` failed it): `wait_sent` raises that failure
            except BaseException as error:  # never leave the waits hanging
                self.fail(transport_error(tf.errors.InternalError, f"{what} failed: {error!r}."))
            finally:
                sent.set()

    def wait_sent(self, sent: threading.Event, deadline: float | None, what: str) -> None:
        """Waits until the messages of `send_later` that returned `sent` are
        sent; raises the link's failure, or fails it past `deadline`."""
        if not sent.wait(None if deadline is None else max(deadline - time.monotonic(), 0.0)):
            raise self.fail(
                transport_error(tf.errors.DeadlineExceededError, f"{what} timed out sending to {self.name}.")
            )
        with self._state:
            failure = self._failure
        if failure is not None:
            raise copy_of(failure)
