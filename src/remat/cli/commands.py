"""The ``remat`` command: demo, profile, plan, verify. The only place that ties stages together
and the only place that prints.
NOTE [ Exit codes and errors ] (``remat.cli.common``) says what exits how.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from remat import __version__
from remat.cli.common import (
    BUDGET_METHODS,
    COMPILE_HELP,
    DEVICE_HELP,
    StageProgress,
    check_budget,
    check_compile_budgets,
    check_device,
    defaults_from_plan,
    fit_verdict,
    given,
    handle_errors,
    model_flags,
    print_demo,
    print_table,
    profile_target,
    report_row,
    save_to,
    say,
)
from remat.cli.targets import ModelArgs, load_target, measured_device
from remat.errors import InvalidValue
from remat.files import same_file
from remat.plan.solver import METHODS
from remat.units import format_bytes, parse_budget

if TYPE_CHECKING:

    pass

__all__ = ["main"]

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
@handle_errors
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
    from remat.demo import run_demo
    from remat.demo_results import results_dict

    with StageProgress() as progress:
        result = run_demo(out, quick=quick, progress=progress)
    if as_json:
        click.echo(json.dumps(results_dict(result), indent=2))
        return
    print_demo(result, out)


@main.command("profile", short_help="Measure (or estimate) what each block of a model costs.")
@model_flags(required=True)
@click.option("--device", callback=check_device, metavar="DEVICE", help=DEVICE_HELP + " Default: cpu.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, metavar="N",
              help="Timed steps per option when measuring (medians; default 3).")
@click.option("--compile-budgets", callback=check_compile_budgets, metavar="B[,B...]", help=COMPILE_HELP)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Save the profile here (JSON) for `remat plan --profile`.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
@handle_errors
def profile_cmd(
    model: str, batch: int | None, seq: int | None, dtype: str | None, optimizer: str,
    blocks: tuple[str, ...], device: str | None, repeats: int, compile_budgets: tuple[float, ...],
    out: Path | None, as_json: bool,
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
      remat profile --model gpt-tiny --compile-budgets 0.5,0.2 --out gpt.json
    """
    args = ModelArgs(model, batch, seq, dtype, optimizer, blocks)
    target = load_target(args, device=device)
    prof = profile_target(target, args, device=device, repeats=repeats, compile_budgets=compile_budgets)
    if out is not None:
        prof.save(save_to(out))
    if as_json:
        click.echo(prof.to_json(), nl=False)
    else:
        from remat.report import profile_table

        print_table(profile_table(prof))
    if out is not None:
        say(f"wrote {out}", as_json=as_json)


@main.command("plan", short_help="Find the fastest plan that fits a budget.")
@model_flags(required=False)
@click.option("--profile", "profile_path", type=click.Path(dir_okay=False, path_type=Path),
              help="A saved profile (remat profile --out) instead of --model.")
@click.option("--budget", callback=check_budget, metavar="BYTES|N%",
              help="Peak of the whole step: 24GiB, 6.5GB, 800MiB, or 60% of the plain peak. "
                   "Default with a device of known memory: that memory.")
@click.option("--method", type=click.Choice(METHODS), default="optimal", show_default=True,
              help="optimal: the fastest plan that fits; greedy: a quick approximation; the "
                   "baselines none, all (every block), every_k, sqrt take no budget.")
@click.option("--k", type=click.IntRange(min=1), metavar="K",
              help="For --method every_k: recompute every k-th block (default 2).")
@click.option("--device", callback=check_device, metavar="DEVICE", help=DEVICE_HELP + " Default: cpu.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, metavar="N",
              help="Timed steps per option when measuring (medians; default 3).")
@click.option("--compile-budgets", callback=check_compile_budgets, metavar="B[,B...]", help=COMPILE_HELP)
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
@handle_errors
def plan_cmd(
    ctx: click.Context, model: str | None, batch: int | None, seq: int | None, dtype: str | None,
    optimizer: str, blocks: tuple[str, ...], profile_path: Path | None, budget: str | None,
    method: str, k: int | None, device: str | None, repeats: int, compile_budgets: tuple[float, ...],
    world_size: int, fsdp: bool, out: Path | None, as_json: bool,
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
    from remat.plan.solver import InfeasibleBudget, in_eval_mode, solve
    from remat.records import Profile
    from remat.report import plan_table

    model_options = ("model", "batch", "seq", "dtype", "optimizer", "blocks", "device", "repeats",
                     "compile_budgets")
    if (model is None) == (profile_path is None):
        raise click.UsageError("give either --model (to profile it now) or --profile FILE")
    if out is not None and profile_path is not None and same_file(out, profile_path):
        raise click.UsageError(f"--out {out} is the --profile it reads; write the plan to another file")
    if profile_path is not None and given(ctx, *model_options):
        raise click.UsageError(
            f"{', '.join(given(ctx, *model_options))} describe the model to profile; "
            "--profile reuses a saved profile as it is"
        )
    if method in BUDGET_METHODS and budget is None and model is not None and device in (None, "cpu"):
        raise click.UsageError(f"--method {method} needs a --budget, e.g. --budget 60%")
    training = True  # the model profiled was in train() mode (a factory's may not be)
    if model is not None:
        args = ModelArgs(model, batch, seq, dtype, optimizer, blocks)
        target = load_target(args, device=device)
        training = bool(getattr(target.model, "training", True))  # a factory when estimating
        # a per-rank budget is not the single device's: the profile then runs the plain step
        one_device = budget if world_size == 1 and not fsdp else None
        prof = profile_target(target, args, device=device, repeats=repeats, compile_budgets=compile_budgets,
                              budget=one_device)
    else:
        assert profile_path is not None
        prof = Profile.load(profile_path)
    if world_size != 1 or fsdp:
        from remat.distributed import per_rank_profile

        prof = per_rank_profile(prof, world_size=world_size, fsdp=fsdp)
        how = "FSDP2" if fsdp else "DDP"
        say(f"per rank of {world_size} ({how}): the budget and the peaks are per GPU", as_json=True)
    budget_bytes: int | None = None
    if budget is not None:
        budget_bytes = parse_budget(budget, plain_peak_bytes=prof.plain_peak_bytes,
                                    device_memory_bytes=prof.device_memory_bytes)
    elif method in BUDGET_METHODS:
        if prof.device_memory_bytes is None:
            raise click.UsageError(f"--method {method} needs a --budget, e.g. --budget 60%")
        budget_bytes = prof.device_memory_bytes
        say(f"budget: the {prof.device}'s memory, {format_bytes(budget_bytes)}", as_json=True)
    try:
        plan = solve(prof, budget_bytes, method=method, k=k)
    except InfeasibleBudget as e:
        if training:
            raise
        raise in_eval_mode(e) from None
    ok, verdict = fit_verdict(plan, prof)
    if out is not None and ok is not False:  # NOTE [ Atomic outputs ]: only after success
        plan.save(save_to(out))
    notes = [n for n in plan.notes if not n.startswith("does not fit")]
    if as_json:
        from remat.plan.costmodel import smallest_feasible

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
        print_table(plan_table(plan, prof))
        for note in notes:
            click.echo(f"note: {note}")
        click.echo(verdict)
    if out is not None:
        say(f"wrote {out}" if ok is not False else f"did not write {out}: the plan does not fit",
            as_json=as_json)
    if ok is False:
        ctx.exit(1)


@main.command("verify", short_help="Measure a plan against plain PyTorch.")
@model_flags(required=True, blocks=False)
@click.option("--plan", "plan_path", required=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="The plan to check (remat plan --out, or the demo's plan.json).")
@click.option("--device", default="cpu", metavar="DEVICE",
              help="Where to measure: cpu (default) or cuda[:N].")
@click.option("--repeats", type=click.IntRange(min=1), default=3, metavar="N",
              help="Timed steps of each kind, plain and planned, alternating (medians; default 3).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
@handle_errors
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
    from remat.applier import apply, remove
    from remat.measure import storages as _storages
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
        batch, seq, dtype = defaults_from_plan(model, plan, batch=batch, seq=seq, dtype=dtype)
    args = ModelArgs(model, batch, seq, dtype, optimizer, ())
    target = load_target(args, device=device)
    apply(target.model, plan)  # a plan for another model fails here, before anything runs
    remove(target.model)
    shape = _storages.batch_shape(target.batch)
    if shape != plan.batch_shape:
        raise InvalidValue(
            f"the plan was made for a batch of shape {plan.batch_shape}; this batch has shape "
            f"{shape}, with other activations: make a plan for this batch, or pass the plan's "
            "--batch/--seq"
        )
    opt = target.optimizer(target.model.parameters()) if target.optimizer else None
    with StageProgress() as progress:
        progress(f"measuring {plan_path.name} on {target.name} against plain ({device})")
        report = verify(
            target.model, target.batch, plan, loss_fn=target.loss_fn, optimizer=opt,
            repeats=repeats,
        )  # fmt: skip
    if report.passed:
        verdict = "passed: " + ("measured peak within the budget" if plan.budget_bytes else
                                "no budget to fit") + (", gradients equal to plain" if report.grads_equal else
                                                       f", gradients not compared ({report.reference})")
    else:
        why = []
        if not report.fits:
            why.append(f"measured peak {format_bytes(report.measured_peak_bytes)} > budget "
                       f"{format_bytes(report.budget_bytes or 0)}")  # fmt: skip
        if report.grads_equal is False:
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
        print_table(comparison_table([plain, report_row(plan_path.name, plan, report)]))
        if plan.device != "cpu" and not plan.device.startswith("cuda"):
            click.echo(f"note: the plan was made for {plan.device} ({plan.dtype}); measured on {device}")
        click.echo(verdict)
    if not report.passed:
        ctx.exit(1)


def _register_train() -> None:
    from remat.cli.train import train_command

    main.add_command(train_command)


_register_train()
