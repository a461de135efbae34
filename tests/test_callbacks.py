"""AdasumDiagnostics: its values against numpy computations on the same deltas."""

import json
import os

import keras
import numpy as np
import pytest
from conftest import mirrored
from diagnostics_oracle import expected_statistics
from simulation import BATCH, IN, OUT, _grads, data

import tf_adasum
from tf_adasum import callbacks


def _train(n, callback, steps=2, lr=0.1):
    x, y = data(steps)
    strategy = mirrored(n)[0]
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
        initial = [w.numpy().astype(np.float64) for w in model.weights]
        model.compile(optimizer=tf_adasum.AdasumOptimizer(keras.optimizers.SGD(lr)), loss="mse")
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[callback])
    return model, initial, x, y, history


@pytest.mark.parametrize("n", [4, 3])
def test_values_equal_numpy_on_the_same_deltas(n, tmp_path):
    callback = tf_adasum.AdasumDiagnostics(every_n_steps=1)
    model, initial, x, y, history = _train(n, callback, lr=0.1)
    step, record = callback.records[0]
    assert step == 0
    optimizer = model.optimizer
    assert optimizer.num_replicas_combined == n
    columns = optimizer.diagnostics_columns()
    assert [list(record[v.path]) for v in model.trainable_variables] == [columns] * len(model.trainable_variables)
    b = BATCH // n
    local_grads = [_grads(initial, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]) for r in range(n)]
    combined_sq = deltas_sq = 0.0
    for t, variable in enumerate(model.trainable_variables):
        deltas = [-0.1 * g[t] for g in local_grads]
        expected = expected_statistics(deltas)
        got = record[variable.path]
        assert list(expected) == columns  # the tensor's statistics, then each level's (the fold first)
        for key, value in expected.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=f"{variable.path} {key}")
        combined_sq += expected["combined_norm"] ** 2
        deltas_sq += sum(np.sum(d**2) for d in deltas)
    # The model-level orthogonality: squared norms summed over tensors, then divided.
    np.testing.assert_allclose(callbacks.model_orthogonality(record), combined_sq / deltas_sq, rtol=1e-5)
    assert history.history["adasum/orthogonality"][-1] == callbacks.model_orthogonality(callback.records[-1][1])


def test_model_orthogonality_weights_by_squared_norms():
    big = {"combined_norm": 3.0, "delta_sq_sum": 18.0}
    small = {"combined_norm": 0.1, "delta_sq_sum": 0.04}
    assert callbacks.model_orthogonality({"a": big, "b": small}) == pytest.approx((9 + 0.01) / (18 + 0.04))
    still = {"combined_norm": 0.0, "delta_sq_sum": 0.0}
    assert callbacks.model_orthogonality({"a": still}) == 1.0


def test_outputs(tmp_path):
    callback = tf_adasum.AdasumDiagnostics(
        every_n_steps=2,
        log_dir=str(tmp_path / "tb"),
        jsonl_path=str(tmp_path / "new" / "diag.jsonl"),
        png_path=tmp_path / "diag.png",
    )
    model, _, _, _, history = _train(2, callback, steps=5)
    assert [step for step, _ in callback.records] == [0, 2, 4]
    lines = [json.loads(line) for line in open(tmp_path / "new" / "diag.jsonl", encoding="utf-8")]
    assert [line["step"] for line in lines] == [0, 2, 4]
    assert lines[-1]["model"]["orthogonality"] == history.history["adasum/orthogonality"][-1]
    assert 0.5 - 1e-9 <= history.history["adasum/orthogonality"][-1] <= 1.0 + 1e-9
    # By default the logs (so the progress line) carry the model-level value only.
    assert [k for k in history.history if k.startswith("adasum/")] == ["adasum/orthogonality"]
    # TensorBoard holds every statistic of every recorded step, the model-level one included.
    logged = _scalars(tmp_path / "tb")
    for step, record in callback.records:
        assert logged[("adasum/orthogonality", step)] == pytest.approx(callbacks.model_orthogonality(record))
        for path, stats in record.items():
            for stat, value in stats.items():
                assert logged[(f"adasum/{path}/{stat}", step)] == pytest.approx(value, rel=1e-6, nan_ok=True)
    assert {step for _, step in logged} == {0, 2, 4}
    assert os.path.getsize(tmp_path / "diag.png") > 1000


def _scalars(log_dir) -> dict[tuple[str, int], float]:
    """``{(tag, step): value}`` of the scalar summaries in `log_dir`'s event files."""
    import tensorflow as tf

    scalars = {}
    for name in os.listdir(log_dir):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(log_dir, name)):
            for value in event.summary.value:
                scalars[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
    return scalars


def test_logged_per_tensor_statistics():
    logged = ("combined_norm", "level0/cos_max")
    callback = tf_adasum.AdasumDiagnostics(every_n_steps=1, logged=logged)
    model, _, _, _, history = _train(2, callback, steps=1)
    expected = set(logged)
    for variable in model.trainable_variables:
        prefix = f"adasum/{variable.path}/"
        assert {k[len(prefix) :] for k in history.history if k.startswith(prefix)} == expected
    assert "adasum/orthogonality" in history.history


def test_not_attached_means_not_computed():
    x, y = data(2)
    strategy = mirrored(2)[0]
    with strategy.scope():
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
        optimizer = tf_adasum.AdasumOptimizer(keras.optimizers.SGD(0.1))
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, verbose=0)
    assert optimizer._diagnostics.variable is None
    with pytest.raises(ValueError, match="attach a tf_adasum.AdasumDiagnostics"):
        optimizer.read_diagnostics()


def test_arguments_and_missing_viz(monkeypatch):
    with pytest.raises(ValueError, match="Received: every_n_steps=0"):
        tf_adasum.AdasumDiagnostics(every_n_steps=0)
    with pytest.raises(TypeError, match="Received: every_n_steps=2.0"):
        tf_adasum.AdasumDiagnostics(every_n_steps=2.0)
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("tensorboard", "matplotlib") else real_find_spec(name, *a),
    )
    with pytest.raises(ImportError, match=r"pip install 'tf_adasum\[viz\]'"):
        tf_adasum.AdasumDiagnostics(log_dir="/tmp/x")
    with pytest.raises(ImportError, match="matplotlib"):
        tf_adasum.AdasumDiagnostics(png_path="/tmp/x.png")


def test_paths_are_checked_at_construction(tmp_path, monkeypatch):
    regular_file = tmp_path / "a_file"
    regular_file.write_text("")
    for name in ("jsonl_path", "png_path"):
        with pytest.raises(ValueError, match=rf"`{name}` names a folder.*Received: {name}="):
            tf_adasum.AdasumDiagnostics(**{name: str(tmp_path)})
        with pytest.raises(ValueError, match=rf"`{name}` is under .*a_file, which is a file.*Received: {name}="):
            tf_adasum.AdasumDiagnostics(**{name: str(regular_file / "sub" / "out.x")})
        with pytest.raises(TypeError, match=rf"Received: {name}=3"):
            tf_adasum.AdasumDiagnostics(**{name: 3})
    with pytest.raises(ValueError, match=r"`log_dir` names a file.*Received: log_dir="):
        tf_adasum.AdasumDiagnostics(log_dir=str(regular_file))
    with pytest.raises(ValueError, match=r"`log_dir` is under .*a_file"):
        tf_adasum.AdasumDiagnostics(log_dir=str(regular_file / "tb"))
    # An unwritable folder (root may write anywhere, so the permission check is simulated).
    monkeypatch.setattr(callbacks.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=r"`jsonl_path` cannot be created: this user cannot write to"):
        tf_adasum.AdasumDiagnostics(jsonl_path=str(tmp_path / "new" / "d.jsonl"))
    with pytest.raises(ValueError, match=r"`log_dir` cannot be written by this user"):
        tf_adasum.AdasumDiagnostics(log_dir=str(tmp_path))


def test_logged_names_are_checked():
    with pytest.raises(ValueError, match=r"unknown statistic 'nonexistent'.*orthogonality.*cos_min.*Received: logged="):
        tf_adasum.AdasumDiagnostics(logged=["nonexistent"])
    with pytest.raises(ValueError, match="unknown statistic 'level0/norm'"):
        tf_adasum.AdasumDiagnostics(logged=["level0/norm"])
    with pytest.raises(TypeError, match="Received: logged='orthogonality'"):
        tf_adasum.AdasumDiagnostics(logged="orthogonality")
    assert tf_adasum.AdasumDiagnostics(logged=["orthogonality", "level1/coef_a_max"]).logged == (
        "orthogonality",
        "level1/coef_a_max",
    )
    # A level this run does not have (2 replicas: level 0 only): an error when training begins.
    with pytest.raises(ValueError, match=r"does not record: level1/cos_min .*Received: logged="):
        _train(2, tf_adasum.AdasumDiagnostics(logged=["level1/cos_min"]), steps=1)


def test_needs_an_adasum_optimizer():
    model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(OUT)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = data(1)
    with pytest.raises(ValueError, match="compiled with a tf_adasum.AdasumOptimizer"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[tf_adasum.AdasumDiagnostics()])
