"""What the documentation tests read from the repository: the committed
JSON-lines records under docs/, the guides' pages, and the benchmark scripts
(loaded as modules, for the functions that made a page's tables)."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def records(path) -> list[dict]:
    """The JSON objects of a JSON-lines file, `path` relative to the
    repository's root or absolute (blank lines skipped)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def page(path, collapse: bool = True) -> str:
    """A page's (or any text file's) text, `path` relative to the
    repository's root or absolute, its whitespace collapsed (the guides wrap
    their paragraphs) unless `collapse` is false."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    return " ".join(text.split()) if collapse else text


def load_script(path) -> object:
    """A script (a benchmark, a test worker) as a module, for its constants
    and functions; `path` relative to the repository's root or absolute."""
    path = os.path.join(ROOT, path)
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark(name: str) -> object:
    """``benchmarks/<name>.py`` as a module."""
    return load_script(os.path.join("benchmarks", f"{name}.py"))


def tables(path) -> list[tuple[str, list[str]]]:
    """The Markdown tables of a page, in page order: each as its header line
    and its body rows (the separator line left out), so that a test can
    check a table has exactly the rows of its records."""
    found, lines = [], page(path, collapse=False).splitlines()
    for i, line in enumerate(lines[:-1]):
        separator = lines[i + 1].strip()
        table = separator.startswith("|") and "-" in separator and set(separator) <= set("|-: ")
        if table and line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")):
            body = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                body.append(row)
            found.append((line, body))
    return found


def table_rows(path, header_start) -> list[str]:
    """The body rows of the one table of `path` whose header line starts
    with `header_start`."""
    (rows,) = [body for header, body in tables(path) if header.startswith(header_start)]
    return rows
