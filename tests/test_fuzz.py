"""Fuzz and property tests (issue 16): budgets, plan files, profile files and command lines drawn
by hypothesis, and signals and threads during writes.

The properties: every input is either accepted or refused with remat's own error (a
``ValueError`` or ``TypeError`` in the library; exit 1 or 2 with one ``Error:`` line in the CLI),
never a traceback; an input file is never changed, and an output is written whole or not at all.
Kept small (tiny profiles, a handful of examples each) so that the suite runs in seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _tables import chains
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import remat
from remat.cli import main
from remat.files import atomic_write
from remat.plan.solver import frontier, solve
from remat.records import Plan, Profile, RecordError
from remat.units import MAX_BYTES, check_budget, parse_budget

# REMAT_FUZZ_EXAMPLES=5000 for a long, random hunt; CI runs a fixed, small set of examples.
_HUNT = int(os.environ.get("REMAT_FUZZ_EXAMPLES", "0"))
FAST = settings(max_examples=_HUNT or 60, deadline=None, derandomize=not _HUNT,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
REFUSED = (ValueError, TypeError)

# --- budgets ---------------------------------------------------------------------------------------

_UNITS = ["", "b", "B", "KB", "kb", "MiB", "mib", "GiB", "GB", "TiB", "k", "M", "g", "T", "EiB",
          "%", " %", "parsecs"]
_NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["1e400", "1E9", "1e+3", ".5", "0.5", "0", "-0", "00", "1.", "nan", "inf",
                     "0x10", "1_000", "", " ", "٣"]),
)
BUDGETS = st.one_of(
    st.builds(lambda n, sp, u: f"{n}{sp}{u}", _NUMBERS, st.sampled_from(["", " ", "\t"]),
              st.sampled_from(_UNITS)),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from([None, True, [], b"1GiB", 1j]),
)


@settings(FAST, max_examples=_HUNT or 200)
@given(budget=BUDGETS, plain=st.integers(1, 2**50))
def test_budgets_parse_or_are_refused(budget: Any, plain: int) -> None:
    try:
        value = parse_budget(budget, plain_peak_bytes=plain)
    except REFUSED:
        value = None
    if value is not None:
        assert isinstance(value, int) and 1 <= value <= MAX_BYTES
    try:
        check_budget(budget)
    except REFUSED:
        assert value is None, "the edge check refused a budget that resolves"


_CHAIN = None


def _chain() -> Profile:
    global _CHAIN
    if _CHAIN is None:
        from test_reliability import chain_profile

        _CHAIN = chain_profile()
    return _CHAIN


@settings(FAST, max_examples=_HUNT or 100)
@given(budget=BUDGETS, method=st.sampled_from(["optimal", "greedy", "none", "all", "sqrt", "x"]))
def test_solve_takes_any_budget_or_refuses_it(budget: Any, method: str) -> None:
    try:
        plan = solve(_chain(), budget, method=method)
    except REFUSED:
        return
    if method in ("optimal", "greedy"):
        assert plan.budget_bytes is not None and plan.estimate.peak_bytes <= plan.budget_bytes


# --- record files ----------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6,
)


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document, as key paths."""
    found = [prefix]
    if isinstance(data, dict):
        for k, v in data.items():
            found += _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            found += _paths(v, (*prefix, i))
    return found


@st.composite
def mutated(draw: st.DrawFn, document: Any) -> str:
    """``document`` with one to three places replaced, deleted, or given an extra key; or text
    that is not that document at all."""
    data = json.loads(json.dumps(document))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        path = draw(st.sampled_from(paths))
        if not path:
            continue
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        how = draw(st.sampled_from(["replace", "replace", "delete", "extra"]))
        if how == "replace":
            parent[path[-1]] = draw(JSON)
        elif how == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=4))] = draw(JSON)
    text = json.dumps(data)
    return draw(st.sampled_from([text, text, text, text[: len(text) // 2], "[" * 5000, "",
                                 "\ufeff" + text, text.replace('"', "'", 1)]))


_NUMBERS_IN_RANGE = st.one_of(
    st.sampled_from([0, 1, -1, 2**50, 2**50 + 1, -(2**50), 2**62]),
    st.integers(-(2**20), 2**40),
    st.floats(-1e9, 1e9),
    st.sampled_from([0.0, -0.0, 1e-300, 1e9, -1e9, 1e10]),
)


@st.composite
def renumbered(draw: st.DrawFn, document: Any) -> str:
    """``document`` with its structure kept and some numbers, names and option keys changed: the
    files that pass the type checks and test the stages behind them."""
    data = json.loads(json.dumps(document))
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from([p for p in _paths(data) if p]))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        old = parent[path[-1]]
        if isinstance(old, bool):
            parent[path[-1]] = draw(st.booleans())
        elif isinstance(old, int | float):
            parent[path[-1]] = draw(_NUMBERS_IN_RANGE)
        elif isinstance(old, str):
            parent[path[-1]] = draw(st.sampled_from(["keep", "recompute", "offload", "layers.0",
                                                     "", "cpu", "h100", "x"]))
        elif isinstance(old, dict) and old:
            key = draw(st.sampled_from(sorted(old)))
            new = draw(st.sampled_from(["keep", "selective", "recompute", "offload",
                                        "recompute_offload", "teleport"]))
            parent[path[-1]] = {(new if k == key else k): v for k, v in old.items()}
        elif isinstance(old, list):
            parent[path[-1]] = draw(st.sampled_from([[], old[:1], old + old[:1], old[::-1]]))
    return json.dumps(data)


@FAST
@given(data=st.data())
def test_profiles_with_odd_numbers_solve_or_are_refused(data: st.DataObject) -> None:
    document = json.loads(data.draw(chains(max_blocks=3)).to_json())
    try:
        prof = Profile.from_json(data.draw(renumbered(document)))
    except RecordError:
        return
    for budget, method in (("60%", "optimal"), (None, "all"), (10**6, "greedy"),
                           ("1GiB", "optimal"), (None, "sqrt")):
        try:
            plan = solve(prof, budget, method=method)
        except REFUSED:
            continue
        assert Plan.from_json(plan.to_json()) == plan
    with contextlib.suppress(REFUSED):
        frontier(prof, points=4)


@pytest.fixture(scope="module")
def small_model_plan() -> tuple[Any, Plan]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)],
                             nn.Linear(8, 1))

    batch = (torch.randn(4, 8),)
    prof = remat.profile(make(), batch, repeats=1)
    return make, solve(prof, method="all")


@FAST
@given(data=st.data())
def test_profile_files_load_and_solve_or_are_refused(data: st.DataObject) -> None:
    document = json.loads(data.draw(chains(max_blocks=3)).to_json())
    text = data.draw(mutated(document))
    try:
        prof = Profile.from_json(text)
    except RecordError:
        return
    for budget, method in (("60%", "optimal"), (None, "all"), (10**6, "greedy")):
        with contextlib.suppress(REFUSED):
            solve(prof, budget, method=method)


@FAST
@given(data=st.data())
def test_plan_files_load_and_apply_or_are_refused(data: st.DataObject,
                                                  small_model_plan: tuple[Any, Plan]) -> None:
    make, plan = small_model_plan
    document = json.loads(plan.to_json())
    text = data.draw(st.one_of(mutated(document), renumbered(document)))
    try:
        loaded = Plan.from_json(text)
    except RecordError:
        return
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with contextlib.suppress(REFUSED):
        remat.apply(model, loaded)
    remat.remove(model)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)


# --- command lines ---------------------------------------------------------------------------------

_VALUES = st.one_of(
    BUDGETS.map(str), st.sampled_from(["1", "0", "-3", "2", "8", "h100", "cpu", "cuda", "rtx4090",
                                       "gpt-tiny", "GPT-tiny", "remat.demo:nope", "nope:x", ":", "x" * 300]),
    st.text(max_size=6),
)
_PLAN_OPTIONS = ["--budget", "--method", "--k", "--world-size", "--device", "--model", "--batch",
                 "--repeats", "--seq", "--dtype", "--blocks"]  # --out: see the test of its own
_FLAGS = ["--fsdp", "--json", "--help"]
_TRAIN_OPTIONS = ["--budget", "--steps", "--global-batch", "--micro-batch", "--seq", "--lr",
                  "--warmup", "--precision", "--clip", "--device", "--model", "--seed"]


@st.composite
def argv(draw: st.DrawFn, options: list[str]) -> list[str]:
    args: list[str] = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 4)) == 0:
            args.append(draw(st.sampled_from(_FLAGS)))
        else:
            args += [draw(st.sampled_from(options)), draw(_VALUES)]
    return args


def _invoke(args: list[str]) -> Any:
    result = CliRunner().invoke(main, args, prog_name="remat")
    assert result.exit_code in (0, 1, 2, 130), (args, result.exit_code, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args, repr(result.exception))
    assert "Traceback" not in result.output, args
    return result


@FAST
@given(args=argv(_PLAN_OPTIONS))
def test_plan_command_lines(args: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    prof = tmp_path_factory.mktemp("cli") / "profile.json"
    _chain().save(prof)
    profile_bytes = prof.read_bytes()
    if "--model" in args:  # a zoo model or a factory would be profiled: only check the parsing
        args = [*args, "--help"]
    _invoke(["plan", "--profile", str(prof), *args])
    assert prof.read_bytes() == profile_bytes  # an input is never written


@FAST
@given(args=argv(_PLAN_OPTIONS), out_is_input=st.booleans())
def test_plan_writes_out_only_when_it_succeeds(args: list[str], out_is_input: bool,
                                               tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("out")
    prof, out = folder / "profile.json", folder / "out.json"
    _chain().save(prof)
    out.write_text("keep me")
    args = [a for a in args if a not in ("--model", "--help")]
    pairs = [(k, v) for k, v in zip(args[::2], args[1::2]) if k.startswith("--") and k != "--out"]
    args = [x for pair in pairs for x in pair]
    target = prof if out_is_input else out
    before = prof.read_bytes()
    result = _invoke(["plan", "--profile", str(prof), *args, "--out", str(target)])
    assert prof.read_bytes() == before
    if result.exit_code != 0:
        assert out.read_text() == "keep me"
    else:
        assert not out_is_input
        Plan.load(out)  # whole


@FAST
@given(args=argv(_TRAIN_OPTIONS))
def test_train_command_lines(args: list[str], monkeypatch: pytest.MonkeyPatch,
                             tmp_path_factory: pytest.TempPathFactory) -> None:
    from remat.errors import InvalidValue
    from remat.train.config import validate

    def validate_only(config: Any, **kwargs: Any) -> Any:
        validate(config)  # what train() checks first; then stop: no training
        raise InvalidValue("stub: valid settings")  # a deliberate error: one Error: line

    monkeypatch.setattr("remat.cli.train.train", validate_only)
    monkeypatch.setattr("remat.cli.train.import_factory", lambda ref: None)  # imports nothing
    out = tmp_path_factory.mktemp("train")
    result = _invoke(["train", "--out", str(out), *args])
    assert result.exit_code != 0 or "--help" in args


# --- signals and threads during writes -----------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(remat.__file__).parents[1])}


_WRITER = textwrap.dedent("""
    import sys
    from remat.files import atomic_write
    path, size = sys.argv[1], int(sys.argv[2])
    for i in range(10**6):
        atomic_write(path, bytes([i % 251]) * size)
        if i == 0:
            print("ready", flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_a_writer_killed_mid_write_leaves_a_whole_file(tmp_path: Path, sig: int) -> None:
    path, size = tmp_path / "out.bin", 2**21
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(size)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    threading.Event().wait(0.05)  # a few writes later: most of the time is spent inside one
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    finally:  # a writer that did not stop is no later test's unclosed pipe
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    data = path.read_bytes()
    assert len(data) == size and data == data[:1] * size, "a torn file"
    if sig == signal.SIGINT:  # KeyboardInterrupt: the temporary file is removed too
        assert b"KeyboardInterrupt" in err
        assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


_CHECKPOINTER = textwrap.dedent("""
    import sys, torch
    from remat.train.state import _KEYS, save_checkpoint
    state = {k: None for k in _KEYS}
    state["config"] = {}
    for step in range(10**6):
        state["step"] = step
        state["model"] = {"w": torch.full((2**19,), float(step))}
        save_checkpoint(__import__("pathlib").Path(sys.argv[1]), state)
        if step == 0:
            print("ready", flush=True)
""")


def test_a_training_checkpoint_killed_mid_save_still_passes_its_checksum(tmp_path: Path) -> None:
    from remat.train.state import _read

    path = tmp_path / "checkpoint.pt"
    proc = subprocess.Popen([sys.executable, "-c", _CHECKPOINTER, str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    threading.Event().wait(0.3)
    proc.kill()
    proc.communicate(timeout=60)
    state = _read(path, mmap=False)  # checks the checksum
    assert torch.equal(state["model"]["w"], torch.full((2**19,), float(state["step"])))


def test_threads_writing_one_file_leave_one_whole_version(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    texts = [json.dumps({"writer": i, "pad": "x" * 100_000}) for i in range(8)]
    threads = [threading.Thread(target=lambda t=t: [atomic_write(path, t) for _ in range(5)])
               for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
