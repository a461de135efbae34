"""benchmarks/link_model.py: the time-to-accuracy cost model against the
collective's committed records on emulated links (docs/cluster/), and the
model's terms one by one."""

import json
import os

import committed
import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
RECORDS = os.path.join(ROOT, "docs", "cluster", "collective_links.jsonl")
GUIDE = os.path.join(ROOT, "docs", "guide", "benchmarks.md")


lm = committed.benchmark("link_model")
tta = lm.tta


@pytest.fixture(scope="module")
def records():
    return committed.records(RECORDS)


def test_every_record_within_the_tolerance_or_explained(records):
    rows = lm.check(records)
    failed = [r for r in rows if r["status"] == "FAIL"]
    assert not failed, "\n".join(json.dumps(r) for r in failed)
    for r in rows:
        if r["status"] == "ok":
            assert abs(r["ratio"] - 1) <= lm.TOLERANCE
        elif r["status"] == "exception":
            assert lm.TOLERANCE < abs(r["ratio"] - 1) <= lm.EXCEPTION_BOUND and r["reason"]
        else:
            assert r["status"] == "unmodelled" and r["reason"]


def test_every_record_is_covered(records):
    rows = lm.check(records)
    assert len(records) == 20
    for record in records:
        paths = {r["path"] for r in rows if lm.key(r, "") == lm.key(record, "")}
        assert paths == {"adasum", "native"} | ({"16-bit wire"} if "compressed_ms" in record else set())
    # Every listed exception is a row beyond the tolerance: none stale.
    beyond = {lm.key(r, r["path"]) for r in rows if r["status"] == "exception"}
    assert beyond == set(lm.EXCEPTIONS)
    # Adasum is checked on every engine, never left unmodelled.
    assert all(path != "adasum" for _, path in lm.UNMODELLED)


def test_a_prediction_beyond_the_tolerance_fails(records):
    record = dict(records[0])
    record["adasum_ms"] = 1.5 * lm.predict_ms(record, "adasum")
    (row,) = [r for r in lm.check([record]) if r["path"] == "adasum"]
    assert row["status"] == "FAIL" and row["ratio"] == pytest.approx(1.5)
    # A listed exception that now holds fails too: the list must shrink.
    (listed,) = [r for r in records if lm.key(r, "adasum") in lm.EXCEPTIONS]
    listed = {**listed, "adasum_ms": lm.predict_ms(listed, "adasum")}
    (row,) = [r for r in lm.check([listed]) if r["path"] == "adasum"]
    assert row["status"] == "FAIL"


def test_the_guide_holds_the_table(records):
    guide = committed.page(GUIDE, collapse=False)
    assert lm.markdown(lm.check(records)) in guide
    assert f"within {lm.TOLERANCE:.0%}" in guide
    dates = " and ".join(sorted({r["date"][:10] for r in records}))
    processors = " and ".join(sorted({r["processor"].replace("AMD EPYC, ", "AMD EPYC with ") for r in records}))
    shown = os.path.relpath(RECORDS, ROOT)
    assert f"the committed records of {dates} (`{shown}`, an {processors})" in " ".join(guide.split())


def test_the_fitted_constants_are_the_committed_ones(records):
    for engine, fitted in lm.fit(records).items():
        for name, value in fitted.items():
            assert lm.ENGINE_CONSTANTS[engine][name] == pytest.approx(value, rel=5e-3), (engine, name)


# -- the terms -------------------------------------------------------------------------------------


def test_payload_rate_counts_the_frames():
    assert tta.payload_rate(1e9) == pytest.approx(1e9 / 8 * 1448 / 1538)
    assert tta.LINKS["1 GbE"] == pytest.approx(117.7e6, rel=1e-3)  # TCP over 1 GbE: 941 Mbit/s
    assert lm.link_rate("1gbit") == pytest.approx(1e9 / 8 * 1448 / 1514)
    assert lm.link_rate("4gbit") == pytest.approx(4 * lm.link_rate("1gbit"))


def test_the_wire_is_the_collectives_link_floor(records):
    """With every software constant zero the model is the link floor of
    benchmarks/collective.py, in frames."""
    zero = dict.fromkeys(("a", "u", "a_ring", "u_ring", "u_code"), 0.0)
    for record in records:
        floor = record["link_floor_ms"] * lm.EMULATED_FRAME / tta.TCP_PAYLOAD
        assert lm.predict_ms(record, "adasum", constants=zero) == pytest.approx(floor, rel=1e-4)
        assert lm.predict_ms(record, "keras", constants=zero) == pytest.approx(floor, rel=1e-4)


def test_contention_scales_the_software_not_the_wire():
    c = {"a": 1e-3, "u": 1e-9, "a_ring": 2e-3, "u_ring": 3e-9}
    size, rate = 1e6, 1e8
    alone = tta.combine_seconds("adasum", 8, size, c, rate)
    assert alone == pytest.approx(12 * 1e-3 + (1e-9 + 2 / rate) * size * 7 / 8)
    assert tta.combine_seconds("adasum", 8, size, c, rate, cores=2) == pytest.approx(
        12 * 1e-3 + (4 * 1e-9 + 2 / rate) * size * 7 / 8
    )
    assert tta.combine_seconds("keras", 8, size, c, rate, cores=2) == pytest.approx(
        14 * 2e-3 + (4 * 3e-9 + 2 / rate) * size * 7 / 8
    )
    assert tta.combine_seconds("adasum", 2, size, c, rate, cores=2) == tta.combine_seconds("adasum", 2, size, c, rate)


def test_the_fold_adds_two_messages_and_the_whole_buffer():
    c = {"a": 1e-3, "u": 1e-9, "a_ring": 0.0, "u_ring": 0.0}
    size, rate = 1e6, 1e8
    # N = 3: p = 1, the fold (2 messages, S each way) before one level.
    assert tta.combine_seconds("adasum", 3, size, c, rate) == pytest.approx(
        (2 + 1 + 2) * 1e-3 + (1e-9 + 2 / rate) * (size / 2 + size)
    )


def test_the_compressed_wire_halves_the_bytes_and_pays_the_coding():
    c = {"a": 0.0, "u": 1e-9, "a_ring": 0.0, "u_ring": 0.0, "u_code": 0.5e-9}
    size, rate = 1e6, 1e8
    assert tta.COMPRESSED_WIRE == pytest.approx(0.5 + 2 / 128 / 2)  # 16 bits, and 4 bytes a block of 128
    assert tta.combine_seconds("adasum", 4, size, c, rate, cores=2, compressed=True) == pytest.approx(
        (2 * 1.5e-9 + 2 / rate * tta.COMPRESSED_WIRE) * size * 3 / 4
    )
    with pytest.raises(ValueError, match="combiner='keras'"):
        tta.combine_seconds("keras", 4, size, c, rate, compressed=True)
