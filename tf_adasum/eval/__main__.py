"""`python -m tf_adasum.eval`: the scaling evaluation."""

import sys

from tf_adasum.eval.cli import main

sys.exit(main(program="python -m tf_adasum.eval"))
