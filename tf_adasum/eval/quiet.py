"""A quiet start for the command line: TensorFlow's start-up log lines hidden,
anything else it writes kept.

TensorFlow 2.21 writes log lines to file descriptor 2 while it is imported,
before its logging reads ``TF_CPP_MIN_LOG_LEVEL``: the absl preamble and
``oneDNN custom operations are on`` come through whatever that variable says
(``TF_ENABLE_ONEDNN_OPTS=0`` would hide the latter by changing kernels, and so
results and timings). `import_tensorflow` sets ``TF_CPP_MIN_LOG_LEVEL=2``
(unless set already), which hides the INFO and WARNING lines of the run, and
imports TensorFlow with file descriptor 2 sent to a temporary file; then it
writes back every line that is not one of those start-up lines, so errors are
never hidden. Only the command line uses this; ``import tf_adasum`` does not.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

from tf_adasum.launcher.startup_log import is_startup_noise  # what the quiet start hides

__all__ = ["QUIET_ENVIRONMENT", "import_tensorflow", "is_startup_noise", "stderr_filtered"]

#: What a quiet command sets in its environment (and its worker processes'), unless already set.
QUIET_ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "2"}


@contextlib.contextmanager
def stderr_filtered(keep=lambda line: not is_startup_noise(line)):
    """Sends file descriptor 2 to a temporary file while the block runs, then
    writes back to it the lines for which `keep` is true (everything else the
    block wrote, from Python or C++, in order)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured.read().splitlines(keepends=True) if keep(line))
            while kept:
                kept = kept[os.write(2, kept) :]


def import_tensorflow(verbose: bool = False) -> None:
    """Imports TensorFlow and Keras, quietly unless `verbose` (see the module docstring).

    Call it before anything imports TensorFlow; once TensorFlow is loaded it
    changes nothing.
    """
    if "tensorflow" in sys.modules:
        return
    if verbose:
        import keras  # noqa: F401
        import tensorflow  # noqa: F401

        return
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    with stderr_filtered():
        import keras  # noqa: F401
        import tensorflow  # noqa: F401
