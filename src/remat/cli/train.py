"""``remat train``: train a language model on text within a memory budget, with a progress bar.

The command is ``train_command``; ``remat.cli`` registers it on the ``remat`` group. Exit codes:
0 done, 1 error (budget infeasible, unusable checkpoint), 2 usage, 130 interrupted (a checkpoint
was saved; the message says how to resume).

# NOTE [ Code that runs ]
``remat train`` imports no code that the user did not name on its command line. The current
folder is on ``sys.path`` only while a ``--model package.module:factory`` given here is imported
(so a folder with its own ``pydoc_data`` does not replace the default text), and a checkpoint's
config is data: a run of a factory resumes only with that ``--model`` on the command line, and the
checkpoint is checked against it (settings, checksums) before the factory is called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from remat.cli.common import check_budget
from remat.cli.targets import import_factory
from remat.errors import RematError
from remat.models import GPTConfig, LlamaConfig
from remat.plan.solver import InfeasibleBudget
from remat.train import PRECISIONS, TrainConfig, TrainInterrupted, TrainResult, train
from remat.train.accumulation import AccumulationPlan, Candidate, InfeasibleTraining
from remat.train.state import CheckpointError, StepLog, read_config
from remat.units import format_bytes

__all__ = ["accumulation_table", "train_command"]

_DEFAULT_OUT = "remat-out/train"
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def accumulation_table(candidates: Sequence[Candidate], *, title: str | None = None) -> Table:
    """One row per micro-batch size the planner considered, and which one it chose and why."""
    planned = any(c.tokens_per_s is not None or c.fits is False for c in candidates)
    table = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left", caption_justify="left",
                  caption="✓: the plan that fits with the highest predicted tokens/s" if planned else None)
    for name in ("micro-batch", "× steps", "plan", "predicted peak", "fits", "tokens/s", ""):
        table.add_column(name, justify="left" if name == "plan" else "right")
    for c in candidates:
        fits = {True: "yes", False: "no", None: "-"}[c.fits]
        table.add_row(
            str(c.micro_batch), str(c.accumulation_steps), c.plan_summary or c.note or "-",
            format_bytes(c.predicted_peak_bytes) if c.predicted_peak_bytes is not None else "-",
            fits, f"{c.tokens_per_s:,.0f}" if c.tokens_per_s is not None else "-",
            "✓" if c.chosen else "", style="bold" if c.chosen else None,
        )
    return table


@click.command("train")
@click.option("--model", default="gpt-tiny", show_default=True,
              help="A zoo language model (gpt-tiny, llama-tiny, gpt2, ...) or package.module:factory.")
@click.option("--text", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A text file to train on (byte-level tokens). Default: Python's pydoc_data.topics.")
@click.option("--budget", callback=check_budget, help="Peak memory of a step: bytes, '2GiB', '800MiB', or '60%' of the "
              "plain step's peak with the whole global batch at once. Default: no plan.")
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True,
              help="Optimizer steps.")
@click.option("--global-batch", type=click.IntRange(min=1), default=16, show_default=True,
              help="Sequences per optimizer step.")
@click.option("--micro-batch", type=click.IntRange(min=1),
              help="Sequences per forward/backward (must divide --global-batch). Default: chosen "
              "with the plan for the highest throughput that fits.")
@click.option("--seq", type=click.IntRange(min=2), default=128, show_default=True,
              help="Bytes per sequence.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=1e-3, show_default=True,
              help="Peak learning rate (AdamW).")
@click.option("--warmup", type=click.IntRange(min=0), default=20, show_default=True,
              help="Linear warm-up steps, then cosine decay to 10% of --lr.")
@click.option("--precision", type=click.Choice(list(PRECISIONS)), default="fp32", show_default=True,
              help="fp32, or autocast to bf16 / fp16 (fp16 with a GradScaler).")
@click.option("--clip", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Clip the gradient norm to this (0: no clipping).")
@click.option("--eval-every", type=click.IntRange(min=0), default=50, show_default=True,
              help="Evaluate on the held-out 10% every N steps and at the end (0: at the end).")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=50, show_default=True,
              help="Save a checkpoint every N steps and at the end (0: at the end).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=_DEFAULT_OUT,
              show_default=True, help="Folder for checkpoint.pt, log.json and loss.png.")
@click.option("--resume", is_flag=True,
              help="Continue the run in --out; options not given are taken from its checkpoint.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of weights, dropout, data.")
@click.option("--device", help="cpu, cuda, cuda:1, ... Default: CUDA when there is one.")
@click.pass_context
def train_command(ctx: click.Context, **options: Any) -> None:
    """Train a language model on text within a memory budget.

    Trains the built-in GPT (or --model) on byte-level text: Python's own pydoc_data.topics, or
    --text FILE; the last 10% is held out for evaluation. For --budget it profiles the step at
    each micro-batch size that divides --global-batch, solves the fastest checkpointing plan for
    each, and runs the one with the highest predicted tokens/s that fits (the table says why).
    AdamW, linear warm-up then cosine decay, gradient clipping, optional bf16/fp16 autocast.

    Writes checkpoint.pt (every --checkpoint-every steps, at the end, and on Ctrl-C), log.json
    and loss.png into --out. Ctrl-C finishes the current step, saves and exits with status 130;
    --resume continues exactly where the run stopped.

    \b
    Examples:
      remat train --budget 60% --steps 100 --global-batch 8 --seq 64
      remat train --model llama-tiny --text notes.txt --budget 70% --precision bf16
      remat train --out remat-out/train --resume
    """
    console = Console(highlight=False, soft_wrap=True)
    resume = options.pop("resume")
    names = {"seq": "seq_len"}  # option name -> TrainConfig field, where they differ
    given = {names.get(k, k): v for k, v in options.items()
             if ctx.get_parameter_source(k) != click.core.ParameterSource.DEFAULT}
    fields: dict[str, Any] = {names.get(k, k): v for k, v in options.items()}
    if resume:
        try:
            saved = read_config(Path(options["out"]) / "checkpoint.pt")
        except CheckpointError as e:
            raise click.ClickException(str(e)) from None
        fields = {k: v for k, v in saved.items() if k in _CONFIG_FIELDS} | given
        fields["model"] = _model_from_json(fields.get("model"), given="model" in given,
                                           out=options["out"])
    fields["text"] = str(fields["text"]) if fields.get("text") is not None else None
    fields["out"] = str(options["out"])
    fields["clip"] = fields.get("clip") or None
    try:
        config = TrainConfig(**{k: v for k, v in fields.items() if k in _CONFIG_FIELDS})
    except TypeError as e:
        raise click.ClickException(f"unusable settings: {e}") from None
    if isinstance(config.model, str) and ":" in config.model:
        try:  # named on this command line (NOTE [ Code that runs ]); imported now, from here
            import_factory(config.model)
        except (ValueError, TypeError) as e:
            raise click.ClickException(str(e)) from None

    bar = _Bar(console, config)
    if resume:
        console.print(f"Resuming the run in {config.out}: its micro-batch and plan are kept.")
    try:
        result = train(config, resume=resume, on_plan=bar.plan, on_step=bar.step)
    except TrainInterrupted as e:
        bar.stop()
        where = f"; checkpoint: {e.checkpoint}" if e.checkpoint else " (no checkpoint yet)"
        console.print(f"Interrupted after step {e.step}{where}.")
        if e.checkpoint:
            console.print(f"Resume with: remat train --out {config.out} --resume")
        ctx.exit(130)
    except KeyboardInterrupt:
        bar.stop()
        existing = Path(config.out) / "checkpoint.pt" if config.out is not None else None
        if existing is not None and existing.is_file():
            console.print(f"Interrupted; the checkpoint {existing} is as it was before.")
            console.print(f"Resume with: remat train --out {config.out} --resume")
        else:
            console.print("Interrupted before training started; nothing was saved.")
        ctx.exit(130)
    except InfeasibleBudget as e:
        bar.stop()
        if isinstance(e, InfeasibleTraining):
            console.print(accumulation_table(e.candidates, title=bar.titled(e.budget_bytes)))
        raise click.ClickException(str(e)) from None
    except RematError as e:  # NOTE [ Exit codes and errors ] in remat.cli.common
        bar.stop()
        raise click.ClickException(str(e)) from None
    bar.stop()
    _summary(console, result)


def _model_from_json(model: Any, *, given: bool, out: Any) -> str | GPTConfig | LlamaConfig:
    """The checkpoint's model, as data: a zoo name or a config. A ``module:function`` factory
    only when the command line names it too (NOTE [ Code that runs ])."""
    if isinstance(model, str):
        if ":" in model and not given:
            raise click.ClickException(
                f"the run in {out} trained the model of the factory {model!r}; remat runs no code "
                f"that a file names, only what you name: resume with --model {model} --resume "
                "if you trust it"
            )
        return model
    classes = {"GPTConfig": GPTConfig, "LlamaConfig": LlamaConfig}
    try:
        data = dict(model)
        cls = classes[data.pop("class")]
        return cls(**data)
    except (TypeError, ValueError, KeyError) as e:
        raise click.ClickException(
            f"the checkpoint in {out} names a model remat cannot build ({type(e).__name__}: {e}); "
            "it was left as it is"
        ) from None


class _Bar:
    """The planner's table, then a progress bar with loss, tokens/s and measured memory."""

    def __init__(self, console: Console, config: TrainConfig) -> None:
        self.console = console
        self.config = config

        self.progress: Progress | None = None
        self.task: Any = None
        self.peak: int | None = None

    def plan(self, decided: AccumulationPlan) -> None:
        self.console.print(accumulation_table(decided.candidates, title=self.titled(decided.budget_bytes)))
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} tok/s"),
            TextColumn("mem {task.fields[mem]}"), TimeRemainingColumn(),
            console=self.console, transient=False,
        )
        self.task = self.progress.add_task("train", total=self.config.steps, loss="-", speed="-",
                                           mem=self._mem())
        self.progress.start()

    def step(self, entry: StepLog) -> None:
        assert self.progress is not None
        if entry.peak_bytes is not None:
            self.peak = max(entry.peak_bytes, self.peak or 0)
        self.progress.update(self.task, completed=entry.step, loss=f"{entry.loss:.3f}",
                             speed=f"{entry.tokens_per_s:,.0f}", mem=self._mem())

    def titled(self, budget_bytes: int | None) -> str:
        budget = "none" if self.config.budget is None else str(self.config.budget)
        if budget_bytes is not None and budget.strip().endswith("%"):
            budget += f" = {format_bytes(budget_bytes)}"
        return (f"Micro-batch × accumulation steps for a global batch of {self.config.global_batch}"
                f" × {self.config.seq_len} bytes, budget {budget}")

    def _mem(self) -> str:
        return format_bytes(self.peak) + " measured" if self.peak is not None else "-"

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _summary(console: Console, result: TrainResult) -> None:
    last = result.steps[-1] if result.steps else None
    evals = result.evals[-1] if result.evals else None
    parts = [f"{result.completed_steps} steps"]
    if last:
        parts.append(f"train loss {last.loss:.3f}")
    if evals:
        parts.append(f"held-out loss {evals.loss:.3f} (nats/byte)")
    console.print("Done: " + ", ".join(parts) + ".")
    mem = []
    if result.measured_peak_bytes is not None:
        mem.append(f"measured peak {format_bytes(result.measured_peak_bytes)}")
    if result.predicted_peak_bytes is not None:
        mem.append(f"predicted {format_bytes(result.predicted_peak_bytes)}")
    if result.budget_bytes is not None:
        mem.append(f"budget {format_bytes(result.budget_bytes)}")
    if mem:
        console.print("Memory: " + ", ".join(mem) + ".")
    if result.config.out is not None:
        out = Path(result.config.out)
        console.print(f"Wrote {out / 'checkpoint.pt'}, {out / 'log.json'}, {out / 'loss.png'}.")
