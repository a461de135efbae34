"""`tf-adasum bench`: which benchmark scripts it runs, how, and what it returns
(the scripts themselves are replaced by a recording stand-in: they take minutes)."""

import os
import sys

import pytest

from tf_adasum import cli

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


class _Calls(list):
    """The commands started, in order; `status` maps a script's file name to its exit status (default 0)."""

    def __init__(self):
        super().__init__()
        self.status = {}

    def __call__(self, command):
        self.append(command)
        return self.status.get(os.path.basename(command[-1]), 0)


@pytest.fixture
def calls(monkeypatch):
    """What `tf-adasum bench` starts, in place of `subprocess.call`."""
    recorder = _Calls()
    monkeypatch.setattr(cli.subprocess, "call", recorder)
    return recorder


def _command(name):
    return [sys.executable, os.path.join(BENCHMARKS, f"{name}.py")]


def test_bench_runs_every_benchmark_of_the_checkout_in_order(calls):
    assert cli.main(["bench"]) == 0
    assert calls == [_command("collective"), _command("optimizer_step")]
    assert all(os.path.isfile(command[-1]) for command in calls)


def test_bench_runs_the_named_benchmarks_only(calls):
    assert cli.main(["bench", "optimizer_step"]) == 0
    assert calls == [_command("optimizer_step")]


def test_bench_stops_at_a_failing_benchmark_with_its_status(calls):
    calls.status["collective.py"] = 3
    assert cli.main(["bench"]) == 3
    assert calls == [_command("collective")]  # optimizer_step never started


def test_an_evaluation_names_how_it_was_started(monkeypatch):
    """`tf-adasum eval` and `python -m tf_adasum.cli eval` differ (the second
    loads TensorFlow first, so keeps its kernels); the records say which."""
    import tf_adasum.eval.cli

    programs = []
    monkeypatch.setattr(tf_adasum.eval.cli, "main", lambda argv, program: programs.append(program) or 0)
    for argv0 in ("/venv/bin/tf-adasum", "/src/tf_adasum/cli.py"):
        monkeypatch.setattr(sys, "argv", [argv0, "eval"])
        assert cli.main(["eval", "--preset", "quick"]) == 0
    assert programs == ["tf-adasum eval", "python -m tf_adasum.cli eval"]
