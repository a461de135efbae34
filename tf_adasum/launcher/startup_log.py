"""TensorFlow's start-up log lines: what `tf-adasum launch` drops from its
workers' output and what the evaluation's quiet start hides.

TensorFlow 2.21 writes these to file descriptor 2 while it is imported,
before its logging reads ``TF_CPP_MIN_LOG_LEVEL``, so they come through
whatever that variable says: the absl preamble ("All log messages before
absl::InitializeLog() ..."), and absl INFO and WARNING records such as
``cpu_feature_guard``'s (two lines) and "oneDNN custom operations are on".
ERROR and FATAL records are never start-up noise. Standard library only.

Examples:
    >>> is_startup_noise(b"I0000 00:00:1796061958.373276    5299 port.cc:153] oneDNN custom operations are on.")
    True
    >>> is_startup_noise(b"E0000 00:00:1796061958.373276    5299 op.cc:1] a real error")
    False
"""

from __future__ import annotations

import re

__all__ = ["is_startup_noise"]

# An absl INFO or WARNING record ("I0000 00:00:1796061958.373276    5299 port.cc:153] ..."),
# what TF_CPP_MIN_LOG_LEVEL=2 hides once it applies; ERROR and FATAL records are kept.
_ABSL_INFO_OR_WARNING = re.compile(rb"^[IW]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w.\-]+:\d+\] ")
_STARTUP_LINES = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"To enable the following instructions:",  # the second line of cpu_feature_guard's record
)


def is_startup_noise(line: bytes) -> bool:
    """Whether `line` is one of TensorFlow's INFO/WARNING start-up log lines."""
    return bool(_ABSL_INFO_OR_WARNING.match(line)) or line.startswith(_STARTUP_LINES)
