"""Who may connect to a worker's socket transport (`tf_adasum.comm.sockets`).

* `Listener`: this process's listening socket (an address and port of the
  engine's choice, by default every interface and a port the system picks)
  and a random token a peer presents in its hello when it connects.
* `Door`: serves a listener on one thread. Each incoming connection has
  `HELLO_SECONDS` in all to send its hello (one deadline for the whole hello,
  not one per byte); at most `MAX_PENDING` connections wait for theirs, and a
  new one beyond that drops the oldest (a peer sends its hello as soon as it
  has connected, so the oldest waiting is the likeliest stranger). Strangers
  therefore cost neither threads nor more than `MAX_PENDING` descriptors, and
  a peer's connection is never queued behind theirs. A hello whose magic or
  token is wrong (compared in constant time) is closed without an answer; a
  right one is handed to the mesh, which answers `ACCEPTED` or closes it.
  `Door.close` stops the thread and closes the listener; `Door.stop` stops
  the thread and the listening (the port refuses connections) but keeps the
  socket open, so its address can still be read.
"""

from __future__ import annotations

import hmac
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["ACCEPTED", "HELLO_SECONDS", "MAX_PENDING", "Door", "Listener", "hello"]

_HELLO = struct.Struct("<8sIQ")  # magic, the connecting process's index, the listener's token
_MAGIC = b"tfadasum"
#: The answer to a hello the mesh took.
ACCEPTED = b"\x01"
#: The whole hello of an incoming connection must arrive within this (seconds).
HELLO_SECONDS = 10.0
#: Incoming connections waiting for their hello at once; a new one beyond this drops the oldest.
MAX_PENDING = 64


def hello(index: int, token: int) -> bytes:
    """What process `index` sends first to a listener whose token is `token`."""
    return _HELLO.pack(_MAGIC, index, token)


class Listener:
    """A listening socket.

    Args:
      host: the address to listen on (a name is resolved; its first address
        is taken); None: every interface.
      port: the port; 0: one the system picks.

    Raises:
      OSError: the address is not this machine's (``EADDRNOTAVAIL``), or the
        port is taken (``EADDRINUSE``).

    Attributes:
      port: the port; token: a random 52-bit number (exact in float64) that
        peers present when they connect, so a stray connection is refused.
    """

    def __init__(self, host: str | None = None, port: int = 0):
        if host is not None:
            self.socket = socket.create_server((host, port))
        elif socket.has_dualstack_ipv6():
            self.socket = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            self.socket = socket.create_server(("", port))
        self.port = self.socket.getsockname()[1]
        self.token = secrets.randbits(52)

    def close(self) -> None:
        """Stops listening (the port is free again)."""
        self.socket.close()


class _Pending:
    """An incoming connection whose hello is not complete yet."""

    def __init__(self, deadline: float):
        self.hello = bytearray(_HELLO.size)
        self.filled = 0
        self.deadline = deadline


class Door:
    """Serves `listener` on one thread (named "tf_adasum listener").

    Args:
      listener: the `Listener` (the door closes it).
      admit: called with a connection (blocking, no timeout) whose hello
        carried the listener's token, and the index its hello gave; takes the
        connection and returns True, or returns False (it is then closed).
    """

    def __init__(self, listener: Listener, admit: Callable[[socket.socket, int], bool]):
        self._listener = listener
        self._admit = admit
        self._expected = _HELLO.pack(_MAGIC, 0, listener.token)
        self._closed = threading.Event()
        self._release = False  # close the listener when the thread ends (else only stop listening)
        self._wake_read, self._wake_write = socket.socketpair()
        self.thread = threading.Thread(target=self._serve, name="tf_adasum listener", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stops the thread (it closes the waiting connections) and closes the listener."""
        self._release = True
        self.stop()
        if self.thread is not threading.current_thread():
            self.thread.join(10)
        self._listener.close()  # (again, if the thread did: closing twice is harmless)

    def stop(self) -> None:
        """Stops the thread; it stops the listening (new connections are
        refused; where the system cannot, it closes the listener) and closes
        the waiting connections."""
        self._closed.set()
        try:
            self._wake_write.send(b"\0")
        except OSError:
            pass

    def _stop_listening(self) -> None:
        if not self._release:
            try:
                self._listener.socket.shutdown(socket.SHUT_RDWR)  # Linux: no longer listening, still open
                return
            except OSError:
                pass
        self._listener.close()

    def _valid(self, data: bytes) -> int | None:
        """The index a hello gives, or None when its magic or token is wrong."""
        right = hmac.compare_digest(data[:8], self._expected[:8]) & hmac.compare_digest(data[12:], self._expected[12:])
        return _HELLO.unpack(data)[1] if right else None

    def _serve(self) -> None:
        listener = self._listener.socket
        selector = selectors.DefaultSelector()
        pending: dict[socket.socket, _Pending] = {}  # in arrival order: the first is the oldest

        def drop(sock: socket.socket) -> None:
            pending.pop(sock, None)
            try:
                selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()

        try:
            listener.setblocking(False)
            selector.register(listener, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while not self._closed.is_set():
                now = time.monotonic()
                for sock in [s for s, p in pending.items() if p.deadline <= now]:
                    drop(sock)  # the whole hello took too long
                first = min((p.deadline for p in pending.values()), default=None)
                for key, _ in selector.select(None if first is None else max(first - now, 0.0)):
                    sock = key.fileobj
                    if sock is self._wake_read:
                        continue
                    if sock is listener:
                        self._accept(listener, pending, selector, drop)
                    elif sock in pending:
                        self._read_hello(sock, pending, selector, drop)
        except (OSError, ValueError):  # the listener was closed under it
            pass
        finally:
            for sock in list(pending):
                drop(sock)
            selector.close()
            self._stop_listening()
            self._wake_read.close()
            self._wake_write.close()

    def _accept(self, listener, pending, selector, drop) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                return
            except OSError:  # no descriptor left, or a client that reset first: make room, go on later
                if pending:
                    drop(next(iter(pending)))
                time.sleep(0.05)
                return
            if len(pending) >= MAX_PENDING:
                drop(next(iter(pending)))
            sock.setblocking(False)
            pending[sock] = _Pending(time.monotonic() + HELLO_SECONDS)
            selector.register(sock, selectors.EVENT_READ)

    def _read_hello(self, sock, pending, selector, drop) -> None:
        state = pending[sock]
        try:
            count = sock.recv_into(memoryview(state.hello)[state.filled :])
        except BlockingIOError:
            return
        except OSError:
            count = 0
        if not count:
            drop(sock)
            return
        state.filled += count
        if state.filled < _HELLO.size:
            return
        pending.pop(sock)
        selector.unregister(sock)
        peer = self._valid(bytes(state.hello))
        try:
            sock.setblocking(True)
            if peer is not None and self._admit(sock, peer):
                return
        except Exception:  # noqa: BLE001 - refused: the connector sees the connection close
            pass
        sock.close()
