"""remat train: a plan leaves the losses bit for bit as they were (CPU fp32) at a lower measured
peak; resuming is exact; bad checkpoints are refused untouched; the accumulation planner picks a
plan that fits; accumulated gradients equal one big batch's; mixed precision runs; GradNorm on a
checkpointed trunk matches plain PyTorch. Tiny models and few steps: the file runs in well under
a minute and a half on two cores."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from remat import apply, checkpoint_module
from remat.cli.train import accumulation_table, train_command
from remat.gradnorm import GradNorm
from remat.measure.step_memory import measure_step
from remat.measure.tracer import MemoryTracer
from remat.models import GPTConfig, build_model
from remat.report import render_text
from remat.train import (
    CheckpointError,
    TrainConfig,
    TrainInterrupted,
    accumulate,
    build_text_model,
    text_loss,
    train,
)
from remat.train.accumulation import micro_batch_sizes
from remat.train.data import VOCAB_SIZE, Sampler, eval_windows, load_text
from remat.train.steps import base_bytes, peak_meter

TINY = GPTConfig(n_layer=3, n_head=2, n_embd=32, dropout=0.1)
BASE = TrainConfig(model=TINY, steps=5, global_batch=4, seq_len=32, warmup=2, eval_every=0,
                   checkpoint_every=0, seed=3)


def tiny_gpt() -> nn.Module:
    """A factory for ``--model test_train:tiny_gpt`` (byte vocabulary, 16 positions, dropout on)."""
    return build_model(GPTConfig(vocab_size=VOCAB_SIZE, block_size=16, n_layer=2, n_head=2, n_embd=16))


def _losses(result: object) -> list[float]:
    return [s.loss for s in result.steps]  # type: ignore[attr-defined]


def _state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_same_tensors(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same_tensors(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_tensors(x, y)
    else:
        assert a == b


# --- a plan changes memory, not numbers -------------------------------------------------------------


def test_plan_gives_the_same_losses_at_a_lower_peak() -> None:
    plain = train(dataclasses.replace(BASE, micro_batch=4))
    planned = train(dataclasses.replace(BASE, micro_batch=4, budget="70%"))
    assert plain.plan is None and planned.plan is not None
    assert set(planned.plan.choices.values()) != {"keep"}, planned.plan.choices
    assert _losses(planned) == _losses(plain)  # bit for bit: dropout replays its random numbers
    assert _losses(plain)[-1] < _losses(plain)[0]

    torch.manual_seed(0)
    model = build_text_model(TINY, seq_len=32)
    batch = (torch.randint(VOCAB_SIZE, (4, 32)),)
    optimizer = torch.optim.AdamW(model.parameters())
    before = measure_step(model, batch, loss_fn=text_loss, optimizer=optimizer, repeats=0)
    apply(model, planned.plan)
    after = measure_step(model, batch, loss_fn=text_loss, optimizer=optimizer, repeats=0)
    assert after.peak_bytes < before.peak_bytes
    assert planned.measured_peak_bytes is not None
    assert planned.plan.budget_bytes is not None
    assert planned.measured_peak_bytes <= planned.plan.budget_bytes
    assert planned.measured_peak_bytes == pytest.approx(planned.predicted_peak_bytes, rel=0.01)
    assert after.peak_bytes == pytest.approx(planned.plan.estimate.peak_bytes, rel=0.01)


# --- resume --------------------------------------------------------------------------------------


def test_resume_continues_exactly(tmp_path: Path) -> None:
    config = dataclasses.replace(BASE, steps=6, micro_batch=2, budget="1.2MiB", eval_every=2)
    straight = train(dataclasses.replace(config, out=str(tmp_path / "a")))

    def stop_at_3(entry: object) -> None:
        if entry.step == 3:  # type: ignore[attr-defined]
            raise KeyboardInterrupt

    cut = dataclasses.replace(config, out=str(tmp_path / "b"))
    with pytest.raises(TrainInterrupted) as info:
        train(cut, on_step=stop_at_3)
    assert info.value.step == 3 and info.value.checkpoint == tmp_path / "b" / "checkpoint.pt"
    stored = json.loads((tmp_path / "b" / "log.json").read_text())
    assert len(stored["steps"]) == 3
    resumed = train(cut, resume=True)

    assert _losses(resumed) == _losses(straight)
    assert [(e.step, e.loss) for e in resumed.evals] == [(e.step, e.loss) for e in straight.evals]
    assert [e.step for e in resumed.evals] == [2, 4, 6]
    assert resumed.plan is not None and resumed.plan.to_json() == stored_plan(stored)
    a, b = _state(tmp_path / "a" / "checkpoint.pt"), _state(tmp_path / "b" / "checkpoint.pt")
    for key in ("model", "optimizer", "scheduler", "sampler"):
        _assert_same_tensors(a[key], b[key])
    lrs = [s.lr for s in straight.steps]
    assert lrs[0] < lrs[1] == lrs[2] > lrs[3] > lrs[-1]  # warm-up, then the cosine
    assert lrs[1] == pytest.approx(config.lr)
    assert (tmp_path / "b" / "loss.png").stat().st_size > 0


def stored_plan(log: dict) -> str:
    return json.dumps(log["plan"], indent=2) + "\n"


def test_bad_checkpoints_are_refused_and_left_alone(tmp_path: Path) -> None:
    config = dataclasses.replace(BASE, steps=1, out=str(tmp_path / "run"))
    train(config)
    path = tmp_path / "run" / "checkpoint.pt"
    good = path.read_bytes()

    with pytest.raises(CheckpointError, match="already holds a training checkpoint"):
        train(config)
    mismatches = {"seq_len": 16, "model": dataclasses.replace(TINY, n_layer=2), "lr": 5e-4}
    for field, value in mismatches.items():
        with pytest.raises(CheckpointError, match=f"belongs to another run.*{field}"):
            train(dataclasses.replace(config, **{field: value}), resume=True)
    assert path.read_bytes() == good
    other = tmp_path / "text.txt"
    other.write_text("another text, " * 400)
    with pytest.raises(CheckpointError, match="text_sha256"):
        train(dataclasses.replace(config, text=str(other)), resume=True)

    for damaged in (good[: len(good) // 2], b"not a checkpoint at all"):
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError, match="not a readable remat training checkpoint"):
            train(config, resume=True)
        assert path.read_bytes() == damaged
    path.write_bytes(good)
    assert train(config, resume=True).completed_steps == 1  # finished: nothing left to do
    with pytest.raises(CheckpointError, match="no checkpoint to resume"):
        train(dataclasses.replace(config, out=str(tmp_path / "empty")), resume=True)


# --- the accumulation planner ---------------------------------------------------------------------


def test_planner_picks_the_plan_that_fits_and_says_why() -> None:
    # At 1 MiB only micro-batch 1 fits (with recomputation); 2 and 4 cannot, whatever the plan.
    result = train(dataclasses.replace(BASE, steps=2, budget="1MiB"))
    rows = result.candidates
    assert [r.micro_batch for r in rows] == [1, 2, 4] == micro_batch_sizes(4)
    chosen = [r for r in rows if r.chosen]
    assert len(chosen) == 1 and chosen[0].micro_batch == result.micro_batch == 1
    assert chosen[0].fits and chosen[0].predicted_peak_bytes is not None
    assert chosen[0].predicted_peak_bytes <= 2**20
    assert [r.fits for r in rows] == [True, False, False]
    assert result.accumulation_steps == 4 and result.plan is not None
    assert chosen[0].plan_summary == result.plan.summary()
    assert result.measured_peak_bytes is not None and result.measured_peak_bytes <= 2**20
    # The bound of NOTE [ Accumulation and checkpointing, planned together ] holds, and is close.
    assert 0.9 * chosen[0].predicted_peak_bytes <= result.measured_peak_bytes
    assert result.measured_peak_bytes <= chosen[0].predicted_peak_bytes

    text = render_text(accumulation_table(rows, title="why"), width=120)
    assert "micro-batch" in text and "predicted peak" in text and "tokens/s" in text
    lines = [line for line in text.splitlines() if line.strip().startswith(("1 ", "2 ", "4 "))]
    assert len(lines) == 3 and "✓" in lines[0] and "✓" not in "".join(lines[1:])
    assert "does not fit" in lines[1]
    assert micro_batch_sizes(24) == [1, 2, 4, 8, 24] and micro_batch_sizes(1) == [1]


def test_accumulated_gradients_equal_one_big_batch() -> None:
    torch.manual_seed(0)
    model = build_text_model(dataclasses.replace(TINY, dropout=0.0), seq_len=32)
    ids = torch.randint(VOCAB_SIZE, (8, 32))
    grads = {}
    losses = {}
    for micro in (8, 2):
        model.zero_grad(set_to_none=True)
        losses[micro] = accumulate(model, ids, micro_batch=micro, loss_fn=text_loss)
        grads[micro] = [p.grad.clone() for p in model.parameters()]
    torch.testing.assert_close(losses[2], losses[8])
    for g_big, g_acc in zip(grads[8], grads[2]):
        torch.testing.assert_close(g_acc, g_big, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="does not divide"):
        accumulate(model, ids, micro_batch=3)


def test_a_step_traced_in_parts_has_the_peak_of_one_trace() -> None:
    """NOTE [ Tracing a step in parts ]: the same accumulated step with AdamW state, traced whole
    and traced a micro-batch at a time, peaks at the same byte."""
    torch.manual_seed(0)
    model = build_text_model(dataclasses.replace(TINY, dropout=0.0), seq_len=32)
    ids = torch.randint(VOCAB_SIZE, (8, 32))
    optimizer = torch.optim.AdamW(model.parameters())
    peaks = []
    for parts in (False, True, False, True):
        optimizer.zero_grad(set_to_none=True)
        with (peak_meter(model, optimizer, ids, torch.device("cpu"), trace=parts) as meter,
              contextlib.nullcontext() if parts else MemoryTracer("cpu") as whole):
            accumulate(model, ids, micro_batch=2, loss_fn=text_loss, part=meter.part)
            with meter.part():
                optimizer.step()
        if parts:
            peaks.append(meter.peak_bytes)
        else:
            peaks.append(base_bytes(model, optimizer, ids) + whole.trace.peak_bytes)
    assert peaks[1] == peaks[2] == peaks[3] and peaks[1] > 0, peaks  # the first step builds AdamW's state


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision: str) -> None:
    result = train(dataclasses.replace(BASE, steps=3, precision=precision, micro_batch=2))
    losses = _losses(result)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert result.evals and result.evals[-1].step == 3


def test_budget_errors_teach() -> None:
    with pytest.raises(ValueError, match="micro_batch=3 must divide global_batch=4"):
        train(dataclasses.replace(BASE, micro_batch=3))
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        train(dataclasses.replace(BASE, precision="fp8"))
    with pytest.raises(ValueError, match="image model|ConvNetConfig"):
        build_text_model("convnet", seq_len=32)


# --- the command ----------------------------------------------------------------------------------


def _cli(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(train_command, args, catch_exceptions=False)
    return result.exit_code, result.output


def test_cli_interrupt_resume_and_infeasible_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["--model", "test_train:tiny_gpt", "--steps", "4", "--global-batch", "2",
              "--micro-batch", "1", "--seq", "16", "--warmup", "1", "--eval-every", "2"]
    code, out = _cli([*common, "--out", str(tmp_path / "a")])
    assert code == 0, out
    assert "Done: 4 steps" in out and "measured" in out
    straight = json.loads((tmp_path / "a" / "log.json").read_text())

    from remat.cli import train as cli_train

    original = cli_train._Bar.step

    def interrupt_at_2(self: object, entry: object) -> None:
        original(self, entry)  # type: ignore[arg-type]
        if entry.step == 2:  # type: ignore[attr-defined]
            raise KeyboardInterrupt

    monkeypatch.setattr(cli_train._Bar, "step", interrupt_at_2)
    code, out = _cli([*common, "--out", str(tmp_path / "b")])
    assert code == 130, out
    assert "Interrupted after step 2" in out and f"--out {tmp_path / 'b'} --resume" in out
    monkeypatch.setattr(cli_train._Bar, "step", original)
    # The rest from the checkpoint; a factory's run resumes only when the command names it too
    # (NOTE [ Code that runs ] in remat.cli.train).
    code, out = _cli(["--model", "test_train:tiny_gpt", "--out", str(tmp_path / "b"), "--resume"])
    assert code == 0, out
    resumed = json.loads((tmp_path / "b" / "log.json").read_text())
    assert [s["loss"] for s in resumed["steps"]] == [s["loss"] for s in straight["steps"]]
    assert resumed["evals"] == straight["evals"]

    code, out = _cli([*common, "--out", str(tmp_path / "b")])
    assert code == 1 and "already holds a training checkpoint" in out
    code, out = _cli(["--model", "test_train:tiny_gpt", "--out", str(tmp_path / "b"), "--resume",
                      "--seq", "8"])
    assert code == 1 and "belongs to another run" in out

    code, out = _cli(["--model", "test_train:tiny_gpt", "--global-batch", "1", "--seq", "16",
                      "--budget", "1KiB", "--out", str(tmp_path / "c")])
    assert code == 1, out
    assert "Error: budget 1.00 KiB is below the smallest feasible" in out
    assert "micro-batch" in out  # the table says how close each micro-batch came
    assert not (tmp_path / "c" / "checkpoint.pt").exists()
    code, out = _cli(["--precision", "fp64"])
    assert code == 2 and "fp64" in out


# --- data -----------------------------------------------------------------------------------------


def test_text_split_and_sampler_position(tmp_path: Path) -> None:
    data = load_text()
    assert data.source == "pydoc_data.topics" and len(data.train) > 400_000
    assert len(data.held_out) == pytest.approx(len(data.train) / 9, rel=1e-3)
    sampler = Sampler(data, seq_len=16, seed=1)
    sampler.next(4)
    state = sampler.state_dict()
    first = sampler.next(4)
    again = Sampler(data, seq_len=16, seed=99)
    again.load_state_dict(state)
    assert torch.equal(again.next(4), first) and again.drawn == 2
    windows = eval_windows(data, seq_len=16)
    assert windows.shape == (32, 16) and torch.equal(windows, eval_windows(data, seq_len=16))

    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ValueError, match="shorter --seq"):
        Sampler(load_text(short), seq_len=16, seed=0)


# --- GradNorm on a checkpointed trunk -------------------------------------------------------------


class TwoTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(*[
            nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Dropout(0.1)) for _ in range(3)])
        self.heads = nn.ModuleList([nn.Linear(16, 4), nn.Linear(16, 1)])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.trunk(x)
        return [head(h) for head in self.heads]


def _gradnorm_run(checkpointed: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = TwoTask()
    if checkpointed:
        for block, mode in zip(model.trunk, ("recompute", "selective", "recompute")):
            checkpoint_module(block, mode=mode)
    gn = GradNorm(2, model.trunk[2][0].weight, alpha=1.5, lr=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    weights = []
    for _ in range(5):
        x = torch.randn(8, 16, generator=gen)
        out = model(x)
        losses = [out[0].pow(2).mean() + 1.0, (out[1] - 3.0).pow(2).mean()]
        gn.backward(losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gn.step()
        weights.append(gn.weights)
    return weights, [p.detach().clone() for p in model.parameters()]


def test_gradnorm_on_a_checkpointed_trunk_matches_plain() -> None:
    plain_w, plain_p = _gradnorm_run(checkpointed=False)
    ckpt_w, ckpt_p = _gradnorm_run(checkpointed=True)
    assert not torch.allclose(plain_w[-1], torch.ones(2))  # the weights moved
    assert plain_w[-1].sum().item() == pytest.approx(2.0)
    for a, b in zip(plain_w + plain_p, ckpt_w + ckpt_p):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
