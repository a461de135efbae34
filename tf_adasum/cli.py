"""The `tf-adasum` command: `eval`, `bench`, `launch`, `tf-config`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = ("collective", "optimizer_step")


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
    unknown = sorted(set(args.names) - set(BENCHMARKS))
    if unknown:
        print(f"tf-adasum bench: unknown benchmark {unknown}; expected some of {list(BENCHMARKS)}.", file=sys.stderr)
        return 2
    for name in args.names or BENCHMARKS:
        code = subprocess.call([sys.executable, os.path.join(folder, f"{name}.py")])
        if code:
            return code
    return 0


def started_as(command: str) -> str:
    """How `command` was started, as its records name it: ``tf-adasum
    COMMAND`` from the console script, else ``python -m tf_adasum.cli
    COMMAND`` (which loads TensorFlow before the command starts)."""
    if os.path.basename(sys.argv[0]) in ("tf-adasum", "tf-adasum.exe"):
        return f"tf-adasum {command}"
    return f"python -m tf_adasum.cli {command}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eval"]:  # the evaluation has its own parser (tf-adasum eval --help)
        from tf_adasum.eval.cli import main as eval_main

        return eval_main(argv[1:], program=started_as("eval"))
    if argv[:1] == ["launch"]:  # so are the launcher's (tf-adasum launch --help)
        from tf_adasum.launch import main as launch_main

        return launch_main(argv[1:])
    if argv[:1] == ["tf-config"]:  # and TF_CONFIG's from a scheduler (tf-adasum tf-config --help)
        from tf_adasum.launcher.tf_config import main as tf_config_main

        return tf_config_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tf-adasum", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run the benchmarks (JSON lines); each script also runs on its own")
    bench.add_argument("names", nargs="*", metavar="NAME", help=f"which ones: {', '.join(BENCHMARKS)} (default: all)")
    bench.set_defaults(run=_bench)
    sub.add_parser("eval", help="the scaling evaluation (see `tf-adasum eval --help`)")
    sub.add_parser("launch", help="start N local workers of a MultiWorkerMirroredStrategy cluster (TF_CONFIG)")
    sub.add_parser("tf-config", help="print this process's TF_CONFIG from a scheduler's variables (Slurm, Kubernetes)")
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
