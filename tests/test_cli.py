"""The ``remat`` command, run in process with click's CliRunner: exit codes, JSON output, golden
text, and the errors a user meets.

Golden files (tests/golden/cli_*.txt) change only on purpose: rerun with REMAT_UPDATE_GOLDEN=1 to
rewrite them, then read the diff. Numbers that depend on timing (step times, overheads, and in the
demo the plans that timing selects) are masked to ``#`` and runs of spaces collapsed, so the files
pin the structure (rows, columns, labels, marks) and every number that is deterministic.

The models are the quick demo's GPT (``remat.demo:quick``, a ~0.1 s step) and tiny zoo shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from remat import demo as demo_module
from remat.cli import main
from remat.records import Plan, Profile

GOLDEN = Path(__file__).parent / "golden"
QUICK = "remat.demo:quick"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("REMAT_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"no golden file {path}; create it with REMAT_UPDATE_GOLDEN=1 and review it")
    assert text == path.read_text(), (
        f"{name} changed; if on purpose, rerun with REMAT_UPDATE_GOLDEN=1"
    )


def mask(text: str, *patterns: str) -> str:
    """Each match of ``patterns`` with its numbers (and their signs) as ``#``; then runs of spaces
    and rules collapsed, since a number's width moves the columns after it."""
    for pattern in patterns:
        text = re.sub(pattern, lambda m: re.sub(r"[+-]?\d+", "#", m.group()), text, flags=re.M)
    text = re.sub(r"(#[.,]?)+#", "#", text)
    text = re.sub(r" {2,}", "  ", text)
    return re.sub(r"─+", "─", text)


def run(*args: Any, code: int = 0, env: dict[str, str] | None = None) -> Result:
    """``remat ARGS`` in process; fails with the output (and a traceback) on another exit code."""
    result = CliRunner().invoke(main, [str(a) for a in args], env=env, prog_name="remat")
    if result.exit_code != code:
        exc = result.exception
        trace = ""
        if exc is not None and not isinstance(exc, SystemExit):
            import traceback

            trace = "".join(traceback.format_exception(exc))
        pytest.fail(
            f"remat {' '.join(map(str, args))}: exit {result.exit_code}, expected {code}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}\n{trace}"
        )
    if code == 1:  # a user's error is one Error: line, never a traceback
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert "Traceback" not in result.output
    return result


# --- help, version, python -m -------------------------------------------------------------------


def test_help_golden() -> None:
    out = run("--help", env={"COLUMNS": "100"}).stdout
    check_golden("cli_help.txt", out)


@pytest.mark.parametrize("command", ["demo", "profile", "plan", "verify"])
def test_command_help_shows_examples(command: str) -> None:
    out = run(command, "--help").stdout
    assert "Examples:" in out
    assert f"remat {command}" in out


def test_version() -> None:
    assert "remat, version" in run("--version").stdout


def test_python_dash_m_remat() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "remat", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Usage: remat" in done.stdout


# --- errors a user meets ------------------------------------------------------------------------


def test_unknown_model_suggests_the_closest_name() -> None:
    result = run("plan", "--model", "gtp2", "--budget", "1GiB", code=1)
    assert "Error: unknown model 'gtp2'; did you mean 'gpt2'?" in result.stderr
    assert result.stdout == ""


def test_unknown_model_with_json_also_writes_the_error_as_json() -> None:
    result = run("profile", "--model", "gtp2", "--json", code=1)
    assert json.loads(result.stdout)["error"].startswith("unknown model 'gtp2'")


def test_factory_whose_module_cannot_be_imported() -> None:
    result = run("profile", "--model", "no_such_pkg.models:make", code=1)
    assert "cannot import module 'no_such_pkg.models'" in result.stderr
    assert "ModuleNotFoundError" in result.stderr


def test_factory_that_is_not_in_its_module() -> None:
    result = run("profile", "--model", "remat.demo:quik", code=1)
    assert "module 'remat.demo' has no attribute 'quik'; did you mean 'quick'?" in result.stderr


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of factories in the current folder, as a user would have it."""
    name = f"user_models_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import torch
        from remat.models import GPTConfig, build_model

        def bare():
            return build_model(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=32))

        def triple():
            layer = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
            model = torch.nn.Sequential(layer(), layer(), torch.nn.Linear(8, 1))
            return model, (torch.randn(4, 8),), None

        def broken():
            raise RuntimeError("no weights here")

        def wrong():
            return 42
    """))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def test_factory_errors_name_the_factory(factories: str) -> None:
    result = run("profile", "--model", f"{factories}:broken", code=1)
    assert f"the factory {factories}:broken raised RuntimeError: no weights here" in result.stderr
    result = run("profile", "--model", f"{factories}:wrong", code=1)
    assert "returned int; expected (model, batch, loss_fn)" in result.stderr
    result = run("profile", "--model", f"{factories}:triple", "--batch", "2", code=1)
    assert "makes its own batch" in result.stderr


def test_factory_from_the_current_folder(factories: str) -> None:
    data = json.loads(
        run("profile", "--model", f"{factories}:triple", "--repeats", "1", "--json").stdout
    )
    assert data["kind"] == "profile" and data["batch_shape"] == [4, 8]
    # a bare remat.models model: remat makes its batch from --batch and --seq
    data = json.loads(
        run("profile", "--model", f"{factories}:bare", "--batch", "2", "--seq", "8", "--repeats", "1",
            "--json").stdout
    )
    assert data["batch_shape"] == [2, 8] and len(data["blocks"]) == 2


@pytest.mark.parametrize(
    ("budget", "message"),
    [("12parsecs", "cannot read '12parsecs' as a size"), ("0%", "a budget must be positive")],
)
def test_budget_that_does_not_parse_is_a_usage_error(budget: str, message: str) -> None:
    result = run("plan", "--model", "gpt-tiny", "--budget", budget, code=2)
    assert "Invalid value for '--budget'" in result.stderr
    assert message in result.stderr


@pytest.mark.parametrize("budgets", ["2", "0.5,half", "0", ","])
def test_compile_budgets_that_do_not_parse_are_a_usage_error(budgets: str) -> None:
    for command in ("profile", "plan"):
        args = ("--budget", "60%") if command == "plan" else ()
        result = run(command, "--model", "gpt-tiny", "--compile-budgets", budgets, *args, code=2)
        assert "Invalid value for '--compile-budgets'" in result.stderr
        assert "comma-separated numbers in (0, 1]" in result.stderr


def test_compile_budgets_describe_a_model_to_profile(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    result = run("plan", "--profile", profile, "--compile-budgets", "0.5", "--budget", "60%", code=2)
    assert "--compile-budgets" in result.stderr and "--profile reuses a saved profile" in result.stderr


def test_unknown_device_is_a_usage_error() -> None:
    result = run("plan", "--model", "gpt-tiny", "--device", "h10", "--budget", "1GiB", code=2)
    assert "unknown device 'h10'" in result.stderr and "Did you mean h100" in result.stderr


def test_plan_needs_a_model_or_a_profile() -> None:
    assert "give either --model" in run("plan", "--budget", "1GiB", code=2).stderr
    assert "needs a --budget" in run("plan", "--model", "gpt-tiny", code=2).stderr


def test_a_model_too_big_to_measure_here_points_to_estimating() -> None:
    result = run("profile", "--model", "llama-70b", code=1)
    assert "too much to measure" in result.stderr and "--device h100" in result.stderr


def test_missing_plan_file() -> None:
    result = run("verify", "--model", QUICK, "--plan", "no-such-plan.json", code=1)
    assert "Error: no such file: no-such-plan.json" in result.stderr


# --- profile and plan, estimated: deterministic, golden without masks ---------------------------


@pytest.fixture(scope="module")
def estimated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    path = tmp_path_factory.mktemp("estimated") / "profile.json"
    return path, run("profile", "--model", QUICK, "--device", "h100", "--out", path)


def test_profile_estimated_golden(estimated: tuple[Path, Result]) -> None:
    path, result = estimated
    assert result.stdout.endswith(f"wrote {path}\n")
    check_golden("cli_profile_estimated.txt", result.stdout.replace(str(path), "PROFILE"))
    prof = Profile.load(path)
    assert prof.mode == "estimated" and prof.device == "h100"


def test_plan_from_a_saved_profile_golden(estimated: tuple[Path, Result], tmp_path: Path) -> None:
    path, _ = estimated
    out = tmp_path / "plans" / "plan.json"
    result = run("plan", "--profile", path, "--budget", "60%", "--out", out)
    check_golden("cli_plan_estimated.txt", result.stdout.replace(str(out), "PLAN"))
    assert "fits: predicted peak" in result.stdout
    plan = Plan.load(out)
    assert plan.budget_bytes == int(0.6 * Profile.load(path).plain_peak_bytes)


def test_plan_json(estimated: tuple[Path, Result]) -> None:
    path, _ = estimated
    data = json.loads(run("plan", "--profile", path, "--budget", "60%", "--json").stdout)
    assert data["kind"] == "plan_result" and data["fits"] is True
    assert data["predicted_peak_bytes"] <= data["budget_bytes"]
    assert data["smallest_feasible_bytes"] <= data["predicted_peak_bytes"]
    assert Plan.from_json(json.dumps(data["plan"])).method == "optimal"


def test_plan_budget_defaults_to_the_devices_memory(estimated: tuple[Path, Result]) -> None:
    path, _ = estimated
    result = run("plan", "--profile", path)
    assert "budget: the h100's memory, 80.00 GiB" in result.stderr
    assert "fits: predicted peak" in result.stdout


def test_infeasible_budget_names_the_smallest_feasible(estimated: tuple[Path, Result]) -> None:
    path, _ = estimated
    result = run("plan", "--profile", path, "--budget", "1MiB", code=1)
    assert re.search(r"Error: budget 1\.00 MiB is below the smallest feasible \d", result.stderr)
    data = json.loads(run("plan", "--profile", path, "--budget", "1MiB", "--json", code=1).stdout)
    assert data["type"] == "InfeasibleBudget" and data["smallest_feasible_bytes"] > 2**20
    assert data["smallest_estimated"] is False  # a profile's floor, not one from tensors alone


def test_baseline_that_does_not_fit_exits_1(estimated: tuple[Path, Result]) -> None:
    path, _ = estimated
    result = run("plan", "--profile", path, "--method", "none", "--budget", "50%", code=1)
    assert "does not fit: predicted peak" in result.stdout


def test_profile_and_model_options_do_not_mix(estimated: tuple[Path, Result]) -> None:
    path, _ = estimated
    result = run("plan", "--profile", path, "--batch", "2", "--budget", "1GiB", code=2)
    assert "--batch describe the model to profile" in result.stderr


# --- profile, plan, verify, measured ------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    path = tmp_path_factory.mktemp("measured") / "profile.json"
    return path, run("profile", "--model", QUICK, "--repeats", "1", "--out", path)


def test_profile_measured_golden(measured: tuple[Path, Result]) -> None:
    path, result = measured
    text = result.stdout.replace(str(path), "PROFILE")
    # times vary: the plain step's, and each row's fwd and bwd ms (the last two numbers)
    check_golden("cli_profile_measured.txt", mask(text, r"[\d.]+ ms", r"[\d.]+\s+[\d.]+$"))


def test_profile_zoo_model_json() -> None:
    result = run("profile", "--model", "gpt-tiny", "--batch", "1", "--seq", "8", "--repeats", "1",
                 "--json")  # fmt: skip
    data = json.loads(result.stdout)
    assert data["kind"] == "profile" and data["batch_shape"] == [1, 8] and data["mode"] == "measured"


@pytest.fixture(scope="module")
def plans(measured: tuple[Path, Result], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    path, _ = measured
    folder = tmp_path_factory.mktemp("plans")
    out = {"optimal": folder / "optimal.json", "every_k": folder / "every_k.json"}
    run("plan", "--profile", path, "--budget", "60%", "--out", out["optimal"])
    run("plan", "--profile", path, "--method", "every_k", "--out", out["every_k"])
    return out


def test_verify_golden(plans: dict[str, Path]) -> None:
    # every_k: a fixed plan, so every byte is deterministic; only the overhead varies
    result = run("verify", "--model", QUICK, "--plan", plans["every_k"], "--repeats", "1")
    text = mask(result.stdout, r"[+-][\d.]+%(?=\s+[✓✗—])")
    check_golden("cli_verify.txt", text)


def test_verify_optimal_plan_json(plans: dict[str, Path]) -> None:
    result = run("verify", "--model", QUICK, "--plan", plans["optimal"], "--repeats", "1", "--json")
    data = json.loads(result.stdout)
    assert data["kind"] == "report" and data["passed"] is True and data["grads_equal"] is True
    assert data["measured_peak_bytes"] <= data["budget_bytes"]
    assert data["verdict"].startswith("passed")


def test_verify_exits_1_when_the_plan_is_over_its_budget(
    plans: dict[str, Path], tmp_path: Path
) -> None:
    tight = tmp_path / "tight.json"
    dataclasses.replace(Plan.load(plans["optimal"]), budget_bytes=1000).save(tight)
    result = run("verify", "--model", QUICK, "--plan", tight, "--repeats", "1", code=1)
    assert "failed: measured peak" in result.stdout and "> budget 1000 B" in result.stdout


def test_verify_a_plan_for_another_model(plans: dict[str, Path]) -> None:
    result = run("verify", "--model", "llama-tiny", "--plan", plans["optimal"], code=1)
    assert "Error: the plan was made for a GPT; its block 'blocks.0' is not in this Llama" in (
        result.stderr
    )
    # same block names, other sizes: the fingerprint tells them apart
    result = run("verify", "--model", "gpt-tiny", "--plan", plans["optimal"], code=1)
    assert "Error: the plan was made for a GPT of another shape" in result.stderr


def test_verify_refuses_an_estimated_device(plans: dict[str, Path]) -> None:
    result = run("verify", "--model", QUICK, "--plan", plans["optimal"], "--device", "h100", code=2)
    assert "verify measures real steps" in result.stderr


# --- demo ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick_demo(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, Result, demo_module.DemoResult]]:
    out = tmp_path_factory.mktemp("demo") / "remat-out"
    results: list[demo_module.DemoResult] = []
    run_demo = demo_module.run_demo

    def spy(*args: Any, **kwargs: Any) -> demo_module.DemoResult:
        results.append(run_demo(*args, **kwargs))
        return results[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo_module, "run_demo", spy)
        # Timings shown whatever the load, so that the golden text has one shape; the withheld
        # form has a test of its own.
        mp.setattr(demo_module, "NOISY", float("inf"))
        mp.setattr(demo_module, "DISTURBED", float("inf"))
        result = run("demo", "--quick", "--out", out)
    yield out, result, results[0]


def test_demo_writes_its_files(quick_demo: tuple[Path, Result, demo_module.DemoResult]) -> None:
    out, result, _ = quick_demo
    for name in ("profile.json", "plan.json", "results.json"):
        assert (out / name).stat().st_size > 0, name
    for name in ("frontier.png", "timeline.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    plan = Plan.load(out / "plan.json")
    prof = Profile.load(out / "profile.json")
    assert plan.fingerprint == prof.fingerprint and plan.method == "optimal"
    results = json.loads((out / "results.json").read_text())
    assert results["kind"] == "demo"
    rows = {r["label"]: r for r in results["rows"]}
    assert {"none (plain)", "remat 100%", "all (every block)"} <= set(rows)
    assert all(r["grads_equal"] for r in results["rows"])
    # the cost model is exact for the fixed baselines: predicted == measured
    for label in ("none (plain)", "every 2nd block", "all (every block)"):
        assert rows[label]["predicted_peak_bytes"] == rows[label]["measured_peak_bytes"]
    assert f"--plan {out / 'plan.json'}" in result.stdout


def test_demo_golden(quick_demo: tuple[Path, Result, demo_module.DemoResult]) -> None:
    out, result, _ = quick_demo
    text = result.stdout.replace(str(out), "OUT")
    text = mask(
        text,
        r"[\d.]+ ms",  # the plain step's time
        r"in \d+ s$",  # the demo's own time
        r"^plan\.json: .*",  # the chosen plan's measurements
        r"^step times: .*",  # the run's noise
        # timing picks remat's plans, so their peaks vary too: predicted, measured, error, overhead
        r"[\d.]+ [KMG]iB\s+[\d.]+ [KMG]iB\s+[+-][\d.]+%\s+[+-][\d.]+%(?=\s+[✓✗—])",
    )
    check_golden("cli_demo_quick.txt", text)


def test_demo_withholds_timings_on_a_loaded_machine(
    quick_demo: tuple[Path, Result, demo_module.DemoResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _, result = quick_demo
    assert result.timings_meaningful  # (the fixture's thresholds)
    loaded = dataclasses.replace(result, timings_meaningful=False, plain_self_overhead=0.123)
    monkeypatch.setattr(demo_module, "run_demo", lambda *a, **k: loaded)
    text = run("demo", "--quick", "--out", out).stdout
    assert "step times withheld: plain against itself +12.3%" in text
    assert "too loaded" in text and "step time" not in text.split("plan.json:")[1].split("\n")[0]
    table = text.split("plan.json:")[0]
    assert "+0.0%" in table  # the errors of predicted peaks are exact...
    for line in table.splitlines():
        if "MiB" in line and line.rstrip().endswith(("=", "≠")):  # ...but no overhead: "—"
            cells = line.split()
            assert cells[-3] == "—", line


def test_demo_json(
    quick_demo: tuple[Path, Result, demo_module.DemoResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _, result = quick_demo
    monkeypatch.setattr(demo_module, "run_demo", lambda *a, **k: result)
    data = json.loads(run("demo", "--quick", "--out", out, "--json").stdout)
    assert data == json.loads((out / "results.json").read_text())
    assert data["plan"]["label"] == result.chosen.label
