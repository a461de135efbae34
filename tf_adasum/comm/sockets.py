"""Pairwise messages between the worker processes of a TF cluster, over TCP.

TensorFlow's collective ops move a tensor between processes through gRPC's
``RecvBuf``: the sender copies it into protobuf strings, gRPC serialises them,
the receiver parses them and copies the bytes into the result. Between the
CPUs of worker processes the vector-halving tree needs only pairwise
messages, so this transport sends each one from the tensor's memory over one
TCP connection per pair of processes, and the receiving thread reads it into
the memory the result lives in: one copy into the kernel and one out.

`Mesh`: one process's connections to its peers, made on first use (the lower
index connects, presenting the token of the peer's `Listener`, from
`tf_adasum.comm.socket_listener`, which also keeps strangers at the door),
each a `tf_adasum.comm.socket_link.Link` read by a thread of its own (and
written by another where the caller does not wait: `Mesh.exchange_in_pieces`). A
message carries a 64-bit tag; the k-th message a peer sends with a tag fills
the k-th receive posted for that tag, so messages match whatever order
TensorFlow's threads run in. (`tf_adasum.comm.socket_communicator` builds the
tree's steps on a mesh; `tf_adasum.comm.socket_setup` makes the mesh of the
workers of a TF cluster.)

Failures never hang (see `tf_adasum.comm.socket_link` for how a link
fails), and a link that failed once stays failed and fails the mesh's other
links (the failed step left messages unmatched there too; the process must
start over), and the mesh's listener stops listening (`Mesh.close` closes
it, which the set-up does only when the workers fall back to TF collective
ops; a mesh in use lives until the process exits). A message that comes
before its receive is posted is buffered only up to the largest message the
mesh expects (`Mesh.allow`, which the communicators call with their steps'
sizes: the agreed layout's). Raised inside a ``tf.numpy_function``, failures
reach the caller as TensorFlow's `UnknownError` whose message carries the
class name and the "tf_adasum socket transport:" text.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_adasum.comm import ordering, socket_listener
from tf_adasum.comm.socket_link import Link, copy_of, transport_error
from tf_adasum.comm.socket_listener import Listener

__all__ = ["CONNECT_TIMEOUT_SECONDS", "Mesh", "Pieces"]

_HANDSHAKE_SECONDS = 30.0  # the connecting side's wait for the answer to its hello
#: How long `Mesh.connect` waits for its peers when messages may wait forever.
CONNECT_TIMEOUT_SECONDS = 600.0


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
        self._links: dict[int, Link] = {}
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
            link.fail(failure)

    def close(self) -> None:
        """Shuts the transport down: every link fails (a later exchange raises
        `UnavailableError`) and the listener is closed."""
        self._fail_all(transport_error(tf.errors.UnavailableError, "the transport was closed."))
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

    def _new_link(self, sock: socket.socket, peer: int) -> Link:
        return Link(sock, self._name(peer), self.timeout, self._fail_all, lambda: self._largest_message)

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

    def link(self, peer: int, deadline: float | None) -> Link:
        """The connection to `peer`, made (the lower index connects) or awaited."""
        if peer == self.index or not 0 <= peer < len(self.addresses):
            raise ValueError(f"`peer` must be another process's index. Received: peer={peer}")
        with self._state:
            while peer not in self._links:
                if self._failure is not None:
                    raise copy_of(self._failure)
                if peer > self.index and peer not in self._connecting:
                    self._connecting.add(peer)
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise transport_error(tf.errors.DeadlineExceededError, f"{self._name(peer)} never connected.")
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

    def _connect(self, peer: int, deadline: float | None) -> Link:
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
            raise transport_error(
                tf.errors.UnavailableError, f"cannot connect to {self._name(peer)}: {error}."
            ) from None

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
                error = transport_error(tf.errors.InternalError, f"{what} failed: {error!r}.")
            raise link.fail(error) from None

    def exchange_in_pieces(
        self, peer: int, tag: int, outgoing: Sequence[np.ndarray], into: Sequence[np.ndarray], what: str
    ) -> Pieces:
        """Starts sending `outgoing` to `peer` and receiving its pieces with
        `tag` into `into` (uint8 arrays), one message each, in order; returns
        at once (the link's sending thread sends): `Pieces.wait` waits for
        one received piece, `Pieces.finish` for the sends."""
        deadline = time.monotonic() + self.timeout if self.timeout else None
        link = self.link(peer, deadline)
        pieces = Pieces(link, deadline, what)
        pieces.guard(lambda: pieces.start(tag, outgoing, into))
        return pieces


class Pieces:
    """An exchange in pieces under way (`Mesh.exchange_in_pieces`), within one deadline."""

    def __init__(self, link: Link, deadline: float | None, what: str):
        self._link, self._deadline, self._what = link, deadline, what
        self._receives: list = []
        self._sent = None

    def guard(self, step: Callable[[], np.ndarray | None]) -> np.ndarray | None:
        """Runs `step`; any failure fails the link (a receive posted but never
        waited for must not take a later message) and is raised as an `OpError`."""
        try:
            return step()
        except BaseException as error:
            if not isinstance(error, tf.errors.OpError):
                error = transport_error(tf.errors.InternalError, f"{self._what} failed: {error!r}.")
            raise self._link.fail(error) from None

    def start(self, tag: int, outgoing: Sequence[np.ndarray], into: Sequence[np.ndarray]) -> None:
        self._receives = [self._link.post(tag, piece) for piece in into]
        self._sent = self._link.send_later(tag, outgoing, self._what)

    def wait(self, k: int) -> np.ndarray:
        """The k-th received piece, once it is in."""
        return self.guard(lambda: self._link.wait(self._receives[k], self._deadline, self._what))

    def abandon(self) -> None:
        """Fails the link, whose receives for this exchange stay posted (its
        step stopped before it waited for them all); raises that failure."""
        raise self._link.fail(
            transport_error(
                tf.errors.AbortedError,
                f"{self._what} never finished (its step stopped before every piece was received); "
                "the transport must start over.",
            )
        )

    def finish(self) -> None:
        """Waits until every outgoing piece is sent."""
        self.guard(lambda: self._link.wait_sent(self._sent, self._deadline, self._what))
