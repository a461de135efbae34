"""A preemption notice: SIGTERM or SIGUSR1, caught while `fit` runs, acted on between batches.

`tf_adasum.BackupAndRestore(save_before_preemption=True)` catches the
signals of `PREEMPTION_SIGNALS` for the length of a `fit`: the handler only
notes the signal; after each batch the processes agree (one tiny sum) on
whether any caught one, back up, and exit with `PREEMPTED_EXIT_CODE`. A
notice still pending when the handlers are given back (it came after the last
batch's check) goes to the handler that was there before. The signal and
the exit code are the elastic launcher's (`tf_adasum.launcher.helper`), which
ends a round for a resize with that signal and reads that code. Standard
library only.
"""

from __future__ import annotations

import os
import signal

from tf_adasum.launcher.helper import NOTICE_SIGNAL, PREEMPTED_EXIT_CODE

__all__ = ["PREEMPTED_EXIT_CODE", "PREEMPTION_SIGNALS", "PreemptionNotice"]

#: The notices caught: SIGTERM (Kubernetes, the clouds' preemptions), SIGUSR1 (Slurm's ``--signal=USR1@T``;
#: mpirun forwards it to its ranks; the elastic launcher's resize). Every process then exits with
#: `PREEMPTED_EXIT_CODE`, 143 (128 + SIGTERM, as a shell shows it).
PREEMPTION_SIGNALS = (signal.SIGTERM, NOTICE_SIGNAL)


class PreemptionNotice:
    """The notices caught between `catch` and `release` (see the module docstring)."""

    def __init__(self):
        self.pending = 0  # the signal caught and not yet acted on (0: none)
        self._previous: dict = {}

    def catch(self) -> None:
        """Notes each of `PREEMPTION_SIGNALS` from now on; a `RuntimeError`
        outside the main thread (where Python allows no handler)."""
        self.release(resend=False)  # one left by an earlier `fit` that raised
        self.pending = 0

        def note(signum, frame):
            self.pending = signum

        try:
            self._previous = {signum: signal.signal(signum, note) for signum in PREEMPTION_SIGNALS}
        except ValueError as e:
            raise RuntimeError(
                "BackupAndRestore(save_before_preemption=True) catches SIGTERM and SIGUSR1, which Python allows "
                f"in the main thread only: call `fit` there. ({e})"
            ) from e

    def release(self, resend: bool = True) -> None:
        """The handlers as they were before `catch`; a pending notice goes to
        them when `resend`."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        pending, self.pending = self.pending, 0
        if pending and resend:
            os.kill(os.getpid(), pending)
