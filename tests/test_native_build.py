"""`tf_adasum.native.build` with a cache on a shared path: what it refuses to
load or follow, its bounded waits, and its flags. No compile here: the cache
entries are made by hand where the build would look (or already exist)."""

import os
import shutil
import time

import pytest

from tf_adasum.native import build as native_build
from tf_adasum.native.build import BuildError

SOURCE, LIBRARY = "adasum_cpu_ops.cc", "tf_adasum_cpu_ops.so"


@pytest.fixture
def cached(monkeypatch, tmp_path):
    """Where `build` of the CPU kernels looks in a fresh cache: its folder made
    as the build makes it, no library yet (a compile must never start)."""
    monkeypatch.setenv("TF_ADASUM_CACHE_DIR", str(tmp_path))

    def no_compile(*args, **kwargs):
        raise AssertionError("the build compiled: it should have refused first")

    monkeypatch.setattr(native_build, "_compile", no_compile)
    _, _, target = native_build._plan(SOURCE, LIBRARY, (), (), "")
    target.parent.mkdir(parents=True)
    os.chmod(target.parent, 0o755)
    return target


def _library(path, mode=0o755):
    path.write_bytes(b"\x7fELF not really")
    os.chmod(path, mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_cached_library_owned_by_another_user_is_refused(cached):
    _library(cached)
    os.chown(cached, 12345, 12345)
    with pytest.raises(BuildError, match="is owned by user 12345, not by this user"):
        native_build.build(SOURCE, LIBRARY)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_cache_folder_owned_by_another_user_is_refused(cached):
    _library(cached)
    os.chown(cached.parent, 12345, 12345)
    with pytest.raises(BuildError, match="folder .* is owned by user 12345"):
        native_build.build(SOURCE, LIBRARY)


@pytest.mark.parametrize("mode", [0o775, 0o757])
def test_a_cached_library_writable_by_others_is_refused(cached, mode):
    _library(cached, mode)
    with pytest.raises(BuildError, match=r"is writable by others .*TF_ADASUM_CACHE_DIR"):
        native_build.build(SOURCE, LIBRARY)


def test_a_cached_library_that_is_a_link_is_refused(cached, tmp_path):
    elsewhere = tmp_path / "elsewhere.so"
    _library(elsewhere)
    os.symlink(elsewhere, cached)
    with pytest.raises(BuildError, match="is not a file"):
        native_build.build(SOURCE, LIBRARY)


def test_a_library_of_our_own_is_loaded_from_the_cache(cached):
    _library(cached)
    assert native_build.build(SOURCE, LIBRARY) == cached


def test_the_lock_file_is_never_followed(cached, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    os.symlink(victim, cached.parent / "lock")
    with pytest.raises(BuildError, match="is a symbolic link"):
        native_build.build(SOURCE, LIBRARY)
    assert victim.read_text() == "untouched"


def test_a_lock_held_too_long_is_a_clear_error(cached, monkeypatch):
    import fcntl

    monkeypatch.setattr(native_build, "LOCK_TIMEOUT_SECONDS", 0.5)
    with open(cached.parent / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another build's (flock: per open file, even in one process)
        with pytest.raises(BuildError, match="held the build lock .* for more than 0.5 s"):
            native_build.build(SOURCE, LIBRARY)


def test_a_compile_past_its_time_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "COMPILE_TIMEOUT_SECONDS", 0.5)
    target = tmp_path / "lib" / "x.so"
    target.parent.mkdir()
    with pytest.raises(BuildError, match="stopped after 0.5 s"):
        native_build._compile("x.cc", ["sh", "-c", "exec sleep 30"], [], target)
    assert not target.exists() and "stopped after" in (target.parent / "build.log").read_text()


def test_a_compile_past_its_time_ends_every_process_it_started(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "COMPILE_TIMEOUT_SECONDS", 1.0)
    target, pid_file = tmp_path / "lib" / "x.so", tmp_path / "grandchild.pid"
    target.parent.mkdir()
    script = f"sleep 60 & echo $! > {pid_file}; wait"  # as cc1plus under the g++ driver
    start = time.monotonic()
    with pytest.raises(BuildError, match="stopped after 1 s"):
        native_build._compile("x.cc", ["sh", "-c", script], [], target)
    assert time.monotonic() - start < 30  # not held until the grandchild ends (it holds the pipes)
    grandchild = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; its parent may take a moment to reap it
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"the compile's process {grandchild} outlived its timeout")


@pytest.mark.parametrize("level", ["root", "library folder"])
def test_a_cache_folder_above_the_library_writable_by_others_is_refused(cached, level):
    _library(cached)
    folder = {"root": native_build.cache_root(), "library folder": cached.parent.parent}[level]
    os.chmod(folder, 0o775)
    with pytest.raises(BuildError, match=r"is writable by others \(mode drwxrwxr-x\)"):
        native_build.build(SOURCE, LIBRARY)


def test_sources_compile_with_warnings_on_and_hardening_where_available():
    command, link, _ = native_build._plan(SOURCE, LIBRARY, ("-I/some/mpi/include",), (), "")
    assert "-Wall" in command and "-w" not in command
    assert command[command.index("/some/mpi/include") - 1] == "-isystem"  # others' headers: their warnings
    assert f"-I{native_build.SOURCES}" in command  # ours: warnings shown
    compile_flags, link_flags = native_build._hardening(command[0])
    assert set(compile_flags) <= set(command) and set(link_flags) <= set(link)
    if "GCC" in native_build.compiler()[1] or "g++" in command[0]:
        assert "-fstack-protector-strong" in command and "-Wl,-z,relro,-z,now" in link


@pytest.mark.parametrize("source", ["adasum_cpu_ops.cc", "adasum_mpi_ops.cc"])
def test_a_change_in_any_header_of_the_folder_is_a_new_cache_key(monkeypatch, tmp_path, source):
    """The libraries include headers beside their .cc (adasum_kernels.h,
    adasum_mpi_tree.h, ...): an edit of any of them must rebuild, never load a
    library built from the old text."""
    sources = tmp_path / "native"
    shutil.copytree(native_build.SOURCES, sources, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(native_build, "SOURCES", sources)
    monkeypatch.setenv("TF_ADASUM_CACHE_DIR", str(tmp_path / "cache"))

    def key():
        return native_build._plan(source, "library.so", (), (), "")[2].parent.name

    headers = sorted(sources.glob("*.h"))
    assert {"adasum_kernels.h", "adasum_mpi_tree.h", "adasum_compression.h"} <= {h.name for h in headers}
    before = key()
    for header in headers:
        text = header.read_bytes()
        header.write_bytes(text + b"\n")
        assert key() != before, header.name
        header.write_bytes(text)
    assert key() == before


def test_the_built_libraries_compiled_without_warnings():
    """The logs of the libraries this installation uses (built by `make install`
    or on first use): their command lines and no warning of our sources."""
    for build in (native_build.build_cpu_kernels,):
        log = (build().parent / "build.log").read_text()
        command, output = log.split("\n", 1)
        assert "-Wall" in command, command
        assert "warning" not in output, output[-3000:]


def test_a_folder_the_build_makes_is_not_writable_by_others_whatever_the_umask(monkeypatch, tmp_path):
    monkeypatch.setenv("TF_ADASUM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_compile", lambda source, command, link, target: _library(target))
    previous = os.umask(0o002)  # group-writable by default, as on many shared machines
    try:
        target = native_build.build(SOURCE, LIBRARY)
    finally:
        os.umask(previous)
    assert target.exists()
    for folder in (target.parent, target.parent.parent):  # every folder the build made
        assert os.stat(folder).st_mode & 0o777 == 0o755, folder
    assert native_build.build(SOURCE, LIBRARY) == target  # and it is loaded from the cache afterwards
