"""The README's quickstart is what the examples print: each command of its
``sh`` blocks runs (on a few hundred MNIST images, `--train-examples`, so
it takes seconds), and its output, but for the notices every TensorFlow
import writes on some processors (`tf_adasum.launcher.startup_log`), is line for
line the ``text`` block the README shows after it: words the same, numbers
free (accuracies, times, ports), a JSON line's shown fields equal and its
``...`` the fields left out."""

import json
import os
import re
import subprocess
import sys

import pytest
from multiprocess import worker_env

from tf_adasum.launcher.startup_log import is_startup_notice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A number where the README shows one, with its time unit if any (Keras writes 126ms/step or 6s/step).
QUANTITY = r"-?\d+(?:\.\d+)?(?:ms|us|s)?"
#: Appended to each quickstart command: a quick run (and, for the mirrored example, a private output folder).
QUICK = ["--train-examples", "512"]


def _quickstart() -> list[tuple[str, list[str]]]:
    """(command, the lines shown after it) for each example command of the README's quickstart."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("[start:quickstart]") : text.index("[end:quickstart]")]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    pairs = []
    for (kind, body), (next_kind, shown) in zip(blocks, blocks[1:]):
        if kind == "sh" and next_kind == "text":
            command = [line.split("#")[0].strip() for line in body.splitlines() if "examples/" in line][-1]
            pairs.append((command, shown.splitlines()))
    return pairs


def _matches(shown: str, printed: str) -> bool:
    """Whether a printed line is the shown line up to its numbers (and, for JSON, its ``...``)."""
    if shown.lstrip().startswith(("{", "[worker 0] {")) and shown.endswith(", ...}"):
        prefix = shown[: shown.index("{")]
        if not printed.startswith(prefix):
            return False
        want = json.loads(shown[len(prefix) : -len(", ...}")] + "}")
        got = json.loads(printed[len(prefix) :])
        return all(got.get(key) == value for key, value in want.items())
    parts = re.split(f"({QUANTITY})", shown)
    pattern = "".join(QUANTITY if re.fullmatch(QUANTITY, part) else re.escape(part) for part in parts)
    return re.fullmatch(pattern, printed) is not None


def test_the_quickstart_shows_its_examples():
    commands = [command for command, _ in _quickstart()]
    assert [c.split()[-3:] for c in commands] == [
        ["examples/mnist_mirrored.py", "--epochs", "1"],
        ["examples/mnist_multiworker.py", "--epochs", "1"],
    ], commands


@pytest.mark.multiworker
@pytest.mark.parametrize("example", range(2))
def test_an_example_prints_what_the_quickstart_shows(example, tmp_path):
    command, shown = _quickstart()[example]
    words = command.split()
    assert words[0].startswith(".venv/bin/"), command
    program = words[0].removeprefix(".venv/bin/")
    # As the README runs it, from the repository's root: python, or the tf-adasum entry point.
    argv = [sys.executable] if program == "python" else [sys.executable, "-m", "tf_adasum.launch"]
    argv += words[1:] if program == "python" else words[2:]
    argv += QUICK + (["--out", str(tmp_path)] if "mnist_mirrored" in command else [])
    env = {k: v for k, v in worker_env().items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as a user's shell has it
    result = subprocess.run(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600
    )
    output = result.stdout  # and stderr, in the order a terminal shows them
    assert result.returncode == 0, output[-4000:]
    printed = [line for line in output.splitlines() if line and not is_startup_notice(line.encode())]
    assert len(printed) == len(shown) and all(map(_matches, shown, printed)), (
        "the README shows:\n" + "\n".join(shown) + "\n\nthe example printed:\n" + "\n".join(printed)
    )
