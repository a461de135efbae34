"""The parts of `tf-adasum launch` and `tf-adasum tf-config` (standard library only, nothing else of ours).

* `helper.py`: the helper program every launched process starts through (run
  by path with ``python -I -S``): a worker's supervisor, the maker of a
  private network or of emulated hosts, the way onto an emulated host.
* `processes.py`: the launcher's side of it: namespaces received, workers run
  and stopped.
* `tf_config.py`: each worker's ``TF_CONFIG``: the launcher's, a Slurm
  task's, a Kubernetes pod's.
* `mpirun.py`: Open MPI's ``mpirun`` and its command lines.

`tf_adasum.launch` is the face (`launch`, ``tf-adasum launch``).
"""
