"""Every command and Python example in the README runs (except `make ...`, which runs this suite)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


PYTHON_BLOCKS = _blocks("python")
COMMANDS = [
    line.split("#")[0].strip()
    for block in _blocks("bash")
    for line in block.splitlines()
    if line.strip().startswith(("remat ", "python "))
]


def test_readme_opens_with_the_two_commands() -> None:
    first = _blocks("bash")[0]
    assert "make demo" in first and "make test" in first
    makefile = (ROOT / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test\n" in ci and "make test-slow" in ci and "\ntest-slow:" in makefile  # both tiers (tests/_tiers.py)


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_python_examples_run(code: str, tmp_path: Path) -> None:
    script = "import torch\ntorch.set_num_threads(1)\n" + code
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=300,
                   capture_output=True, text=True)


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("remat train") else c
                                     for c in COMMANDS], ids=COMMANDS)  # `remat train`: 40-100 s
def test_commands_run(command: str, tmp_path: Path) -> None:
    argv = shlex.split(command)
    exe = BIN / argv[0]
    argv[0] = str(exe) if exe.exists() else argv[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "120"}
    out = subprocess.run(argv, cwd=tmp_path, timeout=600, capture_output=True, text=True, env=env)
    # 0: it fits; 1: a clear "Error:" answer (e.g. "does not fit, the smallest budget is ...")
    assert out.returncode in (0, 1), out.stderr[-2000:]
    if out.returncode == 1:
        assert "Error:" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
