"""The public surface as a user's type checker sees it (NOTE [ Lazy at run time, real to a type
checker ] in ``remat/__init__.py``), and ``import remat`` staying cheap."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import remat

INIT = Path(remat.__file__)
MYPY = shutil.which("mypy", path=str(Path(sys.executable).parent)) or shutil.which("mypy")


def _type_checking_imports() -> dict[str, str]:
    """name -> module of every import under ``if TYPE_CHECKING:`` in ``remat/__init__.py``."""
    out = {}
    for node in ast.parse(INIT.read_text()).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                out |= {a.name: imp.module for a in imp.names}
    return out


def test_the_typed_names_are_the_lazy_names() -> None:
    assert _type_checking_imports() == remat._EXPORTS
    assert sorted(remat.__all__) == sorted(remat._EXPORTS)


@pytest.mark.parametrize("name", sorted(remat._EXPORTS))
def test_every_export_resolves(name: str) -> None:
    assert getattr(remat, name) is not None


def test_import_remat_is_cheap() -> None:
    code = "import sys, remat\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _mypy(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    if MYPY is None:
        pytest.skip("mypy is not installed (pip install 'remat[dev]')")
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent(code))
    src = INIT.parent.parent
    return subprocess.run(
        [MYPY, "--no-incremental", "--follow-imports=silent", "--ignore-missing-imports",
         "--cache-dir", str(tmp_path / "cache"), str(user)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={"MYPYPATH": str(src), "PATH": str(Path(sys.executable).parent)},
    )


@pytest.mark.slow  # a mypy run: 20-25 s
def test_mypy_sees_the_verbs(tmp_path: Path) -> None:
    wrong = _mypy(tmp_path, """
        import remat

        n: int = remat.solve
        p: remat.Plan = remat.checkpoint
    """)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert 'user.py:4: error: Incompatible types in assignment' in wrong.stdout, wrong.stdout
    assert 'user.py:5: error: Incompatible types in assignment' in wrong.stdout, wrong.stdout


@pytest.mark.slow  # a mypy run: 20-25 s
def test_mypy_accepts_correct_use(tmp_path: Path) -> None:
    right = _mypy(tmp_path, """
        from collections.abc import Callable

        import remat

        def plan_for(profile: remat.Profile) -> remat.Plan:
            return remat.solve(profile, "60%")

        solver: Callable[..., remat.Plan] = remat.solve
        option: remat.Option = "recompute"
        try:
            pass
        except remat.RematError as e:
            print(e)
    """)
    assert right.returncode == 0, right.stdout + right.stderr
