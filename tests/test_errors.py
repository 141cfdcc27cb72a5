"""One base for remat's own errors, the builtin each always was, and the command line telling
remat's errors (one Error: line) from bugs (a traceback, and a request to report it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _tables import block, cost, profile
from click.testing import CliRunner

import remat
from remat import errors
from remat.cli import commands
from remat.cli import main as cli_main
from remat.plan.costmodel import estimate

SRC = Path(remat.__file__).parent
# The builtins a deliberate ``raise`` in remat may not use bare: each has a RematError twin.
_BARE = {"ValueError", "TypeError", "RuntimeError", "KeyError", "FileNotFoundError",
         "IsADirectoryError", "ModuleNotFoundError", "ImportError"}


def test_every_error_class_is_a_remat_error_and_its_old_builtin() -> None:
    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    assert len(classes) >= 15
    for cls in classes:
        assert issubclass(cls, errors.RematError), cls
    assert issubclass(errors.InfeasibleBudget, ValueError)
    assert issubclass(errors.InvalidType, TypeError)
    assert issubclass(errors.MissingDependency, ImportError)
    assert remat.RematError is errors.RematError
    from remat.records import RecordError
    from remat.train.accumulation import InfeasibleTraining

    assert RecordError is errors.RecordError and issubclass(InfeasibleTraining, remat.InfeasibleBudget)


def test_remat_raises_no_bare_builtin() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", None)
                if name in _BARE:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} raises {name}")
    assert not found, "raise the RematError twin from remat.errors instead:\n" + "\n".join(found)


def test_a_misuse_is_a_remat_error_and_still_a_value_error() -> None:
    p = profile([block("layers.0", keep=cost(1)), block("layers.1", keep=cost(1))])
    with pytest.raises(errors.RematError, match=r"did you mean 'layers.1'\?") as err:
        estimate(p, {"layers.0": "keep", "layer.1": "keep"})
    assert isinstance(err.value, ValueError)
    with pytest.raises(errors.InvalidValue, match="did you mean 'optimal'"):
        remat.solve(p, "1GiB", method="optimum")
    with pytest.raises(errors.InvalidType):
        estimate(p, [("layers.0", "keep")])  # type: ignore[arg-type]


def test_did_you_mean() -> None:
    assert errors.did_you_mean("gtp2", ["gpt2", "llama"]) == "; did you mean 'gpt2'?"
    assert errors.did_you_mean("zzz", ["gpt2"]) == ""
    assert errors.did_you_mean("layer.1", ["layers.1", "layers.11", "head"], n=2) == (
        "; did you mean 'layers.1', 'layers.11'?"
    )


@pytest.mark.parametrize("raised, is_bug", [
    (errors.InvalidValue("a message that teaches"), False),
    (FileNotFoundError("no such file: x.json"), False),
    (TypeError("an internal slip"), True),
    (ZeroDivisionError("division by zero"), True),
])  # fmt: skip
def test_the_cli_tells_remat_errors_from_bugs(
    raised: Exception, is_bug: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def load_target(*args: object, **kwargs: object) -> None:
        raise raised

    monkeypatch.setattr(commands, "load_target", load_target)
    result = CliRunner().invoke(cli_main, ["profile", "--model", "gpt-tiny"], prog_name="remat")
    assert result.exit_code == 1
    if is_bug:
        assert result.exception is raised  # shown as what it is, with its traceback
        assert "this is a bug" in result.stderr and "please report it" in result.stderr
        assert "Error:" not in result.stderr
    else:
        assert isinstance(result.exception, SystemExit)
        assert f"Error: {raised}" in result.stderr and "bug" not in result.stderr
