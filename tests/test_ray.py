"""Ray Train's `TensorflowTrainer` with AdasumOptimizer, on a one-machine Ray
of 2 CPU workers (tests/workers/ray_driver.py, a process of its own): the
combine and the training equal `tf_adasum.reference`; a worker killed in the
middle of an epoch is restarted by `FailureConfig(max_failures=1)` and the
job resumes from `tf_adasum.BackupAndRestore`, ending bitwise where an
uninterrupted run ends; without restarts the run fails with Ray's error.
Skipped, with the reason, where Ray is missing."""

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from multiprocess import check_collective, check_train, worker_env

from tf_adasum import reference

pytest.importorskip("ray.train.tensorflow", reason="Ray Train is missing: install the `ray` extra (make install)")
pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

DRIVER = pathlib.Path(__file__).resolve().parent / "workers" / "ray_driver.py"


def _drive(scenario, out, error=None):
    """Runs the driver; its run's error must be `error` (a substring; None: no error)."""
    result = subprocess.run(
        [sys.executable, str(DRIVER), scenario, str(out)],
        env=worker_env(RAY_DEDUP_LOGS="0"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout[-6000:] + result.stderr[-6000:]
    assert result.returncode == 0, output
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"error"')]
    assert lines, output
    got = json.loads(lines[-1])["error"]
    assert (got is None) if error is None else (got is not None and error in got), output
    return output


def test_training_under_ray_train_equals_the_reference(tmp_path):
    _drive("train", tmp_path)
    check_collective(tmp_path, 2)
    # One device per worker: the hierarchical combine is Adasum over the workers.
    check_train(tmp_path, 2, hierarchical_combine=reference.adasum_tree)


def test_a_killed_worker_is_restarted_and_resumes_bitwise_from_the_backup(tmp_path):
    _drive("restart", tmp_path)
    first = [json.loads((tmp_path / f"attempt1_rank{r}.json").read_text()) for r in range(2)]
    second = [json.loads((tmp_path / f"attempt2_rank{r}.json").read_text()) for r in range(2)]
    assert all(r["begun"][-1] == 2 for r in first), first  # worker 1 died in epoch 2
    assert all(r["restored"] == 2 and r["begun"] == [2, 3] for r in second), second
    # Delta mode over Adam: one model, and each worker's own moments, restored from its own part of the backup.
    references = [np.load(tmp_path / f"reference_rank{rank}.npz") for rank in range(2)]
    for f in references[0].files[:2]:  # the weights (kernel, bias) come first
        assert references[0][f].tobytes() == references[1][f].tobytes(), f
    for rank, reference_state in enumerate(references):
        result = np.load(tmp_path / f"final_rank{rank}.npz")
        assert result.files == reference_state.files
        for f in result.files:
            assert result[f].tobytes() == reference_state[f].tobytes(), (rank, f)
    assert not os.path.exists(tmp_path / "backup")  # deleted once training completed


def test_without_restarts_a_killed_worker_fails_the_run_with_a_clear_error(tmp_path):
    start = time.monotonic()
    _drive("fail", tmp_path, error="WorkerGroupError: Training failed due to worker errors:\n[Rank 1 Error")
    assert time.monotonic() - start < 300  # the error, not the 600 s limit of the driver
    assert not (tmp_path / "final_rank0.npz").exists() and not (tmp_path / "final_rank1.npz").exists()
