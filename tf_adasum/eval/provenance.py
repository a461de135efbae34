"""Where a record came from: its date, the commit, the processor and the command.

Every evaluation record (`tf_adasum.eval.runner`), every benchmark record
(``benchmarks/*.py``) and the MNIST examples' JSON summary line carry these
four fields (a launched example's ``command`` is what its process ran, not
the launcher's command), so that a figure in the documentation can be
traced to the code and the machine that produced it:

* ``date``: UTC, ISO 8601 to the second (``2026-12-07T01:02:03+00:00``);
* ``commit``: the checkout's short hash, with ``-dirty`` when the code (the
  package, the benchmarks, the examples, ``setup.py``) differs from it or has new files;
  records and pages, which a run into ``docs/`` writes itself, do not count;
  ``""`` outside a git checkout of this project;
* ``processor``: the model name from ``/proc/cpuinfo`` and the widest x86
  vector extension it offers (``AVX-512``, ``AVX2`` or ``no AVX2``), which is
  what the dot products' speed depends on (elsewhere, the architecture);
* ``command``: the command line, as a user would type it from the
  repository's root, preceded by the variables of `PATH_VARIABLES` that are
  set (``TF_ADASUM_WORKER_TRANSPORT=collective python ...``): they choose
  which code path the run measured.

Standard library only.

Examples:
    >>> from tf_adasum.eval import provenance
    >>> sorted(provenance.fields("python benchmarks/collective.py --engine mpi"))
    ['command', 'commit', 'date', 'processor']
    >>> provenance.vector_extension({"avx2", "avx512f"})
    'AVX-512'
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping

__all__ = ["PATH_VARIABLES", "command_line", "commit", "fields", "processor", "vector_extension", "with_path_variables"]

#: The repository's root (the folder above the package).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: What counts as the code for ``-dirty``: not the records and pages under docs/.
CODE_PATHS = ("tf_adasum", "benchmarks", "examples", "setup.py")


def commit() -> str:
    """The checkout's short commit hash, ``-dirty`` with uncommitted changes or
    new files in the code (`CODE_PATHS`), or ``""`` where the package is not in
    a git checkout of this project.

    Examples:
        >>> isinstance(commit(), str)
        True
    """

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True)

    try:
        top, head = git("rev-parse", "--show-toplevel"), git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", *CODE_PATHS)  # new files count too
    except OSError:  # no git
        return ""
    if head.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(ROOT):
        return ""  # not a checkout of this project (e.g. installed inside another repository)
    return head.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")


def vector_extension(flags: set[str]) -> str:
    """The widest x86 vector extension among a processor's ``flags``.

    Examples:
        >>> vector_extension({"sse2", "avx", "avx2", "fma"})
        'AVX2'
        >>> vector_extension({"sse2"})
        'no AVX2'
    """
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else "no AVX2"


def processor() -> str:
    """This machine's processor: its model name and widest vector extension
    (``"AMD EPYC, AVX2"``), or `platform.processor` where ``/proc/cpuinfo``
    cannot be read.

    Examples:
        >>> isinstance(processor(), str)
        True
    """
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    name = name or platform.processor() or "unknown processor"
    if not flags:  # not x86 (or no /proc/cpuinfo): the architecture instead
        return f"{name}, {platform.machine() or 'unknown architecture'}"
    return f"{name}, {vector_extension(flags)}"


#: The environment variables that choose the code a run takes: the CPU
#: kernels (`tf_adasum.ops`), the native MPI ops (`tf_adasum.engines.mpi_native`)
#: and the transport between worker processes (`tf_adasum.comm.socket_setup`).
PATH_VARIABLES = ("TF_ADASUM_CPU_KERNELS", "TF_ADASUM_MPI_NATIVE", "TF_ADASUM_WORKER_TRANSPORT")


def with_path_variables(command: str, environ: Mapping[str, str] | None = None) -> str:
    """`command` preceded by each of `PATH_VARIABLES` set in `environ`
    (default ``os.environ``), as a shell would take them.

    Examples:
        >>> with_path_variables("python benchmarks/collective.py", {"TF_ADASUM_WORKER_TRANSPORT": "collective"})
        'TF_ADASUM_WORKER_TRANSPORT=collective python benchmarks/collective.py'
        >>> with_path_variables("tf-adasum eval --preset quick", {})
        'tf-adasum eval --preset quick'
    """
    environ = os.environ if environ is None else environ
    prefix = [f"{name}={shlex.quote(environ[name])}" for name in PATH_VARIABLES if name in environ]
    return " ".join([*prefix, command])


def command_line(script: str | None = None, args: list[str] | None = None) -> str:
    """The command line of `script` (default ``sys.argv[0]``) with `args`
    (default ``sys.argv[1:]``, as a ``main(argv=None)`` passes them on) as
    typed from the repository's root: ``python``, then the script's path
    relative to it; preceded by the `PATH_VARIABLES` that are set
    (`with_path_variables`).

    Examples:
        >>> command_line(os.path.join(ROOT, "benchmarks", "collective.py"), ["--engine", "mpi"])
        'python benchmarks/collective.py --engine mpi'
    """
    script = (sys.argv[0] if sys.argv else "") if script is None else script
    args = sys.argv[1:] if args is None else args
    if os.path.isabs(script) and script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    return with_path_variables(shlex.join(["python", script, *args]))


def fields(command: str | None = None) -> dict[str, str]:
    """The four provenance fields of a record made now: ``date``, ``commit``,
    ``processor`` and ``command`` (default: `command_line`).

    Examples:
        >>> fields("tf-adasum eval --preset edge")["command"]
        'tf-adasum eval --preset edge'
    """
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "processor": processor(),
        "command": command_line() if command is None else command,
    }
