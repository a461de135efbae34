"""The `tf-adasum` command: `eval`, `bench`, `launch`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = ("collective.py", "optimizer_step.py")


def _bench(args: argparse.Namespace) -> int:
    """Runs the benchmarks of a source checkout; each prints JSON lines."""
    folder = os.path.join(_REPO, "benchmarks")
    if not os.path.isdir(folder):
        print(
            f"tf-adasum bench: no benchmarks/ folder next to the package ({folder}); "
            "run it from a source checkout (`pip install -e .`).",
            file=sys.stderr,
        )
        return 2
    for name in BENCHMARKS:
        code = subprocess.call([sys.executable, os.path.join(folder, name), *args.bench_args])
        if code:
            return code
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tf_adasum.eval.cli import main as eval_main

    return eval_main(args.eval_args)


def _not_built(what: str, issue: str):
    def run(args: argparse.Namespace) -> int:
        print(f'tf-adasum {what}: not built yet (see the issue "{issue}").', file=sys.stderr)
        return 2

    return run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tf-adasum", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run the benchmarks (JSON lines)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to each benchmark")
    bench.set_defaults(run=_bench)
    evaluation = sub.add_parser("eval", help="the scaling evaluation (see `tf-adasum eval --help`)", add_help=False)
    evaluation.add_argument("eval_args", nargs=argparse.REMAINDER)
    evaluation.set_defaults(run=_eval)
    sub.add_parser("launch", help="start N local workers with TF_CONFIG").set_defaults(
        run=_not_built("launch", "Multi-worker")
    )
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
