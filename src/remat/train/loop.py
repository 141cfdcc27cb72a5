"""train(): a real training run of a language model on text, planned to fit a memory budget.

The run: byte-level text (``remat.train.data``), a model (the built-in GPT by default), AdamW with a linear
warm-up and a cosine decay, optional mixed precision and gradient clipping; gradient accumulation
and activation checkpointing chosen together to fit the budget (``remat.train.accumulation``); evaluation on
held-out text; checkpoints of the whole training state that a resumed run continues from exactly
(``remat.train.state``). The library prints nothing: progress goes to the ``on_plan`` / ``on_step``
callbacks (``remat train`` draws them), files go to ``config.out``.

# NOTE [ Exact resume ]
A resumed run must produce the losses the uninterrupted run would have, bit for bit on the CPU. So
everything that decides a number is either rebuilt from the config or restored from the checkpoint:
the weights, AdamW's moments and step counts, the scheduler's position, the GradScaler, the torch /
CUDA / Python RNG states (dropout draws from the global torch generator), the data sampler's own
generator and position, and the micro-batch and plan (a different micro-batch sums gradients in a
different order). Checkpoints are written only between optimizer steps; a Ctrl-C during a step is
held until the step ends (a second one stops at once, and then the last checkpoint stands). A
second Ctrl-C during a save abandons that save (NOTE [ An interrupted write is an interrupt ] in
``remat.files``): the last checkpoint stands, and the run stops without trying to save again.
A run starts (or resumes) by removing what a killed run left half-written (``clear_debris``).
Evaluation and memory measurement draw no random numbers, so they may differ between the runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.applier import apply
from remat.manual.blocks import fingerprint
from remat.records import Plan
from remat.train.accumulation import AccumulationPlan, Candidate, plan_accumulation
from remat.train.config import PRECISIONS, TrainConfig, device_of, validate
from remat.train.data import Sampler, build_text_model, eval_windows, load_text, text_loss
from remat.train.state import (
    CheckpointError,
    EvalLog,
    StepLog,
    TrainResult,
    clear_debris,
    config_dict,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_outputs,
)
from remat.train.steps import (
    HeldInterrupt,
    accumulate,
    autocast_for,
    build_optimizer,
    evaluate,
    lr_factor,
    peak_meter,
    seed_everything,
)

__all__ = [
    "PRECISIONS",
    "CheckpointError",
    "EvalLog",
    "StepLog",
    "TrainConfig",
    "TrainInterrupted",
    "TrainResult",
    "accumulate",
    "build_text_model",
    "text_loss",
    "train",
]

log = logging.getLogger(__name__)



class TrainInterrupted(KeyboardInterrupt):
    """The run was stopped (Ctrl-C); ``checkpoint`` holds the state after ``step`` steps."""

    def __init__(self, *, step: int, checkpoint: Path | None) -> None:
        super().__init__(step, checkpoint)
        self.step = step
        """Optimizer steps completed."""
        self.checkpoint = checkpoint
        """The checkpoint to resume from (None when the run has no ``out`` folder)."""


def train(
    config: TrainConfig,
    *,
    resume: bool = False,
    on_plan: Callable[[AccumulationPlan], None] | None = None,
    on_step: Callable[[StepLog], None] | None = None,
) -> TrainResult:
    """Train as ``config`` says; with ``resume``, continue from ``config.out``'s checkpoint.

    Raises ``InfeasibleBudget`` when no micro-batch and plan fit the budget, ``CheckpointError``
    for a checkpoint that cannot be resumed (or, without ``resume``, one that would be
    overwritten), and ``TrainInterrupted`` (a ``KeyboardInterrupt``) after saving on Ctrl-C.
    """
    validate(config)
    run = _Run(config, resume=resume)
    if on_plan is not None:
        on_plan(run.decided)
    if run.plan is not None:
        apply(run.model, run.plan)
    completed, in_step = run.start, False
    try:
        with HeldInterrupt() as interrupt:
            for index in range(run.start, config.steps):
                in_step = True
                entry = run.step(index)
                in_step, completed = False, index + 1
                run.after_step(completed)
                if on_step is not None:
                    on_step(entry)
                if interrupt.pending:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        raise run.stopped(completed, in_step=in_step) from None
    return run.finish(completed)


def _file_id(path: Path) -> int | None:
    """The file at ``path`` (its inode), to tell whether a save replaced it; None when absent."""
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


class _Run:
    """One run's state (NOTE [ Exact resume ]): built fresh, or restored from its checkpoint."""

    def __init__(self, config: TrainConfig, *, resume: bool) -> None:
        self.config = config
        self.device = device_of(config.device)
        data = load_text(config.text)
        self.out = Path(config.out) if config.out is not None else None
        self.ckpt_path = self.out / "checkpoint.pt" if self.out is not None else None
        self.saved_at = -1  # the step of the last checkpoint this process wrote
        self.abandoned: int | None = None  # the step whose save a Ctrl-C stopped
        if self.out is not None:
            clear_debris(self.out)
        self.expected = config_dict(config, data.sha256)
        state = self._checkpoint_to_resume(resume)
        seed_everything(config.seed)
        self.model = build_text_model(config.model, seq_len=config.seq_len, device=self.device)
        self.model.train()
        self.sampler = Sampler(data, seq_len=config.seq_len, seed=config.seed)
        self.windows = eval_windows(data, seq_len=config.seq_len)
        self.optimizer = build_optimizer(self.model.parameters(), config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config))
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=config.precision == "fp16")
        self.autocast = autocast_for(self.device, config.precision)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.traced = False
        if state is not None:
            self._restore(state)
        else:
            self._plan()

    def _checkpoint_to_resume(self, resume: bool) -> dict[str, Any] | None:
        if resume:
            if self.ckpt_path is None:
                raise CheckpointError("resume needs the run's folder: set out= (--out) to it")
            return load_checkpoint(self.ckpt_path, self.expected)
        if self.ckpt_path is not None and self.ckpt_path.exists():
            raise CheckpointError(
                f"{self.ckpt_path} already holds a training checkpoint; resume it (--resume), or "
                "choose another --out (or delete the file) to start a new run"
            )
        return None

    def _restore(self, state: dict[str, Any]) -> None:
        if state["fingerprint"] != fingerprint(self.model):
            raise CheckpointError(
                f"{self.ckpt_path} was written by a model of another structure (fingerprint "
                f"{state['fingerprint']}, this model has {fingerprint(self.model)}); it was left "
                "as it is"
            )
        try:  # a checksummed file of this run that still does not fit: say so, not a traceback
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.scaler.load_state_dict(state["scaler"])
            self.sampler.load_state_dict(state["sampler"])
            set_rng_state(state["rng"])
            self.plan = Plan.from_json(state["plan"]) if state["plan"] is not None else None
            self.micro = int(state["micro_batch"])
            self.history = state["history"]
            self.start = int(state["step"])
            self.decided = AccumulationPlan(
                micro_batch=self.micro, plan=self.plan, budget_bytes=self.history["budget_bytes"],
                candidates=[Candidate(**c) for c in self.history["candidates"]])
        except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            raise CheckpointError(f"{self.ckpt_path} does not fit this run's model and settings "
                                  f"({reason}); it was left as it is") from None

    def _plan(self) -> None:
        config = self.config
        self.decided = plan_accumulation(
            self.model, budget=config.budget, global_batch=config.global_batch,
            micro_batch=config.micro_batch, seq_len=config.seq_len, loss_fn=text_loss,
            make_optimizer=lambda params: build_optimizer(params, config), autocast=self.autocast,
            device=self.device,
        )
        self.plan, self.micro = self.decided.plan, self.decided.micro_batch
        self.history = {"steps": [], "evals": [], "measured_peak_bytes": None,
                        "candidates": [dataclasses.asdict(c) for c in self.decided.candidates],
                        "budget_bytes": self.decided.budget_bytes}
        self.start = 0

    def step(self, index: int) -> StepLog:
        """Optimizer step ``index + 1``: its micro-batches, clipping, the update; logged."""
        config, optimizer, scaler = self.config, self.optimizer, self.scaler
        t0 = time.perf_counter()
        ids = self.sampler.next(config.global_batch, self.device)
        lr = optimizer.param_groups[0]["lr"]
        # The first step builds AdamW's state only at its end: measure a step that has it.
        trace = not self.traced and bool(optimizer.state)
        self.traced = self.traced or trace
        optimizer.zero_grad(set_to_none=True)
        with peak_meter(self.model, optimizer, ids, self.device, trace=trace) as meter:
            loss = accumulate(self.model, ids, micro_batch=self.micro, loss_fn=text_loss,
                              autocast=self.autocast, scaler=scaler, part=meter.part)
            with meter.part():
                scaler.unscale_(optimizer)
                norm = nn.utils.clip_grad_norm_(self.params, config.clip) if config.clip else None
                scale = scaler.get_scale()
                scaler.step(optimizer)
                scaler.update()
            if scaler.get_scale() >= scale:  # a lower fp16 scale: inf grads, step skipped
                self.scheduler.step()
        loss_value = float(loss)  # waits for the device
        grad_norm = float(norm) if norm is not None else None
        elapsed = time.perf_counter() - t0
        del ids, loss, norm  # freed here, not inside the next step's memory trace
        peak = meter.peak_bytes
        if peak is not None:
            self.history["measured_peak_bytes"] = max(peak, self.history["measured_peak_bytes"] or 0)
        entry = StepLog(step=index + 1, loss=loss_value, lr=lr, grad_norm=grad_norm, peak_bytes=peak,
                        tokens_per_s=config.global_batch * config.seq_len / elapsed)
        self.history["steps"].append(dataclasses.asdict(entry))
        return entry

    def after_step(self, completed: int) -> None:
        """Evaluate and save when it is time."""
        config = self.config
        last = completed == config.steps
        if last or (config.eval_every and completed % config.eval_every == 0):
            eval_loss = evaluate(self.model, self.windows.to(self.device), micro_batch=self.micro,
                                 autocast=self.autocast)
            self.history["evals"].append(dataclasses.asdict(EvalLog(step=completed, loss=eval_loss)))
        if last or (config.checkpoint_every and completed % config.checkpoint_every == 0):
            self.save(completed)

    def save(self, step: int) -> Path | None:
        if self.ckpt_path is None:
            return None
        before = _file_id(self.ckpt_path)
        try:
            save_checkpoint(self.ckpt_path, {
                "config": self.expected, "fingerprint": fingerprint(self.model), "step": step,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "sampler": self.sampler.state_dict(), "rng": rng_state(),
                "plan": self.plan.to_json() if self.plan is not None else None,
                "micro_batch": self.micro, "history": self.history,
            })  # fmt: skip
        except KeyboardInterrupt:  # NOTE [ Exact resume ]
            if _file_id(self.ckpt_path) == before:  # abandoned: the file on disk as it was
                self.abandoned = step
            else:  # the Ctrl-C came after the new file was in place: this step is saved
                self.saved_at = step
            raise
        self.saved_at = step
        return self.ckpt_path

    def stopped(self, completed: int, *, in_step: bool) -> TrainInterrupted:
        """Ctrl-C: save between steps (inside one, the last checkpoint stands), write outputs."""
        if not in_step and self.saved_at != completed and self.abandoned is None:
            with contextlib.suppress(KeyboardInterrupt):  # another Ctrl-C while saving
                self.save(completed)
        path = self.ckpt_path if self.ckpt_path is not None and self.ckpt_path.exists() else None
        saved_at = self.saved_at
        if self.abandoned is not None and saved_at != completed:
            log.warning("stopped while saving step %d: the last checkpoint stands", self.abandoned)
            completed = saved_at if saved_at >= 0 else self.start
        elif in_step:
            completed = saved_at if saved_at >= 0 else self.start
            log.warning("stopped inside step %d: the last checkpoint (step %d) stands",
                        completed + 1, completed)
        if self.out is not None and path is not None:
            write_outputs(self.result(completed), self.out)
        return TrainInterrupted(step=completed, checkpoint=path)

    def finish(self, completed: int) -> TrainResult:
        final = self.result(completed)
        if self.out is not None:
            write_outputs(final, self.out)
        return final

    def result(self, step: int) -> TrainResult:
        config, history, ckpt = self.config, self.history, self.ckpt_path
        return TrainResult(
            config=config, steps=[StepLog(**s) for s in history["steps"]],
            evals=[EvalLog(**e) for e in history["evals"]], plan=self.plan, micro_batch=self.micro,
            accumulation_steps=config.global_batch // self.micro,
            candidates=self.decided.candidates, budget_bytes=self.decided.budget_bytes,
            measured_peak_bytes=history["measured_peak_bytes"], completed_steps=step,
            checkpoint=ckpt if ckpt is not None and ckpt.exists() else None,
        )
