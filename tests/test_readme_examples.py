"""The README's quoted console output is what the command prints: the "did you mean" block, an
indented block with the next paragraph run into it, quoted output the command did not print; it is
a ```console block now, checked here line by line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.train_runner import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def _console_blocks(text: str) -> list[list[str]]:
    """The ```console blocks of a markdown text, as lines."""
    return [block.splitlines() for block in re.findall(r"^```console\n(.*?)^```$", text, re.M | re.S)]


def test_every_readme_console_block_is_what_its_command_prints() -> None:
    blocks = _console_blocks((ROOT / "README.md").read_text())
    assert blocks, "README.md has no ```console block"
    for lines in blocks:
        command, expected = lines[0], lines[1:]
        assert command.startswith("$ python train.py "), command
        args = command.removeprefix("$ python train.py ").split()
        proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env=subprocess_env(OMP_NUM_THREADS="1"))
        assert (proc.stdout + proc.stderr).strip().splitlines() == expected, proc.stdout + proc.stderr

