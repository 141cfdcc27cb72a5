"""Reliability (issue 16): nothing lost, nothing run that the user did not ask for, no tracebacks.

One test per finding of the audit, each written against the behaviour before the fix: damaged
checkpoints resumed, outputs overwritten on failure, code imported from the current folder or
named by a checkpoint, tracebacks where an ``Error:`` line belongs, and messages that misled.
The randomised side (hypothesis, signals during writes) is ``test_fuzz.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _tables import block, cost, profile
from click.testing import CliRunner, Result
from torch import nn

import remat
from remat.cli import main
from remat.files import atomic_write
from remat.models import GPTConfig
from remat.plan.solver import solve
from remat.records import Plan, Profile, RecordError
from remat.train import CheckpointError, TrainConfig, TrainInterrupted, train
from remat.train.state import save_checkpoint
from remat.units import MAX_BYTES, parse_budget, parse_bytes

SMALL = TrainConfig(model=GPTConfig(n_layer=1, n_head=1, n_embd=8), steps=2, global_batch=1,
                    seq_len=8, warmup=0, eval_every=0, checkpoint_every=0, seed=1)


def cli(*args: Any, code: int | None = None, command: Any = main) -> Result:
    """``remat ARGS`` in process. Every exit is 0, 1 or 2 (130: interrupted training) with one
    ``Error:`` line and never a traceback."""
    result = CliRunner().invoke(command, [str(a) for a in args], prog_name="remat")
    if code is not None:
        assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        repr(result.exception)
    )
    assert "Traceback" not in result.output
    if result.exit_code in (1, 2):  # or the verdict of a plan that does not fit
        assert "Error:" in result.output or "does not fit" in result.output
    return result


def chain_profile(**kw: Any) -> Profile:
    """Two blocks, a plain peak of 1000 bytes: planning it takes milliseconds."""
    blocks = [block(f"layers.{i}", keep=cost(100), recompute=cost(10, ms=1.0)) for i in range(2)]
    return profile(blocks, base=300, **kw)


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    chain_profile().save(path)
    return path


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


X = (torch.randn(4, 8),)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step run of a tiny GPT, with its checkpoint."""
    out = tmp_path_factory.mktemp("run") / "run"
    train(dataclasses.replace(SMALL, out=str(out)))
    return out


@pytest.fixture
def run_copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    return copy


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of factories in the current folder, as a user would have it."""
    name = f"reliability_models_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        import torch

        def broken():
            raise RuntimeError("no weights here")

        def exits():
            raise SystemExit(0)

        def frozen():
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
            model.requires_grad_(False)
            return model, (torch.randn(2, 8),), None

        def empty():
            return torch.nn.ReLU(), (torch.randn(2, 8, requires_grad=True),), None
    """))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


# --- data loss -------------------------------------------------------------------------------------


def test_a_flipped_bit_in_a_weight_is_refused_on_resume(run_copy: Path) -> None:
    path = run_copy / "checkpoint.pt"
    raw = bytearray(path.read_bytes())
    weight = torch.load(path, weights_only=True)["model"]["blocks.0.mlp.c_fc.weight"]
    at = bytes(raw).find(weight.numpy().tobytes()[:64])  # the tensor's bytes, stored raw
    assert at > 0
    raw[at + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="damaged: its contents do not match its checksum"):
        train(dataclasses.replace(SMALL, out=str(run_copy), steps=3), resume=True)
    assert path.read_bytes() == bytes(raw)  # left as it is
    result = cli("train", "--out", run_copy, "--resume", "--steps", "3", code=1)
    assert "damaged" in result.output


def test_a_plan_that_does_not_fit_leaves_out_untouched(profile_file: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text("my good plan\n")
    result = cli("plan", "--profile", profile_file, "--method", "none", "--budget", "499",
                 "--out", good, code=1)  # its peak is 500
    assert "does not fit" in result.output and f"did not write {good}" in result.output
    assert good.read_text() == "my good plan\n"
    cli("plan", "--profile", profile_file, "--budget", "319", "--out", good, code=1)  # infeasible
    assert good.read_text() == "my good plan\n"
    cli("plan", "--profile", profile_file, "--budget", "900", "--out", good, code=0)
    assert Plan.load(good).budget_bytes == 900


def test_out_equal_to_the_input_is_refused(profile_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = profile_file.read_bytes()
    monkeypatch.chdir(profile_file.parent)
    for out in (profile_file, "profile.json", "./sub/../profile.json"):
        result = cli("plan", "--profile", profile_file, "--method", "all", "--out", out, code=2)
        assert "is the --profile it reads" in result.output
    (profile_file.parent / "link.json").symlink_to(profile_file)
    cli("plan", "--profile", "link.json", "--method", "all", "--out", profile_file, code=2)
    assert profile_file.read_bytes() == before


def test_train_refuses_a_text_that_is_one_of_its_outputs(tmp_path: Path) -> None:
    log = tmp_path / "log.json"
    log.write_text("some text to train on. " * 400)
    before = log.read_bytes()
    with pytest.raises(ValueError, match="is the run's own log.json"):
        train(dataclasses.replace(SMALL, text=str(log), out=str(tmp_path)))
    assert log.read_bytes() == before


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.write_text("old")

    def fail(error: BaseException) -> Any:
        def write(f: Any) -> None:
            f.write(b"half of the new conte")
            raise error
        return write

    for error in (OSError("disk full"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            atomic_write(path, fail(error))
        assert path.read_text() == "old"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no debris
    atomic_write(path, "new")
    assert path.read_text() == "new" and oct(path.stat().st_mode & 0o777) == oct(0o644)


def test_records_are_written_through_the_atomic_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "plan.json"
    plan = solve(chain_profile(), method="all")
    plan.save(path)
    import remat.files

    def broken(f: Any) -> None:
        raise OSError("no space left on device")

    real = remat.files.atomic_write
    monkeypatch.setattr(remat.files, "atomic_write", lambda p, data: real(p, broken))
    monkeypatch.setattr("remat.record_json.atomic_write", remat.files.atomic_write)
    with pytest.raises(OSError, match="no space"):
        dataclasses.replace(plan, method="none").save(path)
    assert Plan.load(path) == plan


# --- security --------------------------------------------------------------------------------------


def test_train_imports_nothing_from_the_current_folder(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "pydoc_data").mkdir()
    (tmp_path / "pydoc_data" / "__init__.py").write_text("")
    (tmp_path / "pydoc_data" / "topics.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ntopics = {{'x': 'planted text ' * 999}}\n"
    )
    monkeypatch.chdir(tmp_path)
    for name in ("pydoc_data", "pydoc_data.topics"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    seen: dict[str, Any] = {}

    def stop(*args: Any, **kwargs: Any) -> Any:  # the text is loaded; stop before training
        seen["path"] = list(sys.path)
        from remat.errors import InvalidValue

        raise InvalidValue("stopped here")  # a deliberate error: one Error: line

    monkeypatch.setattr("remat.train.loop.build_text_model", stop)
    result = cli("train", "--steps", "1", "--out", tmp_path / "out", code=1)
    assert "stopped here" in result.output
    assert not marker.exists()
    assert str(tmp_path) not in seen["path"] and "" not in seen["path"]


def test_a_checkpoint_cannot_choose_code_to_run(run_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    state["config"]["model"] = "tempfile:mkdtemp"
    out = tmp_path / "planted"
    save_checkpoint(out / "checkpoint.pt", {k: v for k, v in state.items()
                                            if k not in ("format", "version", "sha256")})
    calls: list[Any] = []
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: calls.append(a) or "/nowhere")
    result = cli("train", "--out", out, "--resume", code=1)
    assert "remat runs no code that a file names" in result.output
    assert "--model tempfile:mkdtemp" in result.output
    # The library compares the settings before it builds (imports) anything.
    with pytest.raises(CheckpointError, match="belongs to another run.*model"):
        train(dataclasses.replace(SMALL, out=str(out), model="tempfile:gettempdir"), resume=True)
    assert calls == []


def test_the_current_folder_is_on_the_path_only_while_a_named_factory_imports(
    user_module: str,
) -> None:
    from remat.cli.targets import import_factory

    before = list(sys.path)
    assert callable(import_factory(f"{user_module}:broken"))
    assert sys.path == before


# --- crashes: an Error: line, never a traceback --------------------------------------------------


@pytest.mark.parametrize("budget", ["1e400", "inf", "nan", "1e400GiB", "99999999999TiB"])
def test_huge_and_infinite_budgets_are_refused(budget: str, profile_file: Path) -> None:
    result = cli("plan", "--profile", profile_file, "--budget", budget, code=2)
    assert "Invalid value for '--budget'" in result.output
    cli("train", "--budget", budget, code=2)


@pytest.mark.parametrize("budget", ["99999999999999999999999999999", "1e400", "9" * 400, "1e400GiB"])
def test_a_budget_too_large_names_the_largest_one_taken(budget: str, profile_file: Path) -> None:
    # A finite number as typed, never "must be finite"; the CLI and the library say the same.
    says = r"a budget must be at most 4611686018427387904 bytes \(4 EiB, '4194304TiB'\)"
    for command in (("plan", "--profile", profile_file), ("train",)):
        out = cli(*command, "--budget", budget, code=2).output
        assert re.search(says, out) and "finite" not in out and len(out) < 600, out
    with pytest.raises(remat.RematError, match=says):
        remat.auto(mlp(), X, budget)
    assert parse_budget("4194304TiB") == MAX_BYTES  # the largest, as the message spells it


def test_a_share_too_large_is_refused_before_profiling_or_with_the_largest_share(profile_file: Path) -> None:
    out = cli("plan", "--profile", profile_file, "--budget", "1" + "0" * 30 + "%", code=2).output
    assert "above 4 EiB whatever the step: a budget must be at most" in out
    with pytest.raises(ValueError, match=r"\(1.00 MiB\) is above 4 EiB.*at most 439804651110400% for this step"):
        parse_budget("1" + "0" * 15 + "%", plain_peak_bytes=2**20)


def test_the_library_refuses_infinite_budgets_with_a_value_error() -> None:
    for value in (float("inf"), float("-inf"), float("nan"), 1e400, 10**30, "1e400"):
        with pytest.raises(ValueError, match="finite|at most|cannot read|positive"):
            solve(chain_profile(), value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most"):
        parse_bytes(2**63)
    with pytest.raises(ValueError, match="at most"):
        parse_budget("1" + "0" * 30 + "%", plain_peak_bytes=2**40)


def test_deeply_nested_and_malformed_plan_files(tmp_path: Path, profile_file: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(RecordError, match="nested too deeply"):
        Plan.load(deep)
    assert "nested too deeply" in cli("plan", "--profile", deep, "--method", "all", code=1).output
    good = json.loads(solve(chain_profile(), method="all").to_json())
    listed = tmp_path / "listed.json"
    listed.write_text(json.dumps({**good, "choices": ["layers.0", "recompute"]}))
    with pytest.raises(RecordError, match="choices: expected an object, got a list"):
        Plan.load(listed)
    result = cli("verify", "--model", "remat.demo:quick", "--plan", listed, code=1)
    assert "choices: expected an object" in result.output


def test_models_that_cannot_train_are_refused_before_anything_runs(user_module: str) -> None:
    frozen = mlp().requires_grad_(False)
    for verb in (lambda m: remat.profile(m, X), lambda m: remat.auto(m, X, "1GiB")):
        with pytest.raises(ValueError, match="no parameter that requires grad"):
            verb(frozen)
        with pytest.raises(ValueError, match="meta device"):
            verb(mlp().to("meta"))
        with pytest.raises(ValueError, match="lazy parameters"):  # PyTorch's own error named numel
            verb(nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(1)))
    assert "no parameter that requires grad" in cli(
        "profile", "--model", f"{user_module}:frozen", code=1).output
    assert "(it has none at all)" in cli("profile", "--model", f"{user_module}:empty", code=1).output


def test_a_raising_factory_is_an_error_line_in_every_command(user_module: str) -> None:
    for command in (["profile"], ["plan", "--budget", "1GiB"], ["train", "--steps", "1"]):
        result = cli(*command, "--model", f"{user_module}:broken", code=1)
        assert "raised RuntimeError: no weights here" in result.output
    result = cli("plan", "--model", f"{user_module}:exits", "--budget", "1GiB", code=1)
    assert "raised SystemExit: 0" in result.output


def test_train_on_a_device_that_is_not_here(tmp_path: Path) -> None:
    result = cli("train", "--device", "foo", "--out", tmp_path, code=1)
    assert "unknown device 'foo'" in result.output
    if not torch.cuda.is_available():
        result = cli("train", "--device", "cuda", "--out", tmp_path, code=1)
        assert "CUDA is not available" in result.output


def test_a_checkpoint_with_a_tensor_of_the_wrong_shape(run_dir: Path, tmp_path: Path) -> None:
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    state["model"]["blocks.0.mlp.c_fc.weight"] = torch.zeros(3, 3)
    out = tmp_path / "wrong"
    save_checkpoint(out / "checkpoint.pt", {k: v for k, v in state.items()
                                            if k not in ("format", "version", "sha256")})
    with pytest.raises(CheckpointError, match="does not fit this run's model.*size mismatch"):
        train(dataclasses.replace(SMALL, out=str(out)), resume=True)
    assert "does not fit this run's model" in cli("train", "--out", out, "--resume", code=1).output


# --- messages ----------------------------------------------------------------------------------------


def test_ctrl_c_twice_the_second_during_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.train.loop as train_module

    config = dataclasses.replace(SMALL, steps=4, checkpoint_every=2, out=str(tmp_path / "run"))
    real, saves = train_module.save_checkpoint, []

    def save(path: Path, state: dict[str, Any]) -> None:
        saves.append(state["step"])
        if state["step"] == 3:  # the save after the first Ctrl-C: the second one arrives
            raise KeyboardInterrupt
        real(path, state)

    def first_ctrl_c(entry: Any) -> None:
        if entry.step == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "save_checkpoint", save)
    with pytest.raises(TrainInterrupted) as info:
        train(config, on_step=first_ctrl_c)
    assert saves == [2, 3]
    assert info.value.step == 2 and info.value.checkpoint == tmp_path / "run" / "checkpoint.pt"
    assert torch.load(info.value.checkpoint, weights_only=True)["step"] == 2

    from remat.cli import train as cli_train

    monkeypatch.setattr(cli_train, "train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    result = cli("train", "--out", tmp_path / "run", "--resume", code=130)
    assert "nothing was saved" not in result.output
    assert "checkpoint" in result.output and "--resume" in result.output


def test_eval_mode_no_grad_and_compiled_models_are_named() -> None:
    with pytest.raises(remat.InfeasibleBudget, match=r"eval\(\) mode.*model.train\(\)"):
        remat.auto(mlp().eval(), X, 1000)
    with torch.no_grad(), pytest.raises(ValueError, match=r"under torch.no_grad\(\)"):
        remat.auto(mlp(), X, "60%")
    with torch.inference_mode(), pytest.raises(ValueError, match=r"torch.inference_mode\(\)"):
        remat.profile(mlp(), X)
    with warnings.catch_warnings():  # importing dynamo warns of torch.jit.script_method
        warnings.simplefilter("ignore", DeprecationWarning)
        compiled = torch.compile(mlp())  # compiles nothing until it is called
    for verb in (lambda: remat.auto(compiled, X, "60%"), lambda: remat.profile(compiled, X),
                 lambda: remat.apply(compiled, solve(chain_profile(), method="all"))):
        with pytest.raises(TypeError, match="apply remat to the model before compiling"):
            verb()


def test_a_string_where_a_profile_or_model_belongs() -> None:
    with pytest.raises(TypeError, match=r"solve expects a remat Profile, got str.*Profile.load"):
        solve("profile.json", "1GiB")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects the model, an nn.Module; got str"):
        remat.auto("model", X, "1GiB")  # type: ignore[call-overload]
    plan = solve(chain_profile(), method="all")
    with pytest.raises(TypeError, match="expects the model, an nn.Module; got str"):
        remat.verify("model", X, plan)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expects a remat Plan, got str"):
        remat.verify(mlp(), X, "plan.json")  # type: ignore[arg-type]


@pytest.mark.parametrize("verb", ["remove", "applied_plan", "apply", "measure_step", "option_of",
                                  "checkpoint_module", "uncheckpoint_module"])
def test_every_verb_that_takes_a_model_refuses_a_non_module_with_remats_error(verb: str) -> None:
    fn = getattr(remat, verb)
    args = (solve(chain_profile(), method="all"),) if verb == "apply" else (X,) if verb == "measure_step" else ()
    for wrong, says in (("model", r"got str 'model'; a name or a path is not a module"),
                        (nn.Linear, r"got the class Linear itself; pass an instance of it \(Linear\(\.\.\.\)\)"),
                        (None, "got NoneType; pass the module object itself")):
        with pytest.raises(remat.RematError, match=rf"{verb} expects (the model, )?an nn.Module; {says}"):
            fn(wrong, *args)


def test_a_budget_that_cannot_be_parsed_is_refused_before_profiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_profiling(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("profiled before the budget was checked")

    monkeypatch.setattr("remat.autoplan.profile", no_profiling)
    for budget in ("lots", "0.5", "-1GiB", "0%", float("inf")):
        with pytest.raises(ValueError):
            remat.auto(mlp(), X, budget)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown method 'optimum'; .*did you mean 'optimal'"):
        remat.auto(mlp(), X, "1GiB", method="optimum")
    monkeypatch.setattr("remat.train.loop.load_text", no_profiling)
    with pytest.raises(ValueError, match="cannot read 'lots'"):
        train(dataclasses.replace(SMALL, budget="lots"))
    monkeypatch.setattr("remat.cli.train.train", no_profiling)
    assert "cannot read 'lots'" in cli("train", "--budget", "lots", code=2).output


def test_half_a_byte_is_not_called_zero(profile_file: Path) -> None:
    result = cli("plan", "--profile", profile_file, "--budget", "0.5", code=2)
    assert "at least 1 byte, got '0.5'" in result.output and "got 0 " not in result.output
    with pytest.raises(ValueError, match="at least 1 byte, got 0.5"):
        parse_bytes(0.5)


def test_a_bad_field_in_a_profile_file_is_named(tmp_path: Path) -> None:
    data = json.loads(chain_profile().to_json())
    data["blocks"][1]["options"]["keep"]["kept_bytes"] = "lots"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    where = r"blocks\[1\]\.options\['keep'\]\.kept_bytes: expected an integer, got a string 'lots'"
    with pytest.raises(RecordError, match=where):
        Profile.load(path)
    result = cli("plan", "--profile", path, "--budget", "1GiB", code=1)
    assert "blocks[1].options['keep'].kept_bytes" in result.output
    data["blocks"][1]["options"]["keep"]["kept_bytes"] = 100
    data["plain_step_ms"] = float("inf")
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match="plain_step_ms: expected a finite number"):
        Profile.load(path)


@pytest.mark.parametrize(("crossing", "problem"), [
    ({"size_bytes": 8, "consumers": ["nowhere"]}, r"names \['nowhere'\], which are not among the profile's blocks .expected names such as \['layers.0', 'layers.1'\]."),
    ({"size_bytes": 8, "consumers": ["layers.1"], "saved_by": {"layers.0": ["keep"]}},
     r"is saved by \['layers.0'\], expected only by the blocks that hold it .\['layers.1'\]."),
    ({"size_bytes": 8}, "expected the blocks it enters .consumers. or the block that made it .made_by., got neither"),
    ({"size_bytes": 8, "consumers": ["layers.0"], "made_by": "layers.1"}, "is made by 'layers.1', which does not come before the first block it enters .'layers.0'."),
    ({"size_bytes": 8, "made_by": "layers.1", "dies_after": "layers.0"}, "dies in 'layers.0', which does not come after 'layers.1', its maker"),
])
def test_a_crossing_out_of_place_in_a_profile_file_is_named(crossing: dict, problem: str) -> None:
    data = json.loads(chain_profile().to_json())
    assert [b["name"] for b in data["blocks"][:2]] == ["layers.0", "layers.1"]
    data["crossings"] = [{"size_bytes": 4, "consumers": ["layers.0"]}, crossing]
    with pytest.raises(RecordError, match=f"crossings\\[1\\]: {problem}; recreate the profile"):
        Profile.from_json(json.dumps(data))
    data["crossings"] = data["crossings"][:1]
    assert Profile.from_json(json.dumps(data)).crossings[0].consumers == ["layers.0"]


def test_did_you_mean_ignores_case() -> None:
    result = cli("plan", "--model", "GPT-tiny", "--budget", "1GiB", code=1)
    assert "did you mean 'gpt-tiny'?" in result.output
    with pytest.raises(ValueError, match="Did you mean h100"):
        remat.profile(mlp, X, device="H-100")


def test_a_closed_pipe_exits_quietly(profile_file: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(remat.__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "remat", "plan", "--profile", str(profile_file), "--method", "all"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `remat ... | head -c0`
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=60) == 1
    assert "Broken pipe" not in err and "Error" not in err and "Traceback" not in err, err


def test_a_failing_flop_formula_is_not_silently_zero(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import flop_registry

    from remat.devices import get_device
    from remat.measure.fake import FakeMeter

    def broken(*args: Any, **kwargs: Any) -> int:
        raise TypeError("unexpected keyword argument 'out_val'")

    monkeypatch.setitem(flop_registry, torch.ops.aten.mm, broken)
    with caplog.at_level(logging.WARNING, logger="remat.measure.fake"), FakeTensorMode():
        a = torch.randn(64, 64)
        with FakeMeter(get_device("h100")) as meter:
            a @ a
            a @ a
    assert list(meter.flop_errors) == ["aten.mm.default"]
    warnings = [r for r in caplog.records if "FLOP formula of aten.mm.default failed" in r.message]
    assert len(warnings) == 1  # once per op
