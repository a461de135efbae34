"""TensorFlow's start-up log lines: what the evaluation's quiet start hides
and what `tf-adasum launch` drops from its workers' output.

TensorFlow 2.21 writes log lines to file descriptor 2 while it is imported,
before its logging reads ``TF_CPP_MIN_LOG_LEVEL``, so they come through
whatever that variable says: the absl preamble ("All log messages before
absl::InitializeLog() ..."), and absl INFO and WARNING records such as
``cpu_feature_guard``'s (two lines) and ``port.cc``'s "oneDNN custom
operations are on".

* `is_startup_noise`: any absl INFO or WARNING record or the preamble; for
  output captured while TensorFlow is imported (`tf_adasum.eval.quiet`).
* `is_startup_notice`: only the notices every import writes (the preamble,
  the CPU-feature notice, the oneDNN notice); `tf-adasum launch` drops these
  from a worker's whole output, so that a warning the worker logs later
  still reaches the user.

ERROR and FATAL records are neither. Standard library only.

Examples:
    >>> is_startup_noise(b"I0000 00:00:1796061958.373276    5299 port.cc:153] oneDNN custom operations are on.")
    True
    >>> is_startup_notice(b"I0000 00:00:1796061958.373276    5299 port.cc:153] oneDNN custom operations are on.")
    True
    >>> is_startup_notice(b"W0000 00:00:1796061958.373276    5299 collective_ops.cc:9] a warning at run time")
    False
    >>> is_startup_noise(b"E0000 00:00:1796061958.373276    5299 op.cc:1] a real error")
    False
"""

from __future__ import annotations

import re

__all__ = ["is_startup_noise", "is_startup_notice"]

# An absl INFO or WARNING record ("I0000 00:00:1796061958.373276    5299 port.cc:153] ..."),
# what TF_CPP_MIN_LOG_LEVEL=2 hides once it applies; ERROR and FATAL records are kept.
_ABSL_INFO_OR_WARNING = re.compile(rb"^[IW]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ ([\w.\-]+):\d+\] ")
_STARTUP_LINES = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"To enable the following instructions:",  # the second line of cpu_feature_guard's record
)
# The sources of the notices every import writes: the CPU features TensorFlow was not built for,
# and oneDNN's kernels being on.
_NOTICE_SOURCES = (b"cpu_feature_guard.cc", b"port.cc")


def is_startup_noise(line: bytes) -> bool:
    """Whether `line` is one of TensorFlow's INFO/WARNING start-up log lines."""
    return bool(_ABSL_INFO_OR_WARNING.match(line)) or line.startswith(_STARTUP_LINES)


def is_startup_notice(line: bytes) -> bool:
    """Whether `line` is one of the notices every TensorFlow import writes
    (the preamble, the CPU-feature and oneDNN notices), whatever
    ``TF_CPP_MIN_LOG_LEVEL`` says."""
    if line.startswith(_STARTUP_LINES):
        return True
    record = _ABSL_INFO_OR_WARNING.match(line)
    return bool(record) and record.group(1) in _NOTICE_SOURCES
