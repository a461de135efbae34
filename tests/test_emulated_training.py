"""Minutes per epoch on emulated hosts against the cost model (issue 42):
the committed records of `benchmarks/emulated_training.py`
(`docs/cluster/training_links.jsonl`) carry their provenance, their
predictions are the script's formula, every one is within the tolerance of
its measurement or listed beyond it, and the evaluation guide's table and
prose are theirs."""

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


def _span(values, digits=2):
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def test_the_guides_prose_quotes_the_records(script, records):
    """The figures the evaluation guide quotes beside the table: the count
    within the tolerance, each configuration beyond it with its combine's
    overrun (measured less the predicted compute, over the predicted
    combine), and the collective's own records at these N."""
    text = " ".join(committed.page(GUIDE).split())
    by_key = {tuple(r["key"]): r for r in records}

    def overrun(key):
        r = by_key[key]
        return (r["measured_minutes"] - r["predicted_compute_minutes"]) / (
            r["predicted_minutes"] - r["predicted_compute_minutes"]
        )

    def idle(key):  # the compute before a combine: K steps of N replicas sharing the cores
        r = by_key[key]
        return r["step_ms_one_replica"] * r["hosts"] * r["local_steps"] / 1e3

    def share(key):
        r = by_key[key]
        return 1 - r["predicted_compute_minutes"] / r["predicted_minutes"]

    within = [r for r in records if abs(r["ratio"] - 1) <= script.TOLERANCE]
    ring, *slow = sorted(script.BEYOND_TOLERANCE, key=lambda k: (k[3] != "keras", k[1]))
    lenet_k4 = [("lenet_caffe", n, "1gbit", "adasum", 4) for n in (2, 4)]
    links = committed.records(os.path.join(ROOT, "docs", "cluster", "collective_links.jsonl"))
    lm = committed.benchmark("link_model")
    checked = [
        row
        for row in lm.check(links)
        if row["engine"] == "workers" and row["replicas"] in script.HOSTS and row["path"] in ("adasum", "native")
    ]
    link_names = {"1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}
    quoted = (
        f"{len(within)} of the {len(records)} configurations are within {script.TOLERANCE:.0%} of the prediction. "
        f"The {len(records) - len(within)} beyond",
        f"`{ring[0]}` with Keras at N = {ring[1]} on {link_names[ring[2]]} ({by_key[ring]['ratio']:.2f}), faster than "
        "predicted",
        f"its combines took {overrun(ring):.2f} of the link model's time",
        f"`{slow[0][0]}` with 4 local steps at N = {slow[0][1]} on {link_names[slow[0][2]]} "
        f"({by_key[slow[0]]['ratio']:.2f}) and at N = {slow[1][1]} on {link_names[slow[1][2]]} "
        f"({by_key[slow[1]]['ratio']:.2f}), slower than predicted: their combines took {overrun(slow[0]):.2f} and "
        f"{overrun(slow[1]):.2f} times the link model's time",
        f"(here {idle(slow[0]):.2f} and {idle(slow[1]):.2f} s:",
        f"({overrun(lenet_k4[0]):.2f} and {overrun(lenet_k4[1]):.2f} times at N = 2 and 4) and stayed within 15%: "
        f"there the combine is {100 * min(map(share, lenet_k4)):.0f}-{max(map(share, lenet_k4)):.0%} of the epoch",
        f"Adasum's tree within {_span([r['ratio'] for r in checked if r['path'] == 'adasum'])} on the worker "
        f"processes at these N (TF's ring {_span([r['ratio'] for r in checked if r['path'] == 'native'])})",
    )
    assert ring[3] == "keras" and all(k[3] == "adasum" and k[4] == 4 for k in slow)
    assert slow[0][0] == slow[1][0]  # "`mlp` with 4 local steps at N = 2 ... and at N = 4 ..."
    assert f"on slow links as a lower bound, by up to {max(r['ratio'] for r in records) - 1:.0%}." in text
    assert by_key[ring]["ratio"] < 1 < min(by_key[k]["ratio"] for k in slow)
    assert all(abs(by_key[k]["ratio"] - 1) <= script.TOLERANCE for k in lenet_k4)
    for figure in quoted:
        assert figure in text, figure
    benchmarks = " ".join(committed.page(os.path.join(ROOT, "docs", "guide", "benchmarks.md")).split())
    assert (
        f"within 15% of the measured minutes per epoch in {len(within)} of {len(records)} configurations. Of the "
        f"other {len(records) - len(within)}, two with 4 local steps took "
        f"{_span([by_key[k]['ratio'] for k in slow])} of the prediction (slower), their combines "
        f"{_span([overrun(k) for k in slow])} times the link term's time after the compute's idle gap, and one "
        f"with TensorFlow's ring {by_key[ring]['ratio']:.2f} (faster)"
    ) in benchmarks
