"""Elastic runs of ``tf-adasum launch``: the workers relaunched when one fails, at the size that is available.

A run is a series of rounds. Each round starts as many workers as are
available (at most ``-n``, at least ``--min-workers``) and ends when they end:

* all exit 0: training finished, the launcher exits 0;
* one fails (an exit code, a kill): the others are stopped, and the next
  round starts if fewer than ``--max-restarts`` rounds have failed so far
  (else the launcher exits with that code);
* the count available changes (``--discover``, asked every second while no
  worker has exited): every worker's process group gets SIGUSR1
  (`helper.NOTICE_SIGNAL`), a preemption notice, so that with
  ``tf_adasum.BackupAndRestore(save_before_preemption=True)`` they back up
  after their batch and exit with 143; the next round starts at the new
  size, and such a round does not count as failed (a worker that exits
  otherwise after the notice fails the round; one that exits 0 ends the run:
  training finished).

The training script resumes from its backup at each round's start: that is
what makes the rounds one run. Each worker finds its round in
``TF_ADASUM_ELASTIC_ROUND`` (0, 1, ...).

Logical replicas (``--logical-replicas L``, for `tf_adasum.SimulatedReplicas`
with ``num_replicas=L``, on workers or with ``--mpirun``): a round runs on the largest
count that holds L (`holding_counts`: each process's L / M replicas a subtree of
Adasum's tree; every divisor of L when L is a power of two), the other
available workers spare: 3 available for L = 8 run 2. The workers find L in
``TF_ADASUM_LOGICAL_REPLICAS``, and `SimulatedReplicas` refuses another.

The discovery command (``--discover "CMD"``, run by the shell) prints the
number of workers that can run now, one integer; without it, ``-n`` are
always available. Below the minimum, the launcher asks again every second
for ``--wait`` seconds, then fails with one error. A discovery command that
fails, hangs (`DISCOVERY_TIMEOUT_SECONDS`) or prints anything else is one
error that stops the run, its workers first.

Standard library only, and nothing of ours outside this folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

from . import helper  # the package beside it, whether tf_adasum.launcher or, run by path, launcher

#: The variable that tells each worker its round.
ROUND_VARIABLE = "TF_ADASUM_ELASTIC_ROUND"
#: The variable that tells each worker the job's logical replicas (``--logical-replicas``).
REPLICAS_VARIABLE = "TF_ADASUM_LOGICAL_REPLICAS"
#: Seconds a discovery command may run.
DISCOVERY_TIMEOUT_SECONDS = 30.0
#: Seconds between two discoveries while waiting for the minimum.
WAIT_POLL_SECONDS = 1.0
_COUNT = re.compile(r"\s*(\d{1,6})\s*")


def holding_counts(replicas: int) -> list[int]:
    """The process counts M that can hold `replicas` logical replicas: M
    divides them and each process's contiguous block of replicas / M is a
    subtree of Adasum's tree (`tf_adasum.reference.block_sizes`, here
    without numpy). The tree: with 2^p the largest power of two not above L
    and r = L - 2^p, leaf v is ranks 2v and 2v + 1 for v < r, else rank
    v + r; its subtrees are runs of 2^k leaves starting at multiples of 2^k,
    and single ranks."""
    leaves = 1 << (replicas.bit_length() - 1)
    folded = replicas - leaves

    def first_rank(leaf: int) -> int:
        return replicas if leaf == leaves else 2 * leaf if leaf < folded else leaf + folded

    spans = {(rank, rank + 1) for rank in range(replicas)}
    width = 1
    while width <= leaves:
        spans.update((first_rank(u), first_rank(u + width)) for u in range(0, leaves, width))
        width *= 2
    counts = [m for m in range(1, replicas + 1) if replicas % m == 0]
    return [m for m in counts if all((p * replicas // m, (p + 1) * replicas // m) in spans for p in range(m))]


class ElasticError(RuntimeError):
    """An elastic run cannot go on: discovery failed, or too few workers for too long."""


class Elastic(NamedTuple):
    """The elastic settings of a launch (see the module docstring)."""

    min_workers: int
    max_workers: int
    max_restarts: int = 0
    discover: str | None = None
    wait_seconds: float = 60.0
    logical_replicas: int | None = None

    def check(self) -> Elastic:
        """Itself, or a `TypeError` or `ValueError` naming the argument and the value received."""
        for name in ("min_workers", "max_workers", "max_restarts"):
            value, least = getattr(self, name), 0 if name == "max_restarts" else 1
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"`{name}` must be an int. Received: {name}={value!r}")
            if value < least:
                raise ValueError(f"`{name}` must be an int >= {least}. Received: {name}={value!r}")
        if self.min_workers > self.max_workers:
            raise ValueError(
                "`min_workers` must not exceed the workers asked for (-n). Received: "
                f"min_workers={self.min_workers}, max_workers={self.max_workers}"
            )
        if self.discover is not None and not isinstance(self.discover, str):
            raise TypeError(f"`discover` must be a shell command (str). Received: discover={self.discover!r}")
        if self.discover is not None and not self.discover.strip():
            raise ValueError(f"`discover` must be a shell command. Received: discover={self.discover!r}")
        if isinstance(self.wait_seconds, bool) or not isinstance(self.wait_seconds, (int, float)):
            raise TypeError(f"`wait_seconds` must be a number. Received: wait_seconds={self.wait_seconds!r}")
        if not self.wait_seconds >= 0:
            raise ValueError(f"`wait_seconds` must be a number >= 0. Received: wait_seconds={self.wait_seconds!r}")
        replicas = self.logical_replicas
        if replicas is not None:
            if isinstance(replicas, bool) or not isinstance(replicas, int):
                raise TypeError(f"`logical_replicas` must be an int or None. Received: logical_replicas={replicas!r}")
            if replicas < 1:
                raise ValueError(f"`logical_replicas` must be an int >= 1. Received: logical_replicas={replicas!r}")
            counts = holding_counts(replicas)
            for name in ("max_workers", "min_workers"):
                if getattr(self, name) not in counts:
                    raise ValueError(
                        f"`{name}` must be a count of workers that can hold logical_replicas={replicas} (each "
                        f"worker's replicas a subtree of the tree): one of {counts}. Received: "
                        f"{name}={getattr(self, name)}"
                    )
        return self

    def usable(self, count: int) -> int:
        """Of `count` workers available, how many a round runs: the largest
        that holds `logical_replicas` (the rest spare), or `count` without them."""
        if self.logical_replicas is None:
            return count
        return max([m for m in holding_counts(self.logical_replicas) if m <= count], default=0)

    def is_elastic(self) -> bool:
        """Whether these settings ask for rounds (else: one launch, as without them)."""
        return self.min_workers < self.max_workers or self.max_restarts > 0 or self.discover is not None

    def available(self) -> int:
        """The workers that can run now, at most `max_workers` (the discovery
        command's answer, or `max_workers` without one)."""
        if self.discover is None:
            return self.max_workers
        command = subprocess.Popen(
            self.discover,
            shell=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a group of its own: a command that hangs goes with its children
        )
        try:
            stdout, stderr = command.communicate(timeout=DISCOVERY_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(command.pid, signal.SIGKILL)
            command.communicate()
            raise ElasticError(
                f"the discovery command {self.discover!r} did not answer within {DISCOVERY_TIMEOUT_SECONDS:g} s"
            ) from None
        if command.returncode != 0:
            raise ElasticError(
                f"the discovery command {self.discover!r} exited with code {command.returncode}: "
                f"{stderr.strip()[-500:] or '(no output on stderr)'}"
            )
        match = _COUNT.fullmatch(stdout)
        if match is None:
            raise ElasticError(
                f"the discovery command {self.discover!r} must print the number of workers that can run now "
                f"(one integer, e.g. 4). Received: {stdout[:200]!r}"
            )
        return min(int(match.group(1)), self.max_workers)

    def wait_for_minimum(self) -> int:
        """The workers a round runs (`usable`), once at least `min_workers`;
        an `ElasticError` naming the count available after `wait_seconds` below it."""
        deadline = time.monotonic() + self.wait_seconds
        while True:
            available = self.available()
            if self.usable(available) >= self.min_workers:
                return self.usable(available)
            if time.monotonic() >= deadline:
                raise ElasticError(
                    f"{available} workers available, fewer than --min-workers {self.min_workers}, for "
                    f"{self.wait_seconds:g} s (the discovery command {self.discover!r})"
                )
            time.sleep(WAIT_POLL_SECONDS)


#: The elastic arguments of `tf_adasum.launch.launch` and their options on the command line.
OPTIONS = {
    "min_workers": "--min-workers",
    "max_workers": "-n",
    "max_restarts": "--max-restarts",
    "discover": "--discover",
    "wait_seconds": "--wait",
    "logical_replicas": "--logical-replicas",
    "hosts": "--hosts",
}


def settings(
    num_workers, min_workers, max_restarts, discover, wait_seconds, hosts=None, logical_replicas=None
) -> Elastic:
    """`launch`'s elastic arguments, checked (a `TypeError` or `ValueError` naming the argument)."""
    elastic = Elastic(num_workers if min_workers is None else min_workers, num_workers, max_restarts)
    elastic = elastic._replace(discover=discover, wait_seconds=wait_seconds, logical_replicas=logical_replicas)
    elastic = elastic.check()
    if elastic.min_workers < num_workers and discover is None:
        raise ValueError(
            "`min_workers` below the workers asked for needs `discover` (without it every worker is always "
            f"available). Received: min_workers={elastic.min_workers}, discover=None"
        )
    if elastic.is_elastic() and hosts is not None and elastic.min_workers < hosts:
        raise ValueError(
            "An elastic run on emulated hosts keeps at least one worker a host: `min_workers` >= `hosts`. "
            f"Received: hosts={hosts}, min_workers={elastic.min_workers}"
        )
    return elastic


def as_options(message: str) -> str:
    """An error message of `settings` with the command line's option names."""
    for name, option in OPTIONS.items():
        message = message.replace(f"`{name}`", option).replace(f"{name}=", f"{option} ")
    return message


def add_options(parser) -> None:
    """The elastic options of ``tf-adasum launch``."""
    parser.add_argument(
        "--min-workers",
        type=int,
        metavar="M",
        help="elastic, with --discover: run with as few as M workers (default -n), waiting up to --wait seconds",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="elastic: relaunch the workers after a failure up to R times; they resume from their backup",
    )
    parser.add_argument(
        "--discover",
        metavar="CMD",
        help="elastic: a shell command printing how many workers can run now (one integer), asked every second",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="S",
        help="elastic: seconds to wait for --min-workers before failing (default 60)",
    )
    parser.add_argument(
        "--logical-replicas",
        type=int,
        metavar="L",
        help="the job's replica count (tf_adasum.SimulatedReplicas): each round runs the largest "
        "count of workers that holds L, the others spare",
    )


def say(message: str) -> None:
    print(f"tf-adasum launch: {message}", file=sys.stderr, flush=True)


def run(elastic: Elastic, start_round: Callable[[int, int, Callable[[], bool]], int]) -> int:
    """Runs rounds until training finishes, the restart limit is reached or
    an `ElasticError` ends the run (see the module docstring).

    `start_round(round, workers, resize)` runs one round and returns its exit
    code; it asks `resize()` every second whether the available count changed.

    Returns:
      0 when a round finished training, else the failed round's exit code.
    """
    failures, round_number = 0, 0
    while True:
        workers = elastic.wait_for_minimum()
        changed: list[int] = []

        def resize(workers: int = workers, changed: list[int] = changed) -> bool:
            count = elastic.usable(elastic.available())
            if count != workers and count >= elastic.min_workers:
                changed.append(count)
                return True
            return False

        say(f"round {round_number}: {workers} workers")
        code = start_round(round_number, workers, resize)
        round_number += 1
        if code == 0:
            return 0
        if changed and code in helper.NOTICE_EXIT_CODES:
            say(f"round {round_number - 1} ended for a resize to {changed[0]} workers (exit code {code})")
            continue
        failures += 1
        if failures > elastic.max_restarts:
            say(
                f"a worker failed with exit code {code}; the restart limit (--max-restarts {elastic.max_restarts}) "
                "is reached: the run ends"
            )
            return code
        say(f"a worker failed with exit code {code}; restart {failures} of {elastic.max_restarts}")
