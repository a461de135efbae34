"""Minutes per epoch on emulated hosts against the cost model (issue 42):
the committed records of `benchmarks/emulated_training.py`
(`docs/cluster/training_links.jsonl`) carry their provenance, their
predictions are the script's formula, every one is within the tolerance of
its measurement, and the evaluation guide's table is theirs."""

import os

import committed
import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
RECORDS = os.path.join(ROOT, "docs", "cluster", "training_links.jsonl")
GUIDE = os.path.join(ROOT, "docs", "guide", "evaluation.md")


@pytest.fixture(scope="module")
def script():
    return committed.benchmark("emulated_training")


@pytest.fixture(scope="module")
def records():
    return committed.records(RECORDS)


def test_every_configuration_is_recorded_with_its_provenance(script, records):
    keys = {tuple(r["key"]) for r in records}
    wanted = {
        (model, hosts, link, combiner, k)
        for model in script.MODELS
        for hosts in script.HOSTS
        for link in script.LINKS
        for combiner, k in script.METHODS
    }
    assert keys == wanted
    for r in records:
        assert r["date"] and r["commit"] and r["runs_commit"] and r["processor"], r
        assert r["command"].startswith("python benchmarks/emulated_training.py"), r


def test_the_predictions_are_the_scripts_and_within_the_tolerance(script, records):
    for r in records:
        arguments = (r["model"], r["combiner"], r["local_steps"], r["hosts"], r["link"], 0, r["cpu_count"])
        again = script.predicted_minutes(*arguments)
        compute = r["predicted_compute_minutes"]
        assert again["predicted_combine_ms"] == pytest.approx(r["predicted_combine_ms"], rel=1e-9), r["key"]
        steps = -(-script.MNIST_EXAMPLES // (r["hosts"] * script.BATCH))
        assert compute == pytest.approx(steps * r["step_ms_one_replica"] / 1e3 * r["hosts"] / 60, rel=1e-9)
        assert r["ratio"] == pytest.approx(r["measured_minutes"] / r["predicted_minutes"], rel=1e-9)
        beyond = tuple(r["key"]) in script.BEYOND_TOLERANCE  # listed with the reason, and said in the guide
        assert (abs(r["ratio"] - 1) > script.TOLERANCE) == beyond, (r["key"], r["ratio"])
        assert abs(r["ratio"] - 1) <= 2 * script.TOLERANCE, (r["key"], r["ratio"])


def test_the_guides_table_is_the_records(script, records):
    assert script.markdown(records) in committed.page(GUIDE, collapse=False)
