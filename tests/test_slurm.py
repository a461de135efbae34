"""The Slurm templates of examples/slurm/, submitted with `sbatch` to a real
one-machine Slurm cluster (tests/slurm_cluster.py, which waits for each job's
end by polling `scontrol` every 0.5 s, where `sbatch --wait` would poll at up to
32 s intervals): each job trains and
combines as `tf_adasum.reference` says; a failing job ends with its error
within the job's time limit. Skipped, with the reason, where Slurm is missing."""

import os
import pathlib
import subprocess
import sys
import time

import pytest
from multiprocess import WORKER, check_collective, check_train, worker_env
from slurm_cluster import SlurmCluster, refusal

from tf_adasum import reference
from tf_adasum.launcher.mpirun import find_mpirun

pytestmark = [pytest.mark.slow, pytest.mark.multiworker]

TEMPLATES = pathlib.Path(__file__).resolve().parent.parent / "examples" / "slurm"
#: Seconds a job may take (its Slurm time limit is derived from it).
JOB_TIMEOUT = 240


@pytest.fixture(scope="module")
def slurm():
    reason = refusal()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _job_env(**extra) -> dict:
    """What the job's tasks see: this Python and its `tf-adasum`, the project's mpirun, quiet TF."""
    mpirun = find_mpirun()
    env = worker_env(PYTHON=sys.executable, **extra)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # as in an activated environment
    if mpirun:
        env["MPIRUN"] = mpirun
    return env


def _submit(slurm, template, tasks, out, **env):
    code, output = slurm.sbatch(
        str(TEMPLATES / template), WORKER, tasks, str(out), timeout=JOB_TIMEOUT, env=_job_env(**env)
    )
    assert code == 0, f"{output[-6000:]}\n{slurm.logs()[-4000:]}"
    return output


def _pmix_refusal(slurm) -> str | None:
    listed = subprocess.run(["srun", "--mpi=list"], env=slurm.env, capture_output=True, text=True, timeout=30)
    if "pmix" not in listed.stdout + listed.stderr:
        return "this Slurm has no PMIx plugin (srun --mpi=list)"
    return None


def test_mpi_template_trains_under_mpirun_in_the_allocation(slurm, tmp_path):
    if find_mpirun() is None:
        pytest.fail("mpirun was not found beside this Python or on PATH (the `mpi` extra installs Open MPI)")
    _submit(slurm, "mpi.sbatch", "collective,train", tmp_path)
    check_collective(tmp_path, 2)
    check_train(tmp_path, 2, hierarchical_combine=reference.mean)  # one node: the mean of its ranks


def test_mpi_template_with_srun_and_pmix(slurm, tmp_path):
    reason = _pmix_refusal(slurm)
    if reason:
        pytest.skip(reason)
    _submit(slurm, "mpi.sbatch", "collective", tmp_path, TF_ADASUM_SLURM_SRUN="1")
    check_collective(tmp_path, 2)


def test_multiworker_template_builds_tf_config_from_slurm(slurm, tmp_path):
    _submit(slurm, "multiworker.sbatch", "collective,train", tmp_path)
    check_collective(tmp_path, 2)
    # One device per worker: the hierarchical combine is Adasum over the workers.
    check_train(tmp_path, 2, hierarchical_combine=reference.adasum_tree)


#: The collective and MPI timeouts of the failure test (seconds).
FAILURE_TIMEOUT = 10


@pytest.mark.parametrize("template", ["multiworker.sbatch", "mpi.sbatch"])
def test_a_killed_task_ends_the_job_with_an_error_within_the_timeout(slurm, tmp_path, template):
    # The `killed` task: task 1 dies (exit code 17) in the middle of training.
    timeouts = {"TEST_COLLECTIVE_TIMEOUT": str(FAILURE_TIMEOUT), "TF_ADASUM_MPI_TIMEOUT": str(FAILURE_TIMEOUT)}
    start = time.monotonic()
    code, output = slurm.sbatch(
        str(TEMPLATES / template), WORKER, "killed", str(tmp_path), timeout=JOB_TIMEOUT, env=_job_env(**timeouts)
    )
    elapsed = time.monotonic() - start
    assert code != 0, output
    assert elapsed < FAILURE_TIMEOUT + 90 < JOB_TIMEOUT, (elapsed, output[-3000:])  # not Slurm's time limit
    # srun --kill-on-bad-exit, or mpirun, ends task 0 at once and names task 1's exit code.
    said = {"multiworker.sbatch": "task 1: Exited with exit code 17", "mpi.sbatch": "Exit code:    17"}[template]
    assert said in output, output[-3000:]
