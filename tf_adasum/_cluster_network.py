"""The launcher's emulated cluster network: hosts with their own addresses, joined by rate-limited links.

`tf_adasum.launch` runs this file by path with ``python -I -S`` (``--hosts``),
never imports it, so it imports nothing of tf_adasum and nothing outside the
standard library. It needs Linux, iproute2's ``ip`` and ``tc``, and either
root or unprivileged user namespaces.

``_cluster_network.py LAUNCHER_PID HOSTS RATE|none``
    Creates, as root (else inside a new user namespace that maps only the
    caller's own uid and gid to 0), one *switch* network namespace holding a bridge
    and HOSTS *host* namespaces. Host h has loopback and ``eth0``, with address
    ``10.241.0.(h + 1)/24``: one end of a veth pair whose other end, in the
    switch, is a port of the bridge. Each host's link is limited to RATE (tc
    syntax, e.g. ``1gbit``) in both directions by a token bucket (``tc qdisc
    ... tbf``): on ``eth0`` for what the host sends, on the switch's end for
    what it receives (``none``: no limit). Then it prints ``ready USER_FD
    SWITCH_FD HOST_FD@ADDRESS...``, descriptors of its own that the launcher
    opens through ``/proc/PID/fd`` (or ``error: ...``), and waits until the
    launcher closes its stdin.

``_cluster_network.py enter ADDRESS PROGRAM [ARGS...]``
    Runs PROGRAM on the emulated host at ADDRESS: in that host's network
    namespace and in a new UTS namespace whose host name is
    ``tf-adasum-host-H`` (H counted from 0), so that MPI tells the hosts
    apart, as process 1 of a new PID namespace (so that everything it starts
    ends with it). The launcher names the namespaces in ``TF_ADASUM_EMULATED_HOSTS``
    (``LAUNCHER_PID USER_FD ADDRESS=FD...``, descriptors it holds).

``_cluster_network.py rsh [OPTIONS] ADDRESS WORDS...``
    The same for mpirun's remote-shell agent (``plm_rsh_agent``, in place of
    ssh): runs ``sh -c "WORDS"`` on the host at ADDRESS.

The namespaces have no name (nothing under ``/var/run/netns``): each lives as
long as a process or a descriptor uses it, and the links and the bridge go
with them. The launcher's descriptors and the workers hold them, so they
vanish on every exit path, a killed launcher included (its workers are killed
with it). A parent-death signal ends this process if the launcher dies while
it builds.
"""

import ctypes
import errno
import os
import re
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
CLONE_NEWUTS = 0x04000000
CLONE_NEWPID = 0x20000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
#: Where the launcher names its hosts' namespaces for `enter` and `rsh`.
HOSTS_VARIABLE = "TF_ADASUM_EMULATED_HOSTS"

#: Host h's address is SUBNET + (h + 1); at most 253 hosts.
SUBNET = "10.241.0."
MAX_HOSTS = 253
#: A link rate in tc's syntax (bits per second, SI prefixes).
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


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _call(function, *args, what: str) -> None:
    if function(*args) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _enter_user_namespace_if_needed(libc) -> None:
    """Stays in this user namespace where it may make network namespaces (as
    root); else moves into a new one where our uid and gid are 0, so that
    ``ip`` and ``tc`` run with the capabilities it grants there."""
    try:
        _call(libc.unshare, CLONE_NEWNET, what="unshare(CLONE_NEWNET)")  # a probe: an empty namespace, never used
        return
    except OSError as error:
        if error.errno != errno.EPERM:
            raise
        privileged_error = error
    uid, gid = os.getuid(), os.getgid()
    try:
        _call(libc.unshare, CLONE_NEWUSER, what="unshare(CLONE_NEWUSER)")
    except OSError as error:
        raise OSError(error.errno, f"{privileged_error.strerror}; {error.strerror}") from None
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


class _Namespaces:
    """Fresh network namespaces, held by descriptors; commands run in any of them."""

    def __init__(self):
        self.libc = _libc()
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY)

    def new(self) -> int:
        _call(self.libc.unshare, CLONE_NEWNET, what="unshare(CLONE_NEWNET)")
        fd = os.open("/proc/self/ns/net", os.O_RDONLY)
        _call(self.libc.setns, self.home, CLONE_NEWNET, what="setns(back)")
        return fd

    def run(self, namespace: int, *command: str) -> None:
        """Runs `command` in `namespace` (the child inherits this thread's namespace)."""
        _call(self.libc.setns, namespace, CLONE_NEWNET, what="setns")
        try:
            result = subprocess.run(command, capture_output=True, text=True)
        except FileNotFoundError:
            raise OSError(errno.ENOENT, f"{command[0]} not found (iproute2 is needed)") from None
        finally:
            _call(self.libc.setns, self.home, CLONE_NEWNET, what="setns(back)")
        if result.returncode:
            raise OSError(errno.EINVAL, f"`{' '.join(command)}` failed: {result.stderr.strip()}")


def _token_bucket(rate: str) -> list[str]:
    bytes_per_second = rate_bits_per_second(rate) / 8
    burst = max(int(bytes_per_second * BURST_SECONDS), 64 * 1024 + 1514)
    limit = burst + int(bytes_per_second * QUEUE_SECONDS)
    return ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]


def build(hosts: int, rate: str | None) -> tuple[_Namespaces, int, list[int]]:
    """Makes the switch and `hosts` hosts, links limited to `rate` (None: no
    limit); returns them (descriptors)."""
    spaces = _Namespaces()
    switch = spaces.new()
    spaces.run(switch, "ip", "link", "add", "br0", "type", "bridge")
    spaces.run(switch, "ip", "link", "set", "br0", "up")
    bucket = _token_bucket(rate) if rate else None
    members = []
    for h in range(hosts):
        host = spaces.new()
        members.append(host)
        port = f"h{h}"
        # `ip` opens the switch's namespace by this path: ours, open in this process.
        spaces.run(
            host,
            "ip",
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            f"/proc/{os.getpid()}/fd/{switch}",
        )
        spaces.run(host, "ip", "addr", "add", f"{host_address(h)}/24", "dev", "eth0")
        spaces.run(host, "ip", "link", "set", "lo", "up")
        spaces.run(host, "ip", "link", "set", "eth0", "up")
        spaces.run(switch, "ip", "link", "set", port, "master", "br0")
        spaces.run(switch, "ip", "link", "set", port, "up")
        if bucket:
            spaces.run(host, "tc", "qdisc", "add", "dev", "eth0", "root", *bucket)
            spaces.run(switch, "tc", "qdisc", "add", "dev", port, "root", *bucket)
    return spaces, switch, members


def host_name(host: int) -> str:
    return f"tf-adasum-host-{host}"


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
    libc = _libc()
    user_path = f"/proc/{launcher}/fd/{user}"
    if os.stat(user_path).st_ino != os.stat("/proc/self/ns/user").st_ino:
        with open(user_path) as f:
            _call(libc.setns, f.fileno(), CLONE_NEWUSER, what="setns(user namespace)")
    with open(f"/proc/{launcher}/fd/{fd}") as f:
        _call(libc.setns, f.fileno(), CLONE_NEWNET, what="setns(network namespace)")
    name = host_name(addresses.index(address)).encode()
    _call(libc.unshare, CLONE_NEWUTS, what="unshare(CLONE_NEWUTS)")
    _call(libc.sethostname, name, len(name), what="sethostname")


def enter(argv: list[str]) -> int:
    """``enter ADDRESS PROGRAM [ARGS...]`` or ``rsh [OPTIONS] ADDRESS WORDS...``: see the module docstring."""
    role, rest = argv[0], argv[1:]
    if role == "rsh":
        while rest and rest[0].startswith("-"):  # ssh's options, which mean nothing here
            rest = rest[1:]
    if len(rest) < 2:
        print(f"_cluster_network.py {role}: usage: {role} ADDRESS COMMAND...", file=sys.stderr)
        return 2
    try:
        _enter_host(rest[0])
    except OSError as error:
        print(f"_cluster_network.py {role}: {error.strerror or error}", file=sys.stderr)
        return 2
    command = ["/bin/sh", "-c", " ".join(rest[1:])] if role == "rsh" else rest[1:]
    if role == "enter":
        return _run_as_namespace_init(command)
    try:
        os.execvp(command[0], command)
    except OSError as error:
        print(f"_cluster_network.py {role}: cannot run {command[0]!r}: {error.strerror}", file=sys.stderr)
        return 127


def _run_as_namespace_init(command: list[str]) -> int:
    """Runs `command` as process 1 of a new PID namespace and returns its
    exit code (128 + S for signal S). Whatever it starts stays in that
    namespace, however it detaches (MPI's ranks lead process groups of their
    own), and the kernel kills all of it when process 1 ends: when this
    process dies, by a parent-death signal that kills process 1."""
    libc = _libc()
    _call(libc.unshare, CLONE_NEWPID, what="unshare(CLONE_NEWPID)")
    child = os.fork()
    if child == 0:
        try:
            _call(libc.prctl, PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0, what="prctl(PR_SET_PDEATHSIG)")
            os.execvp(command[0], command)
        except OSError as error:
            print(f"_cluster_network.py enter: cannot run {command[0]!r}: {error.strerror}", file=sys.stderr)
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
    """``LAUNCHER_PID HOSTS RATE|none``: builds the network, reports, and holds it until stdin closes."""
    if argv[:1] in (["enter"], ["rsh"]):
        return enter(argv)
    launcher_pid, hosts, rate = int(argv[0]), int(argv[1]), (None if argv[2] == "none" else argv[2])
    if sys.platform.startswith("linux"):
        _call(_libc().prctl, PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0, what="prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != launcher_pid:
        return 1
    try:
        if not sys.platform.startswith("linux"):
            raise OSError(errno.ENOSYS, f"network namespaces need Linux, not {sys.platform}")
        if not 1 <= hosts <= MAX_HOSTS:
            raise OSError(errno.EINVAL, f"between 1 and {MAX_HOSTS} hosts. Received: {hosts}")
        if rate:
            rate_bits_per_second(rate)
        _enter_user_namespace_if_needed(_libc())
        user = os.open("/proc/self/ns/user", os.O_RDONLY)
        _, switch, members = build(hosts, rate)
    except (OSError, ValueError) as error:
        print(f"error: {getattr(error, 'strerror', None) or error}", flush=True)
        return 2
    print("ready", user, switch, *(f"{fd}@{host_address(h)}" for h, fd in enumerate(members)), flush=True)
    sys.stdin.buffer.read()  # until the launcher has opened our descriptors and closes the pipe
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
