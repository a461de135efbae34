"""Provenance (`tf_adasum.eval.provenance`): every record names its date, the
commit, the processor and the command; a benchmark's records, printed by a
real run of benchmarks/collective.py, carry them."""

import datetime
import itertools
import json
import os
import platform
import re
import shlex
import subprocess
import sys

import committed
import pytest
from multiprocess import worker_env

from tf_adasum.eval import cli, provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_CHECKOUT = os.path.exists(os.path.join(ROOT, ".git"))
COMMIT = r"[0-9a-f]{7,}(-dirty)?" if IN_CHECKOUT else ""
#: The vector extension on x86, else the architecture.
PROCESSOR = r".+, (AVX-512|AVX2|no AVX2)" if platform.machine() in ("x86_64", "AMD64") else r".+, " + platform.machine()


def test_fields_name_date_commit_processor_and_command():
    fields = provenance.fields("python benchmarks/soak.py --minutes 1")
    assert sorted(fields) == ["command", "commit", "date", "processor"]
    assert fields["command"] == "python benchmarks/soak.py --minutes 1"
    date = datetime.datetime.fromisoformat(fields["date"])
    assert date.tzinfo is not None and abs(datetime.datetime.now(datetime.timezone.utc) - date).total_seconds() < 60
    assert re.fullmatch(COMMIT, fields["commit"]), fields["commit"]
    assert re.fullmatch(PROCESSOR, fields["processor"]), fields["processor"]


def test_the_command_is_written_from_the_repository_root(monkeypatch):
    for name in provenance.PATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    script = os.path.join(ROOT, "benchmarks", "mpi_native.py")
    assert provenance.command_line(script, ["--sizes", "1 2"]) == "python benchmarks/mpi_native.py --sizes '1 2'"
    assert provenance.command_line("/elsewhere/x.py", ["-v"]) == "python /elsewhere/x.py -v"


def test_the_command_names_the_variables_that_choose_the_code_path(monkeypatch):
    """A run under ``TF_ADASUM_WORKER_TRANSPORT=collective`` (or without the
    native kernels or MPI ops) measured other code: its command says so, in
    `PATH_VARIABLES` order, whichever script or the evaluation wrote it."""
    for name in provenance.PATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TF_ADASUM_WORKER_TRANSPORT", "collective")
    monkeypatch.setenv("TF_ADASUM_CPU_KERNELS", "0")
    script = os.path.join(ROOT, "benchmarks", "soak.py")
    assert provenance.command_line(script, ["--minutes", "1"]) == (
        "TF_ADASUM_CPU_KERNELS=0 TF_ADASUM_WORKER_TRANSPORT=collective python benchmarks/soak.py --minutes 1"
    )
    assert provenance.fields()["command"].startswith("TF_ADASUM_CPU_KERNELS=0 TF_ADASUM_WORKER_TRANSPORT=collective ")
    assert provenance.with_path_variables("tf-adasum eval --preset quick", {"TF_ADASUM_MPI_NATIVE": "0"}) == (
        "TF_ADASUM_MPI_NATIVE=0 tf-adasum eval --preset quick"
    )


def test_the_vector_extension_is_the_widest_offered():
    assert provenance.vector_extension({"avx2", "avx512f", "avx512bw"}) == "AVX-512"
    assert provenance.vector_extension({"avx", "avx2"}) == "AVX2"
    assert provenance.vector_extension({"avx"}) == "no AVX2"
    assert provenance.vector_extension(set()) == "no AVX2"


#: The package's other TF_ADASUM_* variables: where files go, deadlines, ports,
#: and what the launcher tells its workers; none chooses the code a run measures.
NOT_PATH_VARIABLES = {
    "TF_ADASUM_CACHE_DIR",
    "TF_ADASUM_ELASTIC_ROUND",
    "TF_ADASUM_EMULATED_HOSTS",
    "TF_ADASUM_LOGICAL_REPLICAS",
    "TF_ADASUM_MPI_TIMEOUT",
    "TF_ADASUM_WORKER_PORT_OFFSET",
}


def test_every_variable_of_the_package_is_a_path_variable_or_not():
    """A new TF_ADASUM_* variable must be sorted here: one that chooses the
    code a run takes goes into `PATH_VARIABLES`, so records name it."""
    package = os.path.join(ROOT, "tf_adasum")
    named = set()
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                source = committed.page(os.path.join(folder, name), collapse=False)
                named |= set(re.findall(r"[\"'](TF_ADASUM_[A-Z0-9_]+)[\"']", source))
    assert set(provenance.PATH_VARIABLES).isdisjoint(NOT_PATH_VARIABLES)
    assert named == set(provenance.PATH_VARIABLES) | NOT_PATH_VARIABLES, sorted(named)


def test_the_evaluations_command_names_the_path_variables(monkeypatch):
    for name in provenance.PATH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert cli.command_of(["--preset", "quick", "--out", "a b"]) == "tf-adasum eval --preset quick --out 'a b'"
    monkeypatch.setenv("TF_ADASUM_MPI_NATIVE", "0")
    assert cli.command_of(["--engine", "mpi"]) == "TF_ADASUM_MPI_NATIVE=0 tf-adasum eval --engine mpi"
    assert cli.command_of(["--seed", "0"], "python -m tf_adasum.eval") == (
        "TF_ADASUM_MPI_NATIVE=0 python -m tf_adasum.eval --seed 0"
    )


def _path_variables(command):
    """The ``NAME=VALUE`` words before a record's command, as a dict."""
    words = shlex.split(command)
    return dict(
        word.split("=", 1) for word in itertools.takewhile(lambda w: re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w), words)
    )


def test_a_benchmark_record_carries_its_provenance():
    argv = ["--engine", "local", "--replicas", "2", "--sizes", "4096", "--repeats", "1", "--min-seconds", "0"]
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "collective.py"), *argv],
        env={k: v for k, v in worker_env().items() if k not in provenance.PATH_VARIABLES},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1, result.stdout
    record = records[0]
    assert record["command"] == "python benchmarks/collective.py " + " ".join(argv)
    assert re.fullmatch(COMMIT, record["commit"]) and record["processor"] == provenance.processor(), record
    assert datetime.datetime.fromisoformat(record["date"]).date() == datetime.datetime.now(datetime.timezone.utc).date()


#: Benchmark tables in the guide and the committed records they are generated from.
TABLES = [
    ("docs/benchmarks/collective_loopback.jsonl", "docs/guide/benchmarks.md"),
    ("docs/benchmarks/collective_sweep.jsonl", "docs/guide/benchmarks.md"),
    ("docs/benchmarks/collective_compressed.jsonl", "docs/guide/benchmarks.md"),
    ("docs/benchmarks/collective_mpi_loopback.jsonl", "docs/guide/benchmarks.md"),
    ("docs/benchmarks/collective_tf_collective_ops.jsonl", "docs/guide/benchmarks.md"),
    ("docs/cluster/collective_links_pipelined.jsonl", "docs/guide/cluster.md"),
    ("docs/cluster/collective_links_compressed_pipelined.jsonl", "docs/guide/cluster.md"),
    ("docs/cluster/collective_links_pipelined_avx512.jsonl", "docs/guide/cluster.md"),
]


@pytest.mark.parametrize("records, page", TABLES)
def test_a_benchmark_table_is_its_records(records, page):
    """The guide shows `collective.py --table` of the committed records, and
    every record names its date, commit, processor and command."""
    collective = committed.benchmark("collective")
    rows = committed.records(records)
    assert rows and all({"date", "commit", "processor", "command"} <= set(r) for r in rows), records
    text = committed.page(page, collapse=False)
    assert collective.table(rows) in text, f"{page} does not show the table of {records}"
    for row in rows:  # every command that made its rows, with its commit and date
        assert row["command"] in text and row["commit"] in text and row["date"][:10] in text, row["command"]


def test_the_cost_model_section_quotes_the_fit_of_the_sweeps_records():
    """The guide's fitted constants are `cost_model.fit` of the committed N sweep."""
    cost_model = committed.benchmark("cost_model")
    rows = committed.records("docs/benchmarks/collective_sweep.jsonl")
    text = committed.page("docs/guide/benchmarks.md")
    a, u, a_ring, u_ring = cost_model.fit([r for r in rows if r["engine"] == "workers"], 2)
    quoted = (
        f"the tree {a * 1e3:.2f} ms per message (`a`) and {1e-9 / u:.2f} GB/s",
        f"the ring {a_ring * 1e3:.2f} ms per message (`a'`) and {1e-9 / u_ring:.2f} GB/s",
    )
    for figure in quoted:
        assert figure in text, figure
    local_latency, *_ = cost_model.fit([r for r in rows if r["engine"] == "local"], 2)
    assert f"fit's latency, {local_latency * 1e6:.0f} µs" in text


def test_the_cost_models_extrapolations_are_its_fits():
    """The Adasum/ring ratios the guide quotes, one replica per machine, from
    the fits to the committed N sweep (at 1, 16 and 64 MiB unless it names a size)."""
    cost_model = committed.benchmark("cost_model")
    rows = committed.records("docs/benchmarks/collective_sweep.jsonl")
    text = committed.page("docs/guide/benchmarks.md")
    fitted = {engine: cost_model.fit([r for r in rows if r["engine"] == engine], 2) for engine in ("workers", "local")}

    def ratios(engine, replicas, sizes=(1, 16, 64)):
        predicted = [cost_model.predict(fitted[engine], n, mib << 20, None) for n in replicas for mib in sizes]
        return _span([tree / ring for tree, ring in predicted], "x")

    quoted = (
        f"Adasum's tree costs {ratios('workers', [4], (16, 64))} TensorFlow's CPU ring at N = 4 and "
        f"{ratios('workers', [16], (16, 64))} at N = 16 (both at 16 and 64 MiB), {ratios('workers', [64])} at "
        f"N = 64 and {ratios('workers', [1024])} at N = 1,024",
        f"N = 3 (a fold: two whole buffers more) is the worst case, {ratios('workers', [3])}.",
        f"the tree at {ratios('local', [4, 8, 16])} the ring at N = 4, 8 and 16 ({ratios('local', [3])} at N = 3)",
    )
    for figure in quoted:
        assert figure in text, figure
    # The 2026-12-04 fit, whose records were not kept: time to accuracy's defaults, and their ratio at N = 4.
    c = committed.benchmark("time_to_accuracy").DEFAULT_CONSTANTS
    fitted["defaults"] = (c["a"], c["u"], c["a_ring"], c["u_ring"])
    defaults = (
        f"`a` = {c['a'] * 1e3:.2f} ms, `1/u` = {1e-9 / c['u']:.2f} GB/s, `a'` = {c['a_ring'] * 1e3:.2f} ms, "
        f"`1/u'` = {1e-9 / c['u_ring']:.2f} GB/s, and {ratios('defaults', [4])} the ring at N = 4"
    )
    assert defaults in text, defaults


def test_the_cluster_guides_link_tables_are_their_records():
    """The tables of the collective against the link, each row of both forms
    (ratios, milliseconds), as its record in
    `docs/cluster/collective_links.jsonl` gives it, and the figures the
    bullets beside them quote."""
    text = committed.page("docs/guide/cluster.md", collapse=False)
    names = {"workers": "worker processes", "mpi": "mpirun"}
    records = committed.records("docs/cluster/collective_links.jsonl")
    rows = {}
    for r in records:
        rows.setdefault((r["engine"], r["replicas"], r["link"]), {})[r["bytes"] >> 20] = r
    assert len(rows) == 10, sorted(rows)
    shown = {}  # link -> the rows of its two tables (ratios, milliseconds), as the records give them
    for (engine, n, link), by_size in rows.items():
        small, large = by_size[16], by_size[64]
        ratios = " | ".join(
            f"{r['ratio_to_link_floor']:.2f}, {r['native_ratio_to_link_floor']:.2f}" for r in (small, large)
        )
        speedups = ", ".join(f"{r['adasum_ms'] / r['compressed_ms']:.2f}x" for r in (small, large))
        fields = ("link_floor_ms", "adasum_ms", "native_ms", "compressed_ms")
        ms = " | ".join(", ".join(f"{r[k]:.0f}" for k in fields) for r in (small, large))
        pair = shown.setdefault(link, ([], []))
        pair[0].append(f"| {names[engine]} | {n} | {ratios} | {speedups} |")
        pair[1].append(f"| {names[engine]} | {n} | {ms} |")
    # The page's four tables, in order: ratios then milliseconds at 1 Gbit/s, then at 4 Gbit/s.
    tables = [
        sorted(body)
        for header, body in committed.tables("docs/guide/cluster.md")
        if header.startswith("| engine | N | 16 MiB: ")
    ]
    assert tables == [sorted(rows) for rows in (*shown["1gbit"], *shown["4gbit"])], tables  # no row twice or left out
    for command in {r["command"] for r in records}:
        assert command in text, command
    (commit,) = {r["commit"] for r in records}
    (processor,) = {r["processor"] for r in records}
    assert f"({processor}), float32, one process per host, at commit {commit}" in " ".join(text.split())

    prose = committed.page("docs/guide/cluster.md")

    def span(key="ratio_to_link_floor", unit="x", **match):
        return _span_of(records, key, unit, **match)

    one, two_four = ("1gbit",), (2, 4)
    speedup = lambda r: r["adasum_ms"] / r["compressed_ms"]  # noqa: E731
    native = "native_ratio_to_link_floor"
    plain_sum = lambda r: r["rvh_sum_ms"] / r["link_floor_ms"]  # noqa: E731
    after = _pipelined_runs_at_1gbit()
    quoted = (
        f"TF's ring {span(native, link=one, replicas=two_four, engine=('workers',))}",
        f"MPI's `Allreduce` from numpy {span(native, link=one, replicas=two_four, engine=('mpi',))}",
        f"the same trees took {_span([r['ratio_to_link_floor'] for r in after], 'x')} at these N",
        f"{span(link=one, replicas=(8,))} for Adasum, {span(native, link=one, replicas=(8,))} "
        "for the native all-reduce",
        f"makes Adasum {span(speedup, link=one, replicas=two_four, engine=('workers',))} faster on the worker",
        f"MPI it gains {span(speedup, link=one, replicas=two_four, engine=('mpi',))} up to N = 4",
        f"took about as long or longer: {span(plain_sum, link=one, replicas=two_four)}",
        f"less, or loses: {span(speedup, replicas=(8,))} with 8 processes, "
        f"{span(speedup, link=('4gbit',))} at 4 Gbit/s",
    )
    for figure in quoted:
        assert figure in prose, figure
    benchmarks = committed.page("docs/guide/benchmarks.md")
    assert (
        f"it made Adasum {span(speedup, link=one, replicas=two_four, engine=('workers',))} faster on the worker "
        f"transport and {span(speedup, link=one, replicas=two_four, engine=('mpi',))} under MPI, up to 4 hosts"
    ) in benchmarks
    engines = committed.page("docs/guide/engines.md")
    assert (
        f"the bfloat16 wire made Adasum {span(speedup, link=one, replicas=two_four, engine=('workers',))} faster "
        f"across worker processes and {span(speedup, link=one, replicas=two_four, engine=('mpi',))} under mpirun at "
        f"N = 2 and 4, and {span(speedup, link=one, replicas=(8,))} at N = 8"
    ) in engines
    # "1.06-1.13x ... with one exception": every row at N = 2 and 4, 1 Gbit/s, but one.
    small = sorted(r["ratio_to_link_floor"] for r in records if r["link"] == "1gbit" and r["replicas"] in two_four)
    assert f"Adasum took {small[0]:.2f}-{small[-2]:.2f}x the link floor" in prose
    (slowest,) = [r for r in records if r["link"] == "1gbit" and r["replicas"] in two_four
                  and r["ratio_to_link_floor"] == small[-1]]  # fmt: skip
    assert (slowest["engine"], slowest["replicas"], slowest["bytes"] >> 20) == ("workers", 4, 64)
    assert f"4 x 64 MiB: {small[-1]:.2f}, where TF's ring took {slowest['native_ratio_to_link_floor']:.2f}" in prose
    # "ahead of the native all-reduce in every row but one, where the two are level"
    behind = [r for r in records if r["link"] == "1gbit" and r["replicas"] in two_four and
              r["ratio_to_link_floor"] >= r["native_ratio_to_link_floor"]]  # fmt: skip
    assert (
        len(behind) == 1
        and f"{behind[0]['ratio_to_link_floor']:.2f}" == f"{behind[0]['native_ratio_to_link_floor']:.2f}"
    )
    assert f"2 x 64 MiB: {behind[0]['ratio_to_link_floor']:.2f} both" in prose


def test_the_training_step_table_is_its_records():
    """The guide's training-step ratios are the committed runs', in order."""
    rows = committed.records("docs/benchmarks/optimizer_step.jsonl")
    assert all({"date", "commit", "processor", "command"} <= set(r) for r in rows)
    text = committed.page("docs/guide/benchmarks.md", collapse=False)
    for model, name in (("lenet5", "LeNet-5"), ("mlp10m", "10M MLP")):
        ratios = ", ".join(f"{r['ratio']:.2f}" for r in rows if r["model"] == model)
        assert f"| {name} | {ratios} |" in text, (model, ratios)
    models = {r["model"] for r in rows}
    assert len(committed.table_rows("docs/guide/benchmarks.md", "| model | ratio, three runs |")) == len(models)
    assert rows[0]["command"] in text and rows[0]["date"][:10] in text
    spans = {m: sorted(r["ratio"] for r in rows if r["model"] == m) for m in ("lenet5", "mlp10m")}
    readme = committed.page("README.md")
    lenet, mlp = (f"{spans[m][0]:.2f}-{spans[m][-1]:.2f}x" for m in ("lenet5", "mlp10m"))
    assert f"LeNet-5 {lenet}, a 10M-parameter MLP {mlp}" in readme, (lenet, mlp)


def test_the_soak_table_is_its_records():
    """Each configuration's row is its `soak_summary` record (the worst
    process), and every process ended with the same result."""
    summaries = [r for r in committed.records("docs/benchmarks/soak.jsonl") if r["benchmark"] == "soak_summary"]
    assert len(summaries) == 4 and all({"date", "commit", "processor", "command"} <= set(r) for r in summaries)
    text = committed.page("docs/guide/benchmarks.md", collapse=False)
    for r in summaries:
        assert r["same_result_everywhere"], r
        row = (
            f"| {r['engine']} | {r['processes']} | {r['combines_per_second']:.1f} | "
            f"{r['threads_start']} → {r['threads_end']} | {r['rss_mib_start']:.1f} → {r['rss_mib_end']:.1f} | "
            f"{r['max_rss_growth_mib_per_1000']:.2f}; {r['max_rss_growth_mib_per_1000_second_half']:.2f} |"
        )
        assert row in text, row
    assert len(committed.table_rows("docs/guide/benchmarks.md", "| engine | processes | combines/s |")) == len(
        summaries
    )
    assert summaries[0]["command"] in text and summaries[0]["commit"] in text


def _span(values, unit=""):
    return f"{min(values):.2f}-{max(values):.2f}{unit}"


def _span_of(records, key="ratio_to_link_floor", unit="", **match):
    """`_span` of `key` (a field, or a function of a record) over the records
    whose every field named in `match` is one of its values."""
    return _span(
        [key(r) if callable(key) else r[key] for r in records if all(r[k] in v for k, v in match.items())], unit
    )


def _pipelined_runs_at_1gbit():
    """The pipelined trees' separate runs at 1 Gbit/s, N = 2 and 4 (the worker
    rows before the pipelining, commit 7962123, left out)."""
    rows = committed.records("docs/cluster/collective_links_pipelined.jsonl")
    rows += committed.records("docs/cluster/collective_links_pipelined_avx512.jsonl")
    return [r for r in rows if r["commit"] != "7962123" and r["link"] == "1gbit" and r["replicas"] in (2, 4)]


def test_the_collectives_prose_quotes_its_records():
    """The ranges the benchmarks guide quotes beside its loopback tables are
    the records' own."""
    text = committed.page("docs/guide/benchmarks.md")
    loopback = committed.records("docs/benchmarks/collective_loopback.jsonl")
    assert f"about half its floor ({_span([r['ratio_to_floor'] for r in loopback])})" in text
    sweep = committed.records("docs/benchmarks/collective_sweep.jsonl")
    assert f"within {_span([r['ratio_to_floor'] for r in sweep])} of its floor" in text
    local_1mib = [r["ratio"] for r in sweep if r["engine"] == "local" and r["bytes"] == 1 << 20]
    assert f"on 2-16 local devices ({_span(local_1mib, 'x')})" in text
    large = {
        engine: [r["ratio"] for r in sweep if r["engine"] == engine and r["bytes"] >= 16 << 20]
        for engine in ("local", "workers")
    }
    assert f"costs {_span(large['local'], 'x')} the ring on local devices and {_span(large['workers'], 'x')}" in text
    compressed = committed.records("docs/benchmarks/collective_compressed.jsonl")
    workers = [r["ratio_compressed"] for r in compressed if r["engine"] == "workers"]
    local = {r["replicas"]: f"{r['ratio_compressed']:.2f}x" for r in compressed if r["engine"] == "local"}
    assert f"the float16 wire was {_span(workers, 'x')} slower than full width; on local devices {local[2]}" in text
    assert f"and {local[4]} (N = 4)" in text
    over = {True: {}, False: {}}  # over TF collective ops, or the socket transport: N -> ratio_to_floor
    for r in committed.records("docs/benchmarks/collective_tf_collective_ops.jsonl"):
        transport = _path_variables(r["command"]).get("TF_ADASUM_WORKER_TRANSPORT")
        over[transport == "collective"][r["replicas"]] = r["ratio_to_floor"]
    tf_ops, sockets = over[True], over[False]
    assert (
        f"Over TensorFlow's collective ops Adasum took {tf_ops[2]:.2f} (N = 2) and {tf_ops[4]:.2f} (N = 4) "
        f"times its floor, with the socket transport {sockets[2]:.2f} and {sockets[4]:.2f}" in text
    ), over
    design = committed.page("docs/guide/design.md")
    assert f"Adasum is still at {tf_ops[2]:.2f} and {tf_ops[4]:.2f} times its floor" in design, tf_ops
    engines = committed.page("docs/guide/engines.md")
    across = [r["ratio"] for r in loopback if r["engine"] == "workers"]
    assert f"over this transport takes {_span(across, 'x')} the time of the strategy's own all-reduce" in engines
    assert (
        f"made Adasum {_span(workers, 'x')} slower than full width across localhost worker processes, and "
        f"{local[2]} (N = 2) and {local[4]} (N = 4) slower on local devices" in engines
    )


def _lacking(record):
    """The provenance a record lacks: a field, the processor's vector
    extension, or a commit as `provenance.commit` writes it (not a
    hand-written ``+changes``)."""
    lacking = {k for k in ("date", "commit", "processor", "command") if not record.get(k)}
    if record.get("processor") and not re.fullmatch(r".+, (AVX-512|AVX2|no AVX2|\w+)", record["processor"]):
        lacking.add("processor extension")
    if record.get("commit") and not re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", record["commit"]):
        lacking.add("commit as written")
    return lacking


def test_every_committed_record_names_its_date_commit_processor_and_command():
    """Every JSON-lines record under docs/ carries the four fields (a soak
    process's progress lines through their configuration's `soak_summary`),
    as the benchmarks guide says."""
    found = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        for name in files:
            if name.endswith(".jsonl"):
                path = os.path.relpath(os.path.join(folder, name), ROOT)
                rows = committed.records(path)
                summaries = {(r["engine"], r["processes"]) for r in rows if r.get("benchmark") == "soak_summary"}
                found[path] = set().union(
                    *(
                        _lacking(r)
                        for r in rows
                        if not (r.get("benchmark") == "soak" and (r["engine"], r["processes"]) in summaries)
                    )
                )
    assert len(found) > 10, f"too few records under docs/: {sorted(found)}"
    assert {path: fields for path, fields in found.items() if fields} == {}
    text = " ".join(committed.page("docs/guide/benchmarks.md").split())
    assert "Every record committed under `docs/` names its date, commit, processor" in text


def test_the_cluster_guides_pipelined_runs_are_quoted_from_their_records():
    """The bullets beside the table of the pipelined trees on the AVX-512
    processor: its ranges per engine, N and link, and the later run of the
    same trees (the tables of the collective against the link) they are
    compared with."""
    text = committed.page("docs/guide/cluster.md")
    rows = committed.records("docs/cluster/collective_links_pipelined_avx512.jsonl")
    before = committed.records("docs/cluster/collective_links.jsonl")

    one, four, two_four = ("1gbit",), ("4gbit",), (2, 4)
    gaps = [abs(r["rvh_sum_ms"] / r["link_floor_ms"] - r["ratio_to_link_floor"]) for r in rows if r["link"] == "4gbit"]
    # The bar: the four runs of the acceptance rows (this table's three, and the tables above).
    bar = [r for r in rows + before if r["link"] == "1gbit" and r["replicas"] in two_four]
    assert len({(r["commit"], r["date"]) for r in bar if r["engine"] == "mpi"}) == 4
    mpi_16 = {c: _span_of(bar, link=one, replicas=(4,), engine=("mpi",), bytes=(16 << 20,), commit=(c,))
              for c in ("e235003", "fe09cb3")}  # fmt: skip
    assert all(r["ratio_to_link_floor"] <= 1.15 for r in bar if r["engine"] == "mpi" and r["commit"] == "e235003")
    workers_4 = sorted(r["ratio_to_link_floor"] for r in bar if r["engine"] == "workers" and r["replicas"] == 4)
    (fast,) = [r for r in bar if r["engine"] == "workers" and r["ratio_to_link_floor"] == workers_4[0]]
    assert fast in before and fast["bytes"] == 16 << 20 and workers_4[1] > 1.15
    quoted = (
        f"worker processes {_span_of(bar, link=one, replicas=(2,), engine=('workers',))}, "
        f"MPI {_span_of(bar, link=one, replicas=(2,), engine=('mpi',))}",
        "within it at 64 MiB in every run "
        f"({_span_of(bar, link=one, replicas=(4,), engine=('mpi',), bytes=(64 << 20,))}",
        f"at 16 MiB in the two runs at e235003 ({mpi_16['e235003'].replace('-', ', ')}) but not in the two at "
        f"fe09cb3 ({mpi_16['fe09cb3'].replace('-', ', ')})",
        f"The worker processes at N = 4 took {workers_4[1]:.2f}-{workers_4[-1]:.2f} in every run but one row "
        f"(16 MiB in the tables above: {workers_4[0]:.2f})",
        f"Adasum {_span_of(rows, 'ratio_to_link_floor', 'x', replicas=(8,), engine=('workers',))} the floor on the "
        f"worker transport and {_span_of(rows, 'ratio_to_link_floor', 'x', replicas=(8,), engine=('mpi',))} under MPI, "
        f"the native all-reduce {_span_of(rows, 'native_ratio_to_link_floor', 'x', replicas=(8,))}",
        f"took {_span_of(before, 'ratio_to_link_floor', 'x', link=one, replicas=(8,), engine=('workers',))} and "
        f"{_span_of(before, 'ratio_to_link_floor', 'x', link=one, replicas=(8,), engine=('mpi',))}",
        f"**4 Gbit/s**: {_span_of(rows, 'ratio_to_link_floor', 'x', link=four)} the floor, the native all-reduce "
        f"{_span_of(rows, 'native_ratio_to_link_floor', 'x', link=four)}",
        f"in the tables above the same trees took {_span_of(before, unit='x', link=four, replicas=two_four)}",
        f"took {_span([r['rvh_sum_ms'] / r['link_floor_ms'] for r in rows if r['link'] == '4gbit'], 'x')} "
        f"(`rvh_sum / floor`), within {sorted(gaps)[-2]:.2f} of Adasum in every row but one",
    )
    for figure in quoted:
        assert figure in text, figure


def test_the_readmes_cluster_figures_are_the_pipelined_records():
    """The README's 1 Gbit/s line: every row of the pipelined trees at N = 2
    and 4, the collective against the link's among them (the worker rows
    before the pipelining, commit 7962123, left out), and the bfloat16 wire's
    speed-up at N = 2 and 4."""
    readme = committed.page("README.md")
    links = committed.records("docs/cluster/collective_links.jsonl")
    before = [r for r in links if r["link"] == "1gbit" and r["replicas"] < 8]
    after = _pipelined_runs_at_1gbit() + before
    runs = {(r["command"], r["commit"], r["date"][:16]) for r in after}
    assert len({r["date"][:10] for r in after}) == 1, "the README names one date"
    processors = {r["processor"] for r in after}
    count = {1: "one", 2: "two", 3: "three"}[len(processors)]
    ahead = [r for r in after if r["ratio_to_link_floor"] < r["native_ratio_to_link_floor"]]
    behind = max(r["ratio_to_link_floor"] - r["native_ratio_to_link_floor"] for r in after)
    ratios = {n: _span([r["ratio_to_link_floor"] for r in after if r["replicas"] == n], "x") for n in (2, 4)}
    # The command shown stands for every run's: the collective on 1 Gbit/s links, its engines among the two.
    for command, _, _ in runs:
        engines = re.search(r"--engine ((?:\w+ )+)", command).group(1).split()
        assert command.startswith("python benchmarks/collective.py ") and "--link 1gbit" in command, command
        assert set(engines) <= {"workers", "mpi"}, command
    quoted = (
        "(`python benchmarks/collective.py --engine workers mpi --link 1gbit ...`; "
        f"{after[0]['date'][:10]}, {len(after)} rows of {len(runs)} runs on {count} processors)",
        f"Adasum took {ratios[2]} the link floor 2(N-1)/N x S / B at N = 2 and {ratios[4]} at N = 4",
        f"ahead of the native all-reduce ({_span([r['native_ratio_to_link_floor'] for r in after], 'x')}) in "
        f"{len(ahead)} rows and at most {behind:.2f} behind it in the others",
        f"the bfloat16 wire cut its time {_span([r['adasum_ms'] / r['compressed_ms'] for r in before], 'x')}",
    )
    for figure in quoted:
        assert figure in readme, figure
