"""Packaging: extras, console script, version, backend check, import hygiene."""

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import tf_adasum

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_python(code, **env):
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env},
    )


def test_extras_and_peer_dependency():
    meta = importlib.metadata.metadata("tf_adasum")
    assert set(meta.get_all("Provides-Extra")) == {"cpu", "tensorflow", "mpi", "viz", "eval", "ray", "docs", "test"}
    unconditional = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert sorted(re.split(r"[<>=!~ ]", r)[0] for r in unconditional) == ["keras", "numpy"]


def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", tf_adasum.__version__)
    assert importlib.metadata.version("tf_adasum") == tf_adasum.__version__


def test_public_api():
    assert sorted(tf_adasum.__all__) == sorted(
        [
            "AdasumCrossDeviceOps",
            "AdasumDiagnostics",
            "AdasumOptimizer",
            "BackupAndRestore",
            "SimulatedReplicas",
            "__version__",
            "adasum_pair",
            "combiners",
            "mpi",
            "reference",
        ]
    )
    for name in tf_adasum.__all__:
        assert hasattr(tf_adasum, name)


def test_reference_imports_no_tensorflow():
    spec = importlib.util.spec_from_file_location(
        "standalone_reference", os.path.join(ROOT, "tf_adasum", "reference.py")
    )
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ref', {spec.origin!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "assert 'tensorflow' not in sys.modules, 'reference imported tensorflow'\n"
        "print(module.adasum_pair(__import__('numpy').ones(2), __import__('numpy').ones(2)))\n"
    )
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    assert "[1. 1.]" in out.stdout


def test_non_tensorflow_keras_backend_is_refused():
    out = _run_python("import tf_adasum", KERAS_BACKEND="numpy")
    assert out.returncode != 0
    assert "ImportError: tf_adasum needs Keras' TensorFlow backend" in out.stderr
    assert "keras.backend.backend()='numpy'" in out.stderr


@pytest.mark.slow
def test_importing_does_not_pull_optional_dependencies():
    # TensorFlow may import some of these itself; look only at what tf_adasum adds.
    code = (
        "import sys, tensorflow, keras\n"
        "before = set(sys.modules)\n"
        "import tf_adasum\n"
        "added = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print('ADDED', sorted(added & {'mpi4py', 'matplotlib', 'tensorboard', 'zarr', 'pureml'}))\n"
    )
    out = _run_python(code)
    assert out.returncode == 0, out.stderr
    assert "ADDED []" in out.stdout


def test_cli_launch_runs_the_launcher(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import json, os, sys\nsys.exit(json.loads(os.environ['TF_CONFIG'])['task']['index'] + 4)\n")
    tf_adasum_cli = os.path.join(os.path.dirname(sys.executable), "tf-adasum")
    out = subprocess.run([tf_adasum_cli, "launch", "-n", "1", str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 4, out.stdout + out.stderr
    out = subprocess.run([tf_adasum_cli, "launch", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--num-workers" in out.stdout


def test_cli_eval_is_the_scaling_evaluation():
    tf_adasum_cli = os.path.join(os.path.dirname(sys.executable), "tf-adasum")
    out = subprocess.run([tf_adasum_cli, "eval", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "--preset" in out.stdout and "--resume" in out.stdout
    bad = subprocess.run([tf_adasum_cli, "eval", "--replicas", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Received: replicas=0" in bad.stderr


@pytest.mark.slow
def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "tf_adasum.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for command in ("eval", "bench", "launch"):
        assert command in out.stdout


def test_ruff_clean():
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    folders = [f for f in ("tf_adasum", "tests", "benchmarks", "examples") if os.path.isdir(os.path.join(ROOT, f))]
    out = subprocess.run([ruff, "check", *folders], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_cli_bench_rejects_unknown_benchmarks():
    out = subprocess.run(
        [sys.executable, "-m", "tf_adasum.cli", "bench", "nope"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert "unknown benchmark ['nope']" in out.stderr
