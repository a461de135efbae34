"""Builds tf_adasum's C++ TensorFlow op libraries and keeps them in a cache.

The sources are in ``tf_adasum/native/``: ``adasum_cpu_ops.cc`` (the CPU
kernels of `tf_adasum.ops`; the compressed wire's in
``adasum_compression.h``), ``adasum_mpi_ops.cc`` (the MPI engine's ops,
`tf_adasum.engines.mpi_native`: the tree's algorithm in
``adasum_mpi_tree.h``, the sum and the gather in ``adasum_mpi_collectives.h``,
their MPI plumbing in ``adasum_mpi_wire.h``) and ``adasum_kernels.h``, the
arithmetic both share. A library is compiled on first use with the C++
compiler (``CXX``, default ``g++``) against the installed TensorFlow, into
``~/.cache/tf_adasum/<library>/<hash>/`` (``TF_ADASUM_CACHE_DIR`` replaces
``~/.cache/tf_adasum``), keyed by the sources (its ``.cc`` and every header
of the folder), TensorFlow's version, the command line, the compiler's
version and what the caller adds (the MPI library). Processes starting
together compile it once: the others wait on a lock file. ``python -m
tf_adasum.native.build`` builds the CPU kernels ahead of time (``make
install`` does) and prints their path.

The cache may sit on a shared path, so what is loaded from it is checked
first: a library (and its folder) must be a regular file (folder) owned by
this user and writable by nobody else, or it is refused (`BuildError`: the
caller falls back to its Python path); the lock and log files are never
followed through a symbolic link; the compile and the wait for another
process's compile are bounded (`COMPILE_TIMEOUT_SECONDS`,
`LOCK_TIMEOUT_SECONDS`). Sources compile
with warnings on (``-Wall``, TensorFlow's and MPI's headers as system
headers) and with the hardening flags the compiler accepts
(`HARDENING_FLAGS`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import tensorflow as tf

__all__ = [
    "COMPILE_TIMEOUT_SECONDS",
    "FLAGS",
    "HARDENING_FLAGS",
    "LOCK_TIMEOUT_SECONDS",
    "SOURCES",
    "BuildError",
    "build",
    "build_cpu_kernels",
    "cache_root",
    "compiler",
    "load",
    "print_built",
]

#: The folder of the C++ sources.
SOURCES = Path(__file__).resolve().parent
#: Portable optimisation only: the AVX2 kernels are chosen at run time.
FLAGS = ["-shared", "-fPIC", "-O3", "-ffp-contract=off", "-Wall", "-Wno-psabi"]
#: Added where the compiler accepts them (probed once per compiler).
HARDENING_FLAGS = ["-fstack-protector-strong", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=2", "-Wl,-z,relro,-z,now"]
#: The longest a compile may take (seconds).
COMPILE_TIMEOUT_SECONDS = 900.0
#: The longest a process waits for another's compile of the same library (seconds).
LOCK_TIMEOUT_SECONDS = COMPILE_TIMEOUT_SECONDS + 60.0


class BuildError(RuntimeError):
    """A library cannot be built here; the message says what is missing."""


def cache_root() -> Path:
    """Where built libraries are kept, one folder per library and configuration."""
    root = os.environ.get("TF_ADASUM_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "tf_adasum"


def compiler() -> tuple[str, str]:
    """The C++ compiler (``CXX``, default ``g++``): its path and version line,
    found once per process and name.

    Raises:
      BuildError: no compiler, or one that does not run.
    """
    return _compiler(os.environ.get("CXX", "g++"))


@functools.cache
def _compiler(name: str) -> tuple[str, str]:
    path = shutil.which(name)
    if path is None:
        raise BuildError(f"no C++ compiler: {name!r} was not found (set CXX)")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise BuildError(f"the C++ compiler {path} does not run ({error})") from error
    return path, (version.splitlines() or ["unknown"])[0]


@functools.cache
def _hardening(compiler_path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The `HARDENING_FLAGS` `compiler_path` accepts for a shared library,
    as (compile flags, link flags): one probe of all, else one per group."""

    def accepted(flags) -> bool:
        with tempfile.TemporaryDirectory() as folder:
            probe = [compiler_path, "-shared", "-fPIC", "-O2", *flags, "-x", "c++", "-", "-o", f"{folder}/probe.so"]
            try:
                result = subprocess.run(
                    probe, input="int f() { return 0; }\n", capture_output=True, text=True, timeout=60
                )
            except (OSError, subprocess.SubprocessError):
                return False
            return result.returncode == 0 and not result.stderr.strip()

    groups = [HARDENING_FLAGS[:1], HARDENING_FLAGS[1:3], HARDENING_FLAGS[3:]]  # -U and -D go together
    chosen = groups if accepted(HARDENING_FLAGS) else [g for g in groups if accepted(g)]
    flags = [flag for group in chosen for flag in group]
    return tuple(f for f in flags if not f.startswith("-Wl,")), tuple(f for f in flags if f.startswith("-Wl,"))


def _as_system_includes(flags: Sequence[str]) -> list[str]:
    """`flags` with each ``-I<folder>`` as ``-isystem <folder>``: the warnings
    of other projects' headers (TensorFlow's, MPI's) are theirs, not ours."""
    out = []
    for flag in flags:
        out += ["-isystem", flag[2:]] if flag.startswith("-I") and len(flag) > 2 else [flag]
    return out


def _check_owned(path: Path, what: str) -> None:
    """Raises BuildError unless `path` (not followed if a link) is a `what`
    (a regular "file" or a "folder") owned by this user and writable by no
    one else: a library loaded from a shared cache runs as this user."""
    info = os.lstat(path)
    kind = stat.S_ISREG if what == "file" else stat.S_ISDIR
    problem = None
    if not kind(info.st_mode):
        problem = f"is not a {what} (a symbolic link or something else)"
    elif hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        problem = f"is owned by user {info.st_uid}, not by this user ({os.geteuid()})"
    elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"is writable by others (mode {stat.filemode(info.st_mode)})"
    if problem:
        raise BuildError(
            f"the cached {what} {path} {problem}, so it is not loaded. Remove it, or set TF_ADASUM_CACHE_DIR to "
            "a folder of your own"
        )


def _cache_folders(folder: Path) -> list[Path]:
    """The folders from the cache root down to `folder` (a library's own)."""
    root = cache_root()
    return [root, *reversed([p for p in folder.parents if p != root and root in p.parents]), folder]


def _check_folders(folder: Path) -> None:
    """`_check_owned` of every folder from the cache root down to `folder`: one
    that others could write would let them swap the folders below it."""
    for path in _cache_folders(folder):
        _check_owned(path, "folder")


def _make_folders(folder: Path) -> None:
    """Creates the cache folders down to `folder` that are missing, writable by
    this user only whatever the umask; then `_check_folders`."""
    for path in _cache_folders(folder):
        try:
            os.mkdir(path, 0o755)
            os.chmod(path, 0o755)  # the umask may have taken bits away, never added: set exactly
        except FileExistsError:
            pass
    _check_folders(folder)


def _open_no_follow(path: Path, flags: int) -> int:
    """`os.open` that refuses a symbolic link at `path` (BuildError)."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as error:
        if os.path.islink(path):
            raise BuildError(f"{path} is a symbolic link; remove it (the build never follows one)") from error
        raise


def _locked(lock_fd: int, path: Path, timeout: float) -> None:
    """Takes the exclusive lock on `lock_fd` within `timeout` seconds."""
    import fcntl  # POSIX only: imported where a library is built

    deadline = time.monotonic() + timeout
    pause = 0.05
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the file closes
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise BuildError(
                    f"another process has held the build lock {path} for more than {timeout:g} s; if no build "
                    "is running, remove the lock file"
                ) from None
            time.sleep(pause)
            pause = min(1.0, 2 * pause)


def _plan(source: str, library: str, compile_flags: Sequence[str], link_flags: Sequence[str], identity: str):
    """The compile command, the link flags and the cached library's path."""
    compiler_path, version = compiler()
    source_path = SOURCES / source
    includes = _as_system_includes([*tf.sysconfig.get_compile_flags(), *compile_flags])
    hardening_compile, hardening_link = _hardening(compiler_path)
    command = [compiler_path, *FLAGS, *hardening_compile, *includes, f"-I{SOURCES}", str(source_path)]
    link = [*tf.sysconfig.get_link_flags(), *link_flags, *hardening_link]
    key = hashlib.sha256()
    headers = [p.read_bytes() for p in sorted(SOURCES.glob("*.h"))]
    for part in (source_path.read_bytes(), headers, tf.__version__, command, link, identity, version):
        key.update(repr(part).encode() + b"\0")
    return command, link, cache_root() / Path(library).stem / key.hexdigest()[:20] / library


def build(
    source: str,
    library: str,
    compile_flags: Sequence[str] = (),
    link_flags: Sequence[str] = (),
    identity: str = "",
) -> Path:
    """Compiles ``SOURCES / source`` into the shared library `library` unless
    the cache has it; returns its path.

    Args:
      source: the ``.cc`` file's name in `SOURCES`.
      library: the library's file name (``*.so``); also its cache folder's.
      compile_flags, link_flags: added to TensorFlow's.
      identity: what else the build depends on (part of the cache key).

    Raises:
      BuildError: no compiler, a failed or overlong compile (with the log's
        tail), a lock held too long, or a cached library (or its folder) that
        is not this user's alone.
    """
    command, link, target = _plan(source, library, compile_flags, link_flags, identity)
    folder = target.parent
    if os.path.lexists(target):
        _check_folders(folder)
        _check_owned(target, "file")
        return target
    _make_folders(folder)
    lock = _open_no_follow(folder / "lock", os.O_RDWR | os.O_CREAT)
    try:
        _locked(lock, folder / "lock", LOCK_TIMEOUT_SECONDS)
        if os.path.lexists(target):
            _check_owned(target, "file")
            return target
        _compile(source, command, link, target)
    finally:
        os.close(lock)
    return target


def _compile(source: str, command: list[str], link: list[str], target: Path) -> None:
    folder = target.parent
    handle, partial = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(handle)
    line = " ".join(command + ["-o", partial, *link])
    # A session of its own, so that a compile past its time ends with every
    # process it started (cc1plus, ld), not only the compiler driver.
    process = subprocess.Popen(
        [*command, "-o", partial, *link], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stderr = process.communicate(timeout=COMPILE_TIMEOUT_SECONDS)[1]
        failed = bool(process.returncode)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        stderr, failed = f"stopped after {COMPILE_TIMEOUT_SECONDS:g} s\n", True
    # Written beside and renamed over build.log: a link there is replaced, never followed.
    handle, log = tempfile.mkstemp(dir=folder, suffix=".log.tmp")
    with os.fdopen(handle, "w") as f:
        f.write(line + "\n" + stderr)
    os.chmod(log, 0o644)
    os.replace(log, folder / "build.log")
    if failed:
        os.unlink(partial)
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise BuildError(f"compiling {source} with {command[0]} failed (log: {folder / 'build.log'}):\n{tail}")
    os.chmod(partial, 0o755)  # mkstemp made it private
    os.replace(partial, target)


def load(build_library: Callable[[], Path]):
    """Builds (or finds) a library with `build_library` and loads it with
    `tf.load_op_library`. Returns ``(module, path, None)``, or
    ``(None, None, reason)`` where it cannot be built or loaded; never raises
    for these."""
    try:
        path = build_library()
        return tf.load_op_library(str(path)), path, None
    except BuildError as error:
        return None, None, str(error)
    except (OSError, subprocess.SubprocessError, tf.errors.OpError) as error:
        return None, None, f"building or loading the library failed: {error}"


def build_cpu_kernels() -> Path:
    """`build` of the CPU kernels of `tf_adasum.ops` (``adasum_cpu_ops.cc``)."""
    return build("adasum_cpu_ops.cc", "tf_adasum_cpu_ops.so")


def print_built(build_library: Callable[[], Path]) -> int:
    """Command-line ending of a build: prints the library's path (status 0),
    or what stopped it on stderr (status 1)."""
    try:
        print(build_library())
    except BuildError as error:
        print(f"tf_adasum: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Builds the CPU kernels (or finds them in the cache) and prints their path."""
    import argparse

    argparse.ArgumentParser(description="Builds tf_adasum's native CPU kernels and prints their path.").parse_args(argv)
    return print_built(build_cpu_kernels)


if __name__ == "__main__":
    sys.exit(main())
