"""The README's quoted console output is what the command prints: the "did you mean" block, an
indented block with the next paragraph run into it, quoted output the command did not print; it is
a ```console block now, checked here line by line (a ``...`` line stands for lines a block leaves
out). The dry-run blocks end "does not fit" with the layouts that fit, as the dry run prints them."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.train_runner import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _console_blocks(text: str) -> list[list[str]]:
    """The ```console blocks of a markdown text, as lines."""
    return [block.splitlines() for block in re.findall(r"^```console\n(.*?)^```$", text, re.M | re.S)]


def _matches(lines: list[str], expected: list[str]) -> bool:
    """Whether ``lines`` are ``expected``, where an expected line ``...`` stands for any lines (or
    none): a block may leave out what comes before and after the part it shows."""
    if not expected:
        return not lines
    if expected[0] == "...":
        return any(_matches(lines[i:], expected[1:]) for i in range(len(lines) + 1))
    return bool(lines) and lines[0] == expected[0] and _matches(lines[1:], expected[1:])


def test_console_block_wildcards() -> None:
    assert _matches(["a", "b", "c"], ["...", "b", "..."]) and _matches(["b"], ["...", "b", "..."])
    assert not _matches(["a", "b", "c"], ["...", "c", "b"]) and not _matches(["a", "b"], ["a"])


def test_every_readme_console_block_is_what_its_command_prints() -> None:
    blocks = _console_blocks((ROOT / "README.md").read_text())
    assert blocks, "README.md has no ```console block"
    for lines in blocks:
        assert lines[0].startswith("$ python train.py "), lines[0]
    # The commands run at once (two dry runs of glm5_2 take ~25 s each): stdout and stderr to files.
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, lines in enumerate(blocks):
            args = lines[0].removeprefix("$ python train.py ").split()
            out = open(Path(tmp) / f"{i}.txt", "w+")  # noqa: SIM115 - closed below
            procs.append((subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT,
                                           stdout=out, stderr=subprocess.STDOUT, text=True,
                                           env=subprocess_env(OMP_NUM_THREADS="1")), out, lines[1:]))
        for proc, out, expected in procs:
            proc.wait(timeout=240)
            out.seek(0)
            text = out.read()
            out.close()
            assert _matches(text.strip().splitlines(), expected), text
