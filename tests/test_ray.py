"""Ray Train's `TensorflowTrainer` with AdasumOptimizer, on a one-machine Ray
of 2 CPU workers (tests/workers/ray_driver.py, a process of its own, which
starts Ray once and runs the three scenarios in turn): the combine and the
training equal `tf_adasum.reference`; a worker killed in the middle of an
epoch is restarted by `FailureConfig(max_failures=1)` and the job resumes
from `tf_adasum.BackupAndRestore`, ending bitwise where an uninterrupted run
ends; without restarts the run fails with Ray's error. Skipped, with the
reason, where Ray is missing."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from multiprocess import check_collective, check_train, worker_env

from tf_adasum import reference

pytest.importorskip("ray.train.tensorflow", reason="Ray Train is missing: install the `ray` extra (make install)")
pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

DRIVER = pathlib.Path(__file__).resolve().parent / "workers" / "ray_driver.py"


#: The driver's scenarios, in the order it runs them on its one Ray ("fail" last: its dead worker stays dead).
SCENARIOS = ("train", "restart", "fail")


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    """One driver runs every scenario on one Ray (its start paid once):
    the folder of the scenarios, each one's report (its run's error and
    seconds) and the driver's output."""
    out = tmp_path_factory.mktemp("ray")
    result = subprocess.run(
        [sys.executable, str(DRIVER), ",".join(SCENARIOS), str(out)],
        env=worker_env(RAY_DEDUP_LOGS="0"),
        capture_output=True,
        text=True,
        timeout=800,
    )
    output = result.stdout[-12000:] + result.stderr[-6000:]
    assert result.returncode == 0, output
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"scenario"')]
    return out, {line["scenario"]: line for line in lines}, output


def _drive(driven, scenario, error=None):
    """The scenario's folder and report; its run's error must be `error` (a substring; None: no error)."""
    out, reports, output = driven
    assert scenario in reports, output
    got = reports[scenario]["error"]
    assert (got is None) if error is None else (got is not None and error in got), output
    return out / scenario, reports[scenario]


def test_training_under_ray_train_equals_the_reference(driven):
    tmp_path, _ = _drive(driven, "train")
    check_collective(tmp_path, 2)
    # One device per worker: the hierarchical combine is Adasum over the workers.
    check_train(tmp_path, 2, hierarchical_combine=reference.adasum_tree)


def test_a_killed_worker_is_restarted_and_resumes_bitwise_from_the_backup(driven):
    tmp_path, _ = _drive(driven, "restart")
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


def test_without_restarts_a_killed_worker_fails_the_run_with_a_clear_error(driven):
    error = "WorkerGroupError: Training failed due to worker errors:\n[Rank 1 Error"
    tmp_path, report = _drive(driven, "fail", error)
    assert report["seconds"] < 300  # the error, not the limit of the driver
    assert not (tmp_path / "final_rank0.npz").exists() and not (tmp_path / "final_rank1.npz").exists()
