"""The Kubernetes manifests of examples/kubernetes/, checked offline: they
parse; every object of a built-in kind validates against the Kubernetes API
schema of its kind (strict: an unknown field is an error; the schemas ship in
the `kubernetes-validate` package, nothing is fetched); the TFJob's pod
template validates as a PodTemplate and its own fields are those of Kubeflow's
training operator (whose CRD schema no package here ships); and the Indexed
Job's entrypoint, run as the pod runs it, gives each pod the TF_CONFIG of its
index. No cluster runs here."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is missing: install the `test` extra (make install)"
)

MANIFESTS = pathlib.Path(__file__).resolve().parent.parent / "examples" / "kubernetes"
KUBERNETES_VERSION = "1.37.0"


def _objects(name):
    return [o for o in yaml.safe_load_all((MANIFESTS / name).read_text(encoding="utf-8")) if o]


def _validate(obj):
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def _by_kind(objects):
    return {o["kind"]: o for o in objects}


def test_every_manifest_is_listed_here():
    assert sorted(p.name for p in MANIFESTS.glob("*.yaml")) == ["indexed-job.yaml", "tfjob.yaml"]


def test_the_indexed_job_and_its_service_validate_against_the_api_schema():
    objects = _objects("indexed-job.yaml")
    assert sorted(o["kind"] for o in objects) == ["Job", "Service"]
    for obj in objects:
        _validate(obj)


def test_a_misspelt_field_fails_the_validation():
    job = _by_kind(_objects("indexed-job.yaml"))["Job"]
    job["spec"]["completionMod"] = job["spec"].pop("completionMode")
    with pytest.raises(kubernetes_validate.ValidationError, match="completionMod"):
        _validate(job)


def _entrypoint(job):
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    (script,) = container["args"]
    return container, script


def test_the_indexed_job_its_service_and_its_entrypoint_agree():
    objects = _by_kind(_objects("indexed-job.yaml"))
    job, service = objects["Job"], objects["Service"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container, script = _entrypoint(job)
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    port = container["ports"][0]["containerPort"]
    assert service["spec"]["ports"][0]["port"] == port
    name = job["metadata"]["name"]
    expected = f"--workers {spec['completions']} --job {name} --service {service['metadata']['name']} --port {port}"
    assert f"tf-adasum tf-config kubernetes {expected}" in script


def test_the_entrypoint_gives_each_pod_the_tf_config_of_its_index(tmp_path):
    job = _by_kind(_objects("indexed-job.yaml"))["Job"]
    _, script = _entrypoint(job)
    # The pod's shell, with a stand-in `python` that prints the TF_CONFIG it was started with.
    (tmp_path / "python").write_text('#!/bin/sh\nprintf "%s" "$TF_CONFIG"\n')
    (tmp_path / "python").chmod(0o755)
    path = f"{tmp_path}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}/usr/bin:/bin"
    workers = [f"tf-adasum-{i}.tf-adasum:2222" for i in range(4)]
    for index in range(4):
        result = subprocess.run(
            ["/bin/sh", "-c", script],
            env={"PATH": path, "JOB_COMPLETION_INDEX": str(index)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
    result = subprocess.run(["/bin/sh", "-c", script], env={"PATH": path}, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and result.stdout == ""  # no index: the script never starts
    assert "JOB_COMPLETION_INDEX is not set" in result.stderr


def test_the_tfjob_pod_template_validates_and_its_fields_are_the_operators():
    (tfjob,) = _objects("tfjob.yaml")
    assert (tfjob["apiVersion"], tfjob["kind"]) == ("kubeflow.org/v1", "TFJob")
    assert set(tfjob["spec"]) <= {"runPolicy", "tfReplicaSpecs", "successPolicy", "enableDynamicWorker"}
    assert set(tfjob["spec"]["runPolicy"]) <= {
        "cleanPodPolicy", "backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "schedulingPolicy",
        "suspend", "managedBy",
    }  # fmt: skip
    replica_specs = tfjob["spec"]["tfReplicaSpecs"]
    assert set(replica_specs) <= {"Chief", "Master", "PS", "Worker", "Evaluator"}
    for spec in replica_specs.values():
        assert set(spec) <= {"replicas", "restartPolicy", "template"}
        assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        names = [c["name"] for c in spec["template"]["spec"]["containers"]]
        assert "tensorflow" in names  # the container the operator gives TF_CONFIG and the port
        _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": spec["template"]})
