"""Every public class, function and module has a runnable example in its
docstring, and every docstring example of the public modules runs (doctest).

The public objects: the names in `tf_adasum.__all__`, the classes and
functions in the ``__all__`` of the public modules (`tf_adasum.combiners`,
`tf_adasum.mpi`, `tf_adasum.reference`, and any module the API reference
documents as a whole), and every object the API reference
(docs/reference/api.md) documents with a ``:::`` directive. Each needs an
``Examples:`` section with ``>>>`` lines: the section griffe renders as code
on the site (``Example:`` renders as a quote that loses the prompts).

Each docstring's examples run in fresh globals, so an example imports what it
uses and can be copied as it stands; in this process, with conftest's logical
CPUs (an example that needs two devices configures them only where nothing
has).
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pathlib
import re

import pytest

import tf_adasum
from tf_adasum import combiners

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_REFERENCE = ROOT / "docs" / "reference" / "api.md"
OPTIONS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _resolve(path: str):
    """The object a dotted path names: a module, or an attribute of one."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _qualified(obj) -> str:
    return obj.__name__ if inspect.ismodule(obj) else f"{obj.__module__}.{obj.__qualname__}"


def _directives() -> list[tuple[str, object]]:
    """``(path, members option)`` of each ``:::`` directive of the API reference
    (members: None when not set, False, or the list of names)."""
    found = []
    for match in re.finditer(r"^::: ([\w.]+)\n((?:[ ]{4}.*\n)*)", API_REFERENCE.read_text("utf-8"), re.M):
        members = re.search(r"^\s+members: (.*)$", match.group(2), re.M)
        value = None if members is None else members.group(1).strip()
        if value == "false":
            value = False
        elif value is not None:
            value = [name.strip() for name in value.strip("[]").split(",")]
        found.append((match.group(1), value))
    return found


def _rendered_methods(cls) -> list:
    """The methods and properties of `cls` the site shows when it shows all
    its members: its own public ones with a docstring of their own."""
    methods = []
    for name, value in vars(cls).items():
        function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        if name.startswith("_") or not (inspect.isfunction(function) or isinstance(function, property)):
            continue
        if function.__doc__:
            methods.append(function.fget if isinstance(function, property) else function)
    return methods


def _module_members(module, members) -> list[str]:
    """The names a module's directive shows: its `members` list, else its ``__all__``."""
    return members if isinstance(members, list) else list(module.__all__)


def _public_objects() -> dict[str, object]:
    """Every public class, function and module, and every method the API
    reference shows, by qualified name."""
    found = [getattr(tf_adasum, name) for name in tf_adasum.__all__ if name != "__version__"]
    for path, members in _directives():
        obj = _resolve(path)
        if inspect.ismodule(obj):
            if members is False:
                continue  # the module's docstring only, above its class: not an object of the API
            found.append(obj)
            for name in _module_members(obj, members):
                member = getattr(obj, name)
                found.append(member)
                if inspect.isclass(member):
                    found += _rendered_methods(member)
        else:
            found.append(obj)
            for name in members or []:
                member = inspect.getattr_static(obj, name, None)
                if isinstance(member, property):
                    found.append(member.fget)
                elif isinstance(member, (classmethod, staticmethod)) or inspect.isfunction(member):
                    found.append(getattr(obj, name))
    return {
        _qualified(obj): obj
        for obj in found
        if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj)
    }


PUBLIC = _public_objects()
#: The modules holding a public object: every docstring example in them runs.
MODULES = sorted({inspect.getmodule(obj).__name__ for obj in PUBLIC.values()})


def _doctests(obj, recurse: bool) -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(recurse=recurse, exclude_empty=True)
    module = obj if inspect.ismodule(obj) else inspect.getmodule(obj)
    return finder.find(obj, _qualified(obj), module=module, globs={})


def _all_doctests() -> dict[str, doctest.DocTest]:
    tests = {}
    for name in MODULES:
        for test in _doctests(importlib.import_module(name), recurse=True):
            if test.examples:  # a docstring without `>>>` has nothing to run
                tests[test.name] = test
    return tests


DOCTESTS = _all_doctests()


@pytest.fixture(autouse=True)
def _combiner_registry(monkeypatch):
    """An example may register a combiner: the registry is restored afterwards."""
    monkeypatch.setattr(combiners, "_BY_NAME", dict(combiners._BY_NAME))
    monkeypatch.setattr(combiners, "_BY_CLASS_NAME", dict(combiners._BY_CLASS_NAME))


def test_the_public_objects_are_found():
    assert {"tf_adasum.optimizer.AdasumOptimizer", "tf_adasum.reference", "tf_adasum.launch.launch"} <= set(PUBLIC)
    assert len(PUBLIC) > 40, sorted(PUBLIC)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_public_object_has_an_example(name):
    obj = PUBLIC[name]
    docstring = inspect.getdoc(obj) or ""
    assert re.search(r"^Examples:$", docstring, re.M), f"{name}: its docstring has no `Examples:` section"
    tests = _doctests(obj, recurse=False)
    assert tests and tests[0].examples, f"{name}: its `Examples:` section has no `>>>` example"
    assert tests[0].name in DOCTESTS


@pytest.mark.parametrize("name", sorted(DOCTESTS))
def test_the_example_runs(name):
    test = DOCTESTS[name]
    test.globs = {}  # fresh for this run
    output = []
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    result = runner.run(test, out=output.append)
    assert result.attempted > 0
    assert result.failed == 0, f"{name}: its example failed:\n" + "".join(output)


def test_no_docstring_uses_the_example_heading_that_renders_as_a_quote():
    """``Example:`` is a plain admonition for griffe: its ``>>>`` lines become
    nested quotes on the site. ``Examples:`` is parsed into code blocks."""
    finder = doctest.DocTestFinder(exclude_empty=False)
    wrong = []
    for name in MODULES:
        module = importlib.import_module(name)
        for test in finder.find(module, name, module=module, globs={}):
            if test.docstring and re.search(r"^\s*Example:\s*$", test.docstring, re.M):
                wrong.append(test.name)
    assert not wrong, f"use `Examples:` in: {wrong}"


def test_examples_print_no_tensor_repr():
    """A tensor's repr (``<tf.Tensor ...>``) hides the values in its dtype's
    noise and is fragile; the examples print numpy values or plain ones."""
    wrong = [
        name
        for name, test in DOCTESTS.items()
        for example in test.examples
        if example.want.lstrip().startswith(("<tf.Tensor", "<tf.Variable"))
    ]
    assert not wrong, f"print `.numpy()` instead of a tensor in: {wrong}"
