"""`tf_adasum.launcher.tf_config`: TF_CONFIG from Slurm's variables (no Slurm needed:
node lists are expanded by a stand-in for ``scontrol show hostnames``; the
real one runs in tests/test_slurm.py)."""

import json
import os
import subprocess
import sys

import pytest

from tf_adasum.launcher import tf_config

NODES = {"node[01-03],gpu7": ["node01", "node02", "node03", "gpu7"], "vm": ["vm"]}


def _slurm(procid, nodelist="node[01-03],gpu7", tasks="2(x3),1", **extra):
    return {"SLURM_PROCID": str(procid), "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_TASKS_PER_NODE": tasks, **extra}


@pytest.mark.parametrize(
    "value, counts", [("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,3(x2)", [1, 3, 3]), (" 2 , 1 ", [2, 1])]
)
def test_tasks_per_node(value, counts):
    assert tf_config.tasks_per_node(value) == counts


def test_every_task_is_a_worker_in_block_order():
    configs = [tf_config.from_slurm(_slurm(rank), port_base=9000, hostnames=NODES.get) for rank in range(7)]
    workers = ["node01:9000", "node01:9001", "node02:9000", "node02:9001", "node03:9000", "node03:9001", "gpu7:9000"]
    for rank, config in enumerate(configs):
        assert config == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}


def test_the_job_variables_stand_in_for_the_steps():
    env = {"SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "2"}
    config = tf_config.from_slurm(env, hostnames=NODES.get)
    assert config["cluster"]["worker"] == ["vm:8888", "vm:8889"] and config["task"]["index"] == 1


@pytest.mark.parametrize(
    "env, port_base, match",
    [
        ({}, 8888, r"SLURM_PROCID is not set: run this inside an srun step"),
        (_slurm("one"), 8888, r"SLURM_PROCID must be a non-negative integer. Received: SLURM_PROCID='one'"),
        (_slurm(7), 8888, r"SLURM_PROCID is not one of the step's 7 tasks. Received: SLURM_PROCID=7"),
        (_slurm(0, tasks="2(x3)"), 8888, r"names 4 nodes but SLURM_STEP_TASKS_PER_NODE gives 3 counts"),
        (_slurm(0, tasks="2x3"), 8888, r"must look like '2\(x3\),1'. Received: SLURM_STEP_TASKS_PER_NODE='2x3'"),
        (_slurm(0, SLURM_DISTRIBUTION="cyclic"), 8888, r"default distribution. Received: SLURM_DISTRIBUTION='cyclic'"),
        (_slurm(0), 0, r"`port_base` must be an int in \[1, 65535\]. Received: port_base=0"),
        (_slurm(0), 65535, r"`port_base` leaves no port for 2 tasks a node. Received: port_base=65535"),
    ],
)
def test_bad_variables_name_themselves(env, port_base, match):
    with pytest.raises(tf_config.SchedulerError, match=match):
        tf_config.from_slurm(env, port_base=port_base, hostnames=NODES.get)


def test_the_command_prints_the_config_or_one_line_of_error(tmp_path):
    # A stand-in scontrol on PATH, as srun's tasks would find Slurm's.
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames vm" ] && echo vm\n')
    scontrol.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", **_slurm(1, nodelist="vm", tasks="2")}
    command = [os.path.join(os.path.dirname(sys.executable), "tf-adasum"), "tf-config", "slurm", "--port-base", "7000"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # nothing said
    expected = {"cluster": {"worker": ["vm:7000", "vm:7001"]}, "task": {"type": "worker", "index": 1}}
    assert json.loads(result.stdout) == expected
    result = subprocess.run(command, env={"PATH": env["PATH"]}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "tf-adasum tf-config: SLURM_PROCID is not set: run this inside an srun step (one task per worker)"
    ]


def test_each_indexed_job_pod_is_the_worker_of_its_index():
    for index in range(3):
        config = tf_config.from_kubernetes(3, "train", "workers", env={"JOB_COMPLETION_INDEX": str(index)})
        workers = [f"train-{i}.workers:2222" for i in range(3)]
        assert config == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}


@pytest.mark.parametrize(
    "args, env, match",
    [
        ((2, "j", "s"), {}, r"JOB_COMPLETION_INDEX is not set"),
        ((2, "j", "s"), {"JOB_COMPLETION_INDEX": "2"}, r"below `workers` \(2\). Received: JOB_COMPLETION_INDEX=2"),
        ((0, "j", "s"), {"JOB_COMPLETION_INDEX": "0"}, r"`workers` must be an int >= 1. Received: workers=0"),
        ((2, "Train", "s"), {"JOB_COMPLETION_INDEX": "0"}, r"`job` must be a Kubernetes name .* job='Train'"),
        ((2, "j", "s.x"), {"JOB_COMPLETION_INDEX": "0"}, r"`service` must be a Kubernetes name .* service='s.x'"),
        ((2, "j", "s", 70000), {"JOB_COMPLETION_INDEX": "0"}, r"`port` must be an int in \[1, 65535\]"),
    ],
)
def test_bad_kubernetes_settings_name_themselves(args, env, match):
    with pytest.raises(tf_config.SchedulerError, match=match):
        tf_config.from_kubernetes(*args, env=env)


def test_the_command_loads_no_tensorflow():
    # The console script's own start (sys.argv[0] is tf-adasum), then its answer.
    code = (
        "import sys; sys.argv = ['tf-adasum', 'tf-config', 'slurm']; from tf_adasum import cli; "
        "code = cli.main(sys.argv[1:]); assert 'tensorflow' not in sys.modules, 'tensorflow was loaded'; "
        "sys.exit(0 if code == 2 else 1)"
    )
    result = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
