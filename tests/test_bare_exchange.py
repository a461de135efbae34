"""benchmarks/bare_exchange.py: its exchange pattern is the vector-halving
tree's, and it runs over both transports and prints records with their
provenance (on loopback; the cluster guide's records are on emulated links)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import committed
import numpy as np
import pytest
from multiprocess import worker_env

bare = committed.benchmark("bare_exchange")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_each_swap_is_met_by_the_partners_and_moves_the_floors_bytes(n):
    nbytes = 1024
    pattern = {rank: bare.swaps(rank, n, nbytes) for rank in range(n)}
    for rank, steps in pattern.items():
        assert sum(length for *_, length in steps) == 2 * (n - 1) * nbytes // n
        for i, (peer, send_at, receive_at, length) in enumerate(steps):
            assert pattern[peer][i] == (rank, receive_at, send_at, length), (rank, i)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_swaps_are_the_trees_levels(n):
    """Level k pairs rank r with r XOR 2^k (`tf_adasum.tree.topology`, no
    fold at a power of two), the rank with that bit set keeps the upper half
    (as `tf_adasum.tree.rvh` does), and the gather retraces the levels."""
    from tf_adasum.tree import topology

    nbytes, levels = 1024, n.bit_length() - 1
    pairs = set(topology.groups(n))
    for rank in range(n):
        steps = bare.swaps(rank, n, nbytes)
        assert len(steps) == 2 * levels
        start = 0
        for k, (peer, send_at, receive_at, length) in enumerate(steps[:levels]):
            assert peer == rank ^ (1 << k) and topology.pair(rank, peer) in pairs
            assert length == nbytes >> (k + 1)
            upper = bool(rank & (1 << k))
            assert receive_at == start + (length if upper else 0) and send_at == start + (0 if upper else length)
            start = receive_at
        assert [s[0] for s in steps[levels:]] == [s[0] for s in reversed(steps[:levels])]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_pattern_with_a_sum_is_an_all_reduce(n):
    """Adding what the reduce-scatter's swaps receive and copying what the
    gather's receive leaves every rank with the sum of every rank's buffer:
    the pattern is the tree's, only the arithmetic left out."""
    rng = np.random.default_rng(n)
    buffers = [rng.integers(0, 1000, 64) for _ in range(n)]
    expected = sum(buffers)
    steps = [bare.swaps(rank, n, 64) for rank in range(n)]
    for i in range(len(steps[0])):
        sent = [b.copy() for b in buffers]  # what every rank sends at this step, before any receives
        for rank in range(n):
            peer, _, receive_at, length = steps[rank][i]
            part = sent[peer][receive_at : receive_at + length]
            region = slice(receive_at, receive_at + length)
            buffers[rank][region] = buffers[rank][region] + part if i < len(steps[0]) // 2 else part
    for rank in range(n):
        np.testing.assert_array_equal(buffers[rank], expected)


@pytest.mark.parametrize("pattern", ["halving", "stream"])
@pytest.mark.parametrize(
    "transport",
    [pytest.param("sockets", marks=pytest.mark.multiworker), pytest.param("mpi", marks=pytest.mark.mpi)],
)
def test_runs_and_prints_records_with_provenance(transport, pattern):
    argv = ["--pattern", pattern, "--transport", transport, "--replicas", "2", "--sizes", "65536"]
    argv += ["--message-bytes", "0", "16384", "--process-repeats", "2", "--process-warmup", "1"]
    result = subprocess.run(
        [sys.executable, os.path.join(committed.ROOT, "benchmarks", "bare_exchange.py"), *argv],
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=committed.ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    expected = [("sockets", None)] if transport == "sockets" else [("mpi", 0), ("mpi", 16384)]
    assert [(r["transport"], r.get("message_bytes")) for r in records] == expected
    for r in records:
        assert r["pattern"] == pattern and r["replicas"] == 2 and r["bytes"] == 65536 and r["ms"] > 0, r
        assert r["command"] == "python benchmarks/bare_exchange.py " + " ".join(argv), r
        assert r["commit"] and r["processor"] and r["date"], r
        assert r.get("yield_when_idle", False) is False and r.get("receives_first", False) is False, r
    assert bare.table(records).count("\n") == 2 + len(records)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--replicas", "3"], "--replicas takes powers of two from 2. Received: [3]"),
        (["--replicas", "4", "--sizes", "1022"], "--sizes takes positive multiples of the largest --replicas (4). "),
        (["--pattern", "stream", "--replicas", "4"], "--pattern stream runs between two processes"),
        (["--process-repeats", "0"], "Received: 0, 3, 600"),
    ],
)
def test_bad_arguments_are_refused_before_any_process_starts(capsys, argv, named):
    with pytest.raises(SystemExit) as exited:
        bare._parse_args(argv)
    assert exited.value.code == 2 and named in " ".join(capsys.readouterr().err.split())


RECORDS = "docs/cluster/bare_exchange.jsonl"


def _range(values, unit="x"):
    """`values` as the guide quotes them: "1.05x", or "1.31-1.42x" where they differ."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{low}{unit}" if low == high else f"{low}-{high}{unit}"


def _ratios(rows, transport, n, *, nbytes=16 << 20, message_bytes=None, first=False, yielding=False):
    found = [
        r["ratio_to_link_floor"]
        for r in rows
        if r["pattern"] == "halving" and r["transport"] == transport and r["replicas"] == n and r["bytes"] == nbytes
        if transport == "sockets"
        or (r["message_bytes"], r["receives_first"], r["yield_when_idle"]) == (message_bytes, first, yielding)
    ]
    assert found, (transport, n, nbytes, message_bytes, first, yielding)
    return found


def _stream(rows, link):
    found = [r["gbit_per_s"] for r in rows if r["pattern"] == "stream" and r["link"] == link]
    assert len(found) == 2, link  # sockets and mpi
    return _range(found, "")


def quoted_figures(rows) -> dict[str, str]:
    """The figures the cluster guide's "The wire alone" quotes, from the records."""
    whole, mib, kib = 0, 1 << 20, 256 << 10
    return {
        "SOCK2": _range(_ratios(rows, "sockets", 2) + _ratios(rows, "sockets", 2, nbytes=64 << 20)),
        "SOCK4_16": _range(_ratios(rows, "sockets", 4)),
        "SOCK4_64": _range(_ratios(rows, "sockets", 4, nbytes=64 << 20)),
        "SOCK4_ALL": _range(_ratios(rows, "sockets", 4) + _ratios(rows, "sockets", 4, nbytes=64 << 20)),
        "MPIWHOLE2": _range(_ratios(rows, "mpi", 2, message_bytes=whole)),
        "MPIWHOLE4": _range(_ratios(rows, "mpi", 4, message_bytes=whole)),
        "MPI1M2": _range(_ratios(rows, "mpi", 2, message_bytes=mib)),
        "MPI1M4": _range(_ratios(rows, "mpi", 4, message_bytes=mib)),
        "MPI256K2": _range(_ratios(rows, "mpi", 2, message_bytes=kib)),
        "MPI256K4": _range(_ratios(rows, "mpi", 4, message_bytes=kib)),
        "FIRST2": _range(_ratios(rows, "mpi", 2, message_bytes=kib, first=True)),
        "FIRST4": _range(_ratios(rows, "mpi", 4, message_bytes=kib, first=True)),
        "FIRSTWHOLE2": _range(_ratios(rows, "mpi", 2, message_bytes=whole, first=True)),
        "FIRSTWHOLE4": _range(_ratios(rows, "mpi", 4, message_bytes=whole, first=True)),
        "POLL4": _range(_ratios(rows, "mpi", 4, message_bytes=kib)),
        "YIELD4": _range(_ratios(rows, "mpi", 4, message_bytes=kib, yielding=True)),
        "STREAM1": _stream(rows, "1gbit"),
        "STREAM4": _stream(rows, "4gbit"),
        "STREAM10": _stream(rows, "10gbit"),
    }


#: The sentences of the cluster guide that quote the records, with the
#: names of `quoted_figures` in place of the figures.
QUOTED = (
    "Over Python sockets the pattern took SOCK2 the floor at N = 2",
    "At N = 4 it took SOCK4_16 (16 MiB) and SOCK4_64 (64 MiB)",
    "a 64 MiB stream: STREAM1 Gbit/s at `1gbit`",
    "whole messages take MPIWHOLE2 the floor at N = 2 and MPIWHOLE4 at N = 4",
    "in 1 MiB messages MPI1M2 and MPI1M4, in 256 KiB ones MPI256K2 and MPI256K4",
    "256 KiB messages cost about what whole ones do (FIRST2 against FIRSTWHOLE2 at N = 2, "
    "FIRST4 against FIRSTWHOLE4 at N = 4)",
    "In 256 KiB messages at N = 4 the pattern took POLL4 polling and YIELD4 with `--yield-when-idle`",
    "One TCP stream** carried STREAM1 Gbit/s at `1gbit`, STREAM4 at `4gbit` and STREAM10 at `10gbit`",
    "one TCP stream between two hosts carried STREAM4 Gbit/s at `4gbit` and STREAM10 at `10gbit`",
    "took SOCK2 the floor at N = 2, where the frames' headers add 4.6% to the payload, and SOCK4_ALL at N = 4",
    "on the later AVX-512 processor) took SOCK4_16 the floor at N = 4 and 16 MiB",
    "exchanges with nothing computed took SOCK4_16 the floor at N = 4 and 16 MiB ([the wire alone]",
)
#: The same for the benchmarks guide.
QUOTED_BENCHMARKS = (
    "the bare exchange of the same bytes took SOCK2 the floor at N = 2",
    "the tree's pattern in whole messages took MPIWHOLE2 the floor at N = 2 and MPIWHOLE4 at N = 4",
)


def _filled(sentence, figures):
    for name in sorted(figures, key=len, reverse=True):  # SOCK4_16 before SOCK4
        sentence = sentence.replace(name, figures[name])
    return sentence


def test_the_cluster_guide_shows_the_records_table_and_quotes_their_figures():
    rows = committed.records(RECORDS)
    assert rows and all({"date", "commit", "processor", "command"} <= set(r) for r in rows)
    text = committed.page("docs/guide/cluster.md", collapse=False)
    assert bare.table(rows) in text
    for row in rows:
        assert row["command"] in text and row["commit"] in text and row["date"][:10] in text, row["command"]
    times = sorted(row["date"][11:16] for row in rows)
    assert f"{rows[0]['date'][:10]}, commands started {times[0]}-{times[-1]} UTC" in committed.page(
        "docs/guide/cluster.md"
    )
    collective = committed.benchmark("collective")  # the same floor as the collective's records
    for row in rows:
        if row["pattern"] == "halving":
            floor = collective.link_floor_ms(row["replicas"], row["bytes"], row["link"])
            assert row["link_floor_ms"] == pytest.approx(floor, abs=1e-3), row
    flat = committed.page("docs/guide/cluster.md")
    figures = quoted_figures(rows)
    for sentence in QUOTED:
        assert _filled(sentence, figures) in flat, _filled(sentence, figures)
    benchmarks = committed.page("docs/guide/benchmarks.md")
    for sentence in QUOTED_BENCHMARKS:
        assert _filled(sentence, figures) in benchmarks, _filled(sentence, figures)
    # "where N = 2, with a core per rank, is the same either way"
    assert _range(_ratios(rows, "mpi", 2, message_bytes=256 << 10, yielding=True)) == figures["MPI256K2"]
