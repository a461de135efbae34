"""The launcher's helper processes: a worker's supervisor, and the maker of a private network.

`tf_adasum.launch` runs this file by path with ``python -I -S``, never imports
it, so it imports nothing of tf_adasum and nothing outside the standard library
(no TensorFlow) before the worker's own program starts. Two roles:

``worker LAUNCHER_PID [--network NET_FD USER_FD] -- COMMAND...``
    The leader of one worker's process group. It sets a parent-death signal
    (Linux ``prctl(PR_SET_PDEATHSIG)``), checks with ``getppid()`` that the
    launcher is still its parent, joins the private network if given one, then
    runs COMMAND as its child (which gets ``PR_SET_PDEATHSIG = SIGKILL`` tied to
    this process) and exits with the child's code (128 + S for signal S). When
    the launcher dies, even by SIGKILL, it kills its whole process group: the
    worker and everything the worker started that stayed in the group. Where
    ``prctl`` is missing (not Linux) it polls ``getppid()`` twice a second.

``network LAUNCHER_PID``
    Creates a network namespace (as root; else inside a new user namespace
    that maps only the caller's own uid and gid), brings its loopback up,
    prints ``ready`` (or ``error: ...``), and waits until the launcher, which
    opens ``/proc/PID/ns/net`` and ``/proc/PID/ns/user`` meanwhile, closes its
    stdin. The namespace then lives as long as a process or descriptor uses it.
"""

import ctypes
import errno
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH14x"  # struct ifreq: the interface name, then ifr_flags

#: Seconds between two looks at getppid() where no parent-death signal exists.
POLL_SECONDS = 0.5


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _call(function, *args, what: str) -> None:
    if function(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _set_parent_death_signal(signum: int) -> bool:
    """Asks the kernel for `signum` when our parent dies; False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    _call(_libc().prctl, PR_SET_PDEATHSIG, int(signum), 0, 0, 0, what="prctl(PR_SET_PDEATHSIG)")
    return True


def _ns_id(path_or_fd) -> tuple[int, int]:
    info = os.fstat(path_or_fd) if isinstance(path_or_fd, int) else os.stat(path_or_fd)
    return info.st_dev, info.st_ino


def _join_network(net_fd: int, user_fd: int) -> None:
    """Enters the network namespace `net_fd` (first its user namespace, if it has its own)."""
    libc = _libc()
    if _ns_id(user_fd) != _ns_id("/proc/self/ns/user"):
        _call(libc.setns, user_fd, CLONE_NEWUSER, what="setns(user namespace)")
    _call(libc.setns, net_fd, CLONE_NEWNET, what="setns(network namespace)")
    os.close(net_fd)
    os.close(user_fd)


def _supervise(launcher_pid: int, network: list[int], command: list[str]) -> int:
    """Runs `command` as our child until it exits, or kills our process group when the launcher dies."""

    def on_sigterm(signum, frame):
        # From the launcher's group-wide stop, the worker got it too: nothing to do.
        # As our parent-death signal (the launcher is gone): end the whole group.
        if os.getppid() != launcher_pid:
            os.killpg(0, signal.SIGKILL)

    ignored = [signum for signum in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(signum) == signal.SIG_IGN]
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # a group-wide Ctrl-C is the worker's to handle
    has_death_signal = _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != launcher_pid:
        return 1  # the launcher died before we could ask for the signal
    if network:
        try:
            _join_network(*network)
        except OSError as error:
            print(f"tf-adasum launch: cannot join the private network: {error.strerror}", file=sys.stderr, flush=True)
            return 126
    libc, supervisor = (_libc(), os.getpid()) if has_death_signal else (None, 0)

    def child_setup():  # in the forked child; safe, as this process has one thread
        for signum in ignored:  # the worker inherits what the launcher ignored, as it did without us
            signal.signal(signum, signal.SIG_IGN)
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != supervisor:
                os._exit(1)

    try:
        child = subprocess.Popen(command, preexec_fn=child_setup)
    except OSError as error:
        print(f"tf-adasum launch: cannot run {command[0]!r}: {error}", file=sys.stderr, flush=True)
        return 127
    if has_death_signal:
        code = child.wait()
    else:
        while (code := child.poll()) is None:
            if os.getppid() != launcher_pid:
                os.killpg(0, signal.SIGKILL)
            time.sleep(POLL_SECONDS)
    return 128 - code if code < 0 else code


def _unshare_network() -> None:
    """Moves this process into a new network namespace, in a new user namespace if need be."""
    libc = _libc()
    try:
        _call(libc.unshare, CLONE_NEWNET, what="unshare(CLONE_NEWNET)")
        return
    except OSError as error:
        if error.errno != errno.EPERM:  # not privileged: try a user namespace below
            raise
        privileged_error = error
    uid, gid = os.getuid(), os.getgid()
    try:
        _call(libc.unshare, CLONE_NEWUSER | CLONE_NEWNET, what="unshare(CLONE_NEWUSER|CLONE_NEWNET)")
    except OSError as error:
        raise OSError(error.errno, f"{privileged_error.strerror}; {error.strerror}") from None
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _bring_loopback_up() -> None:
    import fcntl  # the network role only: the workers' supervisors start faster without them
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | IFF_UP))


def _hold_network(launcher_pid: int) -> int:
    """Makes the private network, reports ``ready`` or ``error: ...``, and keeps it until stdin closes."""
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher_pid:
        return 1
    try:
        _unshare_network()
        _bring_loopback_up()
    except OSError as error:
        print(f"error: {error.strerror or error}", flush=True)
        return 2
    print("ready", flush=True)
    sys.stdin.buffer.read()  # until the launcher has opened our namespace and closes the pipe
    return 0


def main(argv: list[str]) -> int:
    """``worker LAUNCHER_PID [--network NET_FD USER_FD] -- COMMAND...`` or ``network LAUNCHER_PID``."""
    role, launcher_pid, rest = argv[0], int(argv[1]), argv[2:]
    if role == "network" and not rest:
        return _hold_network(launcher_pid)
    if role == "worker" and "--" in rest:
        split = rest.index("--")
        options, command = rest[:split], rest[split + 1 :]
        network = [int(fd) for fd in options[1:3]] if options[:1] == ["--network"] else []
        return _supervise(launcher_pid, network, command)
    raise SystemExit(f"_worker_bootstrap: bad arguments. Received: {argv!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
