"""The documentation: the site builds offline with warnings as errors, every
internal link and image of the built site and of the README resolves, and the
API reference documents every name in `tf_adasum.__all__` with its docstring.

The build is `make docs`'s command (mkdocs, strict mode); inside a network
namespace of its own where the system allows one (`unshare --net`), so a build
that reached for the network would fail here.
"""

from __future__ import annotations

import html
import html.parser
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys
import urllib.parse

import committed
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
# A Markdown link or image: [text](target) or ![alt](target); the target ends at
# the first space (a title may follow) or the closing parenthesis.
_MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site built into a temporary folder, as `make docs` builds it."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: `make install` brings it (the `docs` extra)")
    out = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    if _can_unshare_network():
        command = ["unshare", "--net", *command]
    result = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert result.returncode == 0, f"`mkdocs build --strict` failed:\n{result.stdout}\n{result.stderr}"
    return out


def _can_unshare_network() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0


class _Page(html.parser.HTMLParser):
    """The link targets (href, src) and element ids of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id":
                self.ids.add(value)
            elif name in ("href", "src"):
                self.targets.append(value)


def _parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _is_external(target: str) -> bool:
    return bool(urllib.parse.urlsplit(target).scheme) or target.startswith("//")


@pytest.fixture(scope="module")
def pages(site) -> dict[pathlib.Path, _Page]:
    """Every built HTML page, parsed once."""
    return {path: _parse(path) for path in site.rglob("*.html")}


@pytest.mark.slow
def test_every_internal_link_and_image_of_the_site_resolves(site, pages):
    broken = []
    for path, page in pages.items():
        for target in page.targets:
            if _is_external(target):
                continue
            parts = urllib.parse.urlsplit(target)
            relative_to = site if parts.path.startswith("/") else path.parent  # 404.html links from the root
            resolved = (relative_to / urllib.parse.unquote(parts.path).lstrip("/")).resolve() if parts.path else path
            if resolved.is_dir():
                resolved = resolved / "index.html"
            if not resolved.is_file():
                broken.append(f"{path.relative_to(site)}: {target} (no file)")
            elif parts.fragment and resolved.suffix == ".html":
                if urllib.parse.unquote(parts.fragment) not in pages[resolved].ids:
                    broken.append(f"{path.relative_to(site)}: {target} (no such anchor)")
    assert not broken, "broken links in the built site:\n" + "\n".join(broken)
    assert len(pages) > 10, f"the site has only {len(pages)} pages"


@pytest.mark.slow
def test_every_figure_in_docs_is_shown_by_a_page(site, pages):
    # That each shown image resolves is checked above; here, that no shipped figure is orphaned,
    # by its path (several folders hold an accuracy.png and a scaling.png).
    shown = set()
    for path, page in pages.items():
        for target in page.targets:
            parts = urllib.parse.urlsplit(target)
            if parts.path.endswith(".png") and not _is_external(target):
                relative_to = site if parts.path.startswith("/") else path.parent
                shown.add((relative_to / parts.path.lstrip("/")).resolve().relative_to(site.resolve()))
    assert shown, "no page shows an image"
    shipped = {p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.png")}
    assert shipped <= shown, f"figures in docs/ that no page shows: {sorted(map(str, shipped - shown))}"


@pytest.mark.slow
def test_the_api_reference_documents_every_public_name(site):
    import tf_adasum

    words = " ".join(_words(_text(site / "reference" / "api.html")))
    missing = []
    for name in tf_adasum.__all__:
        if name == "__version__":
            if "__version__" not in words:
                missing.append(name)
            continue
        obj = getattr(tf_adasum, name)
        qualified = obj.__name__ if inspect.ismodule(obj) else f"{obj.__module__}.{obj.__qualname__}"
        summary = " ".join(_words(inspect.getdoc(obj).split("\n\n")[0])[:12])
        if " ".join(_words(qualified)) not in words:
            missing.append(f"{name} ({qualified} has no entry)")
        elif summary not in words:
            missing.append(f"{name} (its docstring's summary is not shown: {summary!r})")
    assert not missing, "the API reference lacks:\n" + "\n".join(missing)


@pytest.mark.slow
def test_the_api_reference_shows_signatures_and_examples_as_code(site):
    """Each public class with its signature (its ``__init__``'s), and every
    ``>>>`` example in a code block that keeps its prompts: not a quote
    (griffe's ``Example:`` admonition), not raw HTML (a ``<tf.Tensor ...>``
    repr outside code)."""
    import tf_adasum

    path = site / "reference" / "api.html"
    page = path.read_text(encoding="utf-8")
    assert "<blockquote" not in page, "an example renders as a quote: its section must be `Examples:`"
    assert not re.search(r"<tf\.", page), "a repr such as <tf.Tensor ...> is raw HTML in the API reference"
    in_code = sum(block.count("&gt;&gt;&gt;") for block in re.findall(r"<pre>.*?</pre>", page, re.S))
    assert in_code > 50 and in_code == page.count("&gt;&gt;&gt;"), "a `>>>` prompt outside a code block"
    text = _text(path)
    for name in tf_adasum.__all__:
        obj = getattr(tf_adasum, name, None)
        if inspect.isclass(obj):
            first = next(iter(inspect.signature(obj).parameters))
            signature = rf"\b{name} ?\( ?{first} ?:"  # the page's text: a space where a tag was
            assert re.search(signature, text), f"the API reference shows no signature of {name}"
    for module in ("combiners", "mpi", "reference"):  # their module docstrings' examples
        example = rf">>> ?from ?tf_adasum ?import ?{module}\b"
        assert re.search(example, text), f"tf_adasum.{module}'s example is not shown"


def _text(path: pathlib.Path) -> str:
    raw = re.sub(r"<[^>]+>", " ", path.read_text(encoding="utf-8"))
    return re.sub(r"\s+", " ", html.unescape(raw))


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9_]+", text)


def test_every_relative_link_of_the_readme_resolves():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    broken = []
    for target in _MARKDOWN_LINK.findall(readme):
        if _is_external(target) or target.startswith("#"):
            continue
        path = urllib.parse.unquote(urllib.parse.urlsplit(target).path)
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to a guide page in docs/guide/"
    )


def test_every_environment_variable_the_package_reads_is_in_the_table():
    table = (ROOT / "docs" / "guide" / "environment.md").read_text(encoding="utf-8")
    read = set()
    for path in (ROOT / "tf_adasum").rglob("*.py"):
        read.update(re.findall(r"\b(TF_ADASUM_[A-Z_]+)\b", path.read_text(encoding="utf-8")))
    missing = sorted(name for name in read if f"`{name}`" not in table)
    assert not missing, f"docs/guide/environment.md does not list: {missing}"


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_public_api_lists_match_all(page):
    """The "public API" sentence of the README and the home page names every
    public name (`tf_adasum.__all__` but `__version__`), and nothing else."""
    import tf_adasum

    text = (ROOT / page).read_text(encoding="utf-8")
    start = text.index("The public API")
    sentence = text[start : text.index("\n\n", start)]
    sentence = re.sub(r"\([^)]*\)", "", sentence)  # asides in parentheses name other things
    named = {name.removeprefix("tf_adasum.") for name in re.findall(r"`([\w.]+)`", sentence)}
    assert named == set(tf_adasum.__all__) - {"__version__"}, f"{page}: {sentence!r}"


# Words that announce work as still to come: a page that says so about a piece
# of work already published contradicts the page that publishes it.
_STALE_PHRASES = re.compile(r"\b(is planned|are planned|planned \(issue|not yet published|to be published)\b", re.I)


def test_no_page_announces_work_as_still_to_come():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in pages
        if page.name != "changelog.md"
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
        if _STALE_PHRASES.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_api_references_name_table_is_all():
    """The API reference's table of `tf_adasum.` names lists `__all__`, each
    with the module that defines it."""
    import importlib

    import tf_adasum

    text = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| \[`(\w+)`\]\(#[\w.]+\) \| `?([\w./]+)`? \|", text, re.M)
    assert sorted(name for name, _ in rows) == sorted(tf_adasum.__all__), rows
    for name, where in rows:
        value = getattr(tf_adasum, name)
        if where == "module":
            assert importlib.import_module(f"tf_adasum.{name}") is value, name
        elif not where.endswith(".py"):
            assert value.__module__ == where, (name, value.__module__, where)


#: Every table of measured figures in the README and the guide, by its page
#: and header line, with how many tables share that header there and the
#: test (file and function) that checks them against their committed
#: records. A new table of figures fails the test below until it is here.
MEASURED_TABLES = {
    ("README.md", "| method | N=1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 | 256 | largest N, every seed |"): (
        1,
        "test_eval.py::test_replica_tables_are_their_records",
    ),
    ("README.md", "| combiner | link | N=1 | 2 | 4 | 8 | 16 | 32 | 64 |"): (
        1,
        "test_doc_records.py::test_the_time_to_accuracy_figures_are_the_scripts_output",
    ),
    ("docs/guide/benchmarks.md", "| engine | N | buffer | adasum_ms | native_ms | ratio | rvh_sum_ms | dots_ms |"): (
        5,
        "test_provenance.py::test_a_benchmark_table_is_its_records",
    ),
    ("docs/guide/benchmarks.md", "| model | ratio, three runs | acceptance bar (issue 11) |"): (
        1,
        "test_provenance.py::test_the_training_step_table_is_its_records",
    ),
    ("docs/guide/benchmarks.md", "| engine | link | N | MiB | adasum: measured / predicted ms (ratio) |"): (
        1,
        "test_link_model.py::test_the_guide_holds_the_table",
    ),
    ("docs/guide/benchmarks.md", "| engine | processes | combines/s | threads start → end |"): (
        1,
        "test_provenance.py::test_the_soak_table_is_its_records",
    ),
    ("docs/guide/choosing.md", "| method | N="): (
        5,
        "test_choosing_settings.py::test_every_accuracy_table_is_the_generated_tables_cells",
    ),
    ("docs/guide/cluster.md", "| engine | N | 16 MiB: "): (
        4,
        "test_provenance.py::test_the_cluster_guides_link_tables_are_their_records",
    ),
    ("docs/guide/cluster.md", "| engine | N | buffer | link | commit | link_floor_ms | adasum_ms |"): (
        3,
        "test_provenance.py::test_a_benchmark_table_is_its_records",
    ),
    ("docs/guide/cluster.md", "| pattern | transport | N | buffer | messages |"): (
        1,
        "test_bare_exchange.py::test_the_cluster_guide_shows_the_records_table_and_quotes_their_figures",
    ),
    ("docs/guide/elastic.md", "| signal | K | cold start | recovery, median of 5 (range) |"): (
        1,
        "test_doc_records.py::test_the_recovery_table_is_its_records",
    ),
    ("docs/guide/elastic.md", "| row | learning rate through the resize |"): (
        1,
        "test_doc_records.py::test_the_resize_table_is_its_records",
    ),
    ("docs/guide/evaluation.md", "| seed | test accuracy after epochs 1-10 |"): (
        1,
        "test_doc_records.py::test_the_recipe_is_its_records",
    ),
    ("docs/guide/evaluation.md", "| combiner | eff. batch (4 x b) | epochs to 98% |"): (
        1,
        "test_doc_records.py::test_the_quick_preset_is_its_records",
    ),
    ("docs/guide/evaluation.md", "| method | N=1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 | 256 |"): (
        1,
        "test_eval.py::test_replica_tables_are_their_records",
    ),
    ("docs/guide/evaluation.md", "| method | N=32 | 64 | 128 | 256 |"): (
        1,
        "test_eval.py::test_replica_tables_are_their_records",
    ),
    ("docs/guide/evaluation.md", "| method | N | epochs (median) | minutes on 1 GbE |"): (
        1,
        "test_doc_records.py::test_the_time_to_accuracy_figures_are_the_scripts_output",
    ),
    ("docs/guide/evaluation.md", "| replicas | pick | why (the tables above) |"): (
        1,
        "test_doc_records.py::test_the_edge_sweeps_prose_is_its_records",
    ),
    ("docs/guide/evaluation.md", "| combiner | eff. batch"): (
        2,
        "test_doc_records.py::test_the_per_replica_batch_sweep_tables_are_their_records",
    ),
    ("docs/guide/evaluation.md", "| engine | combiner | epochs to 98% |"): (
        1,
        "test_doc_records.py::test_the_runs_across_processes_are_their_records",
    ),
    ("docs/guide/evaluation.md", "| model | N hosts | link | method | measured min/epoch |"): (
        1,
        "test_emulated_training.py::test_the_guides_table_is_the_records",
    ),
}

#: Tables with figures that are not measurements (presets, options, model
#: sizes, tested versions, exit codes), by page and header line.
TABLES_WITHOUT_MEASUREMENTS = {
    ("docs/guide/evaluation.md", "| preset | model / data | target, budget |"),
    ("docs/guide/evaluation.md", "| option | values | default | meaning |"),
    ("docs/guide/evaluation.md", "| model | what it is | parameters |"),
    ("docs/guide/install.md", "| component | tested | notes |"),
    ("docs/guide/security.md", "| Outcome | Launcher's exit code |"),
}

# A cell that is a figure: a number with an optional unit, bold, a bound or a
# range in parentheses after it; or a percentage or ratio with decimals.
_FIGURE_CELL = re.compile(r"(\*\*)?[<>]?\d+(\.\d+)?(%|x| ms| s| min)?(\*\*)?( \(.*\))?")
_FIGURE_IN_CELL = re.compile(r"\d+\.\d+%|\d\.\d\dx")


def _tables_with_figures() -> list[tuple[str, str]]:
    """(page, header line) of every Markdown table in the README and the
    guide with a cell that is a figure."""
    found = []
    for path in [ROOT / "README.md", ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]:
        for header, body in committed.tables(path):
            cells = [cell.strip() for row in body for cell in row.strip().strip("|").split("|")]
            if any(_FIGURE_CELL.fullmatch(cell) or _FIGURE_IN_CELL.search(cell) for cell in cells):
                found.append((str(path.relative_to(ROOT)), header))
    return found


def test_every_table_of_figures_is_checked_against_its_records():
    """Each table of figures in the README and the guide is either one the
    registry names, with the test that checks it against its records (that
    test exists, in a file that reads the page), or a table without
    measurements; and the registry names no table that is gone."""
    found = _tables_with_figures()
    counted = {}
    unknown = []
    for page, header in found:
        keys = [key for key in MEASURED_TABLES if key[0] == page and header.startswith(key[1])]
        if keys:
            longest = max(keys, key=lambda key: len(key[1]))  # the most specific header
            counted[longest] = counted.get(longest, 0) + 1
        elif not any(key[0] == page and header.startswith(key[1]) for key in TABLES_WITHOUT_MEASUREMENTS):
            unknown.append(f"{page}: {header}")
    assert not unknown, f"tables of figures no test is named for (add them to MEASURED_TABLES): {unknown}"
    stale = [
        key for key in TABLES_WITHOUT_MEASUREMENTS if not any(p == key[0] and h.startswith(key[1]) for p, h in found)
    ]
    assert not stale, f"TABLES_WITHOUT_MEASUREMENTS names tables that are gone: {stale}"
    assert counted == {key: count for key, (count, _) in MEASURED_TABLES.items()}
    for (page, _), (_, test) in MEASURED_TABLES.items():
        file, function = test.split("::")
        source = (ROOT / "tests" / file).read_text(encoding="utf-8")
        assert f"\ndef {function}(" in source, test
        assert page in source or page.split("/")[-1] in source, (test, page)
