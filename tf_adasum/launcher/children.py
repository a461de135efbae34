"""The launcher's side of its processes: the helper started, its namespaces received, the workers run and stopped.

Every process the launcher starts runs under `helper.py` in this folder (by
path, with ``python -I -S``; its docstring describes the roles): as the
supervisor of a worker, or as the maker of a private network or of emulated
hosts, whose namespaces this side receives as descriptors. Standard library
only, and nothing of ours.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from . import helper  # the package beside it, whether tf_adasum.launcher or, run by path, launcher
from .startup_log import is_startup_notice

#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
GRACE_SECONDS = 5.0
#: Seconds between two questions to `run`'s `resize`.
POLL_SECONDS = 1.0
#: Seconds the workers get to back up and exit after a resize's SIGTERM.
RESIZE_GRACE_SECONDS = 300.0
#: The helper program (run by path, never imported by the processes it starts).
HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helper.py")


class NetworkIsolationError(OSError):
    """The system refused the network namespaces ``isolate_network=True`` or
    ``hosts=H`` ask for (or, with ``mpirun=True``, there is no root or no mpirun)."""


class Child(NamedTuple):
    """One process the launcher runs under a supervisor: its command and
    environment, the prefix of its output lines, descriptors of the user
    and network namespaces it joins (none: the launcher's), and a line that
    makes its exit a failure even with code 0 (`failure_line`: a program
    that says it ended the job but exits 0)."""

    command: Sequence[str]
    env: Mapping[str, str]
    prefix: str
    joins: Sequence[int] = ()
    failure_line: str | None = None


def helper_command(role: str, *args: str) -> list[str]:
    """The helper in `role`; the roles that watch the launcher are given its process id."""
    watched = [str(os.getpid())] if role in helper.WATCHED_ROLES else []
    return [sys.executable, "-I", "-S", HELPER, role, *watched, *args]


def private_network() -> list[int]:
    """Makes a network namespace holding only loopback; returns descriptors of its user namespace and of it."""
    _require_linux()
    try:
        fds, _ = _namespaces("network", what="a private network namespace for the workers")
    except NetworkIsolationError as error:
        raise NetworkIsolationError(
            f"{error}. Run as root (CAP_SYS_ADMIN) or where unprivileged user namespaces are allowed, "
            "or run without it on a private network or behind a firewall."
        ) from None
    return fds


def emulated_hosts(hosts: int, link: str | None) -> tuple[list[int], list[str]]:
    """Makes `hosts` hosts joined by `link`-rate links; returns descriptors
    (user namespace, switch, host 0, ...) and the hosts' addresses."""
    return _namespaces("hosts", str(hosts), link or "none", what=f"{hosts} emulated hosts")


def _require_linux() -> None:
    if not sys.platform.startswith("linux"):
        raise NetworkIsolationError(f"network namespaces need Linux. Received: sys.platform={sys.platform!r}")


def _namespaces(role: str, *args: str, what: str) -> tuple[list[int], list[str]]:
    """Runs the helper in a maker's `role`; returns descriptors of the namespaces
    it made (opened through its ``/proc/PID/fd``) and the addresses named with them."""
    _require_linux()
    holder = subprocess.Popen(
        helper_command(role, *args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        answer = holder.stdout.readline().strip()
        if answer.split()[:1] != ["ready"]:
            raise NetworkIsolationError(f"cannot create {what} ({answer.removeprefix('error: ') or 'no answer'})")
        words, fds = answer.split()[1:], []
        try:
            for word in words:
                fds.append(os.open(f"/proc/{holder.pid}/fd/{word.split('@')[0]}", os.O_RDONLY))
        except OSError as error:
            for fd in fds:
                os.close(fd)
            raise NetworkIsolationError(f"cannot open the namespaces of {what} ({error})") from None
    finally:
        holder.stdin.close()  # the holder exits; its namespaces live on in our descriptors
        holder.stdout.close()
        try:
            holder.wait(GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
    return fds, [word.split("@")[1] for word in words if "@" in word]


def _forward(
    stream, prefix: str, lock: threading.Lock, failure_line: str | None, failed: threading.Event, quiet: bool
) -> None:
    for line in iter(stream.readline, b""):
        if quiet and is_startup_notice(line):
            continue
        text = line.decode(errors="replace")
        if failure_line is not None and failure_line in text:
            failed.set()
        with lock:
            sys.stdout.write(prefix + text if text.endswith("\n") else prefix + text + "\n")
            sys.stdout.flush()
    stream.close()


def stop(processes: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each running process's group, then SIGKILL what is left."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        # The group may hold children even after its leader exited.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run(children: Sequence[Child], release: Sequence[int] = (), resize: Callable[[], bool] | None = None) -> int:
    """Runs every child under its supervisor, each output line prefixed,
    until one fails or all exit 0; then stops the rest (`stop`). The notices
    every TensorFlow import writes (`startup_log.is_startup_notice`: the absl
    preamble, the CPU-feature and oneDNN notices) are dropped unless the
    child's ``TF_CPP_MIN_LOG_LEVEL`` is ``0``; every other line is kept.

    `release`: descriptors to close once every child holds its namespaces (at
    the latest when this returns). `resize`: asked every `POLL_SECONDS` while
    no child has exited; once it answers True, every child's group gets
    `helper.NOTICE_SIGNAL` (SIGUSR1, a preemption notice: the workers back up,
    then exit with one of `helper.NOTICE_EXIT_CODES`; mpirun forwards it to its
    ranks), and they have `RESIZE_GRACE_SECONDS` to exit; any other exit code
    (a failure) or a child that finished (0) ends the round at once.

    Returns:
      0 (all exited 0; after a notice, one did: training finished), or the
      first non-zero exit code observed (128 + S for signal S); after a
      notice, one of `helper.NOTICE_EXIT_CODES` when every child exited so;
      1 in place of 0 when a child printed its `Child.failure_line`.
    """
    lock = threading.Lock()
    processes, threads, release, said_failed = [], [], list(release), []
    noticed, next_poll = None, time.monotonic() + POLL_SECONDS
    try:
        for child in children:
            network_args = ["--network", *map(str, child.joins)] if child.joins else []
            process = subprocess.Popen(
                helper_command("worker", *network_args, "--", *child.command),
                env=dict(child.env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, so `stop` (and its supervisor) reach its children
                pass_fds=child.joins,
            )
            processes.append(process)
            said_failed.append(threading.Event())
            quiet = child.env.get("TF_CPP_MIN_LOG_LEVEL") != "0"  # "0": TensorFlow's INFO lines asked for
            forwarded = (process.stdout, child.prefix, lock, child.failure_line, said_failed[-1], quiet)
            thread = threading.Thread(target=_forward, args=forwarded, daemon=True)
            thread.start()
            threads.append(thread)
        while release:
            os.close(release.pop())
        while True:
            codes = [128 - c if c is not None and c < 0 else c for c in (p.poll() for p in processes)]
            failed = [c for c in codes if c not in (None, 0)]
            if noticed is None:
                if None not in codes or failed:
                    code = failed[0] if failed else 0
                    break
                # Asked only while no child has finished: a notice racing the end of training would end it.
                if resize is not None and 0 not in codes and time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + POLL_SECONDS
                    if resize():
                        noticed = time.monotonic()
                        for process in processes:
                            with contextlib.suppress(ProcessLookupError):
                                os.killpg(process.pid, helper.NOTICE_SIGNAL)
            else:  # after a notice: a backup, then exits with NOTICE_EXIT_CODES; anything else is a failure
                unexpected = [c for c in failed if c not in helper.NOTICE_EXIT_CODES]
                if 0 in codes or unexpected or None not in codes:
                    code = 0 if 0 in codes else (unexpected or failed)[0]
                    break
                if time.monotonic() > noticed + RESIZE_GRACE_SECONDS:
                    code = 128 + signal.SIGKILL
                    break
            time.sleep(0.1)
    finally:
        stop(processes)
        for fd in release:
            os.close(fd)
    for thread in threads:
        thread.join(timeout=GRACE_SECONDS)
    if code == 0 and any(event.is_set() for event in said_failed):
        return 1  # a child printed its failure line, then exited 0
    return code
