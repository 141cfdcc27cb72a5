"""torch.compile over a model with a plan applied (CPU, inductor): it compiles, remat adds no graph
break, gradients equal plain eager PyTorch's to round-off (compile reorders float ops), the plan's
memory saving survives compilation, and BatchNorm statistics move once.

# NOTE [ Isolated compile tests ]
Inductor's generated CPU code can kill the process: on a 2-core AMD EPYC machine, torch 2.13.0
aborted (``free(): invalid next size (normal)``, ``Fatal Python error: Aborted``) inside the compiled
backward of a small BatchNorm ConvNet compiled with ``fullgraph=True`` and no remat at all, under
``torch.set_num_threads(1)``; with torch's default thread count it ran (docs/integrations.md). A dead
pytest worker takes the whole suite down, so every case here runs in a subprocess of its own
(tests/_compile_cases.py). A case that exits with a failed check fails its test with the case's
traceback. A case that dies by a signal is run again as its control, the same model compiled the
same way without remat: when the control dies too, the crash is torch's and the test is skipped with
that reason; when the control lives, the crash is remat's and the test fails.

Dropout is off here: compiled code draws its own random numbers (inductor's RNG), so a compiled
step never matches an eager one bit for bit with dropout on, plan or no plan.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("_compile_cases.py")
TIMEOUT_S = 600


def _run(case: str, *, control: bool = False, threads: int | None = 1) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(CASES), case]
    cmd += ["--control"] if control else []
    cmd += [] if threads is None else ["--threads", str(threads)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}{' --control' if control else ''} ran past {TIMEOUT_S} s")


def _death(proc: subprocess.CompletedProcess[str]) -> str | None:
    """How the process died (a signal), or None when it exited."""
    if proc.returncode >= 0:
        return None
    try:
        name = signal.Signals(-proc.returncode).name
    except ValueError:
        name = f"signal {-proc.returncode}"
    last = next((ln for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "")
    first = next((ln for ln in proc.stderr.splitlines() if "free()" in ln or "Fatal" in ln), last)
    return f"{name} ({first.strip()[:160]})" if first else name


def verdict(case: str, *, threads: int | None = 1) -> tuple[str, str]:
    """("pass" | "fail" | "skip", why) for ``case`` (NOTE [ Isolated compile tests ])."""
    proc = _run(case, threads=threads)
    if proc.returncode == 0:
        return "pass", ""
    death = _death(proc)
    if death is None:
        return "fail", f"{case} failed:\n{proc.stderr[-6000:]}"
    control = _run(case, control=True, threads=threads)
    control_death = _death(control)
    if control_death is not None:
        return "skip", (
            f"torch.compile itself aborts on this CPU: the same model compiled without remat dies "
            f"too ({control_death}); see docs/integrations.md, Known issues"
        )
    return "fail", (
        f"{case} died by {death} with remat, while the same model compiled without remat ran "
        f"(exit {control.returncode}):\n{proc.stderr[-6000:]}"
    )


def check(case: str, *, threads: int | None = 1) -> None:
    outcome, why = verdict(case, threads=threads)
    if outcome == "skip":
        pytest.skip(why)
    if outcome == "fail":
        pytest.fail(why, pytrace=False)


def test_the_harness_skips_a_crash_torch_has_without_remat() -> None:
    outcome, why = verdict("aborts")
    assert outcome == "skip", why
    assert "torch.compile itself aborts on this CPU" in why and "SIGABRT" in why, why
    assert "free(): invalid next size" in why, why


def test_the_harness_fails_a_crash_only_remat_has() -> None:
    outcome, why = verdict("aborts_with_remat_only")
    assert outcome == "fail", why
    assert "SIGABRT" in why and "without remat ran" in why, why


@pytest.mark.slow  # each compiles a forward and a backward graph, or two (20-40 s)
def test_fullgraph_with_recompute_and_selective() -> None:
    check("fullgraph_gpt")


@pytest.mark.slow
def test_compiled_transformers_model_keeps_the_saving() -> None:
    pytest.importorskip("transformers")
    check("transformers_gpt2")


@pytest.mark.slow
def test_batchnorm_statistics_move_once_when_compiled() -> None:
    # torch's default thread count: the configuration that compiles on the CPU where one thread
    # aborts (NOTE [ Isolated compile tests ]); a crash there too is still told apart from remat's.
    check("batchnorm_convnet", threads=None)
