"""The launcher's helper program: a worker's supervisor, and the maker of its networks.

`tf_adasum.launch` runs this file by path with ``python -I -S`` (and imports it
for its constants and its rate parser), so it imports nothing of tf_adasum and nothing
outside the standard library: no TensorFlow loads before a worker's own
program starts. The first argument is the role:

``worker LAUNCHER_PID [--network USER_FD NET_FD] -- COMMAND...``
    The leader of one worker's process group. It sets a parent-death signal
    (Linux ``prctl(PR_SET_PDEATHSIG)``), checks with ``getppid()`` that the
    launcher is still its parent, joins the given namespaces (descriptors it
    inherited), then runs COMMAND as its child (which gets
    ``PR_SET_PDEATHSIG = SIGKILL`` tied to this process) and exits with the
    child's code (128 + S for signal S). When the launcher dies, even by
    SIGKILL, it kills its whole process group: the worker and everything the
    worker started that stayed in the group. Where ``prctl`` is missing (not
    Linux) it polls ``getppid()`` twice a second.

``network LAUNCHER_PID``
    Creates a network namespace holding only loopback (``--isolate-network``).

``hosts LAUNCHER_PID HOSTS RATE|none``
    Creates an emulated cluster (``--hosts``): one *switch* network namespace
    holding a bridge, and HOSTS *host* namespaces. Host h has loopback and
    ``eth0``, with address ``10.241.0.(h + 1)/24``: one end of a veth pair
    whose other end, in the switch, is a port of the bridge. Each host's link
    is limited to RATE (tc syntax, e.g. ``1gbit``) in both directions by a
    token bucket (``tc qdisc ... tbf``): on ``eth0`` for what the host sends,
    on the switch's end for what it receives (``none``: no limit). It needs
    iproute2's ``ip`` and ``tc``.

    Both makers work as root; else inside a new user namespace that maps only
    the caller's own uid and gid (to themselves for ``network``, so the
    workers keep their uid; to 0 for ``hosts``, so that ``ip`` and ``tc`` run
    with the namespace's capabilities). Each prints ``ready USER_FD NET_FD...``
    (a host's as ``FD@ADDRESS``): descriptors of its own, which the launcher
    opens through ``/proc/PID/fd``; or ``error: ...``. Then it waits until the
    launcher closes its stdin; a parent-death signal ends it if the launcher
    dies first.

``enter ADDRESS PROGRAM [ARGS...]``
    Runs PROGRAM on the emulated host at ADDRESS: in that host's network
    namespace and in a new UTS namespace whose host name is
    ``tf-adasum-host-H`` (H counted from 0), so that MPI tells the hosts
    apart, as process 1 of a new PID namespace (so that everything it starts
    ends with it). The launcher names the namespaces in
    ``TF_ADASUM_EMULATED_HOSTS`` (``LAUNCHER_PID USER_FD ADDRESS=FD...``,
    descriptors it holds).

``rsh [OPTIONS] ADDRESS WORDS...``
    The same for mpirun's remote-shell agent (``plm_rsh_agent``, in place of
    ssh): runs ``sh -c "WORDS"`` on the host at ADDRESS.

The namespaces have no name (nothing under ``/var/run/netns``): each lives as
long as a process or a descriptor uses it, and the links and the bridge go
with them. The launcher's descriptors and the workers hold them, so they
vanish on every exit path, a killed launcher included (its workers are killed
with it).
"""

import ctypes
import errno
import functools
import os
import re
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
CLONE_NEWUTS = 0x04000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
_IFREQ = "16sH14x"  # struct ifreq: the interface name, then ifr_flags

#: Seconds between two looks at getppid() where no parent-death signal exists.
POLL_SECONDS = 0.5
#: The roles that watch the launcher: their first argument is its process id.
WATCHED_ROLES = ("worker", "network", "hosts")
#: Each emulated host's interface to the switch (MPI's TCP traffic goes over it).
HOST_INTERFACE = "eth0"
#: Where the launcher names its hosts' namespaces for `enter` and `rsh`.
HOSTS_VARIABLE = "TF_ADASUM_EMULATED_HOSTS"
#: The signal an elastic launcher sends its workers' groups to end a round for a resize: the workers
#: back up and exit (`tf_adasum.BackupAndRestore(save_before_preemption=True)`); mpirun forwards it.
NOTICE_SIGNAL = signal.SIGUSR1
#: A worker's exit code after the backup a notice (or SIGTERM) asked for: 128 + SIGTERM, as a shell shows it.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
#: The exit codes that end a round after a notice as the notice asked (a worker still starting dies of it).
NOTICE_EXIT_CODES = (PREEMPTED_EXIT_CODE, 128 + NOTICE_SIGNAL)
#: Host h's address is SUBNET + (h + 1); at most MAX_HOSTS hosts.
SUBNET = "10.241.0."
MAX_HOSTS = 253
#: A link rate in tc's syntax: bits per second with an SI prefix, in lower case.
RATE_PATTERN = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)")
_PREFIX = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
#: The token bucket holds this many seconds of traffic at the link's rate
#: (at least 64 KiB plus a frame: one offloaded segment), and queues up to
#: QUEUE_SECONDS more before it drops.
BURST_SECONDS = 0.002
QUEUE_SECONDS = 0.05


def rate_bits_per_second(rate: str) -> float:
    """``"1gbit"`` -> 1e9 (tc's units: powers of 1000)."""
    match = RATE_PATTERN.fullmatch(rate)
    if not match:
        raise ValueError(f"a link rate is a number and one of bit, kbit, mbit, gbit (e.g. 1gbit). Received: {rate!r}")
    return float(match.group(1)) * _PREFIX[match.group(2)]


def host_address(host: int) -> str:
    return f"{SUBNET}{host + 1}"


def host_name(host: int) -> str:
    return f"tf-adasum-host-{host}"


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _call(function, *args, what: str) -> None:
    if function(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _die_with_parent(signum: int) -> bool:
    """Asks the kernel for `signum` when our parent dies; False where it cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    _call(_libc().prctl, PR_SET_PDEATHSIG, int(signum), 0, 0, 0, what="prctl(PR_SET_PDEATHSIG)")
    return True


def _ns_id(path_or_fd) -> tuple[int, int]:
    info = os.fstat(path_or_fd) if isinstance(path_or_fd, int) else os.stat(path_or_fd)
    return info.st_dev, info.st_ino


def _join(user_fd: int, net_fd: int) -> None:
    """Enters the network namespace `net_fd`, first its user namespace `user_fd` if it is not ours; closes both."""
    if _ns_id(user_fd) != _ns_id("/proc/self/ns/user"):
        _call(_libc().setns, user_fd, CLONE_NEWUSER, what="setns(user namespace)")
    _call(_libc().setns, net_fd, CLONE_NEWNET, what="setns(network namespace)")
    os.close(net_fd)
    os.close(user_fd)


def _unshare_network(root_inside: bool) -> None:
    """Moves this process into a new network namespace: directly as root, else
    with a new user namespace that maps only our uid and gid (to 0 with
    `root_inside`, else to themselves)."""
    if not sys.platform.startswith("linux"):
        raise OSError(errno.ENOSYS, f"network namespaces need Linux, not {sys.platform}")
    try:
        _call(_libc().unshare, CLONE_NEWNET, what="unshare(CLONE_NEWNET)")
        return
    except OSError as error:
        if error.errno != errno.EPERM:  # not privileged: try a user namespace below
            raise
        privileged_error = error
    uid, gid = os.getuid(), os.getgid()
    try:
        _call(_libc().unshare, CLONE_NEWUSER | CLONE_NEWNET, what="unshare(CLONE_NEWUSER|CLONE_NEWNET)")
    except OSError as error:
        raise OSError(error.errno, f"{privileged_error.strerror}; {error.strerror}") from None
    inside_uid, inside_gid = (0, 0) if root_inside else (uid, gid)
    maps = (("setgroups", "deny"), ("uid_map", f"{inside_uid} {uid} 1"), ("gid_map", f"{inside_gid} {gid} 1"))
    for name, text in maps:
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _hold(launcher_pid: int, make) -> int:
    """Runs `make` (it builds namespaces and names descriptors of them), says
    ``ready WORDS...`` or ``error: ...``, and keeps the descriptors until stdin closes."""
    _die_with_parent(signal.SIGKILL)
    if os.getppid() != launcher_pid:
        return 1
    try:
        words = make()
    except (OSError, ValueError) as error:
        print(f"error: {getattr(error, 'strerror', None) or error}", flush=True)
        return 2
    print("ready", *words, flush=True)
    sys.stdin.buffer.read()  # until the launcher has opened our descriptors and closes the pipe
    return 0


def _own(kind: str) -> str:
    """A descriptor of this process's namespace of `kind` (``user``, ``net``), as a word of ``ready``."""
    return str(os.open(f"/proc/self/ns/{kind}", os.O_RDONLY))


def _private_network() -> list[str]:
    """The ``network`` role: a namespace holding loopback, up."""
    import fcntl  # this role only: the workers' supervisors start faster without them
    import socket
    import struct

    _unshare_network(root_inside=False)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(sock.fileno(), SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | IFF_UP))
    return [_own("user"), _own("net")]


class _Namespaces:
    """Fresh network namespaces, held by descriptors; commands run in any of them."""

    def __init__(self):
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY)

    def new(self) -> int:
        _call(_libc().unshare, CLONE_NEWNET, what="unshare(CLONE_NEWNET)")
        fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        _call(_libc().setns, self.home, CLONE_NEWNET, what="setns(back)")
        return fd

    def run(self, namespace: int, *command: str) -> None:
        """Runs `command` in `namespace` (the child inherits this thread's namespace)."""
        _call(_libc().setns, namespace, CLONE_NEWNET, what="setns")
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        except FileNotFoundError:
            raise OSError(errno.ENOENT, f"{command[0]} not found (iproute2 is needed)") from None
        finally:
            _call(_libc().setns, self.home, CLONE_NEWNET, what="setns(back)")
        if result.returncode:
            raise OSError(errno.EINVAL, f"`{' '.join(command)}` failed: {result.stderr.strip()}")


def _token_bucket(rate: str) -> list[str]:
    bytes_per_second = rate_bits_per_second(rate) / 8
    burst = max(int(bytes_per_second * BURST_SECONDS), 64 * 1024 + 1514)
    limit = burst + int(bytes_per_second * QUEUE_SECONDS)
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]


def _emulated_hosts(hosts: int, rate: str | None) -> list[str]:
    """The ``hosts`` role: the switch and `hosts` hosts, links limited to `rate` (None: no limit)."""
    if not 1 <= hosts <= MAX_HOSTS:
        raise OSError(errno.EINVAL, f"between 1 and {MAX_HOSTS} hosts. Received: {hosts}")
    bucket = _token_bucket(rate) if rate else None
    _unshare_network(root_inside=True)
    user = _own("user")
    spaces = _Namespaces()
    switch = spaces.new()
    spaces.run(switch, "ip", "link", "add", "br0", "type", "bridge")
    spaces.run(switch, "ip", "link", "set", "br0", "up")
    members = []
    for h in range(hosts):
        host, port = spaces.new(), f"h{h}"
        members.append(f"{host}@{host_address(h)}")
        # `ip` opens the switch's namespace by this path: ours, open in this process.
        switch_path = f"/proc/{os.getpid()}/fd/{switch}"
        veth = ["type", "veth", "peer", "name", port, "netns", switch_path]
        spaces.run(host, "ip", "link", "add", HOST_INTERFACE, *veth)
        spaces.run(host, "ip", "addr", "add", f"{host_address(h)}/24", "dev", HOST_INTERFACE)
        spaces.run(host, "ip", "link", "set", "lo", "up")
        spaces.run(host, "ip", "link", "set", HOST_INTERFACE, "up")
        spaces.run(switch, "ip", "link", "set", port, "master", "br0")
        spaces.run(switch, "ip", "link", "set", port, "up")
        if bucket:
            spaces.run(host, "tc", "qdisc", "add", "dev", HOST_INTERFACE, "root", *bucket)
            spaces.run(switch, "tc", "qdisc", "add", "dev", port, "root", *bucket)
    return [user, str(switch), *members]


def _supervise(launcher_pid: int, network: list[int], command: list[str]) -> int:
    """The ``worker`` role: runs `command` as our child until it exits, or
    kills our process group when the launcher dies."""

    def on_sigterm(signum, frame):
        # From the launcher's group-wide stop, the worker got it too: nothing to do.
        # As our parent-death signal (the launcher is gone): end the whole group.
        if os.getppid() != launcher_pid:
            os.killpg(0, signal.SIGKILL)

    ignored = [signum for signum in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(signum) == signal.SIG_IGN]
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # a group-wide Ctrl-C is the worker's to handle
    signal.signal(NOTICE_SIGNAL, lambda signum, frame: None)  # a resize notice: the worker's (mpirun forwards it)
    has_death_signal = _die_with_parent(signal.SIGTERM)
    if os.getppid() != launcher_pid:
        return 1  # the launcher died before we could ask for the signal
    if network:
        try:
            _join(*network)
        except OSError as error:
            print(f"tf-adasum launch: cannot join the private network: {error.strerror}", file=sys.stderr, flush=True)
            return 126
    supervisor = os.getpid()

    def child_setup():  # in the forked child; safe, as this process has one thread
        for signum in ignored:  # the worker inherits what the launcher ignored, as it did without us
            signal.signal(signum, signal.SIG_IGN)
        if has_death_signal:
            _die_with_parent(signal.SIGKILL)
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


def _enter_host(address: str) -> None:
    """Moves this process onto the emulated host at `address` (see the module docstring)."""
    try:
        launcher, user, *hosts = os.environ[HOSTS_VARIABLE].split()
        addresses = [entry.split("=")[0] for entry in hosts]
        fd = int(hosts[addresses.index(address)].split("=")[1])
    except (KeyError, ValueError, IndexError):
        raise OSError(
            errno.EINVAL, f"no emulated host {address!r} in {HOSTS_VARIABLE}={os.environ.get(HOSTS_VARIABLE)!r}"
        ) from None
    _join(*(os.open(f"/proc/{launcher}/fd/{number}", os.O_RDONLY) for number in (user, fd)))
    name = host_name(addresses.index(address)).encode()
    _call(_libc().unshare, CLONE_NEWUTS, what="unshare(CLONE_NEWUTS)")
    _call(_libc().sethostname, name, len(name), what="sethostname")


def _on_host(role: str, rest: list[str]) -> int:
    """The ``enter`` and ``rsh`` roles: see the module docstring."""
    if role == "rsh":
        while rest and rest[0].startswith("-"):  # ssh's options, which mean nothing here
            rest = rest[1:]
    if len(rest) < 2:
        print(f"tf-adasum launch helper {role}: usage: {role} ADDRESS COMMAND...", file=sys.stderr)
        return 2
    try:
        _enter_host(rest[0])
    except OSError as error:
        print(f"tf-adasum launch helper {role}: {error.strerror or error}", file=sys.stderr)
        return 2
    if role == "enter":
        return _run_as_namespace_init(rest[1:])
    try:
        os.execvp("/bin/sh", ["/bin/sh", "-c", " ".join(rest[1:])])
    except OSError as error:
        print(f"tf-adasum launch helper rsh: cannot run '/bin/sh': {error.strerror}", file=sys.stderr)
        return 127


def _run_as_namespace_init(command: list[str]) -> int:
    """Runs `command` as process 1 of a new PID namespace and returns its
    exit code (128 + S for signal S). Whatever it starts stays in that
    namespace, however it detaches (MPI's ranks lead process groups of their
    own), and the kernel kills all of it when process 1 ends: when this
    process dies, by a parent-death signal that kills process 1."""
    _call(_libc().unshare, CLONE_NEWPID, what="unshare(CLONE_NEWPID)")
    child = os.fork()
    if child == 0:
        try:
            _die_with_parent(signal.SIGKILL)
            os.execvp(command[0], command)
        except OSError as error:
            print(f"tf-adasum launch helper enter: cannot run {command[0]!r}: {error.strerror}", file=sys.stderr)
        os._exit(127)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # passed on; process 1 ignores the unhandled
        signal.signal(signum, lambda number, frame: os.kill(child, number))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main(argv: list[str]) -> int:
    """Dispatches on the role, the first argument (see the module docstring)."""
    role, rest = (argv[0], argv[1:]) if argv else ("", [])
    if role in ("enter", "rsh"):
        return _on_host(role, rest)
    launcher_pid = int(rest[0]) if rest[:1] and rest[0].isdigit() else None
    rest = rest[1:]
    if launcher_pid is not None and role == "network" and not rest:
        return _hold(launcher_pid, _private_network)
    if launcher_pid is not None and role == "hosts" and len(rest) == 2 and rest[0].isdigit():
        hosts, rate = int(rest[0]), (None if rest[1] == "none" else rest[1])
        return _hold(launcher_pid, lambda: _emulated_hosts(hosts, rate))
    if launcher_pid is not None and role == "worker" and "--" in rest:
        split = rest.index("--")
        options, command = rest[:split], rest[split + 1 :]
        network = [int(fd) for fd in options[1:3]] if options[:1] == ["--network"] else []
        return _supervise(launcher_pid, network, command)
    raise SystemExit(f"tf-adasum launch helper: bad arguments. Received: {argv!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
