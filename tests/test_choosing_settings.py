"""docs/guide/choosing.md stays true to the results it turns into advice.

Every accuracy table of the page copies cells of `summary.replica_table` of
the committed sweeps (`docs/eval_replicas`, `docs/eval_edge`); every figure in
its prose is rebuilt here from its source (the records, through the scripts
that made the guide's tables: `benchmarks/time_to_accuracy.py`,
`summary.largest_reached`; or, for the two figures without committed records,
the guide sentence the page cites) and must appear in the page as written; no
decimal figure in the page escapes these checks; each section that quotes a
figure names a date. The page is in the site's navigation and linked from the
evaluation guide and the home page.
"""

from __future__ import annotations

import pathlib
import re

import committed
import pytest

from tf_adasum.eval import summary
from tf_adasum.eval.config import BASE_LR

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "guide" / "choosing.md"
GUIDE = ROOT / "docs" / "guide"

#: Decimals the page may show unchecked: the target accuracy every sweep uses.
UNCHECKED = {"99.3"}


def _flat(text: str) -> str:
    """Markdown with its line breaks and runs of spaces as single spaces."""
    return re.sub(r"\s+", " ", text)


def _tables(markdown: str) -> list[tuple[set[int], list[tuple[str, object, str]]]]:
    """The tables of `markdown` whose first column is `method` (replica
    tables): each as its line numbers and (label, N or "largest", cell)
    triples, the label without backticks."""
    tables, header = [], None
    for number, line in enumerate(markdown.splitlines()):
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == "method":
            header = [int(c.removeprefix("N=")) if c.removeprefix("N=").isdigit() else "largest" for c in cells[1:]]
            tables.append(({number}, []))
        elif header is not None:
            tables[-1][0].add(number)
            if not set(line.strip()) <= set("|-"):
                tables[-1][1].extend((cells[0].strip("`"), column, cell) for column, cell in zip(header, cells[1:]))
    return tables


def _cells(markdown: str) -> dict[str, dict]:
    """label -> {N or "largest": cell} over the replica tables of `markdown`."""
    rows: dict[str, dict] = {}
    for _, triples in _tables(markdown):
        for label, column, cell in triples:
            rows.setdefault(label, {})[column] = cell
    return rows


@pytest.fixture(scope="module")
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def replicas() -> list[dict]:
    return committed.records("docs/eval_replicas/results.jsonl")


@pytest.fixture(scope="module")
def tables(replicas) -> dict[str, dict]:
    """The generated cells: the replica sweep's rows, then the edge sweep's
    rows that the replica sweep lacks (its variants)."""
    edge = _cells(summary.replica_table(committed.records("docs/eval_edge/results.jsonl")))
    return {**edge, **_cells(summary.replica_table(replicas))}


def _best(cell: str) -> str:
    """The median best accuracy of a cell whose median run missed the target."""
    assert cell.startswith(">"), cell
    return cell.rsplit(", ", 1)[1]


def _median_epochs(cell: str) -> int:
    """The median epochs of a cell whose median run reached the target."""
    return int(re.match(r"\*\*(\d+)\*\*", cell).group(1))


def _range(values: list[float], digits: int = 2) -> str:
    shown = sorted({round(v, digits) for v in values})
    return f"{shown[0]:.{digits}f}-{shown[-1]:.{digits}f}x"


@pytest.fixture(scope="module")
def figures(replicas, tables) -> list[str]:
    """Every figure the page's prose quotes, in the page's own words, rebuilt
    from its source."""
    phrases = []

    # The replica sweep at 128 and 256 (final; the edge's variants there are not quoted).
    best = {(m, n): _best(tables[m][n]) for m in ("adasum", "keras-scaled") for n in (128, 256)}
    assert float(best["keras-scaled", 256][:-1]) > float(best["adasum", 256][:-1])  # "the tuned baseline led"
    phrases.append(
        f"median best accuracy at 128 was {best['adasum', 128]} for Adasum and {best['keras-scaled', 128]} for "
        f"`keras-scaled`; at 256 the tuned baseline led, {best['keras-scaled', 256]} against {best['adasum', 256]}"
    )

    # The edge sweep at N = 64: how many seeds of each method reached the target.
    edge = committed.records("docs/eval_edge/results.jsonl")
    reached = {}
    for r in edge:
        if r["replicas"] == 64:
            method = summary.config_of(r).method
            reached[method] = reached.get(method, 0) + (r["epochs_until_convergence"] != -1)
    assert [m for m, seeds in reached.items() if seeds == 3] == ["lamb-scaled"]  # "only `lamb-scaled` ... every seed"
    words = ("none", "one", "two", "three")
    phrases.append(
        f"plain Adasum reached it with {words[reached['adasum']]} seeds of three, Adasum with the baseline's scaled "
        f"rate (`adasum scaled`) with {words[reached['adasum scaled']]}."
    )

    # Time to accuracy per interconnect: the benchmark's own scores of the replica sweep.
    tta = committed.benchmark("time_to_accuracy")
    rows = tta.scores(replicas, tta.DEFAULT_CONSTANTS)
    score = {(r["link"], r["method"], r["local_steps"], r["replicas"]): r["score"] for r in rows}

    def minutes(link, method, k, n):
        return f"{score[link, method, k, n]:.2f}"

    assert minutes("1 GbE", "adasum", 4, 8) == minutes("1 GbE", "adasum", 1, 8)  # "no gain"
    assert score["10 GbE", "adasum", 4, 8] > score["10 GbE", "adasum", 1, 8]  # "slower there"
    phrases.append(
        f"{minutes('1 GbE', 'adasum', 4, 4)} minutes to 99.3% against {minutes('1 GbE', 'adasum', 1, 4)} at N = 4, "
        f"and {minutes('1 GbE', 'adasum', 4, 8)} against {minutes('1 GbE', 'adasum', 1, 8)} at N = 8 (no gain; "
        "on 10 Gbit/s local steps are slower there), where plain "
        f"Adasum's median run needed {_median_epochs(tables['adasum'][8])} epochs and local steps' "
        f"{_median_epochs(tables['adasum, 4 local steps'][8])}"
    )
    phrases.append(
        f"At N = 32 the model gives {minutes('1 GbE', 'adasum', 1, 32)} minutes to 99.3% for Adasum against "
        f"{minutes('1 GbE', 'keras-scaled', 1, 32)} for `keras-scaled` on 1 Gbit/s Ethernet, and "
        f"{minutes('10 GbE', 'adasum', 1, 32)} against {minutes('10 GbE', 'keras-scaled', 1, 32)} on 10 Gbit/s"
    )

    # Training on emulated hosts: the sweep's median epochs x the measured minutes per epoch.
    timed = committed.records("docs/cluster/training_links.jsonl")
    measured = {
        (r["link"], r["hosts"], r["combiner"], r["local_steps"]): r["measured_minutes"]
        for r in timed
        if r["model"] == "lenet_caffe"
    }

    def to_target(link, n, method, k):
        label = method if k == 1 else f"{method}, {k} local steps"
        return _median_epochs(tables[label][n]) * measured[link, n, method, k]

    def shown(link, n, method, k):
        return f"{to_target(link, n, method, k):.1f}"

    slow = {n: [shown("100mbit", n, m, k) for m, k in (("adasum", 4), ("adasum", 1), ("keras", 1))] for n in (2, 4)}
    phrases.append(
        f"At 100 Mbit/s, 4 local steps reached the target in {slow[2][0]} minutes against {slow[2][1]} (Adasum) "
        f"and {slow[2][2]} (Keras) at N = 2, and in {slow[4][0]} against {slow[4][1]} and {slow[4][2]} at N = 4."
    )

    def saved(n):
        return 1 - to_target("1gbit", n, "adasum", 4) / to_target("1gbit", n, "adasum", 1)

    def two(link, n, method, k):
        return f"{to_target(link, n, method, k):.2f}"

    assert abs(saved(2)) < 0.05 and 0.15 < saved(4) < 0.25, (saved(2), saved(4))  # "nothing", "a fifth"
    assert _median_epochs(tables["adasum, 4 local steps"][2]) == _median_epochs(tables["adasum"][2]) + 1
    combine = [
        1 - r["predicted_compute_minutes"] / r["predicted_minutes"]
        for r in timed
        if r["model"] == "lenet_caffe" and r["link"] == "1gbit" and r["local_steps"] == 1
    ]
    phrases.append(
        f"where the combine was {100 * min(combine):.0f}-{max(combine):.0%} of an epoch, they saved nothing at N = 2 "
        f"({two('1gbit', 2, 'adasum', 4)} minutes against {two('1gbit', 2, 'adasum', 1)}: they took an epoch more "
        f"to the target) and a fifth at N = 4 ({two('1gbit', 4, 'adasum', 4)} against {two('1gbit', 4, 'adasum', 1)})"
    )

    (slowest,) = [r for r in timed if r["ratio"] == max(t["ratio"] for t in timed)]
    assert slowest["local_steps"] > 1 and slowest["link"] == "100mbit"  # "the most with local steps on slow links"
    phrases.append(
        f"Training timed on emulated hosts took {_range([r['ratio'] for r in timed])[:-1]} times the model's"
    )

    # The collective on emulated links: the bfloat16 wire's speed-up and the link floor.
    links = committed.records("docs/cluster/collective_links.jsonl")
    assert {(r["dtype"], r["bytes"], r["compression"]) for r in links} == {
        ("float32", size << 20, "bfloat16") for size in (16, 64)
    }

    def speedups(engines, link, ns):
        chosen = [r for r in links if r["engine"] in engines and r["link"] == link and r["replicas"] in ns]
        assert chosen, (engines, link, ns)
        return _range([r["adasum_ms"] / r["compressed_ms"] for r in chosen])

    assert {r["replicas"] for r in links if r["link"] == "4gbit"} == {2, 4}
    phrases += [
        f"{speedups({'workers'}, '1gbit', {2, 4})} faster across worker processes at N = 2 and 4",
        f"{speedups({'mpi'}, '1gbit', {2, 4})} faster under `mpirun` at N = 2 and 4",
        f"{speedups({'workers', 'mpi'}, '1gbit', {8})} at N = 8",
        f"{speedups({'workers', 'mpi'}, '4gbit', {2, 4})} at 4 Gbit/s (N = 2 and 4)",
    ]

    # The 16-bit wire on loopback.
    loopback = committed.records("docs/benchmarks/collective_compressed.jsonl")
    assert {r["compression"] for r in loopback} == {"float16"}
    local = {r["replicas"]: f"{r['ratio_compressed']:.2f}x" for r in loopback if r["engine"] == "local"}
    phrases.append(
        f"The float16 wire was {_range([r['ratio_compressed'] for r in loopback if r['engine'] == 'workers'])} "
        f"slower than full width across localhost worker processes, and {local[2]} (N = 2) and {local[4]} "
        "(N = 4) slower on local devices"
    )

    def floor(engine, field):
        return _range(
            [r[field] for r in links if r["engine"] == engine and r["link"] == "1gbit" and r["replicas"] in (2, 4)]
        )

    phrases.append(
        f"Adasum's combine took {floor('workers', 'ratio_to_link_floor')} the link's floor across worker processes "
        f"and {floor('mpi', 'ratio_to_link_floor')} under `mpirun`. The native all-reduces took "
        f"{floor('workers', 'native_ratio_to_link_floor')} (TensorFlow's ring) and "
        f"{floor('mpi', 'native_ratio_to_link_floor')} (MPI's `Allreduce`)"
    )
    pipelined = committed.records("docs/cluster/collective_links_pipelined.jsonl")
    pipelined += committed.records("docs/cluster/collective_links_pipelined_avx512.jsonl")
    others = [r["ratio_to_link_floor"] for r in pipelined if r["commit"] != "7962123" and r["replicas"] == 4
              and r["link"] == "1gbit"]  # fmt: skip
    phrases.append(f"at N = 4 other runs of the pipelined trees took up to {max(others):.2f}x")

    # The per-replica-batch sweep: the largest effective batch each method reached, every seed.
    paper = committed.records("docs/eval_paper/results.jsonl")
    assert {r["replicas"] for r in paper} == {4} and len({r["seed"] for r in paper}) == 1  # "4 replicas, one seed"
    largest = {}
    for line in summary.largest_reached(paper):
        found = re.search(r", (\S+) K=(\d+): largest effective batch reaching [\d.]+: (\d+|none)", line)
        largest[found.group(1), int(found.group(2))] = found.group(3)
    assert largest["adacons", 1] == largest["mean", 1] == largest["keras", 1]
    assert largest["adasum", 1] == largest["keras-scaled", 1]
    phrases += [
        f"which the hierarchical mode takes within a worker) reached 99.3% up to effective batch "
        f"{largest['mean', 1]}. Adasum reached it up to {largest['adasum', 1]}",
        f"AdaCons reached 99.3% up to effective batch {largest['adacons', 1]}, as `mean` and `keras` did. "
        f"Adasum reached it up to {largest['adasum', 1]}",
        f"Adasum and `keras-scaled` both reached 99.3% up to effective batch {largest['adasum', 1]}, and `keras` "
        f"up to {largest['keras', 1]}",
    ]

    # The runs across processes: seconds per epoch after the first, per engine.
    def epoch_seconds(engine):
        runs = [
            r
            for r in committed.records("docs/eval_processes/results.jsonl")
            if r["engine"] == engine and r["combiner"] == "adasum"
        ]
        assert len(runs) == 1 and runs[0]["date"].startswith("2026-12-07"), engine
        shown = sorted({f"{s:.1f}" for s in runs[0]["seconds_per_epoch"][1:]}, key=float)
        return shown[0] if len(shown) == 1 else f"{shown[0]}-{shown[-1]}"

    phrases.append(
        f"Adasum's epochs after the first took {epoch_seconds('mpi')} s under `mpirun` and "
        f"{epoch_seconds('tf-collective')} s across worker processes"
    )

    # LAMB's single-worker rate in the edge preset.
    assert BASE_LR["lamb"] == 3e-3
    phrases.append("Keras' `Lamb` at its single-worker rate 3e-3")
    return phrases


#: Figures without committed records: the page quotes the guide sentence that reports them.
CITED = {
    "adacons.md": ["momentum=0.99"],
}


def test_every_accuracy_table_is_the_generated_tables_cells(page, tables):
    page_tables = _tables(page)
    assert len(page_tables) >= 5, "the page's replica tables were not found: has their header changed?"
    for _, triples in page_tables:
        for label, column, cell in triples:
            assert label in tables, f"{label!r} is not a method of the replica or edge sweep"
            assert cell == tables[label].get(column), (
                f"choosing.md shows {label} at {column} as {cell!r}; the records give {tables[label].get(column)!r}"
            )


def test_every_figure_in_the_prose_is_its_source(page, figures):
    text = _flat(page)
    missing = [phrase for phrase in figures if phrase not in text]
    assert not missing, "choosing.md no longer says what the records give:\n" + "\n".join(missing)


def test_figures_without_records_are_the_cited_guides_words(page):
    text = _flat(page)
    for name, phrases in CITED.items():
        source = _flat((GUIDE / name).read_text(encoding="utf-8"))
        for phrase in phrases:
            assert phrase in text, f"choosing.md no longer quotes {phrase!r}"
            if name == "adacons.md":
                assert "the authors' demo uses 0.99" in source
            else:
                assert phrase in source, f"{name} no longer says {phrase!r}"
    engines = _flat((GUIDE / "engines.md").read_text(encoding="utf-8"))
    bounds = re.search(r"at most (\S+) for float16 and (\S+) for bfloat16", engines)
    assert f"float16's relative L2 error to at most {bounds[1]} and bfloat16's to at most {bounds[2]}" in text
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    day = changelog.split("## 2026-12-05", 1)[1].split("\n## ", 1)[0]
    assert "Native encoding of the 16-bit wire" in day, "the changelog's 2026-12-05 no longer adds the native encoding"


def test_no_decimal_figure_escapes_the_checks(page, figures):
    """Every decimal in the page is in a replica table (checked cell by cell)
    or in a checked phrase; link targets aside."""
    in_tables = set().union(*(numbers for numbers, _ in _tables(page)))
    text = _flat("\n".join(line for number, line in enumerate(page.splitlines()) if number not in in_tables))
    for phrase in [*figures, *(p for phrases in CITED.values() for p in phrases)]:
        text = text.replace(phrase, " ")
    text = re.sub(r"\]\([^)]*\)", "]", text)
    unchecked = set(re.findall(r"(?<![\w.])\d+\.\d+", text)) - UNCHECKED
    assert not unchecked, f"choosing.md quotes figures no test checks: {sorted(unchecked)}"


def test_the_sweeps_are_what_the_page_says(page, replicas):
    """The recipe the page describes, and each sweep's date beside its command."""
    text = _flat(page)
    edge = committed.records("docs/eval_edge/results.jsonl")
    for r in replicas + edge:
        assert (r["model"], r["dataset"], r["target"], r["epochs"]) == ("lenet_caffe", "mnist", 0.993, 10)
        assert r["batch_per_replica"] == 64 and r["engine"] == "simulated"
    assert {r["lr"] for r in replicas} == {1e-3} and {r["seed"] for r in replicas} == {0, 1, 2}
    sources = {
        "tf-adasum eval --preset replicas": replicas,
        "tf-adasum eval --preset edge": [r for r in edge if "--preset edge" in r["command"] and r["replicas"] <= 64],
        "tf-adasum eval --preset paper": committed.records("docs/eval_paper/results.jsonl"),
        "python benchmarks/emulated_training.py": committed.records("docs/cluster/training_links.jsonl"),
    }
    quoted = re.findall(r"`([^`]+)`, (20\d\d-\d\d-\d\d(?: and 20\d\d-\d\d-\d\d)*)", text)
    assert {command for command, _ in quoted} >= set(sources), f"choosing.md no longer names its sources: {quoted}"
    for command, date in quoted:
        records = sources.get(command)
        if records is not None:
            dates = sorted({r["date"][:10] for r in records})
            assert dates == date.split(" and "), f"choosing.md dates `{command}` {date}; its records: {dates}"


def test_every_section_with_a_figure_names_a_date(page):
    for section in re.split(r"\n#{2,3} ", page)[1:]:
        heading = section.splitlines()[0]
        figures = set(re.findall(r"(?<![\w.])\d+\.\d+|\*\*\d+\*\*", section)) - UNCHECKED
        if figures and heading not in ("In short", "How to read the tables"):
            assert re.search(r"20\d\d-\d\d-\d\d", section), f"section {heading!r} quotes figures without a date"


def test_the_page_is_linked():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "- Choosing settings: guide/choosing.md" in nav
    evaluation = (GUIDE / "evaluation.md").read_text(encoding="utf-8").rstrip().splitlines()
    assert "(choosing.md)" in evaluation[-1]
    assert "(guide/choosing.md)" in (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
