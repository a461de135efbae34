"""Entry point for Bazel's py_test: runs pytest on the files given as arguments."""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(sys.argv[1:]))
