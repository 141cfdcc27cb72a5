"""The ``remat`` command: demo, profile, plan, verify. The only place that ties stages together
and the only place that prints.

# NOTE [ Exit codes and errors ]
0: done (and, for ``plan``/``verify``, the plan fits / passed). 1: the command ran into something
wrong with what it was given or found: an unknown model, a factory that fails, a file that cannot
be read, an infeasible budget, a plan made for another model, a plan that does not fit or fails
verification. 2: the command line itself is malformed, which click reports before anything runs:
an unknown option, a missing one, a value of the wrong form (a budget that does not parse, an
unknown device, method or dtype). remat's own errors are ``ValueError`` subclasses with messages
that teach; they become one ``Error: ...`` line (``remat --traceback ...`` shows the traceback).
With ``--json``, an error is also written to stdout as ``{"error": ..., "type": ...}``. A closed
stdout (``remat ... | head``) ends the command quietly with 1, as click does. Outputs (``--out``)
are written only when the command succeeds, atomically, and never onto an input (NOTE [ Atomic
outputs ] in ``remat.files``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from remat import __version__
from remat.devices import DEVICES
from remat.files import same_file
from remat.solver import METHODS
from remat.targets import DTYPES as _DTYPES
from remat.targets import ModelArgs, Target, load_target, measured_device
from remat.units import check_budget, format_bytes, parse_budget

if TYPE_CHECKING:

    from remat.records import Plan, Profile
    from remat.report import ComparisonRow
    from remat.verifier import Report

__all__ = ["main"]

_F = TypeVar("_F", bound=Callable[..., Any])

_OPTIMIZERS = ("adamw", "sgd", "none")
_BUDGET_METHODS = ("optimal", "greedy")
# What a user's mistake raises in remat (its errors are ValueError subclasses) and in their code.
_USER_ERRORS = (ValueError, TypeError, OSError, ImportError)

_MODEL_HELP = (
    "A zoo name (gpt-tiny, gpt2, gpt2-xl, llama-1b, llama-8b, llama-70b, bert-large, vit-l, ...) "
    "or module:function, a zero-argument function that returns (model, batch, loss_fn) or a "
    "built-in remat.models model; see `remat --help`."
)
_DEVICE_HELP = (
    "cpu or cuda[:N] to measure real steps there; a device name to estimate for one you do not "
    f"have: {', '.join(d for d in DEVICES if d != 'cpu')}."
)


# --- output ------------------------------------------------------------------------------------


def _print_table(table: Table) -> None:
    """A table on stdout: in colour on a terminal; else as plain text, 100 columns wide without
    trailing spaces, so that logs and golden files read alike."""
    console = Console(highlight=False)
    if console.is_terminal:
        console.print(table)
        return
    from remat.report import render_text

    click.echo(render_text(table, width=100), nl=False)


def _say(text: str, *, as_json: bool = False) -> None:
    """A line for people: stdout, or stderr when stdout carries JSON."""
    click.echo(text, err=as_json)


class _Progress:
    """A rich spinner and bar on stderr when it is a terminal; plain lines when it is not."""

    def __init__(self) -> None:
        self.console = Console(stderr=True)
        self.bar: Any = None
        self.task: Any = None
        self.last = ""

    def __enter__(self) -> _Progress:
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


def _handle_errors(fn: _F) -> _F:
    """remat's errors and a user's code's errors as ``Error: ...``, exit 1 (NOTE [ Exit codes and
    errors ]); anything else is a bug and keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, BrokenPipeError):
            raise  # click exits quietly with status 1 on a closed pipe (`remat ... | head`)
        except (*_USER_ERRORS, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not _out_of_memory(e):
                raise
            if click.get_current_context().find_root().params.get("show_traceback"):
                raise
            message = str(e) or type(e).__name__
            if _out_of_memory(e):
                message = (
                    f"out of memory: {message.strip().splitlines()[0]}. Lower --batch or --seq, or "
                    "estimate for a device instead of measuring here (--device h100, ...)"
                )
            if kwargs.get("as_json"):
                error: dict[str, Any] = {"error": message, "type": type(e).__name__}
                smallest = getattr(e, "smallest_bytes", None)
                if smallest is not None:
                    error["smallest_feasible_bytes"] = smallest
                click.echo(json.dumps(error))
            raise click.ClickException(message) from e

    return wrapper  # type: ignore[return-value]


def _out_of_memory(e: BaseException) -> bool:
    return type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e)


def _given(ctx: click.Context, *names: str) -> list[str]:
    """The options among ``names`` that the command line set."""
    return [
        "--" + n.replace("_", "-")
        for n in names
        if ctx.get_parameter_source(n) not in (None, ParameterSource.DEFAULT)
    ]


# --- option values -----------------------------------------------------------------------------


def _check_budget(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Refuse a budget that does not parse now, before a long profile; "60%" is resolved later."""
    if value is not None:
        try:
            check_budget(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


def _check_device(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None or measured_device(value):
        return value
    from remat.devices import get_device

    try:
        return get_device(value).name
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _model_options(*, required: bool, blocks: bool = True) -> Callable[[_F], _F]:
    options = [
        click.option("--model", "model", required=required, metavar="NAME_OR_FACTORY",
                     help=_MODEL_HELP),
        click.option("--batch", type=click.IntRange(min=1), metavar="N",
                     help="Examples per batch (zoo models; default: the zoo entry's)."),
        click.option("--seq", type=click.IntRange(min=2), metavar="N",
                     help="Tokens per example (zoo token models; default: the entry's context)."),
        click.option("--dtype", type=click.Choice(_DTYPES),
                     help="Parameter dtype of a zoo model (default float32)."),
        click.option("--optimizer", type=click.Choice(_OPTIMIZERS), default="adamw",
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


def _profile(target: Target, args: ModelArgs, *, device: str | None, repeats: int) -> Profile:
    from remat.profiler import profile

    where = "measuring on the CPU" if device in (None, "cpu") else (
        f"measuring on {device}" if measured_device(device) else f"estimating for {device}"
    )
    with _Progress() as progress:
        progress(f"profiling {target.name} ({where})")
        return profile(
            target.model, target.batch, loss_fn=target.loss_fn, optimizer=target.optimizer,
            blocks=list(args.blocks) or None, device=None if measured_device(device) else device,
            repeats=repeats,
        )  # fmt: skip


def _verdict(plan: Plan, prof: Profile | None) -> tuple[bool | None, str]:
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


def _report_row(label: str, plan: Plan, report: Report) -> ComparisonRow:
    from remat.report import ComparisonRow

    return ComparisonRow(
        label=label, method=plan.method, budget_bytes=plan.budget_bytes,
        predicted_peak_bytes=plan.estimate.peak_bytes,
        measured_peak_bytes=report.measured_peak_bytes, overhead=report.measured_overhead,
        fits=None if plan.budget_bytes is None else report.fits, grads_equal=report.grads_equal,
    )  # fmt: skip


def _save_to(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# --- commands ----------------------------------------------------------------------------------


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog="Exit status: 0 done (the plan fits, the check passed); 1 an error or a plan that "
    "does not fit or fails its check; 2 a malformed command line (an unknown option, a budget "
    "that does not parse); 130 a training run stopped with Ctrl-C (it saved a checkpoint).",
)
@click.version_option(__version__, prog_name="remat")
@click.option("--traceback", "show_traceback", is_flag=True,
              help="Show the full traceback of an error instead of one Error: line.")  # fmt: skip
def main(show_traceback: bool) -> None:
    """Make a PyTorch training step fit a memory budget by activation checkpointing.

    remat profiles what each block of a model keeps for the backward pass and what recomputing
    it costs, solves for the fastest plan that fits a budget, and checks the plan by measuring.

    \b
    Examples:
      remat demo                       # the whole pipeline on a small GPT, on this CPU
      remat profile --model gpt-tiny --out profile.json
      remat plan --model llama-8b --seq 8192 --device rtx4090 --budget 24GiB
      remat plan --profile profile.json --budget 60% --out plan.json
      remat verify --model gpt-tiny --plan plan.json
      remat train --budget 60% --steps 100      # train on real text within a budget

    \b
    Models (--model NAME_OR_FACTORY):
      a zoo name: gpt-tiny, llama-tiny, convnet (CPU-sized), gpt2 ... gpt2-xl, llama-1b, -3b,
        -7b, -8b, -13b, -70b, bert-tiny, bert-base, bert-large, vit-tiny, vit-b, vit-l
      or module:function, imported from the current folder or sys.path: a zero-argument
        function that returns (model, batch, loss_fn): model(*batch) runs the forward (a dict
        batch: model(**batch)), loss_fn(output, batch) returns the scalar loss (None: the
        output's .loss, or its mean). It may return a remat.models model alone instead; remat
        then makes the batch (--batch, --seq). With --device h100 (estimating) it is called
        inside FakeTensorMode, so it must create its tensors in it, not load them.

    \b
    Budgets (--budget): bytes ("24GiB", "6.5GB", "800MiB") or a share of the plain step's
    peak ("60%"): the peak of a whole training step, weights and optimizer state included.
    """
    # NOTE: torch's profiler (which measures CPU memory) logs two kineto lines per trace to the
    # terminal; level 6 is above every level it logs at. Set only if the user has not chosen one.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


@main.command(short_help="Run the whole pipeline on a built-in GPT, on this CPU.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default="remat-out",
              metavar="DIR",
              help="Folder for profile.json, plan.json, the plots and results.json (default: "
                   "remat-out).")
@click.option("--quick", is_flag=True, help="A much smaller GPT and fewer budgets (~10 s).")
@click.option("--json", "as_json", is_flag=True, help="Print results.json instead of the table.")
@_handle_errors
def demo(out: Path, quick: bool, as_json: bool) -> None:
    """The whole pipeline on a built-in GPT, measured on this CPU.

    Profiles the model once, solves the optimal plan for budgets from the plain step's peak down
    to the smallest feasible one, applies and measures every plan and the baselines (no
    checkpointing, every 2nd block, every block) against plain PyTorch: peak memory predicted and
    measured, step-time overhead, gradients. Writes profile.json, plan.json (the plan at ~60% of
    the plain peak), frontier.png, timeline.png and results.json into --out.

    \b
    Examples:
      remat demo                       # under a minute on two cores
      remat demo --quick --out /tmp/remat-demo
      remat demo --json | jq '.rows[] | {label, measured_peak_bytes, measured_overhead}'
    """
    from remat.demo import comparison_rows, results_dict, run_demo
    from remat.report import comparison_table

    with _Progress() as progress:
        result = run_demo(out, quick=quick, progress=progress)
    if as_json:
        click.echo(json.dumps(results_dict(result), indent=2))
        return
    prof, chosen = result.profile, result.chosen
    name = result.setup.model if isinstance(result.setup.model, str) else "a small GPT"
    shape = "×".join(str(d) for d in prof.batch_shape)
    click.echo(
        f"{name} ({prof.model}, {len(prof.blocks)} blocks), batch {shape}, AdamW, {prof.device}: "
        f"plain step peak {format_bytes(prof.plain_peak_bytes)}, {prof.plain_step_ms:.0f} ms; "
        f"smallest feasible {format_bytes(result.smallest_feasible_bytes)} "
        f"({result.smallest_feasible_reason})"
    )
    _print_table(comparison_table(comparison_rows(result)))
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
        f"gradients {'equal to' if report.grads_equal else 'DIFFERENT from'} plain"
    )
    names = ", ".join(p.name for p in result.files.values())
    click.echo(f"wrote {names} to {out} in {result.seconds:.0f} s")
    click.echo(
        f"check the plan again: remat verify --model {result.setup.factory} "
        f"--plan {result.files['plan']}"
    )


@main.command("profile", short_help="Measure (or estimate) what each block of a model costs.")
@_model_options(required=True)
@click.option("--device", callback=_check_device, metavar="DEVICE", help=_DEVICE_HELP + " Default: cpu.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, metavar="N",
              help="Timed steps per option when measuring (medians; default 3).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Save the profile here (JSON) for `remat plan --profile`.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
@_handle_errors
def profile_cmd(
    model: str, batch: int | None, seq: int | None, dtype: str | None, optimizer: str,
    blocks: tuple[str, ...], device: str | None, repeats: int, out: Path | None, as_json: bool,
) -> None:  # fmt: skip
    """What each block of a model keeps for the backward, and what each option costs.

    Measures real training steps on this machine (--device cpu, the default, or cuda), or
    estimates them for a device you do not have (--device h100, rtx4090, ...) with fake tensors:
    exact bytes, roofline times, nothing allocated, so 70B models profile on a laptop.

    \b
    Examples:
      remat profile --model gpt-tiny
      remat profile --model gpt2 --batch 4 --seq 512 --out gpt2.json
      remat profile --model llama-8b --seq 8192 --dtype bfloat16 --device h100 --json
      remat profile --model mypkg.models:make_step --blocks 'encoder.layers.*'
    """
    args = ModelArgs(model, batch, seq, dtype, optimizer, blocks)
    target = load_target(args, device=device)
    prof = _profile(target, args, device=device, repeats=repeats)
    if out is not None:
        prof.save(_save_to(out))
    if as_json:
        click.echo(prof.to_json(), nl=False)
    else:
        from remat.report import profile_table

        _print_table(profile_table(prof))
    if out is not None:
        _say(f"wrote {out}", as_json=as_json)


@main.command("plan", short_help="Find the fastest plan that fits a budget.")
@_model_options(required=False)
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A saved profile (remat profile --out) instead of --model.")
@click.option("--budget", callback=_check_budget, metavar="BYTES|N%",
              help="Peak of the whole step: 24GiB, 6.5GB, 800MiB, or 60% of the plain peak. "
                   "Default with a device of known memory: that memory.")
@click.option("--method", type=click.Choice(METHODS), default="optimal", show_default=True,
              help="optimal: the fastest plan that fits; greedy: a quick approximation; the "
                   "baselines none, all (every block), every_k, sqrt take no budget.")
@click.option("--k", type=click.IntRange(min=1), metavar="K",
              help="For --method every_k: recompute every k-th block (default 2).")
@click.option("--device", callback=_check_device, metavar="DEVICE", help=_DEVICE_HELP + " Default: cpu.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, metavar="N",
              help="Timed steps per option when measuring (medians; default 3).")
@click.option("--world-size", type=click.IntRange(min=1), default=1, metavar="N",
              help="Plan for one rank of an N-rank data-parallel job (DDP; with --fsdp, FSDP2): "
                   "the budget is per GPU, --batch the per-rank batch.")
@click.option("--fsdp", is_flag=True,
              help="Parameters, gradients and optimizer state sharded over --world-size ranks "
                   "(fully_shard on each block and the root; see docs/distributed.md).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Save the plan here (JSON) for `remat verify` and remat.apply.")
@click.option("--json", "as_json", is_flag=True,
              help="Print {fits, verdict, plan, ...} as JSON.")
@click.pass_context
@_handle_errors
def plan_cmd(
    ctx: click.Context, model: str | None, batch: int | None, seq: int | None, dtype: str | None,
    optimizer: str, blocks: tuple[str, ...], profile_path: Path | None, budget: str | None,
    method: str, k: int | None, device: str | None, repeats: int, world_size: int, fsdp: bool,
    out: Path | None, as_json: bool,
) -> None:  # fmt: skip
    """The fastest plan that fits a budget: which blocks to keep, recompute, or offload.

    Prints the plan and whether it fits (exit 0) or not (exit 1). A budget that no plan can meet
    is an error that names the smallest feasible budget and what dominates it.

    \b
    Examples:
      remat plan --model gpt-tiny --budget 60%
      remat plan --model llama-8b --seq 8192 --device rtx4090 --budget 24GiB
      remat plan --model gpt2-xl --device a100-40gb        # budget: the A100's 40 GiB
      remat plan --profile profile.json --budget 60% --out plan.json
      remat plan --profile profile.json --method all --json
      remat plan --model llama-8b --seq 4096 --device h100 --world-size 8 --fsdp
    """
    from remat.records import Profile
    from remat.report import plan_table
    from remat.solver import InfeasibleBudget, in_eval_mode, solve
    model_options = ("model", "batch", "seq", "dtype", "optimizer", "blocks", "device", "repeats")
    if (model is None) == (profile_path is None):
        raise click.UsageError("give either --model (to profile it now) or --profile FILE")
    if out is not None and profile_path is not None and same_file(out, profile_path):
        raise click.UsageError(
            f"--out {out} is the --profile it reads; write the plan to another file"
        )
    if profile_path is not None and _given(ctx, *model_options):
        raise click.UsageError(
            f"{', '.join(_given(ctx, *model_options))} describe the model to profile; "
            "--profile reuses a saved profile as it is"
        )
    if method in _BUDGET_METHODS and budget is None and model is not None and device in (None, "cpu"):
        raise click.UsageError(f"--method {method} needs a --budget, e.g. --budget 60%")
    training = True  # the model profiled was in train() mode (a factory's may not be)
    if model is not None:
        args = ModelArgs(model, batch, seq, dtype, optimizer, blocks)
        target = load_target(args, device=device)
        training = bool(getattr(target.model, "training", True))  # a factory when estimating
        prof = _profile(target, args, device=device, repeats=repeats)
    else:
        assert profile_path is not None
        prof = Profile.load(profile_path)
    if world_size != 1 or fsdp:
        from remat.distributed import per_rank_profile

        prof = per_rank_profile(prof, world_size=world_size, fsdp=fsdp)
        how = "FSDP2" if fsdp else "DDP"
        _say(f"per rank of {world_size} ({how}): the budget and the peaks are per GPU", as_json=True)
    budget_bytes: int | None = None
    if budget is not None:
        budget_bytes = parse_budget(budget, plain_peak_bytes=prof.plain_peak_bytes)
    elif method in _BUDGET_METHODS:
        if prof.device_memory_bytes is None:
            raise click.UsageError(f"--method {method} needs a --budget, e.g. --budget 60%")
        budget_bytes = prof.device_memory_bytes
        _say(f"budget: the {prof.device}'s memory, {format_bytes(budget_bytes)}", as_json=True)
    try:
        plan = solve(prof, budget_bytes, method=method, k=k)
    except InfeasibleBudget as e:
        if training:
            raise
        raise in_eval_mode(e) from None
    ok, verdict = _verdict(plan, prof)
    if out is not None and ok is not False:  # NOTE [ Atomic outputs ]: only after success
        plan.save(_save_to(out))
    notes = [n for n in plan.notes if not n.startswith("does not fit")]
    if as_json:
        from remat.costmodel import smallest_feasible

        result = {
            "kind": "plan_result",
            "fits": ok,
            "verdict": verdict,
            "budget_bytes": plan.budget_bytes,
            "predicted_peak_bytes": plan.estimate.peak_bytes,
            "predicted_overhead": plan.estimate.overhead,
            "device": prof.device,
            "device_memory_bytes": prof.device_memory_bytes,
            "smallest_feasible_bytes": smallest_feasible(prof)[0],
            "plan": json.loads(plan.to_json()),
        }
        click.echo(json.dumps(result, indent=2))
    else:
        _print_table(plan_table(plan, prof))
        for note in notes:
            click.echo(f"note: {note}")
        click.echo(verdict)
    if out is not None:
        _say(f"wrote {out}" if ok is not False else
             f"did not write {out}: the plan does not fit", as_json=as_json)  # fmt: skip
    if ok is False:
        ctx.exit(1)


@main.command("verify", short_help="Measure a plan against plain PyTorch.")
@_model_options(required=True, blocks=False)
@click.option("--plan", "plan_path", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="The plan to check (remat plan --out, or the demo's plan.json).")
@click.option("--device", default="cpu", metavar="DEVICE",
              help="Where to measure: cpu (default) or cuda[:N].")
@click.option("--repeats", type=click.IntRange(min=1), default=3, metavar="N",
              help="Timed steps of each kind, plain and planned, alternating (medians; default 3).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
@_handle_errors
def verify_cmd(
    ctx: click.Context, model: str, batch: int | None, seq: int | None, dtype: str | None,
    optimizer: str, plan_path: Path, device: str, repeats: int, as_json: bool,
) -> None:  # fmt: skip
    """Apply a plan to a fresh model and measure it against plain PyTorch.

    Runs real training steps with and without the plan: peak memory (against the plan's
    prediction and budget), step time, and every gradient compared bit for bit. Exits 1 when the
    measured peak exceeds the budget or a gradient differs. For a zoo model, --batch, --seq and
    --dtype default to the plan's.

    \b
    Examples:
      remat verify --model gpt-tiny --plan plan.json
      remat train --budget 60% --steps 100      # train on real text within a budget
      remat verify --model remat.demo:full --plan remat-out/plan.json --json
    """
    from remat import step as _step
    from remat.applier import apply, remove
    from remat.records import Plan
    from remat.report import ComparisonRow, comparison_table
    from remat.verifier import verify

    if not measured_device(device):
        raise click.BadParameter(
            f"verify measures real steps: cpu or cuda[:N], not {device!r} (to check a plan made "
            f"for {device}, run remat verify on that machine with --device cuda)",
            param_hint="'--device'",
        )
    plan = Plan.load(plan_path)
    if ":" not in model:
        batch, seq, dtype = _defaults_from_plan(model, plan, batch=batch, seq=seq, dtype=dtype)
    args = ModelArgs(model, batch, seq, dtype, optimizer, ())
    target = load_target(args, device=device)
    apply(target.model, plan)  # a plan for another model fails here, before anything runs
    remove(target.model)
    shape = _step.batch_shape(target.batch)
    if shape != plan.batch_shape:
        raise ValueError(
            f"the plan was made for a batch of shape {plan.batch_shape}; this batch has shape "
            f"{shape}, with other activations: make a plan for this batch, or pass the plan's "
            "--batch/--seq"
        )
    opt = target.optimizer(target.model.parameters()) if target.optimizer else None
    with _Progress() as progress:
        progress(f"measuring {plan_path.name} on {target.name} against plain ({device})")
        report = verify(
            target.model, target.batch, plan, loss_fn=target.loss_fn, optimizer=opt,
            repeats=repeats,
        )  # fmt: skip
    if report.passed:
        verdict = "passed: " + ("measured peak within the budget" if plan.budget_bytes else
                                "no budget to fit") + ", gradients equal to plain"
    else:
        why = []
        if not report.fits:
            why.append(f"measured peak {format_bytes(report.measured_peak_bytes)} > budget "
                       f"{format_bytes(report.budget_bytes or 0)}")  # fmt: skip
        if not report.grads_equal:
            why.append(f"gradients differ from plain (largest difference {report.max_grad_diff:.3g})")
        verdict = "failed: " + "; ".join(why)
    if as_json:
        data = json.loads(report.to_json())
        data["verdict"] = verdict
        click.echo(json.dumps(data, indent=2))
    else:
        plain = ComparisonRow(
            label="plain", method="none", measured_peak_bytes=report.plain_peak_bytes, overhead=0.0
        )
        _print_table(comparison_table([plain, _report_row(plan_path.name, plan, report)]))
        if plan.device != "cpu" and not plan.device.startswith("cuda"):
            click.echo(f"note: the plan was made for {plan.device} ({plan.dtype}); measured on {device}")
        click.echo(verdict)
    if not report.passed:
        ctx.exit(1)


def _defaults_from_plan(
    model: str, plan: Plan, *, batch: int | None, seq: int | None, dtype: str | None
) -> tuple[int | None, int | None, str | None]:
    """--batch, --seq and --dtype of a zoo model default to the plan's, so a plan checks as made."""
    from remat import zoo

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


def _register_train() -> None:
    from remat.cli_train import train_command

    main.add_command(train_command)


_register_train()
