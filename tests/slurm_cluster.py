"""A one-machine Slurm cluster for the tests: munged, slurmctld and slurmd from
a scratch folder (Debian's slurm-wlm and munge; `make system-deps` installs
them as root).

Every daemon runs in the foreground as a child of the test process, on ports
nobody else holds, with its own munge key and socket and `SLURM_CONF` in the
environment of what the test submits; `stop()` cancels the jobs left and ends
the daemons on every exit path (and the kernel ends them if the test process
dies: each gets SIGTERM when its parent goes).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

from tf_adasum.launcher.tf_config import free_ports

#: The programs the cluster needs, and what to install where they are missing.
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun")
INSTALL_HINT = "`make system-deps` as root (Debian: apt-get install slurm-wlm munge libpmix-dev)"
#: How long the daemons may take to answer (seconds).
START_TIMEOUT = 60

_PR_SET_PDEATHSIG = 1


def refusal() -> str | None:
    """Why a Slurm cluster cannot run here, or None."""
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): {INSTALL_HINT}"
    if os.geteuid() != 0:
        return "a one-machine Slurm cluster runs its daemons as root here; run the tests as root"
    return None


def _die_with_parent():
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class SlurmCluster:
    """One node (this machine, 2 CPUs, oversubscribed up to 4 tasks a CPU) and one partition."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="tf_adasum_slurm_")
        # The node is "localhost": its name is what srun's tasks put in TF_CONFIG,
        # so the workers talk over loopback only.
        self.node = "localhost"
        self._daemons: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=os.path.join(self.folder, "slurm.conf"))

    def _path(self, *parts: str) -> str:
        return os.path.join(self.folder, *parts)

    def _write_config(self) -> None:
        for name in ("state", "spool", "munge"):
            os.makedirs(self._path(name), mode=0o700)
        with open(self._path("munge", "munge.key"), "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(self._path("munge", "munge.key"), 0o400)
        controller_port, node_port = free_ports(2)
        config = f"""\
ClusterName=tfadasumtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={controller_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self._path("munge", "munge.socket")}
CredType=cred/munge
StateSaveLocation={self._path("state")}
SlurmdSpoolDir={self._path("spool")}
SlurmctldPidFile={self._path("slurmctld.pid")}
SlurmdPidFile={self._path("slurmd.pid")}
SlurmctldLogFile={self._path("slurmctld.log")}
SlurmdLogFile={self._path("slurmd.log")}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
KillWait=5
NodeName={self.node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=30 State=UP OverSubscribe=FORCE:4
"""
        with open(self._path("slurm.conf"), "w") as f:
            f.write(config)

    def _start(self, *command: str) -> None:
        with open(self._path(os.path.basename(command[0]) + ".out"), "wb") as log:  # the daemon keeps its copy
            self._daemons.append(
                subprocess.Popen(
                    command, env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
                )
            )

    def start(self) -> SlurmCluster:
        self._write_config()
        munge = self._path("munge")
        self._start(
            "munged", "--foreground", "--force", f"--key-file={munge}/munge.key",
            f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
            f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed",
        )  # fmt: skip
        self._wait(lambda: os.path.exists(os.path.join(munge, "munge.socket")), "munged")
        self._start("slurmctld", "-D", "-i")
        self._start("slurmd", "-D", "-N", self.node)
        self._wait(self._node_is_idle, "slurmctld and slurmd")
        return self

    def _node_is_idle(self) -> bool:
        result = subprocess.run(
            ["scontrol", "show", "node", self.node], env=self.env, capture_output=True, text=True, timeout=10
        )
        return result.returncode == 0 and "State=IDLE" in result.stdout

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            dead = [d.args[0] for d in self._daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start ({dead or 'timed out'}):\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        texts = []
        for name in sorted(os.listdir(self.folder)):
            if name.endswith((".log", ".out")):
                with open(self._path(name), errors="replace") as f:
                    texts.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(texts)

    def sbatch(self, script: str, *args: str, timeout: float, env: dict | None = None) -> tuple[int, str]:
        """Submits `script` with `args` by ``sbatch`` and waits for the job to
        end; returns ``(its exit code, its output)``. The job's time limit is
        `timeout` rounded up to minutes, so it ends by then. (``sbatch --wait``
        would do the same, polling at up to 32 s intervals.)"""
        output = self._path(f"job-{len(os.listdir(self.folder))}.txt")
        minutes = -(-int(timeout) // 60)
        command = ["sbatch", "--parsable", f"--output={output}", f"--time={minutes}", script, *args]
        submitted = subprocess.run(command, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60)
        if submitted.returncode != 0:
            return submitted.returncode, submitted.stdout + submitted.stderr
        job = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + minutes * 60 + 60  # Slurm's own limit, then its clean-up
        code = None
        while code is None and time.monotonic() < deadline:
            time.sleep(0.5)
            code = self._exit_code(job)
        text = ""
        if os.path.exists(output):
            with open(output, errors="replace") as f:
                text = f.read()
        if code is None:
            raise TimeoutError(f"job {job} did not end within its time limit:\n{text[-3000:]}\n{self.logs()}")
        return code, text

    def _exit_code(self, job: str) -> int | None:
        """The ended job's exit code (its signal as 128 + number), None while it runs."""
        shown = subprocess.run(
            ["scontrol", "show", "job", job], env=self.env, capture_output=True, text=True, timeout=30
        ).stdout
        state = re.search(r"JobState=(\w+)", shown)
        if state is None or state.group(1) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
            return None
        exit_code = re.search(r" ExitCode=(\d+):(\d+)", shown)
        if exit_code is None:
            raise RuntimeError(f"scontrol shows job {job} {state.group(1)} without an ExitCode:\n{shown}")
        code, signal_number = map(int, exit_code.groups())
        if state.group(1) == "COMPLETED":
            return code
        return code or 128 + signal_number  # FAILED, CANCELLED, TIMEOUT, ...: never 0

    def stop(self) -> None:
        """Cancels every job, ends the daemons and removes the folder."""
        try:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for daemon in reversed(self._daemons):
            daemon.terminate()
        for daemon in reversed(self._daemons):
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
