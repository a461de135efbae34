"""BUILD must list every module and every test file (Starlark parses as Python)."""

import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A test file starts processes if it imports subprocess or carries these markers.
STARTS_PROCESSES = re.compile(r"^import subprocess$|pytest[.]mark[.](multiworker|mpi)\b", re.M)


def _targets():
    """Evaluates BUILD with stand-ins for the Bazel rules; returns the targets."""
    targets = []

    def rule(kind):
        return lambda **kwargs: targets.append((kind, kwargs))

    namespace = {
        "load": lambda *args: None,
        "package": lambda **kwargs: None,
        "licenses": lambda *args: None,
        "py_library": rule("py_library"),
        "py_test": rule("py_test"),
        "glob": lambda include, **kwargs: [],
    }
    with open(os.path.join(ROOT, "BUILD"), encoding="utf-8") as f:
        source = f.read()
    ast.parse(source)  # Starlark is Python syntax
    exec(compile(source, "BUILD", "exec"), namespace)
    return targets


def _relative(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def test_every_module_is_in_the_library():
    libraries = {kwargs["name"]: kwargs for kind, kwargs in _targets() if kind == "py_library"}
    assert sorted(libraries["tf_adasum"]["srcs"]) == _relative("tf_adasum/**/*.py")


def test_every_test_file_has_a_py_test():
    tests = {kwargs["name"]: kwargs for kind, kwargs in _targets() if kind == "py_test"}
    files = _relative("tests/test_*.py")
    assert sorted(f"tests/{name}.py" for name in tests) == files
    for name, kwargs in tests.items():
        assert kwargs["srcs"] == [f"tests/{name}.py"]


def test_multi_process_tests_are_exclusive():
    tests = {kwargs["name"]: kwargs for kind, kwargs in _targets() if kind == "py_test"}
    for path in _relative("tests/test_*.py"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
        name = os.path.basename(path)[:-3]
        if STARTS_PROCESSES.search(text):
            assert "exclusive" in tests[name]["tags"], f"{name} starts processes: tag it exclusive"
