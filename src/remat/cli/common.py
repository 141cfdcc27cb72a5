"""What the commands share: output for people, the error boundary, option checks, progress.

# NOTE [ Exit codes and errors ]
0: done (and, for ``plan``/``verify``, the plan fits / passed). 1: the command ran into something
wrong with what it was given or found: an unknown model, a factory that fails, a file that cannot
be read, an infeasible budget, a plan made for another model, a plan that does not fit or fails
verification. 2: the command line itself is malformed, which click reports before anything runs:
an unknown option, a missing one, a value of the wrong form (a budget that does not parse, an
unknown device, method or dtype). 130: a training run stopped with Ctrl-C. remat's own errors are
``RematError`` subclasses (NOTE [ One base, the builtin it always was ] in ``remat.errors``) with
messages that teach; they, a file that cannot be read or written, a missing optional dependency and
running out of memory become one ``Error: ...`` line, exit 1 (``remat --traceback ...`` shows the
traceback). Any other exception is a bug, in remat or in the code it ran: it shows as one, with
its traceback, after a line asking for a report (exit 1, Python's own).
With ``--json``, an error is also written to stdout as ``{"error": ..., "type": ...}``. A closed
stdout (``remat ... | head``) ends the command quietly with 1, as click does. Outputs (``--out``)
are written only when the command succeeds, atomically, and never onto an input (NOTE [ Atomic
outputs ] in ``remat.files``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from remat.cli.targets import DTYPES as _DTYPES
from remat.cli.targets import ModelArgs, Target, measured_device
from remat.devices import DEVICES
from remat.errors import RematError, out_of_memory
from remat.units import check_budget as units_check_budget
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.demo_results import DemoResult
    from remat.records import Plan, Profile
    from remat.report import ComparisonRow
    from remat.verifier import Report

_F = TypeVar("_F", bound=Callable[..., Any])

OPTIMIZERS = ("adamw", "sgd", "none")
BUDGET_METHODS = ("optimal", "greedy")
# What becomes one "Error: ..." line: remat's own errors, and the environment's (a file that cannot
# be read or written, an optional dependency missing). Anything else is a bug.
_EXPECTED = (RematError, OSError, ImportError)
_BUG_LINE = (
    "remat: this is a bug, in remat or in the code it ran (the model, batch or loss function): "
    "please report it, with the command line and the traceback below, unless the traceback "
    "ends in your own code."
)

MODEL_HELP = (
    "A zoo name (gpt-tiny, gpt2, gpt2-xl, llama-1b, llama-8b, llama-70b, bert-large, vit-l, ...) "
    "or module:function, a zero-argument function that returns (model, batch, loss_fn) or a "
    "built-in remat.models model; see `remat --help`."
)
DEVICE_HELP = (
    "cpu or cuda[:N] to measure real steps there; a device name to estimate for one you do not "
    f"have: {', '.join(d for d in DEVICES if d != 'cpu')}."
)


# --- output ------------------------------------------------------------------------------------


def print_table(table: Table) -> None:
    """A table on stdout: in colour on a terminal; else as plain text, 100 columns wide without
    trailing spaces, so that logs and golden files read alike."""
    console = Console(highlight=False)
    if console.is_terminal:
        console.print(table)
        return
    from remat.report import render_text

    click.echo(render_text(table, width=100), nl=False)


def say(text: str, *, as_json: bool = False) -> None:
    """A line for people: stdout, or stderr when stdout carries JSON."""
    click.echo(text, err=as_json)


class StageProgress:
    """A rich spinner and bar on stderr when it is a terminal; plain lines when it is not."""

    def __init__(self) -> None:
        self.console = Console(stderr=True)
        self.bar: Any = None
        self.task: Any = None
        self.last = ""

    def __enter__(self) -> StageProgress:
        if self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, transient=True,
            )  # fmt: skip
            self.bar.start()
            self.task = self.bar.add_task("", total=None)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()

    def __call__(self, what: str, done: int = 0, total: int | None = None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=what, completed=done, total=total)
        elif what != self.last and what != "done":
            click.echo(f"remat: {what}", err=True)
        self.last = what


# --- errors ------------------------------------------------------------------------------------


def handle_errors(fn: _F) -> _F:
    """remat's errors (``RematError``), the environment's and running out of memory as one
    ``Error: ...`` line, exit 1 (NOTE [ Exit codes and errors ]); anything else is a bug: it keeps
    its traceback, after a line that asks for a report."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, BrokenPipeError):
            raise  # click exits quietly with status 1 on a closed pipe (`remat ... | head`)
        except Exception as e:
            if click.get_current_context().find_root().params.get("show_traceback"):
                raise
            if not isinstance(e, _EXPECTED) and not out_of_memory(e):
                click.echo(_BUG_LINE, err=True)
                raise
            message = str(e) or type(e).__name__
            if out_of_memory(e):
                message = (
                    f"out of memory: {message.strip().splitlines()[0]}. Lower --batch or --seq, or "
                    "estimate for a device instead of measuring here (--device h100, ...)"
                )
            if kwargs.get("as_json"):
                error: dict[str, Any] = {"error": message, "type": type(e).__name__}
                smallest = getattr(e, "smallest_bytes", None)
                if smallest is not None:
                    error["smallest_feasible_bytes"] = smallest
                    error["smallest_estimated"] = getattr(e, "estimated", False)  # from tensors alone
                click.echo(json.dumps(error))
            raise click.ClickException(message) from e

    return wrapper  # type: ignore[return-value]


def given(ctx: click.Context, *names: str) -> list[str]:
    """The options among ``names`` that the command line set."""
    return [
        "--" + n.replace("_", "-")
        for n in names
        if ctx.get_parameter_source(n) not in (None, ParameterSource.DEFAULT)
    ]


# --- option values -----------------------------------------------------------------------------


def check_budget(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a budget that does not parse now, before a long profile; "60%" is resolved later."""
    if value is not None:
        try:
            units_check_budget(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


COMPILE_HELP = ("Also measure every block compiled at these activation budgets, as options "
                "compiled:<budget> (comma-separated numbers in (0, 1], e.g. 0.5,0.2; a torch.compile "
                "per budget, tens of seconds each on a CPU). Measured profiles only.")


def check_compile_budgets(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[float, ...]:
    """``--compile-budgets 0.5,0.2`` as numbers, each in (0, 1]; checked before anything runs."""
    if not value:
        return ()
    try:
        budgets = tuple(float(v) for v in value.split(","))
    except ValueError:
        budgets = ()
    if not budgets or not all(0 < b <= 1 for b in budgets):
        raise click.BadParameter(f"expected comma-separated numbers in (0, 1], e.g. 0.5,0.2; got {value!r}")
    return budgets


def check_device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None or measured_device(value):
        return value
    from remat.devices import get_device

    try:
        return get_device(value).name
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def model_flags(*, required: bool, blocks: bool = True) -> Callable[[_F], _F]:
    options = [
        click.option("--model", "model", required=required, metavar="NAME_OR_FACTORY",
                     help=MODEL_HELP),
        click.option("--batch", type=click.IntRange(min=1), metavar="N",
                     help="Examples per batch (zoo models; default: the zoo entry's)."),
        click.option("--seq", type=click.IntRange(min=2), metavar="N",
                     help="Tokens per example (zoo token models; default: the entry's context)."),
        click.option("--dtype", type=click.Choice(_DTYPES),
                     help="Parameter dtype of a zoo model (default float32)."),
        click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw",
                     show_default=True,
                     help="Its state counts towards the step's memory (sgd: no momentum, no state)."),
        click.option("--blocks", multiple=True, metavar="PATTERN",
                     help="Glob of the blocks to plan, e.g. 'layers.*' (repeatable; "
                          "default: found automatically)."),
    ]  # fmt: skip
    if not blocks:  # verify: the plan names its blocks
        options.pop()

    def decorate(fn: _F) -> _F:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


# --- the stages, with progress ------------------------------------------------------------------


def profile_target(target: Target, args: ModelArgs, *, device: str | None, repeats: int,
                   compile_budgets: tuple[float, ...] = (), budget: str | None = None) -> Profile:
    """The target's profile; a measured one runs no step above ``budget`` (NOTE [ Planning what
    does not fit ] in remat.measure.lean)."""
    from remat.measure.profiler import profile

    where = "measuring on the CPU" if device in (None, "cpu") else (
        f"measuring on {device}" if measured_device(device) else f"estimating for {device}"
    )
    with StageProgress() as progress:
        progress(f"profiling {target.name} ({where})")
        return profile(
            target.model, target.batch, loss_fn=target.loss_fn, optimizer=target.optimizer,
            blocks=list(args.blocks) or None, device=None if measured_device(device) else device,
            repeats=repeats, compile_budgets=compile_budgets, budget=budget if measured_device(device) else None,
        )  # fmt: skip


def fit_verdict(plan: Plan, prof: Profile | None) -> tuple[bool | None, str]:
    """Whether ``plan`` fits (None: nothing to fit, no budget and no device memory) and a line."""
    peak = plan.estimate.peak_bytes
    ok: bool | None = None
    text = f"predicted peak {format_bytes(peak)}"
    if plan.budget_bytes is not None:
        ok = peak <= plan.budget_bytes
        text += f" {'≤' if ok else '>'} budget {format_bytes(plan.budget_bytes)}"
    memory = prof.device_memory_bytes if prof is not None else None
    if prof is not None and memory is not None:
        on_device = peak <= memory
        ok = on_device if ok is None else ok and on_device
        if on_device:
            text += f"; the {prof.device} has {format_bytes(memory)}"
        else:
            text += f"; more than the {prof.device}'s {format_bytes(memory)}"
    text += f"; step time {plan.estimate.overhead * 100:+.1f}% vs plain (predicted)"
    if ok is None:
        return None, text
    return ok, ("fits: " if ok else "does not fit: ") + text


def report_row(label: str, plan: Plan, report: Report) -> ComparisonRow:
    from remat.report import ComparisonRow

    return ComparisonRow(
        label=label, method=plan.method, budget_bytes=plan.budget_bytes,
        predicted_peak_bytes=plan.estimate.peak_bytes,
        measured_peak_bytes=report.measured_peak_bytes, overhead=report.measured_overhead,
        fits=None if plan.budget_bytes is None else report.fits, grads_equal=report.grads_equal,
        plain_ran=report.plain_ran,
    )  # fmt: skip


def save_to(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def defaults_from_plan(
    model: str, plan: Plan, *, batch: int | None, seq: int | None, dtype: str | None
) -> tuple[int | None, int | None, str | None]:
    """--batch, --seq and --dtype of a zoo model default to the plan's, so a plan checks as made."""
    from remat.models import zoo

    entry = zoo.ZOO.get(model)
    if entry is None or not plan.batch_shape:
        return batch, seq, dtype
    if batch is None:
        batch = plan.batch_shape[0]
    if seq is None and entry.seq_len is not None and len(plan.batch_shape) == 2:
        seq = plan.batch_shape[1]
    if dtype is None and plan.dtype in _DTYPES:
        dtype = plan.dtype
    return batch, seq, dtype


def print_demo(result: DemoResult, out: Path) -> None:
    """``remat demo``'s report for people: the setup, the comparison table, timing, the files."""
    from remat.demo_results import comparison_rows
    from remat.report import comparison_table

    prof, chosen = result.profile, result.chosen
    name = result.setup.model if isinstance(result.setup.model, str) else "a small GPT"
    shape = "×".join(str(d) for d in prof.batch_shape)
    click.echo(
        f"{name} ({prof.model}, {len(prof.blocks)} blocks), batch {shape}, AdamW, {prof.device}: "
        f"plain step peak {format_bytes(prof.plain_peak_bytes)}, {prof.plain_step_ms:.0f} ms; "
        f"smallest feasible {format_bytes(result.smallest_feasible_bytes)} "
        f"({result.smallest_feasible_reason})"
    )
    print_table(comparison_table(comparison_rows(result)))
    noise = (
        f"plain against itself {result.plain_self_overhead * 100:+.1f}%, steps up to "
        f"{result.step_ms_spread * 100:.0f}% over their fastest"
    )
    if result.timings_meaningful:
        click.echo(
            f"step times: process CPU time on one thread, plain and plans in turns, medians of "
            f"{result.setup.rounds}; {noise}"
        )
    else:
        click.echo(
            f"step times withheld: {noise} in this run, so the machine is too loaded for an "
            f"overhead to mean anything; the bytes are exact (run again on a quieter machine)"
        )
    report = chosen.report
    step = f"step time {report.measured_overhead * 100:+.1f}%, " if result.timings_meaningful else ""
    click.echo(
        f"plan.json: {chosen.label}, budget {format_bytes(chosen.plan.budget_bytes or 0)}: "
        f"measured peak {format_bytes(report.measured_peak_bytes)} "
        f"({report.measured_peak_bytes / report.plain_peak_bytes:.0%} of plain), {step}"
        + {True: "gradients equal to plain", False: "gradients DIFFERENT from plain",
           None: f"gradients not compared ({report.reference})"}[report.grads_equal]
    )
    names = ", ".join(p.name for p in result.files.values())
    click.echo(f"wrote {names} to {out} in {result.seconds:.0f} s")
    click.echo(
        f"check the plan again: remat verify --model {result.setup.factory} "
        f"--plan {result.files['plan']}"
    )
