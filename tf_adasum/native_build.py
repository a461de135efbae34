"""Builds tf_adasum's C++ TensorFlow op libraries and keeps them in a cache.

The sources are in ``tf_adasum/native/``: ``adasum_cpu_ops.cc`` (the CPU
kernels of `tf_adasum.ops`), ``adasum_mpi_ops.cc`` (the MPI engine's ops,
`tf_adasum.engines.mpi_native`) and ``adasum_kernels.h``, the arithmetic
both share. A library is compiled on first use with the C++ compiler
(``CXX``, default ``g++``) against the installed TensorFlow, into
``~/.cache/tf_adasum/<library>/<hash>/`` (``TF_ADASUM_CACHE_DIR`` replaces
``~/.cache/tf_adasum``), keyed by the sources, TensorFlow's version, the
command line, the compiler's version and what the caller adds (the MPI
library). Processes starting together compile it once: the others wait on a
lock file. ``python -m tf_adasum.native_build`` builds the CPU kernels ahead
of time (``make install`` does) and prints their path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import tensorflow as tf

__all__ = [
    "FLAGS",
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
SOURCES = Path(__file__).resolve().parent / "native"
#: Portable optimisation only: the AVX2 kernels are chosen at run time.
FLAGS = ["-shared", "-fPIC", "-O3", "-ffp-contract=off", "-w", "-Wno-psabi"]


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
      BuildError: no compiler, or a failed compile (with the log's tail).
    """
    compiler_path, version = compiler()
    source_path = SOURCES / source
    command = [compiler_path, *FLAGS, *tf.sysconfig.get_compile_flags(), f"-I{SOURCES}", *compile_flags]
    command.append(str(source_path))
    link = [*tf.sysconfig.get_link_flags(), *link_flags]
    key = hashlib.sha256()
    headers = [p.read_bytes() for p in sorted(SOURCES.glob("*.h"))]
    for part in (source_path.read_bytes(), headers, tf.__version__, command, link, identity, version):
        key.update(repr(part).encode() + b"\0")
    folder = cache_root() / Path(library).stem / key.hexdigest()[:20]
    target = folder / library
    if target.exists():
        return target
    import fcntl  # POSIX only: imported where a library is built

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if target.exists():
            return target
        handle, partial = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
        os.close(handle)
        result = subprocess.run([*command, "-o", partial, *link], capture_output=True, text=True)
        (folder / "build.log").write_text(" ".join(command + ["-o", partial, *link]) + "\n" + result.stderr)
        if result.returncode:
            os.unlink(partial)
            tail = "\n".join(result.stderr.strip().splitlines()[-15:])
            raise BuildError(f"compiling {source} with {compiler_path} failed (log: {folder / 'build.log'}):\n{tail}")
        os.chmod(partial, 0o755)  # mkstemp made it private
        os.replace(partial, target)
    return target


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
