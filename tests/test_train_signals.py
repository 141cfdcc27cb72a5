"""``remat train`` stopped by real signals, in a real process: a second Ctrl-C during a checkpoint
save ends the run with its message and exit 130, the last checkpoint whole; a SIGKILL during a
save leaves a temporary file that the resumed run removes; either way ``--resume`` gives the losses
of a run that was never stopped, bit for bit.

The signals go to the process while its save is under way: the test waits for the save's
temporary file to appear. The model carries a 128 MiB buffer so that a save lasts long enough
(hundreds of milliseconds) for a second signal 20 ms after the first; each test checks that the
save was still under way when the signal went out.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import remat
from remat.files import atomic_write, clear_dead_writers

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX signals")

FACTORY = """
import torch
from remat.models import GPTConfig, build_model
from remat.train.data import VOCAB_SIZE


def ballast_gpt():
    model = build_model(GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=2, n_head=2, n_embd=16))
    model.register_buffer("ballast", torch.zeros(32 * 2**20))  # 128 MiB in every checkpoint
    return model
"""
ARGS = ("--model", "ballast:ballast_gpt", "--steps", "3", "--checkpoint-every", "1", "--global-batch", "2",
        "--seq", "16", "--warmup", "1", "--eval-every", "0")


class Run:
    """``remat train ARGS --out folder/name`` in its own process, output to a file."""

    def __init__(self, folder: Path, name: str, *extra: str) -> None:
        (folder / "ballast.py").write_text(textwrap.dedent(FACTORY))
        self.out = folder / name
        self.log = folder / f"{name}-{len(list(folder.glob(f'{name}-*.txt')))}.txt"
        env = {**os.environ, "PYTHONPATH": str(Path(remat.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "remat", "train", *ARGS, "--out", str(self.out), *extra],
                cwd=folder, stdout=sink, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip

    def temps(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.out) if n.startswith(".checkpoint.pt.") and n.endswith(".tmp"))
        except FileNotFoundError:
            return []

    def wait_for(self, found: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + 300
        while not (value := found()):
            assert self.proc.poll() is None, f"remat train ended early:\n{self.log.read_text()}"
            assert time.monotonic() < deadline, "remat train did not get there in 300 s"
            time.sleep(0.0005)
        return value

    def saving_step_2(self) -> str:
        """Wait until step 1's checkpoint is on disk and step 2's save has begun: its temp file."""
        self.wait_for((self.out / "checkpoint.pt").exists)
        temp: str = self.wait_for(self.temps)[0]
        return temp

    def finish(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=300)
        return code, self.log.read_text()

    def losses(self) -> list[float]:
        return [s["loss"] for s in json.loads((self.out / "log.json").read_text())["steps"]]


def _step(checkpoint: Path) -> int:
    step: int = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["step"]
    return step


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of the run never stopped."""
    run = Run(tmp_path_factory.mktemp("straight"), "run")
    code, text = run.finish()
    assert code == 0, text
    return run.losses()


def test_a_second_ctrl_c_during_a_save_exits_130_with_the_last_checkpoint(
    tmp_path: Path, straight: list[float]
) -> None:
    run = Run(tmp_path, "run")
    temp = run.saving_step_2()
    run.proc.send_signal(signal.SIGINT)  # held until the step ends: the save goes on
    time.sleep(0.02)
    run.proc.send_signal(signal.SIGINT)  # stops the save
    saving = (run.out / temp).exists()
    code, text = run.finish()
    assert saving, "step 2's save ended before the second Ctrl-C; the ballast is too small"
    assert code == 130 and "Traceback" not in text and "Error" not in text, text
    assert "stopped while saving step 2: the last checkpoint stands" in text
    assert f"Interrupted after step 1; checkpoint: {run.out / 'checkpoint.pt'}." in text
    assert f"Resume with: remat train --out {run.out} --resume" in text
    assert run.temps() == [] and _step(run.out / "checkpoint.pt") == 1  # the save abandoned cleanly

    resumed = Run(tmp_path, "run", "--resume")
    code, text = resumed.finish()
    assert code == 0, text
    assert resumed.losses() == straight


def test_a_killed_save_leaves_a_temp_file_that_the_resumed_run_removes(
    tmp_path: Path, straight: list[float]
) -> None:
    run = Run(tmp_path, "run")
    temp = run.saving_step_2()
    run.proc.kill()
    code, _ = run.finish()
    assert code == -signal.SIGKILL and run.temps() == [temp], "killed after step 2's save ended"
    assert _step(run.out / "checkpoint.pt") == 1

    resumed = Run(tmp_path, "run", "--resume")
    code, text = resumed.finish()
    assert code == 0, text
    assert run.temps() == []
    assert resumed.losses() == straight


# --- the two mechanisms, in process ---------------------------------------------------------------


class _Interrupting(io.RawIOBase):
    """A file whose third write is hit by Ctrl-C, as a write is when the signal lands in it."""

    def __init__(self, f: Any) -> None:
        self.f, self.writes = f, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.writes += 1
        if self.writes == 3:
            raise KeyboardInterrupt
        return int(self.f.write(b))


def test_ctrl_c_inside_torch_save_is_a_keyboard_interrupt_and_the_old_file_stands(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"the previous checkpoint")
    state = {"a": torch.randn(100), "b": torch.randn(1000)}
    with pytest.raises(KeyboardInterrupt) as info:  # not torch's "unexpected pos" RuntimeError
        atomic_write(target, lambda f: torch.save(state, _Interrupting(f)))
    assert type(info.value) is KeyboardInterrupt
    assert target.read_bytes() == b"the previous checkpoint"
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_only_the_temp_files_of_dead_writers_of_that_file_are_removed(tmp_path: Path) -> None:
    target = tmp_path / "checkpoint.pt"
    seen: list[str] = []
    atomic_write(target, lambda f: seen.extend(p.name for p in tmp_path.glob(".*.tmp")))
    ours = seen[0]  # .checkpoint.pt.w<host>-<pid>.<random>.tmp
    me = f"-{os.getpid()}."
    assert me in ours
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        host = re.search(r"\.w([0-9a-f]{8})-", ours)
        assert host is not None
        elsewhere = "0" * 8 if host.group(1) != "0" * 8 else "1" * 8
        names = {
            "dead": ours.replace(me, f"-{dead}."),
            "live": ours.replace(me, f"-{sleeper.pid}."),
            "this process": ours,
            "another host": ours.replace(f".w{host.group(1)}-", f".w{elsewhere}-").replace(me, f"-{dead}."),
            "another file": ours.replace(".checkpoint.pt.", ".log.json.").replace(me, f"-{dead}."),
            "a name without a writer": ".checkpoint.pt.k2j4h5g6.tmp",
            "unrelated": "notes.tmp",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"half a checkpoint")
        assert clear_dead_writers(target) == [tmp_path / names["dead"]]
        left = set(os.listdir(tmp_path))
        assert left == {"checkpoint.pt"} | {n for k, n in names.items() if k != "dead"}
    finally:
        sleeper.kill()
        sleeper.wait()
