"""tf_adasum.processes: which process this is, how many, a sum over them.

In this process the job is one process; two real processes (workers of a
MultiWorkerMirroredStrategy under `tf-adasum launch`, ranks under `mpirun`)
see their own index, the count and the same sums. The sums of several
processes are also exercised through `tf_adasum.BackupAndRestore`'s check
(tests/test_backup.py).
"""

import json

import numpy as np
import pytest
import tensorflow as tf
from conftest import mirrored

from tf_adasum.processes import KINDS, Processes


def test_one_process_is_index_0_of_1_and_its_sum_is_the_values():
    strategies = (None, tf.distribute.get_strategy(), mirrored(2)[0])
    for processes in [Processes.of(strategy) for strategy in strategies] + [Processes.alone()]:
        assert (processes.kind, processes.index, processes.count) == ("process", 0, 1)
        assert processes.sum([3, 2.5, True, np.int64(7), np.float32(0.5)]) == [3.0, 2.5, 1.0, 7.0, 0.5]
        assert processes.sum((4,), "a named sum") == [4.0]
        assert processes.sum(np.array([1.0, 2.0])) == [1.0, 2.0]
        assert processes.sum([]) == []
        assert processes.barrier() is None


def test_sum_hands_floats_and_the_name_to_its_exchange():
    calls = []

    def reduce(values, what):
        calls.append((values, what))
        return np.asarray(values) * 2

    processes = Processes("rank", 1, 2, reduce)
    assert processes.sum([1, np.int32(2)], "the check") == [2.0, 4.0]
    processes.barrier()
    assert calls == [([1.0, 2.0], "the check"), ([0.0], "a barrier over the processes")]
    assert all(type(v) is float for values, _ in calls for v in values)
    assert repr(processes) == "Processes(kind='rank', index=1, count=2)"
    assert KINDS == ("worker", "rank", "process")


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (("node", 0, 1), ValueError, r"`kind` must be one of \('worker', 'rank', 'process'\). Received: kind='node'"),
        (("worker", 0, 0), ValueError, r"`count` must be at least 1. Received: count=0"),
        (("worker", 0, 2.0), TypeError, r"`count` must be an integer. Received: count=2.0"),
        (("worker", True, 2), TypeError, r"`index` must be an integer. Received: index=True"),
        (("worker", 2, 2), ValueError, r"`index` must be in \[0, 2\) for count=2. Received: index=2"),
        (("worker", -1, 2), ValueError, r"`index` must be in \[0, 2\) for count=2. Received: index=-1"),
    ],
)
def test_construction_arguments_are_checked(arguments, error, match):
    with pytest.raises(error, match=match):
        Processes(*arguments, lambda values, what: values)


def test_reduce_must_be_callable():
    with pytest.raises(TypeError, match=r"`reduce` must be callable. Received: reduce=\[1\]"):
        Processes("worker", 0, 2, [1])


def test_strategy_must_be_a_strategy():
    match = r"`strategy` must be a tf.distribute.Strategy or None .* Received: strategy='mwms' \(of type str\)"
    with pytest.raises(TypeError, match=match):
        Processes.of("mwms")


@pytest.mark.parametrize(
    "values, error, match",
    [
        (3.0, TypeError, r"`values` must be a list of numbers. Received: values=3.0 \(of type float\)"),
        ("12", TypeError, r"`values` must be a list of numbers. Received: values='12' \(of type str\)"),
        ({"a": 1.0}, TypeError, r"`values` must be a list of numbers. Received: values=\{'a': 1.0\}"),
        ([1.0, "2"], TypeError, r"`values\[1\]` must be a real number. Received: values\[1\]='2'"),
        ([1.0, None], TypeError, r"`values\[1\]` must be a real number. Received: values\[1\]=None"),
        ([1j], TypeError, r"`values\[0\]` must be a real number. Received: values\[0\]=1j"),
        (np.zeros((2, 2)), TypeError, r"`values\[0\]` must be a real number. Received: values\[0\]=array"),
    ],
)
def test_sum_arguments_are_checked_before_any_exchange(values, error, match):
    def reduce(values, what):
        raise AssertionError("no exchange may start on a bad argument")

    with pytest.raises(error, match=match):
        Processes("worker", 0, 2, reduce).sum(values)
    with pytest.raises(TypeError, match=r"`what` must be a string. Received: what=3"):
        Processes("worker", 0, 2, reduce).sum([1.0], what=3)


@pytest.mark.parametrize(
    "kind",
    [pytest.param("worker", marks=pytest.mark.multiworker), pytest.param("rank", marks=pytest.mark.mpi)],
)
def test_two_processes_see_their_index_the_count_and_the_same_sums(kind, two_processes):
    """The ``processes`` task of the launch of 2 processes that other tests read too."""
    tmp_path = two_processes({"worker": "tf-adasum launch", "rank": "mpirun"}[kind])
    reports = [json.loads((tmp_path / f"processes_{index}.json").read_text()) for index in range(2)]
    for index, report in enumerate(reports):
        assert (report["kind"], report["index"], report["count"]) == (kind, index, 2)
        assert report["sums"] == [[2.0, 1.0, 11.0], [4.0]]
